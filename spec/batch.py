"""Several prompts decoded at once, each row exact on its own.

A batch is decoded in lockstep rounds, but every row keeps its own sequence: it accepts its
own number of drafts, is cut back to its own length, stops on its own EOS or max_new_tokens,
and leaves the batch when it stops (its row is dropped from both caches: a finished row costs
nothing more). The decode loops are spec.decode's (`speculative_generate` and `greedy_generate`
with several prompts); this module holds what makes rows of different lengths share one forward
pass.

The layout is HF generate's for a left-padded batch: in the cache, each row's positions are
right-aligned and contiguous, padding on their left, masked out by a 2-D attention mask; each
row's positions are passed explicitly (0 at its first real token). Contiguity is what keeps a
sliding-window model exact: the window counts columns, and with no holes inside a row, column
distance is position distance. Two moves keep it:

  - a pass feeds every row the same number of columns: a row with fewer new tokens is cut back
    and re-fed the tokens before them (one or two tokens in the loop's rounds, where rows differ
    by what their draft has seen); a row holding too little for that (a short prompt beside long
    ones) is fed alone and joins the batch after, right-aligned: padding is never fed;
  - a crop removes a different number of positions per row: each row's kept positions are moved
    right so that all rows end in the same column again (spec.hf.regather).

Which models share the batched cache (`Rows`): those whose solo path is spec.runner's "kv-cache"
with 0-based positions, and whose forward, checked by behaviour on a ragged batch (`probe`), gives
every row the logits of its own cache-free forward. Every other decoder still takes a batch, its
rows run one after another on their solo runners (`EachRunner`, exact, no faster), with the reason
kept: a state snapshot (Mamba, RWKV, hybrids) holds the whole batch's recurrent state, so one row
could not be rolled back without the others; a recompute model has no cache to share;
RoBERTa-family positions are counted around pad tokens. Encoder-decoder models and models split
across devices or processes are refused at the call.
"""

from __future__ import annotations

import copy

import torch

from spec import hf
from spec import probe as probing
from spec.options import Positions, RunnerPath
from spec.protocols import Need, Pass, Step
from spec.runner import ModelRunner, retain_tree, score_tree
from spec.runner import tree_support as runner_tree_support
from spec.tree import Tree, in_place, layout
from spec.validate import as_prompt, model_device


def is_batch(input_ids, attention_mask=None) -> bool:
    """Several prompts: a list of prompts (lists or 1-D tensors), a (B, n) tensor with B > 1, or
    any 2-D tensor given with an attention_mask (HF's form)."""
    if attention_mask is not None:
        return True
    if isinstance(input_ids, torch.Tensor):   # (a float tensor is features, Whisper's encoder input)
        return input_ids.dim() == 2 and input_ids.shape[0] > 1 and not input_ids.dtype.is_floating_point
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and \
        all(isinstance(row, (list, tuple, torch.Tensor)) for row in input_ids)


def count(input_ids, attention_mask=None) -> int:
    """How many prompts the input holds (1 for a single prompt), before any check of their ids."""
    if not is_batch(input_ids, attention_mask):
        return 1
    return input_ids.shape[0] if isinstance(input_ids, torch.Tensor) else len(input_ids)


def prompts(input_ids, attention_mask, device: torch.device, models: dict) -> list[torch.Tensor]:
    """Each row's prompt, 1-D on `device`, checked as a single prompt is (spec.validate.as_prompt).
    A (B, n) tensor takes HF's left padding: attention_mask [B, n] of 0s then 1s in each row."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids with an attention_mask must be (B, n), got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
        mask = attention_mask.to(torch.long).cpu()
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        if (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError("attention_mask must be left padding (0s before 1s in each row, HF's "
                             "padding_side='left'): right padding or holes are not a prompt")
        rows = [ids[m.bool().to(ids.device)] for ids, m in zip(input_ids, mask)]
    elif attention_mask is not None:
        raise ValueError("attention_mask goes with a (B, n) tensor of input_ids; a list of prompts needs none")
    elif len(input_ids) == 0:
        raise ValueError("input_ids is an empty list of prompts")
    else:
        rows = list(input_ids)
    out = []
    for b, row in enumerate(rows):
        try:
            out.append(as_prompt(row, device, models))
        except (TypeError, ValueError) as e:
            raise type(e)(f"input_ids row {b}: {e}") from None
    return out


class Rows:
    """A batch of sequences on one model and one DynamicCache (the layout in the module docstring):
    the batched form of a Runner (spec.protocols). `rows(feeds, keep)` feeds each row its ids (a
    list of 1-D tensors, any lengths >= 1) after the positions it holds, and returns the logits of
    the last `keep` positions of every row, [B, keep, V] (keep <= the shortest feed);
    `rows.crop(keeps)` forgets, in row i, every position from keeps[i] on; `rows.select(kept)`
    keeps only the rows at those indices, in that order; `rows.lengths` what each row holds."""

    def __init__(self, model, batch: int):
        self.model, self.device = model, model_device(model)
        self.cache = hf.new_cache(model)
        self.width = 0                          # columns in the cache; each row ends at the last
        self.lengths = [0] * batch              # positions each row holds (right-aligned)
        self.nodes = [0] * batch                # each row's tree nodes in the last pass (its last columns)
        self.held = [torch.empty(0, dtype=torch.long, device=self.device) for _ in range(batch)]

    def __call__(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> Pass:
        if trees is not None and all(tree.is_chain for tree in trees):     # chains: a plain causal pass
            feeds, trees = [torch.cat([f, tree.tokens]) for f, tree in zip(feeds, trees)], None
        if trees is not None and not self.takes_trees:
            raise ValueError(f"draft: a tree came from a drafter whose trees this model cannot verify in a shared "
                             f"batch ({tree_support(self.model)}); add Need.TREES to its `needs`, so that a batch "
                             f"gives each row a runner of its own")
        return Pass(self._logits(feeds, keep, trees))     # no row's hidden states: such a drafter gets an EachRunner

    @property
    def takes_trees(self) -> bool:
        """Whether branching trees share this batch's pass (the model passed the batched-tree probe)."""
        return tree_support(self.model) is None

    def _logits(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> torch.Tensor:
        """The pass (`trees`: each row's tree, under a 4-D mask; None: feeds alone, causal)."""
        fed = feeds if trees is None else [torch.cat([f, tree.tokens]) for f, tree in zip(feeds, trees)]
        M = max(f.numel() for f in fed)
        short = [i for i, (f, n) in enumerate(zip(fed, self.lengths)) if n + f.numel() < M]
        if short:
            logits = self._join_short(feeds, keep, short, trees)
        else:
            logits = self._pass(fed, M, keep, trees)
        self.nodes = [0] * len(feeds) if trees is None else [len(tree) for tree in trees]
        return logits

    def _pass(self, fed: list[torch.Tensor], M: int, keep: int, trees: list | None) -> torch.Tensor:
        """Every row fed M columns (`fed[i]` after re-feeding what it lacks); a row's tree (its
        nodes the last of its feed) under a 4-D mask: each node sees its row's sequence and its
        own ancestors, at position root + depth."""
        back = [M - f.numel() for f in fed]                    # re-fed, so that every row fills the pass
        tokens = [torch.cat([h[n - b:n], f]) for h, n, b, f in zip(self.held, self.lengths, back, fed)]
        self.crop([n - b for n, b in zip(self.lengths, back)])
        W = self.width
        if trees is None:
            start = torch.tensor(self.lengths, device=self.device)[:, None]
            columns = torch.arange(W + M, device=self.device)[None]
            mask = columns >= W - start                         # each row's cached positions and all it is fed
            positions = start + torch.arange(M, device=self.device)[None]
            logits = hf.batch_step(self.model, torch.stack(tokens), self.cache, position_ids=positions,
                                   attention_mask=mask.long(), keep=keep)
        else:
            B = len(fed)
            positions = torch.zeros(B, M, dtype=torch.long)
            keys = torch.zeros(B, W + M, dtype=torch.long)
            mask = torch.zeros(B, M, W + M, dtype=torch.bool)
            for r, (n, tree) in enumerate(zip(self.lengths, trees)):
                pos, seen = layout(tree, n, M - len(tree))      # the row's own cache of n positions
                positions[r] = pos
                keys[r] = torch.cat([torch.arange(W) - (W - n), pos])
                mask[r, :, W - n:] = seen               # its cached columns (padding left of them) and the pass
            logits = hf.masked_step(self.model, torch.stack(tokens), self.cache, position_ids=positions.to(self.device),
                                    mask=mask, key_positions=keys, keep=keep)
        self.width += M
        self.lengths = [n + M for n in self.lengths]
        self.held = [torch.cat([h, t]) for h, t in zip(self.held, tokens)]
        return logits

    def _join_short(self, feeds: list[torch.Tensor], keep: int, short: list[int],
                    trees: list | None = None) -> torch.Tensor:
        """Rows holding too little to fill the pass (a short prompt beside longer ones) are fed
        alone and then join the batch: no padding is ever fed. (A padding column fed to a model
        is a query that may see nothing: transformers 5.25's eager attention then gives NaN,
        which reaches the real rows through the padding's keys at the next layer.) The row fed
        the most is never short, so the others go on as a batch."""
        alone = {i: torch.cat([self.held[i][:self.lengths[i]], feeds[i]]) for i in short}
        rest = [i for i in range(len(feeds)) if i not in alone]
        self.select(rest)
        rest_trees = None if trees is None else [trees[i] for i in rest]
        parts = [(self, self._logits([feeds[i] for i in rest], keep, rest_trees))]
        for i, ids in alone.items():
            row = Rows(self.model, 1)
            nodes = 0 if trees is None else len(trees[i])
            parts.append((row, row._logits([ids], min(keep, ids.numel() + nodes),
                                           None if trees is None else [trees[i]])))
        order = torch.tensor(rest + list(alone), device=self.device).argsort()
        rows = [(part, j) for part, _ in parts for j in range(len(part.lengths))]
        rows = [rows[k] for k in order.tolist()]
        logits = [out[j] for _, out in parts for j in range(out.shape[0])]
        logits = [logits[k] for k in order.tolist()]
        self.cache = hf.join_rows([part.cache for part, _ in parts], order)
        self.width = max(part.width for part, _ in parts)
        self.lengths = [part.lengths[j] for part, j in rows]
        self.held = [part.held[j] for part, j in rows]
        out = logits[0].new_full((len(feeds), keep, logits[0].shape[-1]), float("nan"))
        for i, row in enumerate(logits):
            out[i, keep - row.shape[0]:] = row      # right-aligned: a short row's rows asked for
        return out

    def retain(self, row: int, base: int, path: list[int]) -> None:
        """Of row `row`'s tree (its last pass's nodes, the row's last columns), keep the path only,
        behind the row's sequence: the row moves right by the nodes dropped, padding on its left."""
        if in_place(path):
            return                                  # the crop that follows keeps it
        nodes, length = self.nodes[row], self.lengths[row]
        first = self.width - nodes                  # the tree's first node's column
        assert base == length - nodes, "retain: the base is not where the row's tree starts"
        columns = list(range(self.width - length, first)) + [first + i for i in path]
        hf.keep_row_columns(self.cache, row, torch.tensor(columns, device=self.device), self.width)
        self.lengths[row] = len(columns)
        self.held[row] = torch.cat([self.held[row][:base], self.held[row][base:][torch.tensor(path)]])
        self.nodes[row] = 0

    def crop(self, keeps: list[int]) -> None:
        new = [min(n, k) for n, k in zip(self.lengths, keeps)]
        if new != self.lengths:
            self._rearrange(list(range(len(new))), new)

    def select(self, kept: list[int]) -> None:
        self._rearrange(kept, self.lengths)

    def _rearrange(self, kept: list[int], lengths: list[int]) -> None:
        """Keep rows `kept`, row r cut to lengths[r] positions, right-aligned again in fewer columns."""
        new = [lengths[r] for r in kept]
        drop = [self.lengths[r] - lengths[r] for r in kept]
        width = max(new, default=0)
        if not kept:                            # every row finished
            self.cache = hf.new_cache(self.model)
        elif kept == list(range(len(self.lengths))) and len(set(drop)) == 1 and width == self.width - drop[0]:
            hf.crop(self.cache, width)          # the same cut in every row: a plain crop
        elif self.width:    # row r's kept positions end where its dropped ones began
            hf.regather(self.cache, kept, [self.width - d - width for d in drop], width)
        self.width = width
        self.lengths = new
        self.held = [self.held[r][:lengths[r]] for r in kept]
        self.nodes = [0] * len(kept)            # a tree's nodes are kept (retain) or cut before a crop


class EachRow:
    """A model-free Drafter (spec.protocols: spec.lookup.PromptLookup, or a user's) over the batch's
    rows: one drafter per row, so that a source with state keeps each row's apart. A single prompt
    uses the drafter itself; a batch gives each row a copy."""

    def __init__(self, drafter, batch: int, width: int | None = None):
        self.width = width          # the ids the target can score: a tree's tokens are checked against it
        if batch == 1:
            self.drafters = [drafter]
            return
        try:
            self.drafters = [copy.deepcopy(drafter) for _ in range(batch)]
        except Exception as e:  # noqa: BLE001 - any failure to copy is the same refusal
            raise ValueError(f"draft: {type(drafter).__name__} cannot be copied for each of the {batch} prompts "
                             f"({type(e).__name__}: {e}); decode the prompts one at a time") from None

    def begin(self, prompts: list[torch.Tensor]) -> None:
        for drafter, prompt in zip(self.drafters, prompts):
            drafter.begin(prompt)

    def draft(self, seq: torch.Tensor, n: list[int], gs: list[int], live: list[int]) -> list[Tree]:
        out = []
        for b, g in zip(live, gs):
            made = self.drafters[b].draft(seq[b], n[b], g)
            if not isinstance(made, Tree):
                raise TypeError(f"draft: {type(self.drafters[b]).__name__}.draft must return a spec.Tree "
                                f"(Tree.chain(tokens, q) for tokens in a row), got {type(made).__name__}")
            if len(made) == 0:
                made = Tree.chain(seq[b, n[b]:n[b]])     # nothing proposed (whatever the empty tensor's dtype)
            made.check(g, self.width if self.width is not None else int(made.tokens.max()) + 1)
            if len(self.drafters) > 1 and not made.is_chain and Need.TREES not in self.drafters[b].needs:
                raise ValueError(f"draft: {type(self.drafters[b]).__name__} returned a branching tree in a batch but "
                                 f"does not say it makes trees; add Need.TREES to its `needs` (a batch then verifies "
                                 f"each row's tree under its own mask, in one pass where the model allows it)")
            out.append(made)
        return out

    def observe(self, n: list[int], accepted: list[int], live: list[int]) -> None:
        for b, k in zip(live, accepted):
            self.drafters[b].observe(n[b], k)

    def process(self, steps: list[Step], live: list[int]) -> None:
        for b, step in zip(live, steps):
            self.drafters[b].process(step)          # a drafter with Need.HIDDEN

    def select(self, kept: list[int]) -> None:
        pass            # rows are addressed by their index in the whole batch (`live`)

    def __len__(self) -> int:
        return max((len(d) for d in self.drafters), default=0)


class EachRunner:
    """Rows as one Runner per row, fed one row after another: a single prompt's runner (any path:
    spec.runner's, the plain or compiled draft, an encoder-decoder's decoder), and a batch's rows
    on a model that cannot share a batched cache (`why`, see `unbatched`). Exact as each row's solo
    run, and no faster than running the rows in turn; finished rows still leave it."""

    def __init__(self, runs: list, why: str | None = None):
        self.runs, self.why = runs, why
        self.collecting = False         # collect_hidden was called: each Pass carries the rows' states

    @property
    def lengths(self) -> list[int]:
        return [len(run) for run in self.runs]

    def __call__(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> Pass:
        logits = self._logits(feeds, keep, trees)
        if not self.collecting:
            return Pass(logits)
        return Pass(logits, [run.hidden for run in self.runs], self.runs[0].layers)

    def _logits(self, feeds: list[torch.Tensor], keep: int, trees: list | None = None) -> torch.Tensor:
        trees = trees or [None] * len(feeds)
        if len(self.runs) == 1 and (trees[0] is None and feeds[0].numel() >= keep or
                                    trees[0] is not None and len(trees[0]) + 1 == keep):
            one = self.runs[0]      # one row (a single prompt): no copy
            return (one(feeds[0], keep=keep) if trees[0] is None else score_tree(one, feeds[0], trees[0]))[None]
        out = None
        for i, (run, ids, tree) in enumerate(zip(self.runs, feeds, trees)):
            logits = run(ids, keep=min(keep, ids.numel())) if tree is None else score_tree(run, ids, tree)
            if out is None:
                out = logits.new_full((len(feeds), keep, logits.shape[-1]), float("nan"))
            out[i, keep - logits.shape[0]:] = logits     # right-aligned, as Rows returns them
        return out

    def retain(self, row: int, base: int, path: list[int]) -> None:
        retain_tree(self.runs[row], base, path)

    def collect_hidden(self, layers: tuple[int, ...]) -> None:
        """Keep each pass's hidden states at `layers` (Pass.hidden): a draft source reads them."""
        for run in self.runs:
            if not isinstance(run, ModelRunner):
                raise ValueError(f"a drafter that reads the target's hidden states needs the target on a "
                                 f"spec.runner path; this one runs on {type(run).__name__}")
            run.layers = tuple(layers)
        self.collecting = True

    def crop(self, keeps: list[int]) -> None:
        for run, keep in zip(self.runs, keeps):
            run.crop(keep)

    def select(self, kept: list[int]) -> None:
        self.runs = [self.runs[i] for i in kept]


# --- Which models share a batched cache -----------------------------------------------------------

def tree_support(model) -> str | None:
    """Why branching trees cannot share a left-padded batch's pass on `model` (their rows then run
    one after another, EachRunner), or None where they can: the model scores a tree in one pass
    (spec.runner.tree_support), and a ragged batch of rows, each with a tree under its own 4-D
    mask, gives every node its path's cache-free logits, keeps one row's path and goes on exactly
    (`_tree_batch_probe`). Probed once per model, dtype and device (spec.probe)."""
    why = runner_tree_support(model)
    if why is not None:
        return why
    return probing.once(model, "batched trees", _tree_batch_probe)


def _tree_batch_probe(model) -> str | None:
    tol = probing.tolerance(model)
    L = max(probing.probe_length(model), 16)
    ids = probing.ids(model, L, model_device(model))
    seqs = [ids[:L - 6], ids[3:L - 4], ids[:L // 2]]            # ragged rows, the root each row's last id
    trees = [Tree(torch.stack([ids[0], ids[1], ids[2], ids[3]]), (-1, 0, -1, 2)),
             Tree(torch.stack([ids[4], ids[5], ids[6]]), (-1, -1, 1)),
             Tree(torch.stack([ids[7], ids[8], ids[9], ids[10], ids[11]]), (-1, 0, 0, -1, 3))]
    try:
        rows = Rows(model, len(seqs))
        rows._logits([s[:-1] for s in seqs], 1)
        keep = max(len(t) for t in trees) + 1
        got = rows._logits([s[-1:] for s in seqs], keep, trees)
        for r, (seq, tree) in enumerate(zip(seqs, trees)):
            mine = got[r, keep - len(tree) - 1:]
            for node in [-1] + list(range(len(tree))):
                path = tree.path(node) if node >= 0 else []
                want = hf.authors_forward(model, torch.cat([seq, tree.tokens[path]]))[-1]
                if not probing.close(mine[node + 1], want, tol):
                    return (f"in a left-padded batch under 4-D tree masks, row {r}'s node {node} differs from "
                            f"its path's own forward")
        rows.retain(2, seqs[2].numel(), trees[2].path(4))        # a path that is not the first nodes
        rows.retain(1, seqs[1].numel(), [1, 2])
        kept = [torch.cat([seqs[r], trees[r].tokens[path]]) for r, path in ((0, []), (1, [1, 2]), (2, [3, 4]))]
        rows.crop([rows.lengths[0] - len(trees[0]), rows.lengths[1], rows.lengths[2]])
        nxt = [ids[12:14], ids[13:15], ids[14:16]]
        got = rows._logits(nxt, 2)
        for r, (seq, more) in enumerate(zip(kept, nxt)):
            if not probing.close(got[r], hf.authors_forward(model, torch.cat([seq, more]))[-2:], tol):
                return f"after row {r}'s path was kept in a batch, its next pass differs from the cache-free forward"
    except Exception as e:  # noqa: BLE001 - a forward that fails on a batched tree is a reason to run rows in turn
        return f"its forward fails on a batch under 4-D tree masks ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None


def unbatched(model, path: str, positions: str) -> str | None:
    """Why `model`, run on the solo `path` with `positions` (spec.runner), cannot share one
    left-padded cache across rows (its rows then run one after another: EachRunner); None where
    it can. Probed once per model, dtype and device (spec.probe)."""
    return probing.once(model, ("batches", str(path), positions), lambda m: _why_not(m, path, positions))


def _why_not(model, name: str, positions: str) -> str | None:
    if name not in tuple(RunnerPath):       # a draft run unprobed, by recompute
        return f"it runs on the {name} path, with no cache rows can share"
    path = RunnerPath(name)
    if path.restores_state:
        return (f"it runs on the {path} path (a recurrent state, or a cache that cannot be cut back): "
                f"restoring one row's state would restore the whole batch's")
    if not path.has_cache:
        return f"it runs on the {path} path, with no cache rows can share"
    if Positions(positions) is not Positions.EXPLICIT:
        return (f"its positions are not 0-based ({positions!r}: counted around pad tokens, or inferred by the "
                f"model), so a left-padded row would be given other positions than alone")
    if not hf.takes_batch_masks(model):
        return "its forward takes no 2-D attention mask and position ids, which a left-padded batch needs"
    return probe(model)


# Each row's plan in the probe, as tokens short of its own end: (prefill, feed, crop, feed, crop);
# rows are fed different counts and cut back unevenly, some not at all. The rows still there at
# the end are fed to their ends.
_PROBE_PLANS = [(4, 2, 4, 0, 2), (6, 5, 6, 3, 4), (5, 3, 3, 1, 2), (7, 4, 5, 2, 3)]


def probe(model) -> str | None:
    """Feed and cut back ragged batches of three and four rows the way the loop does (ragged
    prompts, rows fed different counts, uneven crops, a row leaving from the middle or the
    front, the rest kept in another order), in several orders: short rows first and last, the
    widest first, last and inside. (Short rows join the batch in a cyclic order: a two-row batch
    only ever swaps, which is its own inverse.)
    Every row's logits must match its own cache-free forward's (the tolerance of spec.runner's
    probe). The first mismatch, or None."""
    tol = probing.tolerance(model)
    L = max(probing.probe_length(model), 16)
    ids = probing.ids(model, L, model_device(model))
    short, mid, other = ids[:L // 2 + 1], ids[2:2 + 3 * L // 4], ids[L // 3:L // 3 + L // 2 + 2]
    full = {}
    # (rows in batch order, the rows kept when one leaves, in their new order)
    for seqs, kept in (([short, ids, mid, other], [0, 2, 3]), ([ids, other, mid], [2, 0]), ([mid, short, ids], [1, 2])):
        for s in seqs:
            if id(s) not in full:
                full[id(s)] = hf.authors_forward(model, s)
        why = _probe_batch(model, seqs, [full[id(s)] for s in seqs], kept, tol)
        if why is not None:
            return why
    return None


def _probe_batch(model, seqs, full, kept: list[int], tol: float) -> str | None:
    lengths = [s.numel() for s in seqs]
    plans = [_PROBE_PLANS[b % len(_PROBE_PLANS)] for b in range(len(seqs))]
    ends = [[n - plan[i] for n, plan in zip(lengths, plans)] for i in range(5)]
    schedule = [("feed", ends[0]), ("feed", ends[1]), ("crop", ends[2]), ("feed", ends[3]), ("crop", ends[4]),
                ("select", kept), ("feed", lengths)]
    rows, live = Rows(model, len(seqs)), list(range(len(seqs)))
    try:
        for op, arg in schedule:
            if op == "crop":
                rows.crop([arg[b] for b in live])
            elif op == "select":
                rows.select(arg)
                live = [live[j] for j in arg]
            else:
                stops = [arg[b] for b in live]
                feeds = [seqs[b][n:end] for b, n, end in zip(live, rows.lengths, stops)]
                keep = min(f.numel() for f in feeds)
                got = rows(feeds, keep).logits
                for j, (b, end) in enumerate(zip(live, stops)):
                    if not probing.close(got[j], full[b][end - keep:end], tol):
                        return (f"in a left-padded batch of {len(live)} rows, row {j}'s logits at positions "
                                f"{end - keep}..{end - 1} differ from its own forward's")
                if not hf.regatherable(rows.cache):
                    return "its cache is not made of full attention layers that rows can be cut back in"
    except Exception as e:  # noqa: BLE001 - a forward that fails on a batch is a reason to refuse batching it
        return f"its forward fails on a left-padded batch ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None
