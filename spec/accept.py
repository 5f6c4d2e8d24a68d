"""The acceptance rule of speculative decoding (Leviathan et al. 2023, Algorithm 1, step 3), as two
pure functions: the draft's proposals and the target's scores in, the accepted count and what comes
next out. They keep no state and draw no random numbers: the decode loop draws the uniforms and the
last token, so that what they consume from the generator is visible where the generator is.

Greedy: a proposal is kept while it equals the target's argmax at its position; the token after
the kept prefix is the target's own argmax there. The emitted tokens are thus all the target's
argmaxes, and the output is plain greedy decoding's.

Sampling: proposal x_i, drawn from q_i, is kept if u_i < p_i(x_i) / q_i(x_i) (written
u_i * q_i(x_i) < p_i(x_i), which needs no division), for the longest prefix that passes. At the
first rejection the next token is drawn from norm(max(0, p_k - q_k)); when all g pass, from p_g.
The output is then distributed exactly as p (the paper's Appendix A.1, for any q).
"""

from __future__ import annotations

import torch

from spec import sampling


def greedy(proposed: torch.Tensor, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """proposed [g] ids, logits [g + 1, V] (row i scores the token at proposal i's position, row g
    the one after them all) -> (k, the target's token after the first k proposals, a 0-d tensor)."""
    g = proposed.numel()
    choice = logits.argmax(-1)
    k = int((proposed == choice[:g]).cumprod(0).sum())
    return k, choice[k]


def sampled(proposed: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
            u: torch.Tensor) -> tuple[int, torch.Tensor]:
    """proposed [g] ids; q [g, W] the draft distributions they were drawn from (W may be narrower
    than the vocabulary: zero beyond it), or None for a deterministic draft (q one-hot at each
    proposal); p [g + 1, V] the target's distributions; u [g] uniforms in [0, 1)
    -> (k, the distribution the next token is drawn from)."""
    g = proposed.numel()
    if g == 0:
        return 0, p[0]
    if q is None:
        q = torch.nn.functional.one_hot(proposed, p.shape[-1]).double()
    rows = torch.arange(g, device=p.device)
    passed = u * q[rows, proposed] < p[rows, proposed]      # u < p(x) / q(x)
    k = int(passed.cumprod(0).sum())
    return k, (sampling.residual(p[k], q[k]) if k < g else p[g])      # on rejection: norm(max(0, p - q))
