"""A model and the state it carries between forward passes, with an exact rollback.

The decode loop drives every model through one small interface, a Runner (spec.protocols):
`run(ids, keep)` feeds `ids` after the `len(run)` positions the runner holds and
returns their logits (the last `keep` rows; 0: all); `run.crop(keep)` forgets every
position from `keep` on. After a crop `len(run) <= keep`: a runner may go back further,
and the loop then feeds it from `len(run)`, so it recomputes what it dropped in the
same pass as the new tokens. spec.choose makes a model's runner from `verdict` below.

Transformers has three kinds of state, and each gets the rollback that is exact for it:

  kv-cache     attention keys and values (full or sliding-window attention, MoE, ALiBi, ...):
               a DynamicCache of full layers, cropped to `keep`. Sliding windows are applied
               by the model's mask, not by evicting keys, so a verify pass may cross the
               window and still be rewound.
  state-snapshot  recurrent, linear-attention and hybrid models (Mamba, RWKV, Jamba, ...),
               whose state at a position cannot be recovered from a later one: the state
               is copied before the first pass after each crop, and a crop restores that
               copy and re-feeds the kept tokens on top of it, so a partly rejected round
               costs recomputing at most gamma+1 tokens (in a pass of their own), plus one
               state copy a round.
  recompute    a forward with no cache it can take (OpenAI-GPT): every pass runs the whole
               sequence. Exact, and as slow as it sounds.

Which one a model gets is decided by a check of the model, not of its name: `probe`
runs a short random sequence through each candidate with feeds and crops like the
loop's, and takes the first whose logits match the model's own cache-free forward.
A model none of them reproduces (a non-causal forward, a cache that cannot be driven)
is refused with the reason, before any decoding.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from spec import hf
from spec.cpu.executor import Passes, executor_for, first
from spec import probe as probing
from spec.options import Positions, RunnerPath
from spec.protocols import Runner
from spec.tree import Tree, in_place, layout
from spec.positions import choose as choose_positions, cross_length, mask_len, position_ids


class UnsupportedModelError(ValueError):
    """A model spec cannot decode exactly; the message says why. `runs_uncached`: its cache-free
    forward works (so it can still serve as a draft, by recompute)."""

    def __init__(self, message: str, runs_uncached: bool = False):
        super().__init__(message)
        self.runs_uncached = runs_uncached


_UNDECIDED: Any = object()         # a runner's executor before its first pass


class ModelRunner:
    """What every runner shares: the model, how it counts positions (spec.positions), and
    the ids it holds (the "counted" positions are counted over the whole sequence)."""

    # layers: where not None, keep the hidden states at these layers of every id each call was fed,
    # in `hidden` [fed, len(layers), H] (for a draft source with Need.HIDDEN; read by spec.batch.EachRunner)
    layers: tuple[int, ...] | None = None
    hidden: torch.Tensor | None = None

    def __init__(self, model, positions: Positions = Positions.EXPLICIT):
        self.model, self.positions = model, Positions(positions)
        self.held: torch.Tensor | None = None
        self._executor: Passes | None = _UNDECIDED

    def _sink(self) -> list | None:
        return [] if self.layers is not None else None

    @property
    def executor(self) -> Passes | None:
        """What runs the passes in the model's place: its spec.cpu.executor executor (an fp32 CPU target on
        packed weights: a pass of a few rows then costs about one one-token step), or None, the model's own
        forward (spec.cpu.executor.describe says which and why). Decided at the runner's first pass, unless
        set before."""
        if self._executor is _UNDECIDED:
            self._executor = executor_for(self.model)
        return self._executor

    @executor.setter
    def executor(self, value: Passes | None) -> None:
        self._executor = value

    def _step(self, ids: torch.Tensor, cache, start: int, keep: int):
        """hf.step over `ids` fed on top of the `start` positions held, positions as the model counts."""
        self.held = ids if start == 0 or self.held is None else torch.cat([self.held[:start], ids])
        sink = self._sink()
        out = hf.step(self.model, ids, cache, keep=keep, hidden=sink, layers=self.layers or (-1,),
                      position_ids=position_ids(self.positions, self.model, self.held, start),
                      mask_len=mask_len(self.positions, self.held.numel()), fn=self.executor)
        self.hidden = sink[0][-ids.numel():] if sink else None
        return out


class KVRunner(ModelRunner):
    """A DynamicCache of full layers (hf.new_cache), cropped to `keep`."""
    path = RunnerPath.KV_CACHE

    def __init__(self, model, positions: Positions = Positions.EXPLICIT):
        super().__init__(model, positions)
        self.cache = hf.new_cache(model)

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        return self._step(ids, self.cache, len(self), keep)[0]

    def crop(self, keep: int) -> None:
        hf.crop(self.cache, keep)

    def __len__(self) -> int:
        return hf.cache_len(self.cache)

    # Trees (spec.tree): every node in one pass, under a mask that lets a node see only its path.
    @property
    def takes_trees(self) -> bool:
        return self.positions is Positions.EXPLICIT and tree_support(self.model) is None

    def feed_tree(self, before: torch.Tensor, tree: Tree) -> torch.Tensor:
        """`before` (the sequence's unseen ids, the root last) then the tree's nodes, in one pass:
        [len(tree) + 1, V], the root's logits and each node's given its path."""
        start = len(self)
        positions, mask = layout(tree, start, before.numel())
        ids = torch.cat([before, tree.tokens])
        self.held = ids if start == 0 or self.held is None else torch.cat([self.held[:start], ids])
        sink = self._sink()
        logits = hf.tree_step(self.model, ids, self.cache, position_ids=positions.to(ids.device), mask=mask,
                              keep=len(tree) + 1, hidden=sink, layers=self.layers or (-1,), fn=self.executor)
        self.hidden = sink[0] if sink else None
        return logits

    def retain(self, base: int, path: list[int]) -> None:
        """Keep the sequence before `base` and, of the nodes cached from `base` on, the path."""
        kept = torch.tensor(list(range(base)) + [base + i for i in path], dtype=torch.long)
        hf.keep_positions(self.cache, kept)
        assert self.held is not None                # feed_tree came first
        self.held = self.held[kept.to(self.held.device)]


def tree_support(model) -> str | None:
    """Why `model` cannot score a tree in one pass (spec.tree.layout's mask and positions on a
    DynamicCache, then the accepted path kept), or None where it can: checked by behaviour
    against its own cache-free forward on every path of a probe tree (past any sliding window,
    which a custom mask would bypass), then a pass after the path was kept. Probed once per
    model, dtype and device (spec.probe)."""
    return probing.once(model, "trees", _tree_probe)


def _tree_probe(model) -> str | None:
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers model"
    if not hf.takes_batch_masks(model):
        return "its forward takes no attention mask and position ids"
    tol = probing.tolerance(model)
    device = next(model.parameters()).device
    L = max(probing.probe_length(model), 12)
    ids = probing.ids(model, L, device)
    P = L - 4                                              # the sequence; the root is ids[P - 1]
    other = (ids[P:P + 3] + 1) % hf.vocab_rows(model)
    # nodes 0-1-2 follow the sequence's own continuation; 3 a sibling of 0 with a child 4; 5 a sibling of 1
    tree = Tree(torch.stack([ids[P], ids[P + 1], ids[P + 2], other[0], other[1], other[2]]), (-1, 0, 1, -1, 3, 0))
    try:
        run = KVRunner(model)
        run(ids[:P // 2])
        got = run.feed_tree(ids[P // 2:P], tree)
        for node in [-1] + list(range(len(tree))):
            path = tree.path(node) if node >= 0 else []
            want = hf.authors_forward(model, torch.cat([ids[:P], tree.tokens[path]]))[-1]
            if not probing.close(got[node + 1], want, tol):
                return f"in one pass under a tree mask, node {node}'s logits differ from its path's own forward"
        if not hf.regatherable(run.cache):
            return "its cache is not made of full attention layers that a tree's path can be kept in"
        run.retain(P, [0, 1])
        got = run(ids[P + 2:P + 4], keep=2)
        if not probing.close(got, hf.authors_forward(model, ids[:P + 4])[-2:], tol):
            return "after a tree's path was kept, the next pass differs from the cache-free forward"
    except Exception as e:  # noqa: BLE001 - a forward that fails on a tree is a reason to verify branch by branch
        return f"its forward fails on a tree mask ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None


class SnapshotRunner(ModelRunner):
    """The model's own cache (whatever kind it builds), copied at the start of the first pass
    after each crop; a crop to a shorter length restores the copy and re-feeds the kept tokens
    after it at once, so the runner then holds exactly `keep` positions and the next copy is
    taken there. A round thus re-feeds only what the last round kept (at most gamma+1 tokens),
    however many rounds were rejected before it: were the copy taken where the restored state
    stands, it would never move past the last fully accepted round while rounds keep rejecting,
    and every pass would re-feed everything since then."""
    path = RunnerPath.SNAPSHOT
    stepwise = False

    def __init__(self, model, positions: Positions = Positions.EXPLICIT):
        super().__init__(model, positions)  # self.held: every id fed so far, a restore re-feeds from them
        self.cache, self.len = None, 0
        self.saved: tuple[int, Any] | None = None       # (length, cache copy) at the last commit point

    def _feed(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        if self.stepwise and ids.numel() > 1 and self.cache is not None:
            rows, states = [], []
            for i in range(ids.numel()):
                rows.append(self._feed(ids[i:i + 1], 1))
                states.append(self.hidden)
            self.hidden = torch.cat(states) if self.layers is not None else None
            return torch.cat(rows)[-(keep or ids.numel()):]
        logits, self.cache = self._step(ids, self.cache, self.len, keep)
        self.len += ids.numel()
        return logits

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        first = None
        if self.saved is None:
            if 0 < keep < ids.numel():
                # The rows asked for are the ones a crop may take back (the loop's verify rows);
                # the copy goes where they start, so the prompt before them is fed only once.
                self._feed(ids[:-keep], 1)
                first, ids = self.hidden, ids[-keep:]
            self.saved = (self.len, copy.deepcopy(self.cache))
        logits = self._feed(ids, keep)
        if first is not None and self.hidden is not None:     # every id fed has its state
            self.hidden = torch.cat([first, self.hidden])
        return logits

    def crop(self, keep: int) -> None:
        if keep < self.len:
            assert self.held is not None            # something was fed
            at, cache = self.saved if self.saved is not None else (0, None)
            if keep < at:           # behind the copy (the loop never goes there): start over
                at, cache = 0, None
            self.len, self.cache = at, cache
            if keep > at:
                self._feed(self.held[at:keep], 1)
        self.saved = None           # commit: the next pass saves the state it starts from

    def __len__(self) -> int:
        return self.len


class StepwiseSnapshotRunner(SnapshotRunner):
    """As SnapshotRunner, for models whose cached forward is exact one token at a time only
    (a multi-token pass on top of a state drops that state: Mamba's full-sequence scan in
    transformers 5.24 takes no initial state). A verify pass becomes gamma+1 steps: exact,
    with no saving from the block."""
    path = RunnerPath.STEPWISE
    stepwise = True


class RecomputeRunner(ModelRunner):
    """No cache: each pass runs the model over every token held so far."""
    path = RunnerPath.RECOMPUTE

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        held = ids if self.held is None else torch.cat([self.held, ids])
        self.held = held
        positions = position_ids(self.positions, self.model, held, 0)
        sink = self._sink()
        logits, _ = hf.step(self.model, held, position_ids=positions, keep=keep or ids.numel(), use_cache=False,
                            mask_len=mask_len(self.positions, held.numel()), hidden=sink,
                            layers=self.layers or (-1,), fn=self.executor)
        self.hidden = sink[0][-ids.numel():] if sink else None
        return logits

    def crop(self, keep: int) -> None:
        if self.held is not None:
            self.held = self.held[:keep]

    def __len__(self) -> int:
        return 0 if self.held is None else self.held.numel()


# Typed as what they make, so that the type check holds each class to the Runner protocol.
RUNNERS: dict[RunnerPath, Callable[[Any, Positions], Runner]] = {r.path: r for r in (KVRunner, SnapshotRunner,
                                                                        StepwiseSnapshotRunner, RecomputeRunner)}

def unprobed_reach(model) -> str | None:
    """Indexer-selected sparse attention (DeepSeek's DSA: index_topk and kin) is refused: a block
    pass and one-token steps may select different keys, and on tiny models transformers' own
    cached greedy already disagrees with its cache-free forward past the key budget."""
    sparse = {k: v for k, v in probing.reach_fields(hf.text_config(model)).items() if "topk" in k.lower()}
    if sparse:
        k, v = next(iter(sparse.items()))
        return (f"its attention selects keys per pass ({k}={v}): a verify pass may select other keys than "
                f"one-token steps once the sequence passes {v}, so the output is not guaranteed to be greedy's")
    return None


def _replay(runner, ids: torch.Tensor, full: torch.Tensor, tol: float) -> str | None:
    """Feeds and crops like the decode loop's; the first disagreement with `full`, or None."""
    L = ids.numel()
    a, b = L // 3, (2 * L) // 3
    schedule = [("feed", a), ("feed", b), ("crop", a + 1), ("feed", L - 2), ("crop", L - 3),
                ("feed", L - 1), ("feed", L), ("crop", b), ("feed", L)]
    for op, pos in schedule:
        if op == "crop":
            runner.crop(pos)
            continue
        start = len(runner)
        got = runner(ids[start:pos], keep=pos - start)
        if not probing.close(got, full[start:pos], tol):
            return f"logits of positions {start}..{pos - 1} differ from the cache-free forward's"
    return None


def causal_check(model, ids: torch.Tensor, full: torch.Tensor, tol: float) -> str | None:
    """The cache-free forward must be causal: changing the last tokens must not move the
    logits of the earlier ones. (Speculative decoding scores a block in one pass.)"""
    changed = ids.clone()
    changed[-3:] = (changed[-3:] + 1) % hf.vocab_rows(model)
    other = hf.authors_forward(model, changed)
    if not probing.close(other[:-3], full[:-3], tol):
        return "its forward is not causal: logits of a position change with later tokens"
    return None


def _causal_past_chunks(model, ids: torch.Tensor, tol: float) -> str | None:
    """The causal check again over a longer, prime length (spec.positions.cross_length): attention
    that sorts or chunks the sequence (Reformer's LSH layers) can be causal within one chunk and
    not across several."""
    longer = probing.ids(model, cross_length(model), ids.device)
    if longer.numel() <= ids.numel():
        return None
    try:
        full = hf.authors_forward(model, longer)
    except Exception:  # noqa: BLE001 - the model's own forward stops short of this length
        return None
    reason = causal_check(model, longer, full, tol)
    if reason is not None:
        return reason
    # A verify pass scores a block on top of a prefix: the prefix's logits must not depend on
    # how long the whole is (Reformer pads to a multiple of its chunk length, and its LSH layers
    # then chunk the padded sequence).
    for n in sorted({ids.numel(), longer.numel() // 2, longer.numel() - 3}):
        if not probing.close(hf.authors_forward(model, longer[:n]), full[:n], tol):
            return (f"its forward is not prefix-stable: logits of the first {n} positions change when "
                    f"{longer.numel() - n} more tokens follow")
    return None


def verdict(model) -> tuple[RunnerPath, Positions]:
    """(runner path, positions mode) that reproduce `model`'s own forward, called as its
    authors call it (spec.positions); raises UnsupportedModelError with each candidate's
    failure when none does. Probed once per model, dtype and device (spec.probe)."""
    return probing.once(model, "path", _probe, remember=(UnsupportedModelError,))


first("path", verdict)       # (its probe reads the model's own weights: before an executor gives them back)


def probe(model) -> str:
    """The runner path that reproduces `model`'s own forward (see `verdict`)."""
    return verdict(model)[0]


def _probe(model) -> tuple[RunnerPath, Positions]:
    tol = probing.tolerance(model)
    if (why := unprobed_reach(model)) is not None:
        raise _refusal(model, why, runs_uncached=True)
    if (why := unsupported_head(model)) is not None:
        raise _refusal(model, why, runs_uncached=False)
    ids = probing.ids(model, probing.probe_length(model), next(model.parameters()).device)
    reasons = []
    try:
        full = hf.authors_forward(model, ids)
    except Exception as e:  # noqa: BLE001 - any failure of the model is a reason to refuse it
        raise _refusal(model, f"its cache-free forward fails ({type(e).__name__}: {e})", runs_uncached=False) from None
    reason = nondeterministic(model, tol) or causal_check(model, ids, full, tol) or _causal_past_chunks(model, ids, tol)
    if reason is None:
        positions = choose_positions(model, ids, full, lambda a, b: probing.close(a, b, tol))
        for path, cls in RUNNERS.items():
            if path is RunnerPath.KV_CACHE and hf.cache_kwarg(model) not in ("cache", "past_key_values"):
                reasons.append(f"{path}: the forward takes no attention cache")
                continue
            try:
                reason = _replay(cls(model, positions), ids, full, tol)
            except Exception as e:  # noqa: BLE001
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if reason is None:
                return path, positions
            reasons.append(f"{path}: {reason}")
        reason = "no way of running it reproduces its own cache-free forward (" + "; ".join(reasons) + ")"
    raise _refusal(model, reason, runs_uncached=True)


def nondeterministic(model, tol: float) -> str | None:
    """A forward whose logits change between two calls on the same ids (Reformer's LSH attention
    with random hashing, dropout left on in training mode) cannot be reproduced by any decoder.
    Checked on PROBE_MAX tokens (within the model's position table, as cross_length): some randomness shows only
    on sequences longer than what one query attends to (LSH buckets over chunks)."""
    ids = probing.ids(model, min(probing.PROBE_MAX, cross_length(model)), next(model.parameters()).device)
    if not probing.close(hf.authors_forward(model, ids), hf.authors_forward(model, ids), tol):
        return ("its forward is not deterministic: two calls on the same ids give different logits (random "
                "hashing, or dropout in training mode: call model.eval()), so no decoder can reproduce it")
    return None


def unsupported_head(model) -> str | None:
    """spec decodes one stream of tokens from one LM head. A model whose output embeddings are
    several heads (MusicGen: one per codebook) or none is refused before any forward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.ModuleList):
        return (f"its LM head is {len(head)} heads (one per codebook, as in MusicGen): spec decodes "
                f"a single stream of tokens")
    weight = getattr(head, "weight", None)
    if weight is None or getattr(weight, "ndim", 0) != 2:
        return "it has no single LM head (get_output_embeddings() gives no [vocab, hidden] weight)"
    return None


def unembeddable_head(model) -> str | None:
    """A model that decides the output (a target, or greedy's model) must be able to read back
    every id its head can emit. (A draft's wider head is harmless: its proposals are kept to the
    ids both models share.)"""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int) and head.weight.shape[0] > rows:
        return (f"its LM head scores {head.weight.shape[0]} ids but its input embedding has {rows} rows: "
                f"a token it emits could not be fed back to it")
    return None


def _refusal(model, reason: str, *, runs_uncached: bool) -> UnsupportedModelError:
    return UnsupportedModelError(f"{type(model).__name__} cannot be decoded exactly by spec: {reason}",
                                 runs_uncached)


def path_of(model) -> str:
    """The path `model` runs on ("kv-cache", "state-snapshot", "state-stepwise", "recompute"),
    or "plain"/"custom" for objects that are not Hugging Face models; for reports."""
    if not isinstance(model, PreTrainedModel):
        return "custom"
    return probe(model)


# --- Scoring a tree on any Runner (spec.protocols) --------------------------------------------------

def score_tree(run, before: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The target's logits for the tree: [N + 1, V], row 0 after the root (the last id of
    `before`, the sequence's ids the runner has not seen), row i + 1 after node i.

    A chain (nodes in a row, none included) is the runner's plain pass over the sequence and
    its tokens. A runner that takes trees (`run.takes_trees`: spec.runner.KVRunner on a model
    whose forward passed the tree probe) scores every node in one pass and keeps them until
    `retain`. Any other runner is fed the tree branch by branch, root to each leaf, and cut back
    to the sequence after each: exact on every runner, at a pass per leaf."""
    if tree.is_chain:
        return run(torch.cat([before, tree.tokens]), keep=len(tree) + 1)
    if isinstance(run, KVRunner) and run.takes_trees:
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
        hidden = run.hidden if isinstance(run, ModelRunner) else None    # every id fed: `before`'s, then the path's
        if hidden is not None and i == 0:
            sequence = hidden[:-(len(path) + 1)]
        for depth, node in enumerate([-1] + path):
            rows[node + 1] = logits[depth]
            states[node + 1] = hidden[hidden.shape[0] - len(path) - 1 + depth] if hidden is not None else None
    run.crop(end)                               # the accepted path is fed with the next round
    if isinstance(run, ModelRunner) and run.layers is not None:
        run.hidden = torch.cat([sequence, torch.stack(states)])     # as a one-pass runner gives them
    return torch.stack(rows)


def retain_tree(run, base: int, path: list[int]) -> None:
    """After `score`: keep, of the tree's nodes (cached from position `base` on), the accepted
    path only, moved up behind the sequence. A runner fed branch by branch holds none of them."""
    if not in_place(path) and isinstance(run, KVRunner) and run.takes_trees:
        run.retain(base, path)
