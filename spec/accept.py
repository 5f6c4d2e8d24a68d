"""The acceptance rule of speculative decoding (Leviathan et al. 2023, Algorithm 1, step 3), as two
pure functions over a proposal (a spec.tree.Tree: a chain is the tree whose node i follows node
i - 1) and the target's scores at the root and at each node: the accepted path and what comes next
out. They keep no state and draw no random numbers: the decode loop draws the uniforms and the
last token, so that what they consume from the generator is visible where the generator is.

Greedy: from the root, move to the child whose token is the target's argmax at the current node,
while there is one; the token after the path is the target's argmax at its end. Every emitted
token is the target's argmax, and the output is plain greedy decoding's. On a chain: a proposal is
kept while it equals the target's argmax at its position.

Sampling: proposal x_i, drawn from q_i, is kept if u_i < p_i(x_i) / q_i(x_i) (written
u_i * q_i(x_i) < p_i(x_i), which needs no division). On a chain, the longest prefix that passes is
kept; at the first rejection the next token is drawn from norm(max(0, p_k - q_k)); when all g
pass, from p_g. The output is then distributed exactly as p (the paper's Appendix A.1, for any q).
On a tree, SpecInfer's multi-candidate rule (recursive rejection over siblings): at the current
node the target's distribution is r = p(node); each child c in turn, drawn from q_c, is kept if
u_c * q_c(x_c) < r(x_c); a rejected child's mass is removed, r = norm(max(0, r - q_c)), before the
next sibling is tried. A kept child becomes the current node (r = p(c)); when every child is
rejected, or a leaf is reached, the next token is drawn from r. Each step is Algorithm 1's rule for
one proposal against the residual, so the emitted token is distributed as p(node) whatever the
siblings' q (Miao et al. 2024, SpecInfer, Theorem 4.2). A chain is walked as the paper writes it
(one comparison over all g proposals), which is the same rule without the walk.
"""

from __future__ import annotations

import torch

from spec import sampling


def greedy(tree, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """tree: spec.tree.Tree of N nodes; logits [N + 1, V]: row 0 scores the token after the root,
    row i + 1 the token after node i -> (the accepted path, node indices from the root down; the
    target's token after it, a 0-d tensor)."""
    if tree.is_chain:                                  # the paper's gamma tokens in a row
        k, token = _chain_greedy(tree.tokens, logits)
        return list(range(k)), token
    return _walk_greedy(tree, logits)


def sampled(tree, p: torch.Tensor, u: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """tree: spec.tree.Tree (q [N, W] or None: one-hot); p [N + 1, V] the target's distributions
    (row 0 after the root, row i + 1 after node i); u [N] uniforms in [0, 1), one per node
    -> (the accepted path, the distribution the next token is drawn from)."""
    if tree.is_chain:                                  # Algorithm 1's step 3 as the paper writes it
        k, last = _chain_sampled(tree.tokens, tree.q, p, u)
        return list(range(k)), last
    return _walk_sampled(tree, p, u)


# --- A tree, walked from the root -----------------------------------------------------------------

def _walk_greedy(tree, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    choice = _argmax(logits)
    wanted = choice.tolist()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        nxt = next((c for c, p in enumerate(tree.parents) if p == node and tokens[c] == wanted[node + 1]), None)
        if nxt is None:
            return path, choice[node + 1]
        path.append(nxt)
        node = nxt


def _walk_sampled(tree, p: torch.Tensor, u: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node, r = -1, p[0]
    siblings = tree.children(-1)
    while siblings:
        for c in siblings:
            x = tokens[c]
            qc = tree.q[c] if tree.q is not None else torch.nn.functional.one_hot(tree.tokens[c], p.shape[-1]).to(p.dtype)
            q_x = qc[x] if x < qc.shape[-1] else qc.new_zeros(())
            if u[c] * q_x < r[x]:                      # u < r(x) / q(x)
                path.append(c)
                node, r = c, p[c + 1]
                break
            r = sampling.residual(r, qc)               # the rejected child's mass leaves r
        else:
            return path, r                             # every sibling rejected
        siblings = tree.children(node)
    return path, r                                     # a leaf: the next token from p after it


# --- A chain (each node the child of the one before): the same rules, without walking -------------

def _chain_greedy(proposed: torch.Tensor, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """proposed [g] ids, logits [g + 1, V] (row i scores the token at proposal i's position, row g
    the one after them all) -> (k, the target's token after the first k proposals, a 0-d tensor)."""
    g = proposed.numel()
    choice = _argmax(logits)
    k = int((proposed == choice[:g]).cumprod(0).sum())
    return k, choice[k]


def _chain_sampled(proposed: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima), [rows]. On a CPU row by row: one argmax over [rows, V]
    there is split over torch's threads, and their team, spinning a while after, takes a core from the
    target's next pass (SmolLM2, 2 threads: a 9-row round 1.66 -> 1.25 greedy steps)."""
    if logits.device.type != "cpu" or logits.shape[0] == 1:
        return logits.argmax(-1)
    return torch.stack([row.argmax() for row in logits])
