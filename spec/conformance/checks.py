"""The two properties every subject is held to, each written once, over the Subject protocol
(spec/conformance/subject.py): a server and its reference server, llama.cpp in process against its own
plain decoding, and an in-process decoder (spec, HF assisted, any module:function) against the target's
own greedy decoding are all Subjects, so each property is this one function for all of them.

  greedy_exact    each prompt's greedy output from the side under test == the reference's, token for
                  token; a divergence judged by the subject (Subject.judge: a tie within its measured
                  noise, or a bug; an in-process decoder's fp64 targets make every divergence a bug)
  sampling_law    the first `depth` new tokens the side under test samples (one request a seed) fitted
                  to the exact law of those tokens, Pearson's chi-square (stats.law_fit)

Each returns what it found; the property that runs it words the verdict in its own report (the served
properties raise endpoints.Violation, the kit's in-process ones fail with the decoder's settings, llama.cpp's
own name the engine's build and speed), so the reports read as before while the check is one. No torch here:
a served-model run needs none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spec.conformance.endpoint import Completion
from spec.conformance.stats import LawFit, law_fit
from spec.diagnose import Divergence
from spec.options import Verdict


@dataclass
class Compared:
    """One prompt of greedy_exact: both sides' completions and the subject's judgement (None: identical)."""
    index: int
    prompt: list[int]
    expected: Completion          # the reference's
    actual: Completion            # the side under test's
    divergence: Divergence | None


@dataclass
class Exactness:
    """What greedy_exact found, prompt by prompt."""
    rows: list[Compared]

    @property
    def ties(self) -> list[Compared]:
        return [r for r in self.rows if r.divergence is not None and r.divergence.verdict == Verdict.TIE]

    @property
    def bugs(self) -> list[Compared]:
        return [r for r in self.rows if r.divergence is not None and r.divergence.verdict != Verdict.TIE]

    @property
    def identical(self) -> int:
        return sum(r.divergence is None for r in self.rows)


def greedy_exact(subject, prompts: list[list[int]], n: int, noise: float = math.nan, **request) -> Exactness:
    """Greedy exactness: for each prompt, `n` new tokens from the reference, then from the side under test,
    with the same `request` (Side.complete's keywords: stop ids, options, ...), and the subject's judgement
    of the first divergence against its measured `noise`. A side that cannot be asked raises
    UnsupportedRequest (the property is untested, not passed)."""
    rows = []
    for k, p in enumerate(prompts):
        want = subject.reference.complete(list(p), n, **request)
        got = subject.test.complete(list(p), n, **request)
        rows.append(Compared(k, list(p), want, got, subject.judge(list(p), want.ids, got.ids, noise)))
    return Exactness(rows)


class TooShort(AssertionError):
    """A side under test returned fewer tokens than the law is of."""


def sampling_law(subject, prompt: list[int], law: dict, seeds: list, *, depth: int, tokens: int | None = None,
                 temperature: float = 1.0, options: dict | None = None, name: str | None = None,
                 stratum: str = "all", workers: int = 4) -> LawFit:
    """The sampling law: one request per seed in `seeds` to the side under test (`tokens` new tokens, default
    `depth`, at `temperature` with `options`; a seed None draws from the side's own generator), at most
    `workers` in flight where the subject takes requests together, else one after another in order; the
    first `depth` tokens of each fitted to `law` ({tuple of `depth` tokens: probability}, or with a cell None
    for the pooled rest of a law known in part). TooShort if a sample has fewer than `depth` tokens."""
    keywords = {"temperature": temperature, **({"options": options} if options else {})}
    requests = [(list(prompt), tokens or depth, dict(keywords, seed=s)) for s in seeds]
    drawn = subject.generate_many(requests, workers) or [subject.generate(p, m, **kw) for p, m, kw in requests]
    samples = [tuple(ids[:depth]) for ids in drawn]
    short = [s for s in samples if len(s) != depth]
    if short:
        raise TooShort(f"{subject.name} returned fewer than {depth} tokens: {short[:3]}")
    return law_fit(name or f"joint law of the first {depth} tokens", samples, law, stratum)
