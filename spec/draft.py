"""Draft sources over the batch's rows (spec.protocols.BatchDrafter), and a fixed gamma.

A draft model is one ModelDraft, whatever runs it and however many rows it serves; a model-free
Drafter (spec.lookup.PromptLookup, or a user's) serves each row as spec.batch.EachRow; plain
decoding is the same loop with NoDraft."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec import sampling
from spec.processors import Processors
from spec.protocols import DraftSource, Step
from spec.tree import Tree


@dataclass(frozen=True)
class Pick:
    """How a token is picked from logits: the target's rule, which the draft follows too, so that
    q is the distribution its proposal was actually drawn from."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    process: Processors = Processors()
    min_p: float | None = None

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from: logits already processed, then the warpers."""
        return sampling.probabilities(logits, self.temperature, self.top_k, self.top_p, self.min_p)


class ModelDraft:
    """A draft model (Mq) over its rows (a BatchRunner: spec.batch.Rows for a shared cache,
    spec.batch.EachRunner for one Runner per row, a single prompt included): the one engine every
    model draft runs on (a PyTorch draft model, spec.TreeDraft, spec.gguf_draft.GGUFDraft). Each
    step feeds every live row what the draft has not seen and picks by the row's own Pick (greedy
    or sampled, so that q is what a token was drawn from), from the draft's logits after the row's
    processors, cut to the `width` ids both models share. branches=1 drafts a chain, one token a
    step (Algorithm 1's gamma tokens). branches=b grows a tree level by level, each level one pass
    over the tree so far, at most b nodes a level and `nodes` in all: greedy, every node of the
    level offers its b likeliest tokens, the draft's own greedy token first, the rest by the draft's
    probability of their whole path (EAGLE-2's rule in miniature); sampled, the level's nodes take
    turns drawing a child each from their q, without replacement among siblings (a sibling's q is
    its parent's distribution with the earlier siblings' tokens removed: what it was drawn from,
    which keeps SpecInfer's rule exact, spec.accept). Trees need a runner that scores them
    (spec.batch.EachRunner). Where the target can emit ids the draft cannot embed (`clamp`:
    pythia-12b's head is wider than pythia-410m's embedding), the draft is fed a stand-in, the last
    id it can embed: that changes only its guesses."""

    def __init__(self, run, picks: list[Pick], prompt_lens: list[int], *, width: int, rows: int, clamp: bool,
                 branches: int = 1, nodes: int | None = None):
        self.run, self.picks = run, picks           # each row's Pick (rows: indices into the whole batch)
        # the target's processors, each row's min_new_tokens counted from its own prompt
        self.processors = [pick.process.for_prompt(n) if pick.process else None
                           for pick, n in zip(picks, prompt_lens)]
        self.width, self.rows, self.clamp = width, rows, clamp
        self.branches, self.nodes = branches, nodes

    def begin(self, prompts: list[torch.Tensor]) -> None:
        pass                        # its runner is made for the run (spec.choose.rows)

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]):
        if self.branches > 1:
            return self._grow(seq, n, gs, live)
        q: list[list[torch.Tensor]] = [[] for _ in live]
        for i in range(max(gs)):    # every row steps together; a row keeps only its first gs[j]
            feeds = [seq[b, length:n[b] + i] for b, length in zip(live, self.run.lengths)]
            if self.clamp:
                feeds = [f.clamp(max=self.rows - 1) for f in feeds]
            logits = self.run(feeds, keep=1).logits[:, -1, :self.width]
            for j, b in enumerate(live):
                row, process, pick = logits[j], self.processors[b], self.picks[b]
                if process:
                    row = process(row[None], seq[b], n[b] + i)[0]
                if pick.do_sample:
                    q[j].append(pick.probabilities(row))
                    seq[b, n[b] + i] = sampling.sample(q[j][-1], pick.generator)
                else:
                    seq[b, n[b] + i] = row.argmax()
        return [Tree.chain(seq[b, n[b]:n[b] + g], torch.stack(rows[:g]) if rows and g else None)
                for b, rows, g in zip(live, q, gs)]

    def _grow(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]) -> list[Tree]:
        """branches > 1: each live row's tree (the class docstring's rule), a pass a level."""
        trees = [Tree.chain(seq[b, n[b]:n[b]]) for b in live]
        levels: list[list[int]] = [[-1] for _ in live]      # the newest level's nodes (-1: the root)
        path_logp: list[list[float]] = [[] for _ in live]
        budget = self.nodes or self.branches * max(gs, default=0)
        for depth in range(max(gs, default=0)):
            if not any(levels[j] and depth < gs[j] and len(trees[j]) < budget for j in range(len(live))):
                break                       # no row grows another level: no pass for nothing
            feeds = [seq[b, length:n[b]] for b, length in zip(live, self.run.lengths)]
            if self.clamp:
                feeds = [f.clamp(max=self.rows - 1) for f in feeds]
            grown = [Tree(t.tokens.clamp(max=self.rows - 1), t.parents) if self.clamp else t for t in trees]
            logits = self.run(feeds, keep=max(len(t) for t in trees) + 1, trees=grown).logits
            self.run.crop([n[b] - 1 for b in live])      # the root is fed again with the next level
            for j, b in enumerate(live):
                room = min(self.branches, budget - len(trees[j]))
                if depth >= gs[j] or room <= 0 or not levels[j]:
                    levels[j] = []
                    continue
                rows = logits[j, logits.shape[1] - len(trees[j]) - 1:]      # the root's, then each node's
                scores = [self._processed(rows[node + 1, :self.width], seq[b], n[b], trees[j], node, b)
                          for node in levels[j]]
                trees[j], levels[j] = self._level(trees[j], levels[j], scores, path_logp[j], room, self.picks[b])
        return trees

    def _processed(self, row: torch.Tensor, seq: torch.Tensor, n: int, tree: Tree, node: int, b: int) -> torch.Tensor:
        """The draft's scores after `node` (-1: the root), through row b's processors with the prefix
        its path makes."""
        process = self.processors[b]
        if not process:
            return row
        path = tree.path(node) if node >= 0 else []
        line = seq.clone()
        line[n:n + len(path)] = tree.tokens[path]
        return process(row[None], line, n + len(path))[0]

    def _level(self, tree: Tree, level: list[int], scores: list[torch.Tensor], path_logp: list[float], room: int,
               pick: Pick) -> tuple[Tree, list[int]]:
        """The next level of `tree` (at most `room` nodes) from the scores after each node of `level`."""
        tokens, parents = tree.tokens.tolist(), list(tree.parents)
        q = list(tree.q) if tree.q is not None else []
        new: list[int] = []
        if pick.do_sample:                  # the level's nodes take turns, a child each, without replacement
            left = [pick.probabilities(s) for s in scores]
            for turn in range(room):
                i = turn % len(level)
                if float(left[i].sum()) <= 0:
                    continue
                dist = left[i] / left[i].sum()
                token = int(sampling.sample(dist, pick.generator))
                q.append(dist)
                new.append(len(tokens))
                tokens.append(token)
                parents.append(level[i])
                left[i] = left[i].clone()
                left[i][token] = 0          # the next sibling is drawn from what is left
        else:                               # the likeliest paths; the draft's own greedy token first
            offers = []
            for node, s in zip(level, scores):
                logp = torch.log_softmax(s.double(), -1)
                top = logp.topk(min(self.branches, logp.numel()))
                base = path_logp[node] if node >= 0 else 0.0
                offers += [(base + float(v), node, int(t)) for v, t in zip(top.values, top.indices)]
            for lp, node, token in (offers[:1] + sorted(offers[1:], key=lambda o: -o[0]))[:room]:
                new.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                path_logp.append(lp)
        made = Tree(torch.tensor(tokens, dtype=torch.long, device=tree.tokens.device), tuple(parents),
                    torch.stack(q) if q else None)
        return made, new

    def observe(self, n: list[int], accepted: list[int], live: list[int]) -> None:
        self.run.crop([n[b] - 1 for b in live])    # all but each row's newest token, fed next round

    def process(self, steps: list[Step], live: list[int]) -> None:
        pass                        # it reads no target states

    def select(self, kept: list[int]) -> None:
        self.run.select(kept)

    def __len__(self) -> int:
        return max(self.run.lengths, default=0)


class ModelSource(DraftSource):
    """A Drafter (one sequence) that drafts with one draft model on the one engine, a ModelDraft
    over a one-row runner: spec.TreeDraft (a PyTorch model, chains or trees) and
    spec.gguf_draft.GGUFDraft (a GGUF in llama.cpp). One object serves many runs (the caller made
    it, not spec.choose for a run): each draft first keeps the cached prefix the new sequence
    shares (`resync`). A subclass makes `engine` (`_start`, at the first draft) and says which ids
    its runner `run` holds (`_held(run)`)."""

    engine: ModelDraft | None = None

    def _start(self, seq: torch.Tensor, n: int) -> ModelDraft:
        raise NotImplementedError

    def _held(self, run) -> torch.Tensor:
        raise NotImplementedError

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        if self.engine is None:
            self.engine = self._start(seq, n)
        run = self.engine.run.runs[0]
        resync(run, self._held(run), seq, n)
        return self.engine.draft(seq[None], [n], [g], [0])[0]

    def observe(self, n: int, accepted: int) -> None:
        if self.engine is not None:
            self.engine.observe([n], [accepted], [0])

    def __len__(self) -> int:
        return 0 if self.engine is None else len(self.engine)


def resync(run, held: torch.Tensor, seq: torch.Tensor, n: int) -> int:
    """Keep the cached prefix the new sequence shares, cut the rest: `run` (a Runner) holds the ids
    `held` (at least its len(run) first positions); crops it to the longest prefix of them that
    equals seq[:n - 1] (the final tokens but the newest, which is fed again) and returns the
    length kept, so the caller feeds seq[kept:n]. For a draft one object serves across runs, or
    that was not asked every round: whatever it held that the sequence does not share goes."""
    run.crop(shared_prefix(run, held, seq, n))
    return len(run)


def shared_prefix(run, held: torch.Tensor, seq: torch.Tensor, n: int) -> int:
    """How many of the ids `run` holds (`held`) the sequence's final tokens but the newest, seq[:n - 1], begin
    with (what `resync` keeps)."""
    shared = min(len(run), n - 1, held.numel())
    differs = (held[:shared] != seq[:shared].to(held.device)).nonzero()
    return int(differs[0]) if differs.numel() else shared


class NoDraft:
    """Nothing drafted: every round is one target step. greedy_generate is the loop with this."""

    def begin(self, prompts: list[torch.Tensor]) -> None:
        pass

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]):
        return [Tree.chain(seq[b, n[b]:n[b]]) for b in live]

    def observe(self, n: list[int], accepted: list[int], live: list[int]) -> None:
        pass

    def process(self, steps: list[Step], live: list[int]) -> None:
        pass

    def select(self, kept: list[int]) -> None:
        pass

    def __len__(self) -> int:
        return 0


class FixedGamma:
    """gamma tokens drafted every round."""
    timed = False

    def __init__(self, gamma: int):
        self.gamma = self.max_gamma = gamma

    def observe(self, *, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass
