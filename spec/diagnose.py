"""Is a divergence from greedy a numerical tie or a bug?

Greedy decoding picks each token from a one-token cached step; speculative
decoding picks the same token from a position inside a (gamma+1)-token verify
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

from dataclasses import dataclass

import torch

from spec import choose
from spec.options import Verdict
from spec.validate import model_device

# Relative rounding floor per dtype (a few ulps of the largest logit), used when the
# two recomputed paths happen to agree more closely than the dtype can promise.
_ULPS = 8


@dataclass
class Divergence:
    position: int            # index into the new tokens
    expected: int | None     # greedy's token there (None: greedy stopped)
    actual: int | None       # the checked decoder's token (None: it stopped)
    gap_step: float          # target's top-2 logit gap, one-token cached step
    gap_block: float         # the same inside one multi-token pass
    noise: float             # rounding noise between the two paths
    dtype: str
    verdict: Verdict         # "tie" or "bug"

    def __str__(self) -> str:
        return (f"first divergence at new token {self.position}: greedy {self.expected}, got {self.actual}; "
                f"target top-2 logit gap {self.gap_step:.3g} (one-token step) / {self.gap_block:.3g} (block verify), "
                f"noise {self.noise:.3g} ({self.dtype}): "
                + ("numerical tie" if self.verdict == Verdict.TIE else "BUG (gap beyond the dtype's noise)"))


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def _gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def diagnose(target, prompt_ids, expected: list[int], actual: list[int], **encoder_inputs) -> Divergence | None:
    """None when the outputs agree; otherwise the first divergence and its verdict.

    A length difference (one output stopped early, or ran past the other) is never
    a tie: stopping depends on token ids, not on logits. An encoder-decoder target takes
    the inputs speculative_generate took (prompt_ids is the encoder input; input_features=,
    decoder_input_ids= as keywords): its decoder is checked, over the encoder output."""
    i = first_difference(expected, actual)
    if i is None:
        return None
    device = model_device(target)
    dtype = next(target.parameters()).dtype
    exp_tok = expected[i] if i < len(expected) else None
    act_tok = actual[i] if i < len(actual) else None
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
    noise = max(measured, floor)
    gap_step, gap_block = _gap(step), _gap(block)
    top2 = set(torch.topk(step.double(), 2).indices.tolist()) | set(torch.topk(block.double(), 2).indices.tolist())
    is_tie = (exp_tok is not None and act_tok is not None and {exp_tok, act_tok} <= top2
              and min(gap_step, gap_block) <= noise)
    return Divergence(i, exp_tok, act_tok, gap_step, gap_block, noise, str(dtype).replace("torch.", ""),
                      Verdict.TIE if is_tie else Verdict.BUG)
