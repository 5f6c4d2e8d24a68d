"""gamma="auto" and spec.measure recomputed from the numbers they ran on.

Auto mode: a real run with trace=True records each round's draft and verify times; the
rule AutoGamma documents (capped-geometric alpha with a 0.7 x 4 prior, draft time per
drafted token, the verify pass as a least-squares line in the drafted count with its slope
shrunk by SLOPE_PRIOR = 25 and its intercept floored at a quarter of the mean pass, the
first round left out, then Theorem 3.8's optimal gamma priced with that line) is replayed
here, written out independently, and every round's drafted count must equal the gamma it
implies (capped by the tokens left), exactly.

spec.measure: its clock is replaced by a scripted one, so each timed interval is a number
chosen here; the medians, c and slopes it reports must equal those computed by hand.
"""

from __future__ import annotations

import time

import pytest

from spec import speculative_generate

PROMPT = [3, 141, 59, 26]


def rounds_of(result):
    """The per-round records (Result.trace today; Result.rounds where that holds Round objects)."""
    trace = getattr(result, "trace", None)
    return trace if isinstance(trace, list) else result.rounds


def theorem_3_8_costed(alpha, gamma, c, slope):
    return sum(alpha ** i for i in range(gamma + 1)) / (gamma * c + 1 + slope * gamma)


def replay_auto_gamma(rounds, *, start=5, max_gamma=16, prior_alpha=0.7, prior_weight=4.0, slope_prior=25.0):
    """The gamma AutoGamma's documented rule wants before each round (one more at the end)."""
    successes, failures = prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight
    timed = []  # (drafted, draft_s, verify_s) of every round but the first that drafted something
    wanted = [start]
    for i, r in enumerate(rounds):
        successes += r.accepted
        failures += 1 if r.accepted < r.drafted else 0
        if i > 0 and r.drafted > 0:
            timed.append((r.drafted, r.draft_s, r.verify_s))
            n = len(timed)
            mean_x = sum(x for x, _, _ in timed) / n
            mean_y = sum(y for _, _, y in timed) / n
            sxx = sum((x - mean_x) ** 2 for x, _, _ in timed)
            sxy = sum((x - mean_x) * (y - mean_y) for x, _, y in timed)
            slope = max(0.0, sxy / (sxx + slope_prior))
            step = max(mean_y - slope * mean_x, 0.25 * mean_y)
            c = sum(d for _, d, _ in timed) / sum(x for x, _, _ in timed) / step
            alpha = min(successes / (successes + failures), 0.999)
            values = {g: theorem_3_8_costed(alpha, g, c, slope / step) for g in range(1, max_gamma + 1)}
            best = max(values.values())
            wanted.append(min(g for g, v in values.items() if v >= best * (1 - 1e-12)))
        else:
            wanted.append(wanted[-1])
    return wanted


@pytest.mark.parametrize("draft_kind,max_new_tokens", [("partial", 90), ("shallow", 60), ("random", 30)])
def test_auto_gamma_choices_replay_from_the_trace(target, drafts, draft_kind, max_new_tokens):
    r = speculative_generate(target, drafts[draft_kind], PROMPT, gamma="auto", max_new_tokens=max_new_tokens,
                             trace=True)
    rounds = rounds_of(r)
    assert len(rounds) == len(r.drafted_per_round) >= 3
    assert [x.drafted for x in rounds] == r.drafted_per_round
    assert all(x.draft_s >= 0 and x.verify_s > 0 for x in rounds)
    wanted = replay_auto_gamma(rounds)
    produced = 0
    for i, x in enumerate(rounds):
        assert x.drafted == min(wanted[i], max_new_tokens - produced - 1), f"round {i}: {x}, wanted {wanted[i]}"
        produced += x.emitted
    assert produced == len(r.tokens) == max_new_tokens


def test_replay_is_sensitive_to_what_it_checks():
    """The replay itself tells different timings apart (it would catch a rule that ignores them)."""
    from types import SimpleNamespace as R
    cheap = [R(drafted=5, accepted=5, draft_s=0.05, verify_s=1.0)] * 6
    dear = [R(drafted=5, accepted=5, draft_s=5.0, verify_s=1.0)] * 6   # c = 1: drafting never pays
    assert replay_auto_gamma(cheap)[-1] == 16 and replay_auto_gamma(dear)[-1] == 1


# --- spec.measure on a scripted clock ------------------------------------------------------------


MEASURE_PROMPT = [3, 141, 59, 26, 5, 8, 13]   # 7 tokens: no timed pass below is that long


class ScriptedClock:
    """time.perf_counter replaced by a clock that stands still except inside the models'
    forward passes: each pass after a prefill (a 7-token input) moves it on by the next of
    `durations`, so every interval spec.measure times around a pass is a number chosen here,
    however often it reads the clock."""

    def __init__(self, durations, models):
        self.durations, self.now, self.passes = list(durations), 0.0, 0
        self.hooks = [m.register_forward_pre_hook(self._advance, with_kwargs=True) for m in models]

    def _advance(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids.shape[-1] != len(MEASURE_PROMPT):
            self.now += self.durations[self.passes]
            self.passes += 1

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clocks = []

    def install(durations, *models):
        for old in clocks:  # one clock at a time
            for h in old.hooks:
                h.remove()
        c = ScriptedClock(durations, models)
        monkeypatch.setattr(time, "perf_counter", c)
        clocks.append(c)
        return c
    yield install
    for c in clocks:
        for h in c.hooks:
            h.remove()


def test_step_time_is_the_median_after_warmup(target, clock):
    from spec.measure import step_time
    c = clock([50.0, 40.0, 3.0, 1.0, 4.0, 1.5, 9.0], target)
    assert step_time(target, MEASURE_PROMPT, steps=5, warmup=2) == 3.0     # median of 3, 1, 4, 1.5, 9
    assert c.passes == 7
    c = clock([7.0, 2.0, 6.0, 1.0, 5.0], target)
    assert step_time(target, MEASURE_PROMPT, steps=4, warmup=1) == 3.5     # median of 2, 6, 1, 5
    assert c.passes == 5


def test_cost_ratio_interleaves_and_averages(target, partial_draft, clock):
    from spec.measure import cost_ratio
    # steps=6: each of the four blocks times 1 warmup + 3 steps: draft, target, draft, target
    c = clock([99.0, 1.0, 2.0, 3.0,  99.0, 10.0, 20.0, 30.0,  99.0, 4.0, 4.0, 5.0,  99.0, 10.0, 10.0, 40.0],
              target, partial_draft)
    costs = cost_ratio(target, partial_draft, MEASURE_PROMPT, steps=6, warmup=1, draft_impl="hf")
    assert c.passes == 16
    assert (costs.draft_step_s, costs.target_step_s) == (3.0, 15.0)   # means of medians (2, 4) and (20, 10)
    assert costs.c == 0.2


def test_pass_times_and_verify_cost(target, clock):
    from spec.measure import pass_times, verify_cost
    # repeats 3, gammas [0, 2, 5] interleaved: 0, 2, 5, 0, 2, 5, 0, 2, 5
    c = clock([1.0, 2.0, 3.0, 1.2, 2.5, 2.0, 0.9, 1.0, 9.0], target)
    assert pass_times(target, MEASURE_PROMPT, [0, 2, 5], repeats=3) == {0: 1.0, 2: 2.0, 5: 3.0}
    assert c.passes == 9
    clock([4.0, 5.0, 4.0, 6.0, 4.0, 7.0, 4.0, 6.0], target)
    assert verify_cost(target, MEASURE_PROMPT, 3, repeats=4) == 1.5          # medians 4 and 6


def test_verify_slope_by_least_squares(target, clock):
    from spec.measure import verify_slope
    # max_gamma 8: passes for gamma 0, 2, 4, 8; medians 10, 12, 14, 18 (one repeat each): slope 1 a
    # token, 0.1 one-token steps
    clock([10.0, 12.0, 14.0, 18.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == pytest.approx(0.1, rel=1e-15)
    # medians 10, 11, 16, 13 over gamma 0, 2, 4, 8: slope = sum((g-3.5)(t-12.5)) / sum((g-3.5)^2) = 15 / 35
    clock([10.0, 11.0, 16.0, 13.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == pytest.approx(15 / 35 / 10, rel=1e-14)
    # max_gamma 3: gammas {0, 1, 3}; medians 5, 6, 8: slope 1 a token over 5
    clock([5.0, 6.0, 8.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=3, repeats=1) == pytest.approx(0.2, rel=1e-14)
    # a pass that gets cheaper with more tokens is reported as flat, not negative
    clock([10.0, 9.0, 8.0, 7.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == 0.0
