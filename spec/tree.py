"""A draft proposal: a tree of candidate tokens after the sequence's last final token (the root).

Node i proposes `tokens[i]` to follow node `parents[i]` (-1: the root), parents before children.
A chain, the paper's gamma tokens in a row, is the tree whose node i follows node i - 1; a tree
(SpecInfer, Medusa, EAGLE) offers several continuations, and the target scores them all in one
pass: node i sits at position root + depth(i) and attends to the sequence and to its own
ancestors only (`visibility`), so its logits are those of the path that leads to it.

q[i] is the distribution node i's token was drawn from, given its path and the siblings drafted
before it (None: a deterministic source, q one-hot at each token). spec.accept walks the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor                 # [N] ids, parents before children
    parents: tuple[int, ...]             # parents[i] < i; -1 is the root
    q: torch.Tensor | None = None        # [N, width] or None (deterministic)

    @staticmethod
    def chain(tokens: torch.Tensor, q: torch.Tensor | None = None) -> "Tree":
        return Tree(tokens, tuple(range(-1, tokens.numel() - 1)), q)

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def children(self, node: int) -> list[int]:
        """The nodes that follow `node` (-1: the root), in the order they were drafted."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        parents = set(self.parents)
        return [i for i in range(len(self)) if i not in parents]

    def visibility(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j when j is i or one of its ancestors."""
        seen = torch.eye(len(self), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i] |= seen[p]
        return seen

    def check(self, depth_limit: int, width: int) -> None:
        """The contract a drafter keeps (a bad tree would be verified wrong, not refused later)."""
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.long:
            raise ValueError(f"Tree.tokens must be a 1-D LongTensor, got {self.tokens.dtype} "
                             f"of shape {tuple(self.tokens.shape)}")
        if len(self.parents) != len(self):
            raise ValueError(f"Tree.parents has {len(self.parents)} entries for {len(self)} tokens")
        bad = [i for i, p in enumerate(self.parents) if not -1 <= p < i]
        if bad:
            raise ValueError(f"Tree.parents[{bad[0]}] = {self.parents[bad[0]]}: a parent must come before "
                             f"its child (-1 for the root)")
        if len(self) and max(self.depths()) > depth_limit:
            raise ValueError(f"Tree is {max(self.depths())} deep, more than the {depth_limit} tokens drafted "
                             f"this round may be")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != len(self)):
            raise ValueError(f"Tree.q must be [{len(self)}, width] or None, got shape {tuple(self.q.shape)}")
        if len(self) and not 0 <= int(self.tokens.min()) <= int(self.tokens.max()) < width:
            raise ValueError(f"Tree.tokens must be ids in [0, {width}), got {self.tokens.tolist()}")


def layout(tree: Tree, start: int, fed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pass that feeds `fed` tokens of the sequence (the last of them the root) after `start`
    cached positions, then the tree's nodes: (positions [fed + N], mask [fed + N, start + fed + N],
    True where a query may attend). The sequence part is causal; a node sees the sequence and
    its ancestors, at position root + its depth."""
    N = len(tree)
    root = start + fed - 1
    positions = torch.cat([torch.arange(start, start + fed),
                           root + torch.tensor(tree.depths(), dtype=torch.long)])
    mask = torch.ones(fed + N, start + fed + N, dtype=torch.bool).tril(start)
    mask[fed:, start + fed:] = tree.visibility()
    return positions, mask


def in_place(path: list[int]) -> bool:
    """The path is the proposal's first nodes (a chain's accepted prefix): its positions are
    already in order behind the sequence, and keeping it is the crop that follows."""
    return path == list(range(len(path)))
