"""Endpoint properties: a speculative server (`spec`) against the same model served without speculation
(`ref`), both spec.endpoint.Endpoint. Each check returns its evidence (a line for the report) or raises
Violation with the counterexample. The reference's own logprobs are the evidence for a divergence: the
top-2 gap at the first divergent position, against the engine's measured noise (the same positions'
logprobs from the reference alone and among concurrent requests, `measure_noise`), so a numerical tie
is named a tie and anything else is a bug.

  greedy_exact   speculative greedy output == the reference's, token for token (ties named)
  stops          max_tokens exact (never one more), stop_token_ids and EOS where the reference stops
                 (inside an accepted block or not), ignore_eos, min_tokens
  concurrency    each request's output alone == its output among concurrent requests with other prompts
  logprobs       the logprob reported for each emitted token == the reference's for the same prefix,
                 within the measured noise (not the draft's, not a processed one)
  sampling_law   the law of the first new token at T > 0 with per-request seeds (speculation running
                 over the next ones) against the law from the reference's own top logprobs, chi-square;
                 at T < 1 only where the unreported tail is bounded below TAIL_TOLERANCE
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spec.conformance.stats import goodness_of_fit

LOGPROB_FLOOR = 1e-6     # JSON round trip and float32 printing: below this two logprobs are equal
TAIL_TOLERANCE = 1e-4    # a law known to within this (the unreported tail at T < 1) is tested: at n = 400
                         # it moves an expected count by 0.04


class Violation(AssertionError):
    pass


def concurrently(calls: list, workers: int = 8) -> list:
    """Run the zero-argument `calls` at once (results in order)."""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(calls)))) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_noise(ref, prompts: list[list[int]], n: int) -> float:
    """The reference's own logprob noise across batch shapes: the largest difference between a
    position's logprobs (the emitted token's and the top-2) computed alone and among concurrent
    requests (each prompt twice, at once), over the positions where both outputs agree so far."""
    alone = [ref.complete(p, n, logprobs=2) for p in prompts]
    crowd = concurrently([lambda p=p: ref.complete(p, n, logprobs=2) for p in prompts + prompts])
    worst = 0.0
    for a, c in zip(alone + alone, crowd):
        same = first_difference(a.ids, c.ids)
        for i in range(len(a.ids) if same is None else same):
            worst = max(worst, abs(a.logprobs[i] - c.logprobs[i]))
            if a.top and c.top:
                for t in set(a.top[i]) & set(c.top[i]):
                    worst = max(worst, abs(a.top[i][t] - c.top[i][t]))
    return worst


@dataclass
class Divergence:
    position: int
    expected: int | None
    actual: int | None
    gap: float
    noise: float
    verdict: str            # "tie" or "bug"

    def __str__(self) -> str:
        if math.isnan(self.gap):
            return (f"first divergence at new token {self.position}: reference {self.expected}, got {self.actual} "
                    f"(a length difference: a stop rule, not a tie): BUG")
        return (f"first divergence at new token {self.position}: reference {self.expected}, got {self.actual}; "
                f"reference top-2 logprob gap {self.gap:.3g}, measured noise {self.noise:.3g}: "
                + ("numerical tie" if self.verdict == "tie" else "BUG (gap beyond the engine's noise)"))


def diagnose(ref, prompt: list[int], expected: list[int], actual: list[int], noise: float) -> Divergence | None:
    i = first_difference(expected, actual)
    if i is None:
        return None
    e = expected[i] if i < len(expected) else None
    a = actual[i] if i < len(actual) else None
    if e is None or a is None:
        return Divergence(i, e, a, math.nan, noise, "bug")
    top = ref.complete(list(prompt) + expected[:i], 1, logprobs=2).top
    values = sorted(top[0].values(), reverse=True) if top else []
    gap = values[0] - values[1] if len(values) >= 2 else math.inf
    return Divergence(i, e, a, gap, noise, "tie" if gap <= noise else "bug")


def greedy_exact(spec, ref, prompts: list[list[int]], n: int, noise: float) -> str:
    ties, bugs = [], []
    for k, p in enumerate(prompts):
        want, got = ref.complete(p, n).ids, spec.complete(p, n).ids
        d = diagnose(ref, p, want, got, noise)
        if d is not None:
            (ties if d.verdict == "tie" else bugs).append(f"prompt {k} ({len(p)} ids, {n} tokens): {d}\n"
                                                          f"    prompt {p}\n    expected {want}\n    actual   {got}")
    if bugs:
        raise Violation("greedy output differs from the reference's beyond a tie:\n  " + "\n  ".join(bugs + ties))
    return (f"{len(prompts) - len(ties)} of {len(prompts)} identical, {len(ties)} ties (noise {noise:.3g})"
            + "".join(f"\n  {t}" for t in ties))


def stops(spec, ref, prompt: list[int], n: int, eos_prompts: list[list[int]] = ()) -> str:
    """max_tokens, stop_token_ids, min_tokens and EOS: the speculative server stops where the reference
    does. Stop ids are taken from the reference's own greedy output, so they fall inside what a
    speculative round accepts in one block."""
    full = ref.complete(prompt, n).ids
    checked = []
    for m in sorted({1, 2, 3, 5, 9, n}):
        if m > n:
            continue
        got = spec.complete(prompt, m).ids
        if got != full[:m]:
            raise Violation(f"max_tokens={m} (ignore_eos): expected the reference's {full[:m]}, got {got} "
                            f"({len(got)} tokens)")
    checked.append("max_tokens 1..%d exact" % n)
    for k in sorted({1, 3, n // 2}):
        if k >= len(full):
            continue
        stop = full[k]
        j = full.index(stop)
        want = ref.complete(prompt, n, stop_token_ids=[stop]).ids
        if want not in (full[:j + 1], full[:j]):
            raise Violation(f"the reference itself does not stop at stop_token_ids=[{stop}] (first at {j}): {want}")
        got = spec.complete(prompt, n, stop_token_ids=[stop]).ids
        if got != want:
            raise Violation(f"stop_token_ids=[{stop}] (first emitted at new token {j}): reference {want}, got {got}")
        low = min(n, j + 2)
        want_min = ref.complete(prompt, n, stop_token_ids=[stop], min_tokens=low).ids
        got_min = spec.complete(prompt, n, stop_token_ids=[stop], min_tokens=low).ids
        if got_min != want_min or len(got_min) < min(low, len(want_min)):
            raise Violation(f"stop_token_ids=[{stop}], min_tokens={low}: reference {want_min}, got {got_min}")
    checked.append("stop_token_ids and min_tokens at new tokens 1, 3, n/2")
    for p in eos_prompts:
        want, got = ref.complete(p, n, ignore_eos=False).ids, spec.complete(p, n, ignore_eos=False).ids
        if got != want:
            raise Violation(f"EOS (ignore_eos false): reference {want} ({len(want)} tokens), got {got}\n  prompt {p}")
        if len(spec.complete(p, n, ignore_eos=True).ids) != n:
            raise Violation(f"ignore_eos true stopped before max_tokens={n}\n  prompt {p}")
    if eos_prompts:
        checked.append(f"EOS and ignore_eos on {len(eos_prompts)} prompts")
    return "; ".join(checked)


def concurrency(spec, ref, prompts: list[list[int]], n: int, noise: float) -> str:
    alone = [spec.complete(p, n).ids for p in prompts]
    crowd = concurrently([lambda p=p: spec.complete(p, n).ids for p in prompts + prompts])
    ties, bugs = [], []
    for k, (p, a, c) in enumerate(zip(prompts + prompts, alone + alone, crowd)):
        d = diagnose(ref, p, a, c, noise)
        if d is not None:
            (ties if d.verdict == "tie" else bugs).append(f"prompt {k % len(prompts)}: alone {a}, among "
                                                          f"{len(crowd)} at once {c}: {d}")
    if bugs:
        raise Violation("output changes with the requests in flight:\n  " + "\n  ".join(bugs))
    return f"{len(crowd)} requests at once equal each alone, {len(ties)} ties (noise {noise:.3g})"


def logprobs(spec, ref, prompts: list[list[int]], n: int, noise: float) -> str:
    worst, compared = 0.0, 0
    for k, p in enumerate(prompts):
        s, r = spec.complete(p, n, logprobs=1), ref.complete(p, n, logprobs=1)
        same = first_difference(s.ids, r.ids)
        for i in range(len(s.ids) if same is None else same):
            diff = abs(s.logprobs[i] - r.logprobs[i])
            compared += 1
            worst = max(worst, diff)
            if diff > noise + LOGPROB_FLOOR:
                raise Violation(f"prompt {k}, new token {i} ({s.ids[i]}): reported logprob {s.logprobs[i]:.6g}, the "
                                f"reference's {r.logprobs[i]:.6g} (difference {diff:.3g} > noise {noise:.3g})")
    return f"{compared} emitted tokens' logprobs equal the reference's (largest difference {worst:.3g})"


def first_token_law(ref, prompt: list[int], temperature: float, k: int) -> tuple[dict, str | None]:
    """{token: probability} of the first new token at `temperature` from the reference's top-k raw
    logprobs, with the rest pooled as None; and why not, when the server's limit leaves it unknown."""
    top = ref.complete(prompt, 1, logprobs=k).top[0]
    known = {t: math.exp(v) for t, v in top.items()}
    rest = max(0.0, 1.0 - sum(known.values()))
    if temperature == 1.0:
        return {**known, None: rest}, None
    power = 1 / temperature
    tempered = {t: v ** power for t, v in known.items()}
    # every unreported token has p <= the smallest reported one, so below T=1 the rest's tempered mass
    # is at most rest * p_min^(1/T - 1); where that is negligible the law is known to within it
    bound = rest * min(known.values()) ** (power - 1) if power > 1 and known else (0.0 if rest <= 1e-12 else math.inf)
    z = sum(tempered.values()) + bound / 2
    if bound / z > TAIL_TOLERANCE:
        return {}, (f"the server gives {len(top)} top logprobs covering {1 - rest:.4f} of the mass: the law at "
                    f"T={temperature} depends on the rest by up to {bound / z:.2g} (only T=1, or T < 1 where the "
                    f"rest is bounded below {TAIL_TOLERANCE:g}, is testable at this logprob limit)")
    return {**{t: v / z for t, v in tempered.items()}, None: bound / 2 / z}, None


def sampling_law(spec, ref, prompt: list[int], temperature: float, samples: int, k: int, alpha: float,
                 seed: int = 1234, tokens: int = 4) -> str:
    law, why = first_token_law(ref, prompt, temperature, k)
    if why:
        return f"untested: {why}"
    seeds = [seed + i for i in range(samples)]
    firsts = concurrently([lambda s=s: spec.complete(prompt, tokens, temperature=temperature, seed=s).ids[0]
                           for s in seeds], workers=4)
    for t in firsts:
        if t not in law and None not in law:   # outside a law known in full: an outcome of probability 0
            law[t] = 0.0
    cells = list(law)
    counts = [0] * len(cells)
    for t in firsts:
        counts[cells.index(t if t in law else None)] += 1
    fit = goodness_of_fit("law of the first new token", {"first": (counts, [law[c] for c in cells])})
    if fit.rejects(alpha):
        table = ", ".join(f"{c}: {o}/{samples * law[c]:.1f}" for c, o in zip(cells, counts) if o or law[c] > 0.01)
        raise Violation(f"T={temperature}: {fit} < {alpha}\n  observed/expected {table}")
    return f"T={temperature}: p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {alpha})"
