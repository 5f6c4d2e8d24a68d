"""A chain of draft sources, llama.cpp's common/speculative way: each round the first source that
proposes anything drafts, e.g. `FirstOf(PromptLookup(), TreeDraft(draft_model, branches=1))`:
prompt lookup where the text repeats (almost free), the draft model where it does not.

Exactness is each source's: the round's tree is one source's own (its q included), so the
acceptance rule sees exactly what that source drew, and the output is the target's whatever the
chain chose (Leviathan et al., Appendix A.1, for any q).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from spec.protocols import DraftSource, Drafter, Need, Step
from spec.tree import Tree


@dataclass
class Counts:
    """One source's statistics: the rounds it drafted (it was the first to propose anything), the
    nodes it proposed in them and how many of those the loop kept (as observe heard it: an EOS
    inside a kept block is counted before the cut)."""
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


class FirstOf(DraftSource):
    """Use as the draft: `speculative_generate(target, FirstOf(PromptLookup(), GGUFDraft(...)), ids)`.

    Each round asks its sources in order and drafts the first tree with a node (an empty one when
    none has one); the sources after it are not asked. `needs` is the union of the sources'.
    `observe` is passed to every source: the one that drafted hears the accepted count, the
    others 0 (they proposed nothing), so each learns that seq[:n] is final; a stateful source that
    was not asked for some rounds catches up on its next draft (spec.draft.resync). `len` is the
    largest of the sources'. `stats`: a dict, one `Counts` per source, keyed by its repr (a repeated
    repr gets ` #i`, its place in the chain). A copy (one per row of a batch) copies each source
    as it copies itself and shares `stats`, so that the statistics count every row."""

    def __init__(self, *sources: Drafter) -> None:
        if not sources:
            raise ValueError("FirstOf: give at least one draft source")
        for source in sources:
            if not isinstance(source, Drafter):
                raise TypeError(f"FirstOf: {type(source).__name__} is not a Drafter (spec.protocols); a draft "
                                f"model goes in as spec.TreeDraft(model, branches=1), which drafts its chain")
        self.sources = list(sources)
        self.needs = frozenset().union(*(source.needs for source in sources))
        readers = {source.layers for source in sources if Need.HIDDEN in source.needs}
        if len(readers) > 1:
            raise ValueError(f"FirstOf: the sources that read hidden states ask for different layers "
                             f"({sorted(readers)}); the target keeps one set a run")
        self.layers = readers.pop() if readers else (-1,)
        self.names = _names(self.sources)
        self.stats = {name: Counts() for name in self.names}
        self.drafter: int | None = None     # the index of the source that drafted this round

    def __repr__(self) -> str:
        return f"FirstOf({', '.join(map(repr, self.sources))})"

    def begin(self, prompt: torch.Tensor) -> None:
        for source in self.sources:
            source.begin(prompt)

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        """The first source's tree with a node, in the chain's order; no source is asked when g < 1."""
        self.drafter = None
        for i, source in enumerate(self.sources if g >= 1 else []):
            tree = source.draft(seq, n, g)
            if not isinstance(tree, Tree):
                raise TypeError(f"draft: {type(source).__name__}.draft must return a spec.Tree, got "
                                f"{type(tree).__name__}")
            if len(tree):
                self.drafter = i
                counts = self.stats[self.names[i]]
                counts.rounds += 1
                counts.proposed += len(tree)
                return tree
        return Tree.chain(seq[n:n])

    def observe(self, n: int, accepted: int) -> None:
        """Every source hears that seq[:n] is final: this round's drafter `accepted`, the rest 0."""
        for i, source in enumerate(self.sources):
            source.observe(n, accepted if i == self.drafter else 0)
        if self.drafter is not None:
            self.stats[self.names[self.drafter]].accepted += accepted
        self.drafter = None

    def process(self, step: Step) -> None:
        """Each source with Need.HIDDEN gets the round's Step, whoever drafted."""
        for source in self.sources:
            if Need.HIDDEN in source.needs:
                source.process(step)

    def __len__(self) -> int:
        return max(len(source) for source in self.sources)

    def __deepcopy__(self, memo):
        made = copy.copy(self)              # stats (and names, needs) shared
        made.sources = copy.deepcopy(self.sources, memo)
        return made


def _names(sources: list[Drafter]) -> list[str]:
    """Each source's repr; one that repeats gets ` #i`, its place in the chain."""
    reprs = [repr(source) for source in sources]
    return [r if reprs.count(r) == 1 else f"{r} #{i}" for i, r in enumerate(reprs)]
