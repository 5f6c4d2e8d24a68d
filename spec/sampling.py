"""Turning logits into the distributions that the rejection rule compares.

Target and draft go through the same processing (temperature, then top-k, then
top-p, then min-p: HF's order), so p and q are the distributions actually sampled from; the paper's
guarantee is that speculative output is distributed exactly as processed p."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """Softmax of logits [..., V] (float32 or wider) after temperature and filtering."""
    logits = logits.float() / temperature if logits.dtype in (torch.float16, torch.bfloat16) else logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p is not None:
        # HF's MinPLogitsWarper: drop tokens whose probability is below min_p times the largest
        # (compared as probabilities, as HF does; the most likely token always stays)
        probs = logits.softmax(-1)
        drop = probs < min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(-1, keepdim=True), False)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) for one position; q may be narrower than p (zero beyond it).

    If p <= q everywhere (only possible up to rounding, since a rejection needs
    q(x) > p(x) somewhere and both sum to one) we fall back to p."""
    r = p.clone()
    r[: q.shape[-1]] -= q
    r.clamp_(min=0)
    total = r.sum()
    return r / total if total > 0 else p


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (a 0-d tensor, left on device) drawn from a 1-D distribution."""
    return torch.multinomial(probs, 1, generator=generator)[0]
