"""Logits processors that carry state: repetition penalty and no-repeat n-gram, as HF applies them.

Both depend on the whole sequence so far, so in speculative decoding each position must
see exactly its own prefix: verify row i (which predicts seq[n + i]) sees seq[:n + i], the
prompt, the accepted tokens and the draft tokens before it; the draft's step i sees the
same prefix. The state is recomputed from `seq` every time, never carried over, so a
rejected draft token (overwritten in `seq`, beyond `n`) can never leak into a later round.

Semantics follow transformers' RepetitionPenaltyLogitsProcessor and NoRepeatNGramLogitsProcessor
(the prompt counts as part of the sequence); they run on raw logits, before temperature,
top-k and top-p, which is also HF's order.
"""

from __future__ import annotations

import torch


class Processors:
    """repetition_penalty: every id already in the sequence has its logit divided by the
    penalty if it is >= 0, multiplied if it is negative (None or 1.0: off).
    no_repeat_ngram_size: an id that would complete an n-gram already in the sequence gets
    logit -inf (None or 0: off)."""

    def __init__(self, repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None):
        if repetition_penalty is not None and (isinstance(repetition_penalty, bool)
                                               or not isinstance(repetition_penalty, (int, float))
                                               or not repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be None or a number > 0, got {repetition_penalty!r}")
        if no_repeat_ngram_size is not None and (isinstance(no_repeat_ngram_size, bool)
                                                 or not isinstance(no_repeat_ngram_size, int)
                                                 or no_repeat_ngram_size < 0):
            raise ValueError(f"no_repeat_ngram_size must be None or an integer >= 0, got {no_repeat_ngram_size!r}")
        self.penalty = None if repetition_penalty in (None, 1, 1.0) else float(repetition_penalty)
        self.ngram = no_repeat_ngram_size or None

    def __bool__(self) -> bool:
        return self.penalty is not None or self.ngram is not None

    def __call__(self, logits: torch.Tensor, seq: torch.Tensor, start: int) -> torch.Tensor:
        """logits [k, V]: row i processed as the next-token logits after seq[:start + i]."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        out = logits.clone()
        width = out.shape[-1]
        for i in range(out.shape[0]):
            prefix = seq[:start + i]
            if self.penalty is not None:
                ids = prefix[prefix < width]  # a wider target may emit ids the draft's head lacks
                score = out[i].gather(0, ids)
                out[i].scatter_(0, ids, torch.where(score < 0, score * self.penalty, score / self.penalty))
            if self.ngram is not None and prefix.numel() >= self.ngram:  # else no n-gram exists yet
                n = self.ngram
                windows = prefix.unfold(0, n, 1)                    # every n-gram so far
                tail = prefix[prefix.numel() - n + 1:]              # the n-1 tokens a new n-gram starts with
                banned = windows[(windows[:, :-1] == tail).all(1), -1]
                out[i, banned[banned < width]] = float("-inf")
        return out
