"""Draft sources over the batch's rows (spec.protocols.BatchDrafter), and a fixed gamma.

A draft model is one ModelDraft, whatever runs it and however many rows it serves; a model-free
Drafter (spec.lookup.PromptLookup, or a user's) serves each row as spec.batch.EachRow; plain
decoding is the same loop with NoDraft."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec import sampling
from spec.processors import Processors
from spec.protocols import Step
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
    spec.batch.EachRunner for one Runner per row, a single prompt included). Each step feeds every
    live row what the draft has not seen and picks one token per row, by the row's own Pick
    (greedy or sampled, so that q is what its token was drawn from), from the draft's logits, cut
    to the `width` ids both models share. Where the target can emit ids the draft cannot embed
    (`clamp`: pythia-12b's head is wider than pythia-410m's embedding), the draft is fed a
    stand-in, the last id it can embed: that changes only its guesses."""

    def __init__(self, run, picks: list[Pick], prompt_lens: list[int], *, width: int, rows: int, clamp: bool):
        self.run, self.picks = run, picks           # each row's Pick (rows: indices into the whole batch)
        # the target's processors, each row's min_new_tokens counted from its own prompt
        self.processors = [pick.process.for_prompt(n) if pick.process else None
                           for pick, n in zip(picks, prompt_lens)]
        self.width, self.rows, self.clamp = width, rows, clamp

    def begin(self, prompts: list[torch.Tensor]) -> None:
        pass                        # its runner is made for the run (spec.choose.rows)

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]):
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

    def observe(self, n: list[int], accepted: list[int], live: list[int]) -> None:
        self.run.crop([n[b] - 1 for b in live])    # all but each row's newest token, fed next round

    def process(self, steps: list[Step], live: list[int]) -> None:
        pass                        # it reads no target states

    def select(self, kept: list[int]) -> None:
        self.run.select(kept)

    def __len__(self) -> int:
        return max(self.run.lengths, default=0)


def resync(run, held: torch.Tensor, seq: torch.Tensor, n: int) -> int:
    """Keep the cached prefix the new sequence shares, cut the rest: `run` (a Runner) holds the ids
    `held` (at least its len(run) first positions); crops it to the longest prefix of them that
    equals seq[:n - 1] (the final tokens but the newest, which is fed again) and returns the
    length kept, so the caller feeds seq[kept:n]. For a draft one object serves across runs, or
    that was not asked every round: whatever it held that the sequence does not share goes."""
    shared = min(len(run), n - 1, held.numel())
    differs = (held[:shared] != seq[:shared].to(held.device)).nonzero()
    run.crop(int(differs[0]) if differs.numel() else shared)
    return len(run)


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
