"""Two tree drafters (spec.tree): several candidate continuations a round, verified in one pass.

TreeDraft grows a tree from a draft model on the one model-drafting engine (spec.draft.ModelDraft,
EAGLE-2's way in miniature): at each depth every node of the newest level offers its `branches`
likeliest next tokens, and the draft's greedy chain plus the candidates with the highest
probability of their whole path (the draft's) become the next level, `branches` of them, up to
`nodes` nodes (sampled: drawn, with their q). LookupTree is prompt lookup (spec.lookup) with
several earlier matches as branches, merged where they agree.

Greedy verification keeps the target's argmaxes and sampling verification is SpecInfer's rule
(spec.accept, q one-hot for a deterministic tree): exact either way, whatever the tree.
"""

from __future__ import annotations

import torch

from spec import batch, choose, hf
from spec.draft import ModelDraft, ModelSource, Pick
from spec.lookup import PromptLookup, matches
from spec.protocols import DraftSource, Need
from spec.tree import Tree


def _count(name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class TreeDraft(ModelSource):
    """Use as the draft: `speculative_generate(target, TreeDraft(draft_model), ids, gamma=4)`.
    gamma is the tree's depth; branches the width of each level; nodes the most nodes a round
    (the target scores nodes + 1 positions in its pass). branches=1 drafts the chain a draft
    model would. pick: how it picks (spec.draft.Pick; greedy by default, a deterministic tree;
    sampled, each node drawn from its q, for a sampled run with the same options). It runs on the
    one model-drafting engine, spec.draft.ModelDraft, over the draft model's own runner."""

    needs = frozenset({Need.TREES})

    def __init__(self, model, branches: int = 2, nodes: int = 8, *, pick: Pick = Pick()):
        self.model, self.pick = model, pick
        self.branches, self.nodes = _count("branches", branches), _count("nodes", nodes)
        choose.check({"draft": model})
        self.width = min(hf.logit_width(model), hf.vocab_rows(model))

    def __repr__(self) -> str:
        return f"TreeDraft({type(self.model).__name__}, branches={self.branches}, nodes={self.nodes})"

    def __deepcopy__(self, memo):       # one per row of a batch: the model shared, the state not
        return TreeDraft(self.model, self.branches, self.nodes, pick=self.pick)

    def _start(self, seq: torch.Tensor, n: int) -> ModelDraft:
        run = choose.runs({"draft": self.model}, seq[:n], draft_impl="hf").runs[0]
        return ModelDraft(batch.EachRunner([run]), [self.pick], [self.pick.process.prompt_len], width=self.width,
                          rows=self.width, clamp=False, branches=self.branches, nodes=self.nodes)

    def _held(self, run) -> torch.Tensor:
        return run.held if run.held is not None else torch.zeros(0, dtype=torch.long)

    @torch.inference_mode()
    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        return super().draft(seq, n, g)


class LookupTree(DraftSource):
    """Prompt lookup with branches: the continuations of up to `branches` earlier occurrences of
    the sequence's last n tokens (the most recent first; longest n first, as PromptLookup), merged
    into a tree where they share a prefix, at most `nodes` nodes and gamma deep. 11 nodes by default:
    with the root a 12-row verify pass, the most spec.cpu.gemv's few-row kernel runs on a CPU (16 nodes
    measured 1.03x greedy on SmolLM2, 11 nodes 1.13x: docs/log/benchmarks.md)."""

    needs = frozenset({Need.TREES})

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, branches: int = 3, nodes: int = 11):
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
