"""Served and engine properties: a decoder with speculation against the same model decoded without it, both
sides of a Subject (spec/conformance/subject.py: a server and its reference server, either dialect of
spec/conformance/endpoint.py, or llama.cpp in process against its own plain decoding). Each check takes the
Subject first (`spec, ref = subject.test, subject.reference`) and returns its evidence (a line for the report) or raises
Violation with the counterexample. The reference's own logprobs are the evidence for a divergence: the
top-2 gap at the first divergent position, against the engine's measured noise (the same positions'
logprobs from the reference alone and among concurrent requests, `measure_noise`), so a numerical tie
is named a tie and anything else is a bug.

  greedy_exact   speculative greedy output == the reference's, token for token (ties named)
  stops          max_tokens exact (never one more), stop_token_ids and EOS where the reference stops
                 (inside an accepted block or not), ignore_eos, min_tokens
  concurrency    each request's output alone == its output among concurrent requests with other prompts
  mixed_batch    ... and among sampled requests in flight
  companions     ... and among top-k, seeded or penalised requests in flight (COMPANIONS)
  seeded_batch   a seeded sampled request's ids alone == at once with others == at once in reversed order
  logprobs       the logprob reported for each emitted token == the reference's for the same prefix,
                 within the measured noise (not the draft's, not a processed one)
  sampling_law   the law of the first new token at T > 0 with per-request seeds (speculation running
                 over the next ones) against the law from the reference's own top logprobs, chi-square;
                 at T < 1 only where the unreported tail is bounded below TAIL_TOLERANCE
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spec.conformance import checks
from spec.conformance.endpoint import EndpointError, UnsupportedRequest
from spec.conformance.stats import homogeneity
from spec.diagnose import Divergence, first_difference
from spec.options import Verdict

# Two logprobs that differ by float32 rounding alone are equal: servers compute and print them in float32
# (a relative step of 1.19e-7), so the bound scales with the values (a fixed 1e-6 is one float32 step
# at a logprob of 8, and a tie of rounding could fail a server on a CPU that rounds the other way).
FLOAT32_EPS = 2.0 ** -23
ROUNDING_STEPS = 16


def rounding(a: float, b: float) -> float:
    """How far two logprobs may differ by float32 rounding: ROUNDING_STEPS steps at their magnitude."""
    return ROUNDING_STEPS * FLOAT32_EPS * (1.0 + max(abs(a), abs(b)))


TAIL_TOLERANCE = 1e-4    # a law known to within this (the unreported tail at T < 1) is tested: at n = 400
                         # it moves an expected count by 0.04


@dataclass
class Case:
    """One request of a failed property that shows the failure on its own: sent to the side under test,
    it gave `actual` where the reference gave `expected` (`spec conform --repro` replays it)."""
    prompt: list[int]
    max_tokens: int
    request: dict                # Side.complete's keywords (temperature, stop_token_ids, options, ...)
    expected: list[int]
    actual: list[int]
    divergence: str = ""


@dataclass
class Crowd:
    """Requests of a failed property that show the failure only when sent together (`spec conform --repro`
    replays them at once): (prompt, max_tokens, Side.complete's keywords) each; `expected` the ids each
    gave alone (None for a request that is only there to be in flight, e.g. a sampled one), `actual` what
    each gave in the crowd."""
    requests: list[tuple[list[int], int, dict]]
    expected: list[list[int] | None]
    actual: list[list[int] | None]
    divergence: str = ""


@dataclass
class Repeat:
    """A request that, sent twice alone, gave two outputs (a seeded sample not repeated): `spec conform --repro`
    sends it twice, up to a number of attempts (it may be intermittent)."""
    prompt: list[int]
    max_tokens: int
    request: dict
    first: list[int]
    second: list[int]


@dataclass
class Crash:
    """A request that took the server down (answered 5xx or not at all), or a known crash the kit did not send:
    `spec conform --repro` writes a script that sends it and then a plain greedy request on the same prompt.
    `sent`: (URL, JSON body) exactly as it was sent, when it was."""
    prompt: list[int] | None
    max_tokens: int
    request: dict
    reason: str = ""
    sent: tuple | None = None


class Violation(AssertionError):
    """A property failed; `cases` are the single requests (Case) or the requests sent together (Crowd) that
    show it (none for a law over samples)."""

    def __init__(self, message: str, cases=()):
        super().__init__(message)
        self.cases = list(cases)


# A property's verdict when the server under test drafted nothing while it ran (its evidence starts so).
NOT_SPECULATING = "not speculating"


def concurrently(calls: list, workers: int = 8) -> list:
    """Run the zero-argument `calls` at once (results in order)."""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(calls)))) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def at_once(side, requests: list) -> list[list[int]]:
    """The ids `side` gives each of `requests` ((prompt, max_tokens, Side.complete's keywords) each), all sent
    at once, one thread a request (in order)."""
    return concurrently([lambda r=r: side.complete(r[0], r[1], **r[2]).ids for r in requests], workers=len(requests))


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


def diagnose(subject, prompt: list[int], expected: list[int], actual: list[int], noise: float) -> Divergence | None:
    """The first divergence of `actual` from the reference's `expected`, tie or bug (Subject.judge)."""
    return subject.judge(list(prompt), list(expected), list(actual), noise)


def greedy_exact(subject, prompts: list[list[int]], n: int, noise: float) -> str:
    """endpoint_greedy_exact's verdict on the one greedy-exactness check (checks.greedy_exact): ties pass,
    named; a bug raises Violation with each diverging request."""
    found = checks.greedy_exact(subject, prompts, n, noise)

    def line(r):
        return (f"prompt {r.index} ({len(r.prompt)} ids, {n} tokens): {r.divergence}\n    prompt {r.prompt}\n"
                f"    expected {r.expected.ids}\n    actual   {r.actual.ids}")
    ties = [line(r) for r in found.ties]
    if found.bugs:
        raise Violation("greedy output differs from the reference's beyond a tie:\n  "
                        + "\n  ".join([line(r) for r in found.bugs] + ties),
                        [Case(r.prompt, n, {}, r.expected.ids, r.actual.ids, str(r.divergence)) for r in found.bugs])
    return (f"{len(prompts) - len(ties)} of {len(prompts)} identical, {len(ties)} ties (noise {noise:.3g})"
            + "".join(f"\n  {t}" for t in ties))


def eos_prompts(ref, candidates: list[list[int]], limit: int) -> list[list[int]]:
    """The candidates whose reference output ends at the model's EOS within `limit` new tokens (asked
    with ignore_eos false): where an EOS test means something."""
    found = []
    for p in candidates:
        try:
            out = ref.complete(p, limit, ignore_eos=False)
        except UnsupportedRequest:   # a subject with no EOS stop: EOS is named untested by `stops`
            return []
        if out.finish_reason == "stop" and len(out.ids) < limit:
            found.append(p)
    return found


def stops(subject, prompt: list[int], n: int, eos_prompts: list[list[int]] = (), eos_limit: int | None = None) -> str:
    """max_tokens, stop_token_ids, min_tokens and EOS: the speculative server stops where the reference
    does. Stop ids are taken from the reference's own greedy output, so they fall inside what a
    speculative round accepts in one block. EOS is tested on `eos_prompts` with `eos_limit` (default n)
    new tokens: prompts whose reference output ends at EOS (eos_prompts() finds them)."""
    spec, ref = subject.test, subject.reference
    full = ref.complete(prompt, n).ids
    checked = []
    for m in sorted({1, 2, 3, 5, 9, n}):
        if m > n:
            continue
        got = spec.complete(prompt, m).ids
        if got != full[:m]:
            raise Violation(f"max_tokens={m} (ignore_eos): expected the reference's {full[:m]}, got {got} "
                            f"({len(got)} tokens)", [Case(list(prompt), m, {}, full[:m], got)])
    checked.append("max_tokens 1..%d exact" % n)
    try:
        checked.append(_stop_ids(subject, prompt, n, full))
    except UnsupportedRequest as why:   # an API without stop_token_ids (llama-server): named, not failed
        checked.append(f"stop_token_ids and min_tokens untested ({why})")
    m = eos_limit or n
    ended = 0
    for p in eos_prompts:
        want, got = ref.complete(p, m, ignore_eos=False), spec.complete(p, m, ignore_eos=False)
        if got.ids != want.ids:
            raise Violation(f"EOS (ignore_eos false): reference {want.ids} ({len(want.ids)} tokens), got {got.ids}"
                            f"\n  prompt {p}")
        ended += want.finish_reason == "stop" and len(want.ids) < m
        if len(spec.complete(p, m, ignore_eos=True).ids) != m:
            raise Violation(f"ignore_eos true stopped before max_tokens={m}\n  prompt {p}")
    if eos_prompts:
        checked.append(f"EOS and ignore_eos on {len(eos_prompts)} prompts ({ended} ending at EOS within {m})")
    else:
        checked.append(f"EOS untested: no prompt's reference output ended at EOS within {m} tokens")
    return "; ".join(checked)


def _stop_ids(subject, prompt: list[int], n: int, full: list[int]) -> str:
    """stop_token_ids (ids from the reference's own output `full`) and min_tokens: spec stops where ref does."""
    spec, ref = subject.test, subject.reference
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
            raise Violation(f"stop_token_ids=[{stop}] (first emitted at new token {j}): reference {want}, got {got}",
                            [Case(list(prompt), n, {"stop_token_ids": [stop]}, want, got)])
        low = min(n, j + 2)
        want_min = ref.complete(prompt, n, stop_token_ids=[stop], min_tokens=low).ids
        got_min = spec.complete(prompt, n, stop_token_ids=[stop], min_tokens=low).ids
        if got_min != want_min or len(got_min) < min(low, len(want_min)):
            raise Violation(f"stop_token_ids=[{stop}], min_tokens={low}: reference {want_min}, got {got_min}")
    return "stop_token_ids and min_tokens at new tokens 1, 3, n/2"


# Companions: the requests sent beside the greedy ones (each prompt's greedy request twice) in a mixed batch.
# kind -> the keywords (Side.complete's) of prompt k's companion. `sampled` is endpoint_mixed_batch (T = 1, a
# seed each); the others are endpoint_companions[kind]: `top_k` (T = 0.9, top-k 2, a seed each), `seeded` (T = 1,
# one fixed seed for all, the seed endpoint_seeded sends first), `penalised` (T = 1, a seed each, a repetition
# penalty and presence + frequency penalties on alternate prompts). The field's reports: a greedy row changed by
# a sampled, filtered, seeded or penalised neighbour in the same step (vLLM 0.32.0 CPU: docs/CONFORMANCE.md).
COMPANIONS = {
    "sampled": lambda k: {"temperature": 1.0, "seed": 100 + k},
    "top_k": lambda k: {"temperature": 0.9, "seed": 200 + k, "options": {"top_k": 2}},
    "seeded": lambda k: {"temperature": 1.0, "seed": 11},
    "penalised": lambda k: {"temperature": 1.0, "seed": 300 + k,
                            "options": [{"repetition_penalty": 1.3},
                                        {"presence_penalty": 0.8, "frequency_penalty": 0.6}][k % 2]},
}


def companion_options(kind: str) -> set[str]:
    """The sampling options a companion kind sends (known crashes are keyed on them)."""
    return {o for k in range(2) for o in COMPANIONS[kind](k).get("options", {})}


def _companions(subject, kind: str, prompts: list[list[int]], n: int) -> tuple[list, list[str]]:
    """Prompt k's companion of `kind` for each prompt, as (prompt, n, keywords); and the option sets the server
    under test refuses (each tried once alone, 2 tokens: a 4xx or an option its API lacks), which are left out."""
    spec = subject.test
    kept, refused, verdict = [], [], {}
    for k, p in enumerate(prompts):
        keywords = COMPANIONS[kind](k)
        key = repr(keywords.get("options"))
        if key not in verdict:
            try:
                _refusable("the speculative server", lambda: spec.complete(list(p), 2, **keywords))
                verdict[key] = None
            except Untested as why:
                verdict[key] = f"{keywords.get('options')} ({why})"
                refused.append(verdict[key])
        if verdict[key] is None:
            kept.append((list(p), n, keywords))
    return kept, refused


def _crowd_check(subject, prompts: list[list[int]], n: int, noise: float,
                 others: list, label: str = "") -> tuple[int, list, list, Crowd]:
    """Each greedy request alone against the same requests sent at once (each prompt twice), with `others`
    ((prompt, n, keywords) each: the companions) in flight beside them. (count, ties, bugs as lines, the crowd).
    A subject that takes one request at a time has no crowd to vary: Untested."""
    spec = subject.test
    if not subject.concurrent:
        raise Untested(f"{subject.name} decodes one request at a time (no requests in flight together)")
    alone = [spec.complete(p, n).ids for p in prompts]
    greedy = [(list(p), n, {}) for p in prompts + prompts]
    everything = list(others) + greedy
    answers = at_once(spec, everything)
    crowd = answers[len(others):]
    ties, bugs = [], []
    for k, (p, a, c) in enumerate(zip(prompts + prompts, alone + alone, crowd)):
        d = diagnose(subject, p, a, c, noise)
        if d is not None:
            (ties if d.verdict == Verdict.TIE else bugs).append(
                f"prompt {k % len(prompts)}: alone {a}, among {len(greedy)} greedy"
                + (f" and {len(others)} {label}" if others else "") + f" requests at once {c}: {d}")
    together = Crowd(everything, [None] * len(others) + alone + alone, answers, "\n".join(bugs))
    return len(everything), ties, bugs, together


NO_CONTROL = "no control given"
SURVIVES = "survives the control: bug"
VANISHES = "vanishes under the control: batch-shape effect"


def control_verdict(subject, crowd: Crowd) -> str:
    """What the failed `crowd` does on the subject's control (the same speculative engine in its deterministic /
    batch-invariant mode, `--control openai:URL`): each request with an `expected` output sent alone there, then
    the crowd at once, as the kit sent it. A difference that survives there is a bug; one that vanishes is the
    batch shape's numerics. The property fails either way: this is its label."""
    control = subject.control
    if control is None:
        return (f"{NO_CONTROL} (--control openai:URL, the same engine in its batch-invariant mode, would tell a bug "
                f"from a batch-shape effect)")
    try:
        alone: dict = {}
        for (p, m, kw), e in zip(crowd.requests, crowd.expected):
            key = repr((p, m, sorted(kw.items())))
            if e is not None and key not in alone:
                alone[key] = control.complete(p, m, **kw).ids
        together = at_once(control, crowd.requests)
    except EndpointError as err:
        return f"control: no verdict, the control failed ({str(err)[:200]})"
    judged = [(k, alone[repr((p, m, sorted(kw.items())))], got) for k, ((p, m, kw), e, got)
              in enumerate(zip(crowd.requests, crowd.expected, together)) if e is not None]
    differ = [k for k, a, got in judged if a != got]
    if differ:
        return (f"{SURVIVES} (on the control {len(differ)} of {len(judged)} requests differ from their output "
                f"alone there: requests {differ[:8]})")
    return f"{VANISHES} (on the control each of the {len(judged)} requests gave its output alone)"


def crowd_violation(subject, message: str, lines: list[str], crowd: Crowd) -> Violation:
    """A crowd property's failure: `message`, the control's verdict on the crowd (control_verdict), the lines."""
    return Violation(f"{message}\n  {control_verdict(subject, crowd)}\n  " + "\n  ".join(lines), [crowd])


def concurrency(subject, prompts: list[list[int]], n: int, noise: float) -> str:
    """Each greedy request alone == the same request among other greedy requests in flight."""
    total, ties, bugs, crowd = _crowd_check(subject, prompts, n, noise, [])
    if bugs:
        raise crowd_violation(subject, "output changes with the requests in flight:", bugs, crowd)
    return f"{total} requests at once equal each alone, {len(ties)} ties (noise {noise:.3g})"


def companions(subject, prompts: list[list[int]], n: int, noise: float, kind: str = "sampled") -> str:
    """Each greedy request alone == the same request while companions of `kind` (COMPANIONS) are in flight:
    an engine that batches them must not let a sampled, filtered, seeded or penalised row change how a greedy
    row's drafts are judged. Companion option sets the server refuses are left out and named; a kind refused
    entirely is untested, never a pass."""
    if kind not in COMPANIONS:
        raise ValueError(f"kind must be one of {sorted(COMPANIONS)}, got {kind!r}")
    if not subject.concurrent:
        raise Untested(f"{subject.name} decodes one request at a time (no requests in flight together)")
    others, refused = _companions(subject, kind, prompts, n)
    if not others:
        raise Untested(f"every {kind} companion refused: {'; '.join(refused)}")
    total, ties, bugs, crowd = _crowd_check(subject, prompts, n, noise, others, kind)
    if bugs:
        raise crowd_violation(subject, f"greedy output changes when {kind} requests are in flight:", bugs, crowd)
    return (f"{2 * len(prompts)} greedy requests among {len(others)} {kind} ones equal each alone, "
            f"{len(ties)} ties (noise {noise:.3g})" + (f"; untested companions: {'; '.join(refused)}" if refused else ""))


def mixed_batch(subject, prompts: list[list[int]], n: int, noise: float) -> str:
    """Each greedy request alone == the same request while sampled requests (T = 1, a seed each) are in
    flight (companions of kind `sampled`): an engine that batches them must not let a sampled row change how
    a greedy row's drafts are judged (vLLM 0.32.0 on CPU does: docs/CONFORMANCE.md)."""
    return companions(subject, prompts, n, noise, "sampled")


def logprobs(subject, prompts: list[list[int]], n: int, noise: float) -> str:
    spec, ref = subject.test, subject.reference
    worst, compared = 0.0, 0
    for k, p in enumerate(prompts):
        s, r = spec.complete(p, n, logprobs=1), ref.complete(p, n, logprobs=1)
        same = first_difference(s.ids, r.ids)
        for i in range(len(s.ids) if same is None else same):
            diff = abs(s.logprobs[i] - r.logprobs[i])
            compared += 1
            worst = max(worst, diff)
            if diff > noise + rounding(s.logprobs[i], r.logprobs[i]):
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


def sampling_law(subject, prompt: list[int], temperature: float, samples: int, k: int, alpha: float,
                 seed: int = 1234, tokens: int = 4) -> str:
    """endpoint_sampling_law's verdict on the one sampling-law check (checks.sampling_law): the first new token
    of `samples` seeded requests (4 in flight) against the law from the reference's top-k logprobs."""
    law, why = first_token_law(subject.reference, prompt, temperature, k)
    if why:
        return f"untested: {why}"
    try:
        fitted = checks.sampling_law(subject, prompt, {t if t is None else (t,): p for t, p in law.items()},
                                     [seed + i for i in range(samples)], depth=1, tokens=tokens,
                                     temperature=temperature, name="law of the first new token", stratum="first")
    except checks.TooShort as short:
        raise Violation(f"T={temperature}: {short}") from None
    fit = fitted.fit
    if fit.rejects(alpha):
        table = ", ".join(f"{c if c is None else c[0]}: {o}/{samples * p:.1f}"
                          for c, o, p in zip(fitted.cells, fitted.observed, fitted.probs) if o or p > 0.01)
        raise Violation(f"T={temperature}: {fit} < {alpha}\n  observed/expected {table}")
    return f"T={temperature}: p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {alpha})"


# --- options, response fields, streaming, seeds, sampled logprobs, sampling with options ---------------

class Untested(Exception):
    """A server refuses an option (a 4xx naming it): nothing to compare, named in the evidence. A refusal is
    loud, not a wrong answer: vLLM refuses min_p and logit_bias under speculation, for one."""


def _refusable(who: str, call):
    """`call()`'s answer, or Untested when the server refuses the request with a 4xx or its API has no
    such option (UnsupportedRequest)."""
    try:
        return call()
    except UnsupportedRequest as err:
        raise Untested(f"{who} cannot be asked: {err}") from None
    except EndpointError as err:
        if " answered 4" in str(err):
            message = str(err).split(" answered ", 1)[1]
            raise Untested(f"{who} refuses it: {message[:240]}") from None
        raise


class _Refusing:
    """A side whose refusals (a 4xx, or an option its API lacks) raise Untested naming `who` (_refusable)."""

    def __init__(self, side, who: str):
        self.side, self.who = side, who

    def complete(self, prompt, max_tokens, **kwargs):
        return _refusable(self.who, lambda: self.side.complete(prompt, max_tokens, **kwargs))


def greedy_option_sets(ref, prompt: list[int], n: int) -> dict[str, dict]:
    """Greedy requests whose options change the output, built from the reference's own output on `prompt`:
    penalties, a logit bias that lifts the runner-up at new token 1 (so the output turns inside the first
    speculative block) and one that bans the token at new token 3, and a stop string from the middle of
    the reference's text."""
    base = ref.complete(prompt, n, logprobs=2)
    sets = {"repetition_penalty": {"repetition_penalty": 1.3},
            "presence+frequency_penalty": {"presence_penalty": 0.8, "frequency_penalty": 0.6}}
    if base.top and len(base.top) > 1 and len(base.top[1]) > 1:
        (first, v1), (second, v2) = sorted(base.top[1].items(), key=lambda kv: -kv[1])[:2]
        sets["logit_bias+"] = {"logit_bias": {str(second): round(v1 - v2 + 1.0, 3)}}
    if len(base.ids) > 3:
        sets["logit_bias-100"] = {"logit_bias": {str(base.ids[3]): -100}}
    text = base.text or ""
    middle = text[len(text) // 2:len(text) // 2 + 3]
    if middle.strip():
        sets["stop_string"] = {"stop": [middle]}
    return sets


def greedy_options(subject, prompts: list[list[int]], n: int, noise: float) -> str:
    """Greedy with options the reference takes (greedy_option_sets): the speculative output == the
    reference's, ids and text; a divergence is judged by the reference's raw top-2 gap, tie or bug.
    Options the reference refuses are named as untested."""
    ref = subject.reference
    asked = dataclasses.replace(subject, test=_Refusing(subject.test, "the speculative server"),
                                reference=_Refusing(ref, "the reference"), own_scores=subject.scores)
    done, untested, ties, bugs, cases = [], [], [], [], []
    for k, p in enumerate(prompts):
        for name, options in greedy_option_sets(ref, p, n).items():
            try:
                (row,) = checks.greedy_exact(asked, [p], n, noise, options=options).rows
            except Untested as why:
                untested.append(f"{name} ({why})")
                continue
            want, got, d = row.expected, row.actual, row.divergence
            if d is None and want.text is not None and got.text != want.text:
                bugs.append(f"prompt {k}, {name} {options}: same ids, text {got.text!r} != the reference's {want.text!r}")
            elif d is not None:
                (ties if d.verdict == Verdict.TIE else bugs).append(
                    f"prompt {k}, {name} {options}: {d}\n    expected {want.ids}\n    actual   {got.ids}")
                if d.verdict != Verdict.TIE:
                    cases.append(Case(list(p), n, {"options": options}, want.ids, got.ids, str(d)))
            else:
                done.append(name)
    if bugs:
        raise Violation("greedy output with options differs from the reference's:\n  " + "\n  ".join(bugs + ties),
                        cases)
    names = sorted(set(done))
    if not done and not ties:   # nothing compared: never a pass
        return f"untested: every option set ({'; '.join(sorted(set(untested)))})"
    return (f"{len(done)} option runs identical ({', '.join(names)}), {len(ties)} ties"
            + (f"; untested: {'; '.join(sorted(set(untested)))}" if untested else ""))


def _fields(where: str, prompt: list[int], got, want) -> list[str]:
    """What a response says about its ids, against the reference's response for the same request."""
    wrong = []
    if got.finish_reason != want.finish_reason:
        wrong.append(f"{where}: finish_reason {got.finish_reason!r}, the reference's {want.finish_reason!r}")
    if want.text is not None and got.text != want.text:
        wrong.append(f"{where}: text {got.text!r}, the reference's {want.text!r}")
    if got.usage is not None:
        if got.usage.get("completion_tokens") != len(got.ids):
            wrong.append(f"{where}: usage.completion_tokens {got.usage.get('completion_tokens')} for {len(got.ids)} "
                         f"new tokens")
        if got.usage.get("prompt_tokens") not in (None, len(prompt)):
            wrong.append(f"{where}: usage.prompt_tokens {got.usage.get('prompt_tokens')} for a {len(prompt)}-id prompt")
    elif want.usage is not None:
        wrong.append(f"{where}: no usage, the reference reports {want.usage}")
    return wrong


def fields(subject, prompts: list[list[int]], n: int) -> str:
    """Where the ids agree, the rest of the response agrees too: finish_reason ('length', 'stop' at EOS or
    a stop id inside a block), text, and usage that counts the emitted tokens, not the drafted ones."""
    spec, ref = subject.test, subject.reference
    wrong, compared, untested = [], 0, set()
    for k, p in enumerate(prompts):
        full = ref.complete(p, n).ids
        requests = {"length": {}, "eos": {"ignore_eos": False}}
        if len(full) > 2:
            requests["stop id"] = {"stop_token_ids": [full[2]]}
        for what, kw in requests.items():
            try:
                want, got = ref.complete(p, n, **kw), spec.complete(p, n, **kw)
            except UnsupportedRequest as why:
                untested.add(f"{what} ({why})")
                continue
            if got.ids != want.ids:
                continue     # greedy_exact and stops judge the ids
            if want.finish_reason is None and want.text is None and want.usage is None:
                untested.add(f"{what} (the reference reports no finish_reason, text or usage)")
                continue
            compared += 1
            wrong += _fields(f"prompt {k} ({what})", p, got, want)
    if wrong:
        raise Violation("response fields differ from the reference's:\n  " + "\n  ".join(wrong))
    if not compared:
        return f"untested: no response to compare ({'; '.join(sorted(untested))})"
    return (f"{compared} responses: finish_reason, text and usage agree with the reference's"
            + (f"; untested: {'; '.join(sorted(untested))}" if untested else ""))


def streaming(subject, prompts: list[list[int]], n: int) -> str:
    """A streamed request gives what the same request gives unstreamed (and what the reference gives):
    the chunks' ids and text joined, the finish_reason, the usage; chunks carry whole accepted blocks."""
    spec, ref = subject.test, subject.reference
    wrong, widest, untested, compared = [], 0, set(), 0
    for k, p in enumerate(prompts):
        full = ref.complete(p, n).ids
        cases = {"length": {}, **({"stop id": {"stop_token_ids": [full[len(full) // 2]]}} if full else {})}
        for what, kw in cases.items():
            try:
                want, got = ref.complete(p, n, **kw), spec.stream(p, n, **kw)
            except UnsupportedRequest as why:
                untested.add(f"{what} ({why})")
                continue
            compared += 1
            widest = max(widest, *(got.chunks or [0]))
            if got.ids != want.ids:
                wrong.append(f"prompt {k} ({what}): streamed ids {got.ids} ({got.chunks} per chunk), the "
                             f"reference's {want.ids}")
                continue
            wrong += _fields(f"prompt {k} ({what}, streamed)", p, got, want)
    if wrong:
        raise Violation("streamed output differs:\n  " + "\n  ".join(wrong))
    if not compared:
        return f"untested: nothing streamed ({'; '.join(sorted(untested))})"
    return (f"{len(prompts)} prompts streamed == unstreamed reference (up to {widest} tokens in one chunk)"
            + (f"; untested: {'; '.join(sorted(untested))}" if untested else ""))


def seeded(subject, prompts: list[list[int]], n: int, seeds=(11, 12, 13), temperature: float = 1.0) -> str:
    """A request with a seed gives the same sample when sent again (alone), as the reference does."""
    spec, ref = subject.test, subject.reference
    samples: dict = {}
    for k, p in enumerate(prompts):
        for s in seeds:
            r1, r2 = (ref.complete(p, n, temperature=temperature, seed=s).ids for _ in range(2))
            if r1 != r2:
                return f"untested: the reference itself gives two samples for seed {s} ({r1} and {r2})"
            a, b = (spec.complete(p, n, temperature=temperature, seed=s).ids for _ in range(2))
            if a != b:
                raise Violation(f"prompt {k}, seed {s}, T={temperature}: the same request gave {a} then {b} "
                                f"(the reference repeats its sample)",
                                [Repeat(list(p), n, {"temperature": temperature, "seed": s}, a, b)])
            samples.setdefault(k, {})[s] = (a, r1)
    for k, by_seed in samples.items():   # a seed that changes nothing is ignored (the reference's samples differ)
        ours, theirs = {tuple(a) for a, _ in by_seed.values()}, {tuple(r) for _, r in by_seed.values()}
        if len(ours) == 1 and len(theirs) > 1:
            raise Violation(f"prompt {k}, seeds {sorted(by_seed)}, T={temperature}: every seed gave {list(ours.pop())} "
                            f"(the reference's samples differ with the seed)")
    return f"{len(prompts) * len(seeds)} seeded requests repeat their samples"


def seeded_batch(subject, prompts: list[list[int]], n: int, seeds=(21, 22, 23), temperature: float = 1.0) -> str:
    """Seeded sampled requests (each prompt with each seed) sent alone, then all at once, then all at once in
    reversed order: each one's ids are the same all three ways (a seed is the request's, not its position in a
    batch or its neighbours'). Untested where the reference itself does not repeat its seeded samples batched."""
    spec, ref = subject.test, subject.reference
    if not subject.concurrent:
        raise Untested(f"{subject.name} decodes one request at a time (no requests in flight together)")
    requests = [(list(p), n, {"temperature": temperature, "seed": s}) for p in prompts for s in seeds]

    def three_ways(side):
        alone = [side.complete(p, m, **kw).ids for p, m, kw in requests]
        return alone, at_once(side, requests), at_once(side, requests[::-1])[::-1]

    r_alone, r_together, r_backwards = three_ways(ref)
    if r_alone != r_together or r_alone != r_backwards:
        k = next(i for i in range(len(requests)) if not r_alone[i] == r_together[i] == r_backwards[i])
        return (f"untested: the reference itself does not repeat its seeded sample batched (seed "
                f"{requests[k][2]['seed']}: alone {r_alone[k]}, together {r_together[k]}, reversed {r_backwards[k]})")
    alone, together, backwards = three_ways(spec)
    for order, got in (("at once", together), ("at once in reversed order", backwards)):
        differ = [k for k in range(len(requests)) if got[k] != alone[k]]
        if differ:
            sent = requests if order == "at once" else requests[::-1]
            crowd = Crowd(sent, alone if order == "at once" else alone[::-1],
                          got if order == "at once" else got[::-1])
            lines = [f"prompt {k // len(seeds)}, seed {requests[k][2]['seed']}, T={temperature}: alone {alone[k]}, "
                     f"{len(requests)} {order} {got[k]}" for k in differ]
            crowd.divergence = "\n".join(lines)
            raise crowd_violation(subject, f"seeded samples change when sent {order} ({len(differ)} of "
                                           f"{len(requests)}; the reference repeats its own):", lines, crowd)
    return (f"{len(requests)} seeded requests give their samples alone, at once and at once in reversed order, "
            f"as the reference's do")


def sampled_logprobs(subject, prompts: list[list[int]], n: int, noise: float, k: int,
                     temperature: float = 0.7, seed: int = 99) -> str:
    """Sampled tokens' reported logprobs == the reference's raw logprob of that token after the same
    prefix (within the measured noise), at T != 1: not the draft's, not the tempered or processed one."""
    spec, ref = subject.test, subject.reference
    worst, compared = 0.0, 0
    for j, p in enumerate(prompts):
        s = spec.complete(p, n, temperature=temperature, seed=seed + j, logprobs=1)
        tops = concurrently([lambda i=i: ref.complete(p + s.ids[:i], 1, logprobs=k).top[0] for i in range(len(s.ids))],
                            workers=4)
        for i, (t, top) in enumerate(zip(s.ids, tops)):
            if t not in top:
                continue
            diff = abs(s.logprobs[i] - top[t])
            compared, worst = compared + 1, max(worst, diff)
            if diff > noise + rounding(s.logprobs[i], top[t]):
                raise Violation(f"prompt {j}, sampled new token {i} ({t}) at T={temperature}: reported logprob "
                                f"{s.logprobs[i]:.6g}, the reference's {top[t]:.6g} for that prefix (difference "
                                f"{diff:.3g} > noise {noise:.3g})")
    if not compared:
        return "untested: no sampled token was among the reference's top logprobs"
    return f"{compared} sampled tokens' logprobs equal the reference's (largest difference {worst:.3g})"


FIXED_SAMPLING_OPTIONS = {"top_k": {"top_k": 2}, "top_p": {"top_p": 0.6}, "min_p": {"min_p": 0.2},
                          "repetition_penalty": {"repetition_penalty": 1.8},
                          "presence+frequency_penalty": {"presence_penalty": 1.5, "frequency_penalty": 1.0}}


def sampling_option_sets(ref, prompt: list[int], k: int) -> dict[str, dict]:
    """Sampling options that change the law of the first tokens on `prompt`, from the reference's top
    logprobs there: top-k 2, top-p 0.6, min-p 0.2, a logit bias on the third token, a repetition penalty
    (the prompt's tokens), presence and frequency penalties (the first new token's, at the second)."""
    top = sorted(ref.complete(prompt, 1, logprobs=k).top[0].items(), key=lambda kv: -kv[1])
    sets = dict(FIXED_SAMPLING_OPTIONS)
    if len(top) > 2:
        sets["logit_bias"] = {"logit_bias": {str(top[2][0]): 2.0}}
    return sets


def sampling_options(subject, prompt: list[int], options: dict, samples: int, alpha: float,
                     temperature: float = 0.9, tokens: int = 4, depth: int = 2, seed: int = 5000) -> str:
    """The law of the first `depth` new tokens with `options` at `temperature`: the speculative server's
    seeded samples against the reference's (other seeds), a two-sample chi-square test. It needs no
    model of the engine's filters: the same engine without speculation is the law."""
    spec, ref = subject.test, subject.reference
    try:
        for who, server in (("the reference", ref), ("the speculative server", spec)):
            _refusable(who, lambda: server.complete(prompt, tokens, temperature=temperature, seed=seed, options=options))
    except Untested as why:
        return f"untested: {options}: {why}"
    draw = lambda server, s: tuple(server.complete(prompt, tokens, temperature=temperature, seed=s,  # noqa: E731
                                                   options=options).ids[:depth])
    a = concurrently([lambda s=s: draw(spec, s) for s in range(seed, seed + samples)], workers=4)
    b = concurrently([lambda s=s: draw(ref, s) for s in range(seed + 10 ** 6, seed + 10 ** 6 + samples)], workers=4)
    fit = homogeneity(f"first {depth} new tokens with {options}", a, b)
    if fit.df == 0:
        return f"untested: {options} leaves one outcome at this n"
    if fit.rejects(alpha):
        from collections import Counter
        ca, cb = Counter(a), Counter(b)
        table = ", ".join(f"{c}: {ca[c]}/{cb[c]}" for c, _ in (ca + cb).most_common(8))
        raise Violation(f"T={temperature} with {options}: the speculative server's law differs from the "
                        f"reference's: {fit} < {alpha}\n  speculative/reference counts {table}")
    return f"T={temperature} {options}: p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {samples} + {samples})"
