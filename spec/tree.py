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


# --- Scoring a tree on a Runner (spec.protocols) -----------------------------------------------------

def score(run, before: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The target's logits for the tree: [N + 1, V], row 0 after the root (the last id of
    `before`, the sequence's ids the runner has not seen), row i + 1 after node i.

    A chain (nodes in a row, none included) is the runner's plain pass over the sequence and
    its tokens. A runner that takes trees (`run.takes_trees`: spec.runner.KVRunner on a model
    whose forward passed the tree probe) scores every node in one pass and keeps them until
    `retain`. Any other runner is fed the tree branch by branch, root to each leaf, and cut back
    to the sequence after each: exact on every runner, at a pass per leaf."""
    if tree.is_chain:
        return run(torch.cat([before, tree.tokens]), keep=len(tree) + 1)
    if getattr(run, "takes_trees", False):
        return run.feed_tree(before, tree)
    base = len(run)
    end = base + before.numel()                 # the root is the sequence's last id, at end - 1
    rows: list = [None] * (len(tree) + 1)
    states: list = [None] * (len(tree) + 1)        # hidden states, for a runner that keeps them
    sequence = None                                # the states of `before` up to the root
    for i, leaf in enumerate(tree.leaves()):
        if i:
            run.crop(end - 1)                   # back to the sequence; the root is fed again
        if len(run) < base:
            raise RuntimeError(f"{type(run).__name__} went back to {len(run)} positions, before the {base} "
                               f"it held when the tree came")
        path = tree.path(leaf)
        logits = run(torch.cat([before[len(run) - base:], tree.tokens[path]]), keep=len(path) + 1)
        hidden = getattr(run, "hidden", None)          # every id fed: `before`'s, then the path's
        if hidden is not None and i == 0:
            sequence = hidden[:-(len(path) + 1)]
        for depth, node in enumerate([-1] + path):
            rows[node + 1] = logits[depth]
            states[node + 1] = hidden[hidden.shape[0] - len(path) - 1 + depth] if hidden is not None else None
    run.crop(end)                               # the accepted path is fed with the next round
    if getattr(run, "collect_hidden", False):
        run.hidden = torch.cat([sequence, torch.stack(states)])     # as a one-pass runner gives them
    return torch.stack(rows)


def in_place(path: list[int]) -> bool:
    """The path is the proposal's first nodes (a chain's accepted prefix): its positions are
    already in order behind the sequence, and keeping it is the crop that follows."""
    return path == list(range(len(path)))


def retain(run, base: int, path: list[int]) -> None:
    """After `score`: keep, of the tree's nodes (cached from position `base` on), the accepted
    path only, moved up behind the sequence. A runner fed branch by branch holds none of them."""
    if not in_place(path) and getattr(run, "takes_trees", False):
        run.retain(base, path)
