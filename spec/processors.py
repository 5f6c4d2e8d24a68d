"""Logits processors that depend on the sequence, as HF applies them: sequence bias, repetition
penalty, no-repeat n-gram, bad words, min_new_tokens.

Both depend on the whole sequence so far, so in speculative decoding each position must
see exactly its own prefix: verify row i (which predicts seq[n + i]) sees seq[:n + i], the
prompt, the accepted tokens and the draft tokens before it; the draft's step i sees the
same prefix. The state is recomputed from `seq` every time, never carried over, so a
rejected draft token (overwritten in `seq`, beyond `n`) can never leak into a later round.

Semantics follow transformers' SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor,
NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor and MinNewTokensLengthLogitsProcessor, in
that order, which is the order HF's generate() builds them in (the prompt counts as part of the
sequence); they run on raw logits, before temperature, top-k, top-p and min-p, which is also HF's
order. tests/correctness/test_logits_processors.py checks each against HF's own classes.
"""

from __future__ import annotations

import copy

import torch


class Processors:
    """repetition_penalty: every id already in the sequence has its logit divided by the
    penalty if it is >= 0, multiplied if it is negative (None or 1.0: off).
    no_repeat_ngram_size: an id that would complete an n-gram already in the sequence gets
    logit -inf (None or 0: off).
    sequence_bias: {tuple of ids: bias}; a one-id key biases that id always, a longer key biases
    its last id where the sequence ends with the rest (HF's sequence_bias; a dict or HF's list form
    [[ids], bias]). bad_words_ids: [[ids], ...]; the same with bias -inf, except that a one-id
    entry equal to an EOS id is dropped (as HF does). min_new_tokens: the EOS ids get -inf while
    fewer than this many tokens follow the prompt (needs eos_ids and prompt_len; HF applies it
    only when an EOS id is set)."""

    def __init__(self, repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None, *,
                 sequence_bias=None, bad_words_ids=None, min_new_tokens: int | None = None, eos_ids=(),
                 prompt_len: int = 0):
        if repetition_penalty is not None and (isinstance(repetition_penalty, bool)
                                               or not isinstance(repetition_penalty, (int, float))
                                               or not repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be None or a number > 0, got {repetition_penalty!r}")
        if no_repeat_ngram_size is not None and (isinstance(no_repeat_ngram_size, bool)
                                                 or not isinstance(no_repeat_ngram_size, int)
                                                 or no_repeat_ngram_size < 0):
            raise ValueError(f"no_repeat_ngram_size must be None or an integer >= 0, got {no_repeat_ngram_size!r}")
        if min_new_tokens is not None and (isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int)
                                           or min_new_tokens < 0):
            raise ValueError(f"min_new_tokens must be None or an integer >= 0, got {min_new_tokens!r}")
        self.penalty = None if repetition_penalty in (None, 1, 1.0) else float(repetition_penalty)
        self.ngram = no_repeat_ngram_size or None
        self.bias = _sequences("sequence_bias", sequence_bias)
        eos = {int(t) for t in eos_ids}
        bad = _sequences("bad_words_ids", None if bad_words_ids is None else _bad_words(bad_words_ids))
        self.bad = [s for s, _ in bad if not (len(s) == 1 and s[0] in eos)]
        self.min_new = (min_new_tokens or None) if eos else None  # HF: no EOS, no min_new_tokens processor
        self.eos, self.prompt_len = sorted(eos), prompt_len

    def for_prompt(self, prompt_len: int) -> Processors:
        """A copy whose min_new_tokens counts from a prompt of `prompt_len` tokens (one per batch row)."""
        row = copy.copy(self)
        row.prompt_len = prompt_len
        return row

    def max_id(self) -> int:
        """The largest id the biases and bad words name (-1 if none): must be inside the vocabulary."""
        return max([t for s, _ in self.bias for t in s] + [t for s in self.bad for t in s], default=-1)

    def __bool__(self) -> bool:
        return bool(self.penalty is not None or self.ngram is not None or self.bias or self.bad or self.min_new)

    def __call__(self, logits: torch.Tensor, seq: torch.Tensor, start: int) -> torch.Tensor:
        """logits [k, V]: row i processed as the next-token logits after seq[:start + i]."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        out = logits.clone()
        width = out.shape[-1]
        for i in range(out.shape[0]):
            prefix = seq[:start + i]
            _add_bias(out[i], prefix, self.bias)
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
            _add_bias(out[i], prefix, [(b, float("-inf")) for b in self.bad])
            if self.min_new is not None and start + i - self.prompt_len < self.min_new:
                out[i, [t for t in self.eos if t < width]] = float("-inf")
        return out


def _bad_words(bad_words_ids):
    if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids:
        raise ValueError(f"bad_words_ids must be a non-empty list of lists of ids, got {bad_words_ids!r}")
    return [[list(b) if isinstance(b, (list, tuple)) else b, float("-inf")] for b in bad_words_ids]


def _sequences(name, spec) -> list[tuple[tuple[int, ...], float]]:
    """[(ids, bias)] from {tuple: bias} or [[ids, bias], ...] (HF's two forms), checked."""
    if spec is None:
        return []
    items = list(spec.items()) if isinstance(spec, dict) else spec
    out = []
    for item in items if isinstance(items, (list, tuple)) else [None]:
        ids, bias = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
                or isinstance(bias, bool) or not isinstance(bias, (int, float))):
            raise ValueError(f"{name} must map non-empty sequences of ids >= 0 to numbers, got {spec!r}")
        out.append((tuple(ids), float(bias)))
    if not out:
        raise ValueError(f"{name} must not be empty, got {spec!r}")
    return out


def _add_bias(row: torch.Tensor, prefix: torch.Tensor, biases) -> None:
    """HF's SequenceBiasLogitsProcessor on one row: a one-id sequence always, a longer one where
    the prefix ends with all but its last id. HF holds the biases in float32: so do we."""
    width = row.shape[-1]
    for ids, bias in biases:
        head, last = ids[:-1], ids[-1]
        if last >= width or len(head) > prefix.numel():
            continue
        if head and prefix[prefix.numel() - len(head):].tolist() != list(head):
            continue
        row[last] += torch.tensor(bias, dtype=torch.float32).to(row.dtype)
