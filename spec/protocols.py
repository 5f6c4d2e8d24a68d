"""The two interfaces the decode loop is written against. Nothing here runs: these are the
contracts every runner and every draft source keeps (spec.choose makes them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from spec.tree import Tree


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


class Need(enum.Enum):
    """What a draft source needs from the loop, declared in its `needs` (a frozenset of these)."""
    TREES = "trees"         # its proposals branch: each row is verified on a runner of its own
    HIDDEN = "hidden"       # it reads the target's hidden states at its `layers` (`process(step)`)


@dataclass(frozen=True)
class Step:
    """What the target's verify pass tells a draft source with Need.HIDDEN, for one row, each round
    (`process(step)`): `positions` [m], the positions of the sequence, now final, whose states it
    has not heard before: on the first round the prompt's (prefill), then the root's and the
    accepted path's; each position is heard once, and the last one's logits chose seq[n - 1].
    `hidden` [m, len(layers), H]: the target's hidden states there, from the verify pass itself,
    at the source's `layers` in its order (indices into transformers' `hidden_states`: 0 the
    embeddings, -1 the last layer's, after the final norm: what the LM head reads)."""
    positions: torch.Tensor
    hidden: torch.Tensor
    layers: tuple[int, ...]

    def at(self, layer: int) -> torch.Tensor:
        """The states at one of the layers asked for, [m, H]."""
        if layer not in self.layers:
            raise ValueError(f"layer: {layer} was not asked for (the source's layers are {self.layers})")
        return self.hidden[:, self.layers.index(layer)]


@dataclass(frozen=True)
class Pass:
    """A BatchRunner's answer to one pass over its rows. `logits` [B, keep, V], each row's last
    `keep` positions right-aligned (a row fed fewer than `keep` has NaN on the left). `hidden`:
    where the rows keep them (`collect_hidden(layers)`: a draft source with Need.HIDDEN), per row
    the states [fed, len(layers), H] of every id the pass fed it (its positions from the row's
    length before the pass on, then its tree's nodes in order), else None."""
    logits: torch.Tensor
    hidden: list[torch.Tensor] | None = None
    layers: tuple[int, ...] = ()


@runtime_checkable
class Drafter(Protocol):
    """A source of draft tokens for speculative decoding, for one sequence.

    `drafter.begin(prompt)` starts a sequence (1-D ids): a source forgets any state from an
    earlier one (one drafter serves many runs). `drafter.draft(seq, n, g)` proposes what may
    follow the final tokens `seq[:n]`: a spec.tree.Tree no deeper than g (0 nodes is allowed: the round is then one target step), with
    q, the distribution each node was drawn from, or None for a deterministic source (q one-hot
    at each node; the acceptance rule stays exact for any q). The paper's gamma tokens in a row
    are `Tree.chain(tokens, q)`; a source of several candidate continuations returns a branching
    tree (and has Need.TREES in its `needs`), which the target verifies in one pass. seq[n:] is
    the drafter's to write as it likes (the loop writes the accepted path there afterwards).
    `drafter.observe(n, accepted)` is told after each round that `seq[:n]` is now final and that
    `accepted` of the proposals were kept (a tree: the accepted path's length), so that a stateful
    source rolls back what was rejected (llama.cpp's `accept`). A source with Need.HIDDEN (an
    EAGLE- or Medusa-style head) is then handed the round's `Step`: `drafter.process(step)`, the
    target's hidden states at its `layers` for every position it has not heard, the prompt's on
    the first round (see Step). `len(drafter)` is the number of positions its state holds (0 for
    none; reported by trace=True). `needs`: a frozenset of Need (empty for most sources);
    `layers`: the hidden-state layers a Need.HIDDEN source reads (default (-1,), the last). The
    lifecycle, per run: begin, then each round draft, observe and (Need.HIDDEN) process. Implementations:
    spec.lookup.PromptLookup, spec.gguf_draft.GGUFDraft, spec.treedraft.TreeDraft and LookupTree;
    spec.protocols.DraftSource is a base with the defaults."""

    needs: frozenset[Need]
    layers: tuple[int, ...]

    def begin(self, prompt: torch.Tensor) -> None: ...

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree: ...

    def observe(self, n: int, accepted: int) -> None: ...

    def process(self, step: Step) -> None: ...

    def __len__(self) -> int: ...


class DraftSource:
    """A base for a Drafter: nothing needed, no state (nothing to roll back, no positions held).
    A subclass writes `draft` and, where it keeps state, `begin`, `observe` and `__len__`; one
    with Need.HIDDEN in its `needs` writes `process` (and `layers` if not the last layer's)."""

    needs: frozenset[Need] = frozenset()
    layers: tuple[int, ...] = (-1,)

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        raise NotImplementedError

    def observe(self, n: int, accepted: int) -> None:
        pass

    def process(self, step: Step) -> None:
        pass

    def __len__(self) -> int:
        return 0


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


# --- What the decode loop runs on: rows (one prompt is a batch of one), addressed in the batch's order

@runtime_checkable
class BatchRunner(Protocol):
    """A model with its state for one or several sequences (rows). `rows(feeds, keep, trees)` feeds row i the ids
    `feeds[i]` (1-D, any lengths >= 1) after the `rows.lengths[i]` positions it holds and returns
    a `Pass`: the logits of every row's last `keep` positions, [B, keep, V], right-aligned (a row
    fed fewer than `keep` has NaN on the left), and the rows' hidden states where it keeps them.
    trees[i], where given (not None), is a spec.tree.Tree whose
    nodes follow row i's feed: the row's last len(tree) + 1 logits are then the root's and each
    node's given its path; `rows.retain(i, base, path)` keeps, of row i's tree, only the path
    (cache compaction: the nodes' positions after `base` become the path's, in order).
    `rows.crop(keeps)` forgets, in row i, every position from keeps[i] on (a row may go back
    further, like a Runner); `rows.select(kept)` keeps only the rows at those indices, in that
    order: a finished row leaves and costs nothing more.
    Implementations: spec.batch.Rows (one shared left-padded cache; trees under 4-D masks), spec.batch.EachRunner
    (one Runner per row: a single prompt's, or a model that cannot share a cache)."""

    @property
    def lengths(self) -> list[int]: ...

    def __call__(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> Pass: ...

    def retain(self, row: int, base: int, path: list[int]) -> None: ...

    def crop(self, keeps: list[int]) -> None: ...

    def select(self, kept: list[int]) -> None: ...


@runtime_checkable
class BatchDrafter(Protocol):
    """A draft source over the rows. `drafter.begin(prompts)` starts a run (each row's prompt, in
    the batch's order); `drafter.draft(seq, n, gs, live)` proposes, for each row b =
    live[j] (indices into the [B, L] buffer `seq`, in the batch's order), at most gs[j] tokens deep
    after seq[b, :n[b]]; returns one spec.tree.Tree per live row (a chain's tokens are also
    written to seq[b, n[b]:], and Tree.tokens is a view of them). `observe(n, accepted, live)`
    hears each live row's final length and kept count; `process(steps, live)` (a source with
    Need.HIDDEN) each live row's Step; `select(kept)` follows the batch when rows
    leave (kept: indices into live). Implementations: spec.draft.ModelDraft (a draft model over a
    BatchRunner), spec.batch.EachRow (one model-free Drafter per row), spec.draft.NoDraft (plain
    decoding)."""

    def begin(self, prompts: list[torch.Tensor]) -> None: ...

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]) -> list[Tree]: ...

    def observe(self, n: list[int], accepted: list[int], live: list[int]) -> None: ...

    def process(self, steps: list[Step], live: list[int]) -> None: ...

    def select(self, kept: list[int]) -> None: ...

    def __len__(self) -> int: ...
