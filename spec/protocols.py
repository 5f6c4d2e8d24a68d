"""The two interfaces the decode loop is written against. Nothing here runs: these are the
contracts every runner and every draft source keeps (spec.choose makes them)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Runner(Protocol):
    """A model together with the state it carries between forward passes, for one sequence.

    `run(ids, keep)` feeds `ids` (1-D LongTensor) after the `len(run)` positions the runner
    holds and returns the logits of the last `keep` of them, [keep, vocab]; keep=0 returns a row
    for every id fed (the default, the same for every runner). `run.crop(keep)` forgets every
    position from `keep` on; afterwards `len(run) <= keep`: a runner may go back further (a
    snapshot restored), and is then fed the positions it dropped with the next ids, so a caller
    always feeds `seq[len(run):end]`. Implementations: spec.runner (the probed paths), spec.neox
    (the plain-tensor GPT-NeoX draft), spec.hf.Cached (the compiled draft), spec.seq2seq.Decoder."""

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor: ...

    def crop(self, keep: int) -> None: ...

    def __len__(self) -> int: ...


@runtime_checkable
class Drafter(Protocol):
    """A source of draft tokens for speculative decoding.

    `drafter.draft(seq, n, g)` proposes up to g tokens to follow the final tokens `seq[:n]`,
    writes them to `seq[n:n + m]` and returns `(m, q)`: m <= g (0 is allowed: the round is then
    one target step) and q [m, width], the distribution each proposal was drawn from, or None for
    a deterministic source (q one-hot at each proposal; the acceptance rule stays exact for any
    q). `drafter.observe(n, accepted)` is told after each round that `seq[:n]` is now final and
    that `accepted` of the proposals were kept, so that a stateful source rolls back what was
    rejected. `len(drafter)` is the number of positions its state holds (0 for none; reported by
    trace=True). Implementations: spec.draft.ModelDraft (a draft model over a Runner),
    spec.lookup.PromptLookup."""

    def draft(self, seq: torch.Tensor, n: int, g: int) -> tuple[int, torch.Tensor | None]: ...

    def observe(self, n: int, accepted: int) -> None: ...

    def __len__(self) -> int: ...


@runtime_checkable
class GammaPolicy(Protocol):
    """How many tokens to draft next round. `policy.gamma` is the next round's gamma, at most
    `policy.max_gamma`; `policy.observe(drafted=, accepted=, draft_s=, verify_s=)` hears each
    round's counts and timings, which the loop measures only when `policy.timed` is true.
    Implementations: spec.draft.FixedGamma, spec.autogamma.AutoGamma (gamma="auto")."""

    gamma: int
    max_gamma: int
    timed: bool

    def observe(self, *, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None: ...
