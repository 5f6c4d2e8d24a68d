"""Reference answers the suite checks the decoders against."""

from __future__ import annotations

import warnings

import pytest

from spec import greedy_generate
from spec.diagnose import diagnose


def assert_exact(target, prompt, expected: list[int], actual: list[int], *, allow_ties: bool = False):
    """Fail with the diagnosis (position, both tokens, top-2 gap on both paths, verdict)
    unless the outputs agree. A proven tie passes only with allow_ties, and is reported."""
    d = diagnose(target, prompt, expected, actual)
    if d is None:
        return None
    if d.verdict == "tie" and allow_ties:
        warnings.warn(f"numerical tie, not a bug: {d}")
        return d
    pytest.fail(str(d), pytrace=False)


def reference_rounds(draft, prompt: list[int], greedy_tokens: list[int], gamma: int, max_new_tokens: int):
    """Algorithm 1 replayed without any cache: per round (drafted, accepted, emitted).

    Each round drafts min(gamma, tokens left - 1) tokens as the draft's own greedy
    continuation of the context (recomputed from scratch), accepts the prefix that
    matches the target's greedy output, and emits one more token (cut at the end,
    which is where greedy stopped at EOS or max_new_tokens)."""
    rounds, n = [], 0
    while n < len(greedy_tokens):
        g = min(gamma, max_new_tokens - n - 1)
        proposals = greedy_generate(draft, prompt + greedy_tokens[:n], max_new_tokens=g).tokens if g else []
        k = 0
        while k < g and n + k < len(greedy_tokens) and proposals[k] == greedy_tokens[n + k]:
            k += 1
        emitted = min(k + 1, len(greedy_tokens) - n)
        rounds.append((g, k, emitted))
        n += emitted
    return rounds
