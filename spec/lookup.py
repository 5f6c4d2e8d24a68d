"""A model-free draft: prompt lookup (n-gram matching in the prompt and the output so far).

Chat answers, code edits and summaries repeat spans of their prompt and of themselves. The
draft looks for the most recent earlier occurrence of the sequence's last n tokens (longest
n first, max_ngram down to min_ngram) and proposes the tokens that followed it. Its cost is
a tensor comparison, not a model step: c is near 0, so every accepted token is almost free.

Exactness: the proposal is a deterministic function of the sequence so far, i.e. a draft
whose q is one-hot at the proposed token x. Greedy verification then keeps the target's own
argmaxes, as for any draft. For sampling, Algorithm 1 with a one-hot q accepts x with
probability min(1, p(x) / q(x)) = p(x) and on rejection samples from norm(max(0, p - q)),
which is p with x removed: the output is distributed exactly as p (Leviathan et al. 2023,
Appendix A.1, for any q). When nothing matches, the round drafts no token: one target step.
"""

from __future__ import annotations

import torch

from spec.protocols import DraftSource
from spec.tree import Tree


class PromptLookup(DraftSource):
    """Use as the draft: `speculative_generate(target, PromptLookup(), ids, gamma=...)`.

    gamma caps the tokens proposed a round; a round proposes fewer where the matched
    occurrence's continuation is short, and none where nothing matches.
    max_ngram, min_ngram: the n-gram lengths tried, longest first. min_ngram 2 by default: on
    SmolLM2-135M-Instruct's greedy text (seed prompts, 128 tokens) a one-token match was
    accepted too rarely to pay for the dearer verify pass it causes (docs/log/benchmarks.md)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __repr__(self) -> str:
        return f"PromptLookup(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    # A Drafter (spec.protocols.DraftSource): a deterministic source (q one-hot, given as None)
    # with no state, so nothing to roll back and no positions held.
    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        return Tree.chain(torch.tensor(self.propose(seq[:n], g), dtype=torch.long, device=seq.device))

    def propose(self, history: torch.Tensor, limit: int) -> list[int]:
        """Up to `limit` tokens to follow `history` (1-D ids: prompt and output so far): the
        continuation of the longest tail n-gram's most recent earlier match (`matches`)."""
        found = matches(history, self.max_ngram, self.min_ngram, limit, 1)
        return found[0] if found else []


def matches(history: torch.Tensor, max_ngram: int, min_ngram: int, limit: int, count: int = 1) -> list[list[int]]:
    """The continuations, `limit` tokens each, of the `count` most recent earlier occurrences of
    history's longest tail n-gram that occurs earlier (n from max_ngram down to min_ngram), the
    most recent first; [] where none occurs or limit < 1. An occurrence is earlier when it ends
    before the last token, so each continuation has at least one known token.

    The continuation of a match is copied; where it reaches the end of the history it goes on
    with the tokens just proposed (the match then sits a period d back, and the text repeats with
    period d: a loop is drafted in full, not one token a round)."""
    n = history.numel()
    if limit < 1:
        return []
    for k in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        # windows[i] = history[i:i+k] for every i whose window ends before the last token
        windows = history[:n - 1].unfold(0, k, 1)
        hits = (windows == history[n - k:]).all(1).nonzero().flatten().tolist()
        if hits:
            return [_loop(history[hit + k:hit + k + limit].tolist(), limit) for hit in reversed(hits[-count:])]
    return []


def _loop(known: list[int], limit: int) -> list[int]:
    """`known` (non-empty) extended to `limit` tokens by repeating it: the loop rule."""
    out: list[int] = []
    for j in range(limit):
        out.append(known[j] if j < len(known) else out[j - len(known)])
    return out
