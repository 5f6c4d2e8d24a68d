"""The two interfaces the decode loop is written against. Nothing here runs: these are the
contracts every runner and every draft source keeps (spec.choose makes them)."""

from __future__ import annotations

import enum
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
    HIDDEN = "hidden"       # it reads the target's last-layer hidden states (observe's `hidden`)


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
    `drafter.observe(n, accepted, hidden)` is told after each round that `seq[:n]` is now final
    and that `accepted` of the proposals were kept (a tree: the accepted path's length), so that
    a stateful source rolls back what was rejected. hidden is None unless the source has
    Need.HIDDEN (an EAGLE- or Medusa-style head): then the target's last-layer hidden states,
    from the verify pass itself, at every position not delivered before, up to n - 2: on the
    first round the prompt's (prefill) and then the emitted tokens', [n - 1, H]; afterwards
    [emitted, H], the positions whose logits chose this round's emitted tokens (n_before - 1 and
    the accepted proposals'). Each position's state is heard once; the last row chose seq[n - 1].
    `len(drafter)` is the number of positions its state holds (0 for none; reported by
    trace=True). `needs`: a frozenset of Need (empty for most sources). Implementations:
    spec.lookup.PromptLookup, spec.gguf_draft.GGUFDraft, spec.treedraft.TreeDraft and LookupTree;
    spec.protocols.DraftSource is a base with the defaults."""

    needs: frozenset[Need]

    def begin(self, prompt: torch.Tensor) -> None: ...

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree: ...

    def observe(self, n: int, accepted: int, hidden: torch.Tensor | None = None) -> None: ...

    def __len__(self) -> int: ...


class DraftSource:
    """A base for a Drafter: nothing needed, no state (nothing to roll back, no positions held).
    A subclass writes `draft` and, where it keeps state, `begin`, `observe` and `__len__`."""

    needs: frozenset[Need] = frozenset()

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        raise NotImplementedError

    def observe(self, n: int, accepted: int, hidden: torch.Tensor | None = None) -> None:
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
    the logits of every row's last `keep` positions, [B, keep, V], right-aligned (a row fed fewer
    than `keep` has NaN on the left). trees[i], where given (not None), is a spec.tree.Tree whose
    nodes follow row i's feed: the row's last len(tree) + 1 logits are then the root's and each
    node's given its path; `rows.retain(i, base, path)` keeps, of row i's tree, only the path
    (cache compaction: the nodes' positions after `base` become the path's, in order).
    `rows.crop(keeps)` forgets, in row i, every position from keeps[i] on (a row may go back
    further, like a Runner); `rows.select(kept)` keeps only the rows at those indices, in that
    order: a finished row leaves and costs nothing more. `rows.hidden`: where the rows keep them
    (a drafter with Need.HIDDEN), each row's last-layer states of every id the last call fed it
    (positions rows.lengths before the call on, then its tree's nodes), else None.
    Implementations: spec.batch.Rows (one shared left-padded cache; chains only), spec.batch.EachRunner
    (one Runner per row: a single prompt's, or a model that cannot share a cache)."""

    @property
    def lengths(self) -> list[int]: ...

    @property
    def hidden(self) -> list[torch.Tensor] | None: ...

    def __call__(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> torch.Tensor: ...

    def retain(self, row: int, base: int, path: list[int]) -> None: ...

    def crop(self, keeps: list[int]) -> None: ...

    def select(self, kept: list[int]) -> None: ...


@runtime_checkable
class BatchDrafter(Protocol):
    """A draft source over the rows. `drafter.begin(prompts)` starts a run (each row's prompt, in
    the batch's order); `drafter.draft(seq, n, gs, live)` proposes, for each row b =
    live[j] (indices into the [B, L] buffer `seq`, in the batch's order), at most gs[j] tokens deep
    after seq[b, :n[b]]; returns one spec.tree.Tree per live row (a chain's tokens are also
    written to seq[b, n[b]:], and Tree.tokens is a view of them). `observe(n, accepted, live,
    hidden)` hears each live row's final length and kept count (hidden: each live row's target
    hidden states, given where the drafter has Need.HIDDEN, else None); `select(kept)` follows the batch when rows
    leave (kept: indices into live). Implementations: spec.draft.ModelDraft (a draft model over a
    BatchRunner), spec.batch.EachRow (one model-free Drafter per row), spec.draft.NoDraft (plain
    decoding)."""

    def begin(self, prompts: list[torch.Tensor]) -> None: ...

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]) -> list[Tree]: ...

    def observe(self, n: list[int], accepted: list[int], live: list[int], hidden: list | None = None) -> None: ...

    def select(self, kept: list[int]) -> None: ...

    def __len__(self) -> int: ...
