"""gamma="auto" and spec.experiment.measure recomputed from the numbers they ran on.

Auto mode: a real run with trace=True records each round's draft and verify times; the
rule AutoGamma documents (capped-geometric alpha with a 0.7 x 4 prior, draft time per
drafted token, the verify pass as a least-squares line in the drafted count with its slope
shrunk by SLOPE_PRIOR = 25 and its intercept floored at a quarter of the mean pass, the
first round left out, then Theorem 3.8's optimal gamma priced with that line) is replayed
here, written out independently, and every round's drafted count must equal the gamma it
implies (capped by the tokens left), exactly.

spec.experiment.measure: its clock is replaced by a scripted one, so each timed interval is a number
chosen here; the medians, c and slopes it reports must equal those computed by hand.
"""

from __future__ import annotations

import time

import pytest
import torch
from oracles import relative_tolerance

from spec import speculative_generate
from spec.runner import probe

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


# --- spec.experiment.measure on a scripted clock ------------------------------------------------------------


MEASURE_PROMPT = [3, 141, 59, 26, 5, 8, 13]   # 7 tokens: no timed pass below is that long


class ScriptedClock:
    """time.perf_counter replaced by a clock that stands still except inside the models'
    forward passes: each pass after a prefill (a 7-token input) moves it on by the next of
    `durations`, so every interval spec.experiment.measure times around a pass is a number chosen here,
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
        for m in models:  # the probe's own passes (once a model, memoised) happen before the clock counts
            probe(m)
        c = ScriptedClock(durations, models)
        monkeypatch.setattr(time, "perf_counter", c)
        clocks.append(c)
        return c
    yield install
    for c in clocks:
        for h in c.hooks:
            h.remove()


def test_step_time_is_the_median_after_warmup(target, clock):
    from spec.experiment.measure import step_time
    c = clock([50.0, 40.0, 3.0, 1.0, 4.0, 1.5, 9.0], target)
    assert step_time(target, MEASURE_PROMPT, steps=5, warmup=2) == 3.0     # median of 3, 1, 4, 1.5, 9
    assert c.passes == 7
    c = clock([7.0, 2.0, 6.0, 1.0, 5.0], target)
    assert step_time(target, MEASURE_PROMPT, steps=4, warmup=1) == 3.5     # median of 2, 6, 1, 5
    assert c.passes == 5


def test_cost_ratio_interleaves_and_averages(target, partial_draft, clock):
    from spec.experiment.measure import cost_ratio
    from spec.runner import path_of
    path_of(target), path_of(partial_draft)  # the runner probe's passes run before the clock is scripted
    # steps=6: each of the four blocks times 1 warmup + 3 steps: draft, target, draft, target
    c = clock([99.0, 1.0, 2.0, 3.0,  99.0, 10.0, 20.0, 30.0,  99.0, 4.0, 4.0, 5.0,  99.0, 10.0, 10.0, 40.0],
              target, partial_draft)
    costs = cost_ratio(target, partial_draft, MEASURE_PROMPT, steps=6, warmup=1, draft_impl="hf")
    assert c.passes == 16
    assert (costs.draft_step_s, costs.target_step_s) == (3.0, 15.0)   # means of medians (2, 4) and (20, 10)
    assert costs.c == 0.2


def test_pass_times_and_verify_cost(target, clock):
    from spec.experiment.measure import pass_times, verify_cost
    # repeats 3, gammas [0, 2, 5] interleaved: 0, 2, 5, 0, 2, 5, 0, 2, 5
    c = clock([1.0, 2.0, 3.0, 1.2, 2.5, 2.0, 0.9, 1.0, 9.0], target)
    assert pass_times(target, MEASURE_PROMPT, [0, 2, 5], repeats=3) == {0: 1.0, 2: 2.0, 5: 3.0}
    assert c.passes == 9
    clock([4.0, 5.0, 4.0, 6.0, 4.0, 7.0, 4.0, 6.0], target)
    assert verify_cost(target, MEASURE_PROMPT, 3, repeats=4) == 1.5          # medians 4 and 6


# Scalar float arithmetic rounds a few ulps; a bound of 256 fp64 eps (oracles) catches any slip in a formula.
REL = relative_tolerance(torch.float64)


def test_verify_slope_by_least_squares(target, clock):
    from spec.experiment.measure import verify_slope
    # max_gamma 8: passes for gamma 0, 2, 4, 8; medians 10, 12, 14, 18 (one repeat each): slope 1 a
    # token, 0.1 one-token steps
    clock([10.0, 12.0, 14.0, 18.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == pytest.approx(0.1, rel=REL)
    # medians 10, 11, 16, 13 over gamma 0, 2, 4, 8: slope = sum((g-3.5)(t-12.5)) / sum((g-3.5)^2) = 15 / 35
    clock([10.0, 11.0, 16.0, 13.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == pytest.approx(15 / 35 / 10, rel=REL)
    # max_gamma 3: gammas {0, 1, 3}; medians 5, 6, 8: slope 1 a token over 5
    clock([5.0, 6.0, 8.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=3, repeats=1) == pytest.approx(0.2, rel=REL)
    # a pass that gets cheaper with more tokens is reported as flat, not negative
    clock([10.0, 9.0, 8.0, 7.0], target)
    assert verify_slope(target, MEASURE_PROMPT, max_gamma=8, repeats=1) == 0.0


def test_step_time_and_cost_ratio_defaults(target, partial_draft, clock):
    """Defaults: 4 warmup + 32 timed steps; cost_ratio's four blocks of 4 + 16."""
    from spec.experiment.measure import cost_ratio, step_time
    c = clock([1.0] * 4 + [float(i) for i in range(1, 33)], target)
    assert step_time(target, MEASURE_PROMPT) == 16.5 and c.passes == 36
    c = clock([1.0] * 80, target, partial_draft)
    assert cost_ratio(target, partial_draft, MEASURE_PROMPT, draft_impl="hf").c == 1.0 and c.passes == 80


def test_cost_ratio_runs_the_draft_as_the_loop_does(target, partial_draft, clock):
    """draft_impl="plain": the draft runs in spec.neox, never through the model's forward, so
    the scripted clock (moved only by forward passes) sees no draft time at all; its KV buffer
    must hold the prompt, the warmup and the steps."""
    from spec.experiment.measure import cost_ratio
    c = clock([9.0] * 4 + [1.0, 2.0, 3.0] + [9.0] * 4 + [3.0, 3.0, 4.0], target, partial_draft)
    costs = cost_ratio(target, partial_draft, MEASURE_PROMPT, steps=6, warmup=4, draft_impl="plain")
    assert c.passes == 14 and costs.draft_step_s == 0.0  # two target blocks of 4 warmup + 3 steps, nothing else
    assert costs.target_step_s == 2.5                    # medians 2 and 3


def test_cost_ratio_checks_the_prompt_against_the_draft(target, partial_draft):
    from spec.experiment.measure import cost_ratio
    with pytest.raises(ValueError, match=r"^input_ids holds token id 600, outside the draft's vocabulary \[0, 600\)$"):
        cost_ratio(target, build_small_draft(), [1, 600], steps=2, warmup=1)


def build_small_draft():
    from spec import build_gpt_neox
    return build_gpt_neox("tiny-draft", seed=2, vocab_size=600)


def test_pass_counts_at_the_defaults(target, clock):
    from spec.experiment.measure import verify_cost, verify_slope
    c = clock([2.0] * 16, target)
    assert verify_cost(target, MEASURE_PROMPT, 3) == 1.0 and c.passes == 16      # 8 repeats of 2 passes
    c = clock([2.0] * 24, target)
    assert verify_slope(target, MEASURE_PROMPT) == 0.0 and c.passes == 24        # gammas 0, 4, 8, 16 x 6


def test_sync_waits_for_cuda_only(monkeypatch):
    from spec.experiment import measure
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    measure.sync("cpu")
    measure.sync(torch.device("cpu"))
    assert calls == []
    measure.sync("cuda:1")
    assert calls == [torch.device("cuda:1")]


# --- AutoGamma by hand -------------------------------------------------------------------------


def test_auto_gamma_defaults():
    from spec.autogamma import SLOPE_PRIOR, AutoGamma
    auto = AutoGamma()
    assert (auto.gamma, auto.max_gamma, auto.rounds, auto.passes) == (5, 16, 0, 0)
    assert auto.successes == pytest.approx(2.8, rel=REL) and auto.failures == pytest.approx(1.2, rel=REL)
    assert SLOPE_PRIOR == 25.0


def test_auto_gamma_verify_line_by_hand():
    """Timed rounds drafting 5 and 4 with passes of 10 and 8 (the first round is not timed):
    mean 4.5 and 9, sxx 0.5, sxy 1: slope 1 / (0.5 + 25), intercept 9 - 4.5 * slope."""
    from spec.autogamma import AutoGamma
    auto = AutoGamma()
    auto.observe(drafted=5, accepted=5, draft_s=50.0, verify_s=50.0)
    auto.observe(drafted=5, accepted=2, draft_s=0.5, verify_s=10.0)
    auto.observe(drafted=4, accepted=4, draft_s=0.4, verify_s=8.0)
    step, slope = auto.verify_line()
    assert slope == pytest.approx(1 / 25.5, rel=REL) and step == pytest.approx(9 - 4.5 / 25.5, rel=REL)
    # alpha: prior 2.8 / 1.2, then 5 + 2 + 4 successes and one failure
    alpha = (2.8 + 11) / (2.8 + 11 + 1.2 + 1)
    c = (0.9 / 9) / step
    from spec import theory
    assert auto.gamma == theory.optimal_gamma(alpha, c, 16, verify_slope=slope / step)
    # a steep line through two rounds: its intercept would be small, and is floored at a quarter of the mean
    steep = AutoGamma()
    steep.observe(drafted=5, accepted=5, draft_s=0.0, verify_s=0.0)
    for drafted, verify_s in ((2, 10.0), (16, 100.0)):
        steep.observe(drafted=drafted, accepted=0, draft_s=0.01 * drafted, verify_s=verify_s)
    step, slope = steep.verify_line()
    # mean 9 and 55, sxx 2 * 7^2 = 98, sxy 2 * 7 * 45 = 630: slope 630 / 123, and the intercept
    # 55 - 9 * 5.12 = 8.9 falls under a quarter of the mean pass, 13.75, which it is floored at
    assert slope == pytest.approx(630 / 123, rel=1e-12)
    assert step == 13.75


def test_auto_gamma_caps_at_max_gamma_and_alpha_at_0_999():
    from spec.autogamma import AutoGamma
    auto = AutoGamma()
    for _ in range(400):   # every token accepted, drafting nearly free: the optimum is the cap
        auto.observe(drafted=auto.gamma, accepted=auto.gamma, draft_s=1e-6 * auto.gamma, verify_s=1.0)
    assert auto.gamma == 16
    wide = AutoGamma(max_gamma=40)
    for _ in range(400):
        wide.observe(drafted=wide.gamma, accepted=wide.gamma, draft_s=1e-6 * wide.gamma, verify_s=1.0)
    assert wide.gamma == 40


def test_auto_gamma_alpha_is_capped_at_0_999():
    """After thousands of fully accepted rounds the estimate passes 0.9999; the controller still
    prices it as 0.999. At c = 0.9 with a flat pass that matters: 14 at 0.999, the cap 16 above."""
    from spec import theory
    from spec.autogamma import AutoGamma
    assert theory.optimal_gamma(0.999, 0.9, 16) == 14 and theory.optimal_gamma(0.9999, 0.9, 16) == 16
    auto = AutoGamma()
    for _ in range(3000):
        auto.observe(drafted=auto.gamma, accepted=auto.gamma, draft_s=0.9 * auto.gamma, verify_s=1.0)
    assert auto.successes / (auto.successes + auto.failures) > 0.9999
    assert auto.gamma == 14


def test_cost_ratio_default_draft_impl_is_auto(target, partial_draft, clock):
    from spec.experiment.measure import cost_ratio
    c = clock([1.0] * 8, target, partial_draft)          # auto picks the plain draft: only target passes move it
    assert cost_ratio(target, partial_draft, MEASURE_PROMPT, steps=2, warmup=1).draft_step_s == 0.0
    assert c.passes == 4
