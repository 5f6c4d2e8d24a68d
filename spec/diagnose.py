"""Is a divergence from greedy a numerical tie or a bug? One diagnosis for every subject.

`first_difference` finds the first position where an output differs from its reference; `judge`
makes the verdict there from the reference's scores (`Scores`: its top-2 gap at that position and
the noise of the subject's computation), and `Divergence` is the one record every subject prints:
a Hugging Face target (`diagnose` below), a served model (spec.conformance.endpoints: the reference
server's top-2 logprob gap against the noise measured on it) and llama.cpp in process
(spec.conformance.llamacpp: the engine's own logits against its one-token vs block noise). The rule
is the same for all: a length difference (one output stopped) is a bug; a differing token is a tie
only where the reference's top-2 gap there is within the noise (and, where the subject knows its
reference's two best tokens, both tokens are among them); anything else is a bug.

For a Hugging Face target: greedy decoding picks each token from a one-token cached step;
speculative decoding picks the same token from a position inside a (gamma+1)-token verify
pass. The two matmul shapes round differently, so where the target's top-2
logits are closer than that rounding noise the argmax may legitimately flip.
At the first divergent position we recompute the target's logits both ways and
compare the top-2 gap with the noise: within it, a tie; beyond it, a bug.

The noise is the larger of two numbers:
  - measured: max |step logits - block logits| over the vocabulary at that position,
    the two paths recomputed here (a block of up to 6 positions, as a verify pass
    would run them);
  - a floor of 8 ulps of the largest logit, 8 * eps(dtype) * max|logit|, for when the
    two paths happen to agree more closely than the dtype can promise (for instance a
    one-token prompt diverging at its first new token, where both paths are the same
    computation). Per dtype that floor is, relative to the largest logit:
        float64  8 * 2^-52 = 1.8e-15
        float32  8 * 2^-23 = 9.5e-7   (docs/FACTS.md: step vs block differ by up to 1.1e-6)
        float16  8 * 2^-10 = 7.8e-3
        bfloat16 8 * 2^-7  = 6.3e-2   (docs/FACTS.md: up to 9e-3, argmax flips in 3 of 320)
    Why 8 ulps: a logit is a long dot product at the end of a stack of layers whose
    inputs already carry rounding; the two matmul shapes sum in different orders, and
    measured step/block differences reach a few ulps of the largest logit. Eight keeps
    a real tie from being called a bug without excusing anything coarser.
A divergence is a tie only if both tokens are among the target's two best (by either
path) and the smaller of the two paths' top-2 gaps is within that noise; a length
difference (one output stopped) is always a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from spec.options import Verdict

# Relative rounding floor per dtype (a few ulps of the largest logit), used when the
# two recomputed paths happen to agree more closely than the dtype can promise.
_ULPS = 8


@dataclass
class Scores:
    """What a subject's reference says at one position, for the verdict there."""
    gap: float                            # the reference's top-2 gap (logits, or logprobs for a server)
    noise: float                          # how far the subject's own computation moves it
    top2: frozenset[int] | None = None    # the reference's two best ids, where the subject knows them
    gap_block: float | None = None        # HF: the same gap inside a block pass (gap: the one-token step)
    dtype: str | None = None              # HF: the target's dtype (the noise floor's)
    replay: list[int] | None = None       # llama.cpp: block widths whose last row gives the emitted token


@dataclass
class Divergence:
    """The first divergence of an output from its reference and its verdict (Verdict.TIE or BUG), with
    the evidence; `str()` is the line every property and report prints."""
    position: int                   # index into the new tokens
    expected: int | None            # the reference's token there (None: the reference stopped)
    actual: int | None              # the checked output's token (None: it stopped)
    verdict: Verdict
    gap: float = math.nan           # the reference's top-2 gap there (NaN: not computed, a length difference)
    noise: float = math.nan         # the noise it is judged against
    gap_block: float | None = None  # HF: the gap inside one multi-token pass (gap: the one-token cached step)
    dtype: str | None = None        # HF: the target's dtype
    replay: list[int] | None = None  # llama.cpp: the engine's block widths whose last row gives `actual`
    reference: str = "greedy"       # what the expected output is called ("greedy", "reference")
    scale: str = "logit"            # what the gap is of ("logit"; "logprob" for a server)

    @property
    def gap_step(self) -> float:
        """HF: the top-2 gap in the one-token cached step (greedy's path)."""
        return self.gap

    def __str__(self) -> str:
        head = f"first divergence at new token {self.position}: {self.reference} {self.expected}, got {self.actual}"
        if math.isnan(self.gap):
            return f"{head} (a length difference: a stop rule, not a tie): BUG"
        tie = self.verdict == Verdict.TIE
        if self.gap_block is not None:     # a Hugging Face target: both paths recomputed, the dtype's noise
            return (f"{head}; target top-2 {self.scale} gap {self.gap:.3g} (one-token step) / {self.gap_block:.3g} "
                    f"(block verify), noise {self.noise:.3g} ({self.dtype}): "
                    + ("numerical tie" if tie else "BUG (gap beyond the dtype's noise)"))
        line = (f"{head}; {self.reference} top-2 {self.scale} gap {self.gap:.3g}, measured noise {self.noise:.3g}: "
                + ("numerical tie" if tie else "BUG (gap beyond the engine's noise)"))
        if self.replay is not None:
            line += (f"; the engine's own block pass of width {self.replay} gives {self.actual}" if self.replay
                     else f"; no block pass of width 1..gamma+1 gives {self.actual}")
        return line


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """The first index where the two differ (a shorter one differs where it ends), or None."""
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def judge(expected: list[int], actual: list[int], scores: Callable[[int], Scores], *, noise: float = math.nan,
          score_lengths: bool = False, **describe) -> Divergence | None:
    """None when the outputs agree; otherwise the first divergence and its verdict, from `scores(i)`, the
    subject's reference at position i. A length difference is a bug whatever the scores (they are asked
    for it only when `score_lengths`, as evidence; else it carries `noise`). A differing token is a tie
    only where the gap (the smaller of the step and block gaps, where both are known) is within the noise
    and, where the scores name the reference's two best ids, both tokens are among them."""
    i = first_difference(expected, actual)
    if i is None:
        return None
    e = int(expected[i]) if i < len(expected) else None
    a = int(actual[i]) if i < len(actual) else None
    if (e is None or a is None) and not score_lengths:
        return Divergence(i, e, a, Verdict.BUG, noise=noise, **describe)
    s = scores(i)
    gap = s.gap if s.gap_block is None else min(s.gap, s.gap_block)
    tie = (e is not None and a is not None and gap <= s.noise and (s.top2 is None or {e, a} <= s.top2))
    return Divergence(i, e, a, Verdict.TIE if tie else Verdict.BUG, s.gap, s.noise, s.gap_block, s.dtype, s.replay,
                      **describe)


def _gap(logits) -> float:
    import torch
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def diagnose(target, prompt_ids, expected: list[int], actual: list[int], **encoder_inputs) -> Divergence | None:
    """None when the outputs agree; otherwise the first divergence and its verdict.

    A length difference (one output stopped early, or ran past the other) is never
    a tie: stopping depends on token ids, not on logits. An encoder-decoder target takes
    the inputs speculative_generate took (prompt_ids is the encoder input; input_features=,
    decoder_input_ids= as keywords): its decoder is checked, over the encoder output."""
    return judge(expected, actual, lambda i: _scores(target, prompt_ids, expected, i, encoder_inputs),
                 score_lengths=True)


def _scores(target, prompt_ids, expected: list[int], i: int, encoder_inputs: dict) -> Scores:
    """The target's logits at new token i recomputed as greedy's one-token step and as a block."""
    import torch

    from spec import choose
    from spec.validate import model_device

    device = model_device(target)
    dtype = next(target.parameters()).dtype
    fresh = lambda: choose.runs({"target": target}, prompt_ids, **encoder_inputs)  # noqa: E731
    with torch.inference_mode():   # a context, not a decorator: mutmut leaves decorated functions alone
        chosen = fresh()
        prompt = chosen.prompt
        context = torch.cat([prompt, torch.tensor(expected[:i], dtype=torch.long, device=device)])
        # Path 1, greedy's: prefill the prompt, then one token at a time.
        run = chosen.runs[0]
        step = run(context[:prompt.numel()], keep=1)[-1]
        for t in range(prompt.numel(), context.numel()):
            step = run(context[t:t + 1], keep=1)[-1]
        # Path 2, a block's: the last positions in one pass, as a verify round computes them.
        block_start = max(prompt.numel() - 1, context.numel() - 6)
        run = fresh().runs[0]
        if block_start > 0:
            run(context[:block_start], keep=1)
        block = run(context[block_start:], keep=1)[-1]

    finite = torch.isfinite(step) & torch.isfinite(block)  # tokens an encoder-decoder's masks rule out
    measured = float((step.double() - block.double())[finite].abs().max())
    floor = _ULPS * torch.finfo(dtype).eps * float(step.double()[finite].abs().max())
    top2 = set(torch.topk(step.double(), 2).indices.tolist()) | set(torch.topk(block.double(), 2).indices.tolist())
    return Scores(_gap(step), max(measured, floor), frozenset(top2), _gap(block), str(dtype).replace("torch.", ""))
