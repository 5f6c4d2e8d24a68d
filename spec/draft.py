"""A draft model as a Drafter (spec.protocols): proposals drawn one step at a time from a Runner,
and a fixed gamma as a GammaPolicy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec import sampling
from spec.processors import Processors


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


class ModelDraft:
    """A draft model (Mq) run by `run`, a Runner over its state. A round feeds the tokens the
    draft has not seen, then proposes g tokens autoregressively, each from the draft's logits cut
    to the `width` ids both models share. Where the target can emit ids the draft cannot embed
    (`clamp`: pythia-12b's head is wider than pythia-410m's embedding), the draft is fed a
    stand-in, the last id it can embed: that changes only its guesses."""

    def __init__(self, run, pick: Pick, *, width: int, rows: int, clamp: bool):
        self.run, self.pick = run, pick
        self.width, self.rows, self.clamp = width, rows, clamp

    def draft(self, seq: torch.Tensor, n: int, g: int) -> tuple[int, torch.Tensor | None]:
        pick, q = self.pick, []
        for i in range(g):
            feed = seq[len(self.run):n + i]
            logits = self.run(feed.clamp(max=self.rows - 1) if self.clamp else feed, keep=1)[-1, :self.width]
            if pick.process:
                logits = pick.process(logits[None], seq, n + i)[0]
            if pick.do_sample:
                q.append(sampling.probabilities(logits, pick.temperature, pick.top_k, pick.top_p, pick.min_p))
                seq[n + i] = sampling.sample(q[-1], pick.generator)
            else:
                seq[n + i] = logits.argmax()
        return g, (torch.stack(q) if q else None)

    def observe(self, n: int, accepted: int) -> None:
        self.run.crop(n - 1)  # all but the newest token, which the next round feeds

    def __len__(self) -> int:
        return len(self.run)


class FixedGamma:
    """gamma tokens drafted every round."""
    timed = False

    def __init__(self, gamma: int):
        self.gamma = self.max_gamma = gamma

    def observe(self, *, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass
