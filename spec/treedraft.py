"""Two tree drafters (spec.tree): several candidate continuations a round, verified in one pass.

TreeDraft grows a tree from a draft model, EAGLE-2's way in miniature: at each depth every node
of the newest level offers its `branches` likeliest next tokens, and the draft's greedy chain
plus the candidates with the highest probability of their whole path (the draft's) become the
next level, `branches` of them, up to `nodes` nodes. LookupTree is prompt lookup (spec.lookup) with several earlier matches as
branches, merged where they agree.

Both are deterministic sources (q one-hot at each node), so greedy verification keeps the
target's argmaxes and sampling verification is SpecInfer's rule with one-hot q (spec.accept):
exact either way, whatever the tree.
"""

from __future__ import annotations

import torch

from spec import choose, hf
from spec.draft import resync
from spec.lookup import PromptLookup, matches
from spec.protocols import DraftSource, Need, Runner
from spec.runner import score_tree
from spec.tree import Tree


def _count(name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class TreeDraft(DraftSource):
    """Use as the draft: `speculative_generate(target, TreeDraft(draft_model), ids, gamma=4)`.
    gamma is the tree's depth; branches the width of each level; nodes the most nodes a round
    (the target scores nodes + 1 positions in its pass). branches=1 drafts the chain a draft
    model would."""

    needs = frozenset({Need.TREES})

    def __init__(self, model, branches: int = 2, nodes: int = 8):
        self.model = model
        self.branches, self.nodes = _count("branches", branches), _count("nodes", nodes)
        choose.check({"draft": model})
        self.width = min(hf.logit_width(model), hf.vocab_rows(model))
        self.run: Runner | None = None  # the draft model's Runner, made for the first sequence
        self.seen = torch.zeros(0, dtype=torch.long)    # the ids it holds

    def __repr__(self) -> str:
        return f"TreeDraft({type(self.model).__name__}, branches={self.branches}, nodes={self.nodes})"

    def __deepcopy__(self, memo):       # one per row of a batch: the model shared, the state not
        return TreeDraft(self.model, self.branches, self.nodes)

    def _sync(self, seq: torch.Tensor, n: int) -> tuple[Runner, torch.Tensor]:
        """The runner, cut back to what it shares with seq[:n - 1]; and the ids it must be fed, root last."""
        if self.run is None:
            self.run = choose.runs({"draft": self.model}, seq[:n], draft_impl="hf").runs[0]
            self.seen = seq[:0].clone()
        start = resync(self.run, self.seen, seq, n)
        self.seen = seq[:n].clone()
        return self.run, seq[start:n]

    @torch.inference_mode()
    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        run, before = self._sync(seq, n)
        end = len(run) + before.numel()
        tokens: list[int] = []
        parents: list[int] = []
        path_logp: list[float] = []
        level = [-1]
        logp = torch.log_softmax(run(before, keep=1)[-1, :self.width].double(), -1)[None]
        for depth in range(g):
            room = self.nodes - len(tokens)
            if room <= 0 or not level:
                break
            # every node of the level offers its likeliest tokens; the likeliest paths go on
            top = logp.topk(min(self.branches, self.width), dim=-1)
            offers = [((path_logp[node] if node >= 0 else 0.0) + float(v), node, int(t))
                      for row, node in enumerate(level) for v, t in zip(top.values[row], top.indices[row])]
            # the first offer is the draft's own greedy chain (level[0]'s likeliest token): it is
            # always kept, so that a tree keeps, round for round, at least what the chain would
            offers = offers[:1] + sorted(offers[1:], key=lambda o: -o[0])
            level = []
            for lp, node, token in offers[:min(self.branches, room)]:
                level.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                path_logp.append(lp)
            if depth + 1 == g or len(tokens) >= self.nodes:
                break
            # the draft's next-token logits at the new level, every node given its own path
            run.crop(end - 1)                           # the root is fed again with the tree
            tree = Tree(torch.tensor(tokens, dtype=torch.long, device=seq.device), tuple(parents))
            rows = score_tree(run, seq[len(run):n], tree)
            logp = torch.log_softmax(rows[[i + 1 for i in level], :self.width].double(), -1)
        run.crop(end)
        return Tree(torch.tensor(tokens, dtype=torch.long, device=seq.device), tuple(parents))

    def observe(self, n: int, accepted: int) -> None:
        if self.run is not None:
            self.run.crop(n - 1)            # all but the newest token, fed next round

    def __len__(self) -> int:
        return 0 if self.run is None else len(self.run)


class LookupTree(DraftSource):
    """Prompt lookup with branches: the continuations of up to `branches` earlier occurrences of
    the sequence's last n tokens (the most recent first; longest n first, as PromptLookup), merged
    into a tree where they share a prefix, at most `nodes` nodes and gamma deep."""

    needs = frozenset({Need.TREES})

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, branches: int = 3, nodes: int = 16):
        self.lookup = PromptLookup(max_ngram, min_ngram)
        self.branches, self.nodes = _count("branches", branches), _count("nodes", nodes)

    def __repr__(self) -> str:
        return (f"LookupTree(max_ngram={self.lookup.max_ngram}, min_ngram={self.lookup.min_ngram}, "
                f"branches={self.branches}, nodes={self.nodes})")

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}      # (parent, token) -> node
        for branch in self.continuations(seq[:n], g):
            node = -1
            for token in branch:
                if (node, token) not in child:
                    if len(tokens) == self.nodes:
                        break
                    child[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child[(node, token)]
        return Tree(torch.tensor(tokens, dtype=torch.long, device=seq.device), tuple(parents))

    def continuations(self, history: torch.Tensor, limit: int) -> list[list[int]]:
        """Up to `branches` continuations of the last n-gram's most recent earlier occurrences."""
        return matches(history, self.lookup.max_ngram, self.lookup.min_ngram, limit, self.branches)
