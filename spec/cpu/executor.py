"""An fp32 CPU target's passes on packed weights, run by an object spec.runner calls.

`executor_for(model)` gives the model's executor (made once per model and its weights, probed once per
model, dtype and device: spec.probe), or None where the model's own forward runs its passes, and
`describe(model)` says which path produces its logits and why:

  kernel        spec.cpu.gemv's few-row kernel runs every product of a pass of 1 to KERNEL_ROWS rows (12 with
                AVX-512F, 6 with AVX2+FMA) at up to KERNEL_THREADS torch threads, its panels split over the
                caller's torch threads (named per call: no setting is changed)
  oneDNN        every product of a longer pass where the weights are kept (SPEC_SHED=0; given back, spec.cpu.
                prepack.shed, the kernel runs longer passes too), of any pass above KERNEL_THREADS threads, or
                without the kernel, on oneDNN (over its reordered copy where that pays, else the model's own
                weights: spec.cpu.prepack); the head's kept rows on the kernel where they are few
  transformers  the model's own forward, unchanged: a model this code does not run (not fp32 on CPU, linears
                too small to pay, a probe that disagreed, switched off), or one call it does not follow

Two kinds, each called as the model's forward is (spec.hf.step, tree_step and authors_forward take it as
`fn`) and returning what that forward returns there (the logits of the kept rows, the cache object it was
given, updated, the hidden states where asked):

  Executor  a plain Llama (spec.cpu.plainllama.supports; SmolLM2 is one): the embedding, each decoder layer's
            plain-tensor computation, the final norm and the head on its own packed weights (spec.cpu.prepack)
            and the model's own cache object and rotary tables. No module is called. Calls it does not follow
            (hooks on the model's modules, training mode, attention weights asked for, a batch, a padded mask,
            a cache other than a DynamicCache of full layers) run the model's own forward, the reason counted.
  Linears   any other model (or a Llama whose plain layers failed their probe): the model's own forward,
            unchanged, under a torch function mode, which is thread-local, that sends each of its plain
            nn.Linear products to the packed weights (hooks, masks and caches are the model's own).

Neither replaces a module's `forward` or changes a process-wide setting, so another thread using the model
sees it as it is, and each thread's passes are its own (all a pass's state lives in its call). Global module
hooks (torch.nn.modules.module.register_module_forward_hook) do not see an Executor's passes.

Threads: a kernel pass of an Executor at 2 torch threads (a prefill's too, where the weights were given
back) splits the kernel's panels and the attention's key heads over 2 threads of spec.cpu.gemv's pool and
keeps its other work on the calling thread (the rotary rows come from tables, the residual adds and kept
states are NumPy's, the cache is appended in place by NumPy: hf.cache_update), so that torch's own
thread team never wakes to spin beside the pool's worker (SmolLM2, 700-token prefill at 2 threads: 0.49 s,
against 0.56 s on oneDNN over the weights read back); Linears run the kernel on the calling thread alone
(the model's own torch ops run at torch's threads). torch's thread setting is never changed.

Switches: SPEC_PREPACK=0 leaves the model's own forward, SPEC_PLAIN_LAYERS=0 Linears, SPEC_GEMV=0 oneDNN for
every pass.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import threading
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spec import hf, probe
from spec.cpu import gemv, heap, plainllama, prepack

log = logging.getLogger(__name__)

KERNEL, ONEDNN, TRANSFORMERS = "kernel", "oneDNN", "transformers"
# A pass of at least LONG_ROWS rows gives the heap's free memory back after a layer where the heap has grown by
# more than HEAP_GROWTH bytes past its size at the pass's start or at the last such trim, and at its end
# (spec.cpu.heap; SmolLM2, one thread: the 700-token prefill 2-5% slower, the 2,000-token one 2-3%)
LONG_ROWS = 256
HEAP_GROWTH = 32 << 20
# and one of at least TRIM_ROWS rows (a prompt's prefill; a verify pass is shorter) at its end: its temporaries,
# freed, otherwise stay in the heap through the decode (SmolLM2's 135M shape: 12 MB after a 64-token prefill,
# about 35 MB after the first call's; a trim costs 1-4 ms)
TRIM_ROWS = 64
# The keywords of the model's forward a pass here follows (spec.hf passes no others); any other that is
# not None runs the model's own forward.
FOLLOWED = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep",
                      "output_hidden_states", *hf.LAYER_CACHE_KWARGS})


class Output:
    """A pass's result, named as the model's forward names it: logits [1, rows kept, V], the cache it was
    given (None: none), hidden_states (a tuple, where asked)."""
    __slots__ = ("logits", "cache", "hidden_states")

    def __init__(self, logits, cache, hidden_states=None):
        self.logits, self.cache, self.hidden_states = logits, cache, hidden_states


def _recorder(hook) -> bool:
    """A forward hook transformers installs on a model's layers to collect their outputs when hidden states
    or attention weights are asked for (transformers.utils.output_capturing): it does nothing outside the
    model's own forward, and the executor gives hidden states itself."""
    return getattr(hook, "__module__", "").startswith("transformers.utils.")


def weights_key(model) -> tuple:
    """What the packed copies were made from: every linear's weight, by identity and version."""
    return tuple((id(m.weight), m.weight._version) for m in model.modules() if type(m) is torch.nn.Linear)


class Passes:
    """What both kinds of executor share: the model (weakly: the model's own forward, for the calls not
    followed), `most` (the most rows the kernel runs; 0: none), the passes run so far by path (kernel, oneDNN,
    transformers) and why calls went to the model's own forward (`declined`), and the products' threads for
    a pass (`threads`)."""
    kind = ""

    def __init__(self, model, most: int, shed: bool = False):
        self._model = weakref.ref(model)
        self.most, self.shed = most, shed
        self.key = weights_key(model)
        self.passes: Counter = Counter()
        self.declined: Counter = Counter()
        self._count = threading.Lock()

    def __call__(self, **kwargs):
        """The model's forward over `kwargs` (as spec.hf passes them), run here or, where this does not
        follow the call, by the model itself."""
        return self.forward(kwargs)

    def forward(self, kwargs: dict, threads: int | None = None):
        raise NotImplementedError

    def threads(self, rows: int) -> tuple[int, bool]:
        """(the products' threads for a pass of `rows` rows: 0 oneDNN, n > 0 the kernel split over n threads
        for its products of 1 to `most` rows; whether the pass's torch ops stay on the calling thread)."""
        if not self.most:
            return 0, False
        torch_threads = torch.get_num_threads()
        if torch_threads > prepack.KERNEL_THREADS:
            return 0, False
        if rows <= self.most or self.shed:      # (a longer pass where the weights were shed: the kernel's too)
            return torch_threads, torch_threads > 1
        return 1, False      # (a longer pass over kept weights: oneDNN, the head's few kept rows on the kernel)

    def on_kernel(self, kernel: int, rows: int) -> bool:
        """Whether a pass of `rows` rows whose products take `kernel` threads runs them on the kernel."""
        return bool(kernel) and (rows <= self.most or self.shed and prepack.long_on_kernel(kernel))

    def path(self, rows: int) -> str:
        """The path a pass of `rows` rows takes at torch's threads now: "kernel" or "oneDNN"."""
        return KERNEL if self.on_kernel(self.threads(rows)[0], rows) else ONEDNN

    def _counted(self, path: str, why: str | None = None) -> None:
        with self._count:
            self.passes[path] += 1
            if why is not None:
                self.declined[why] += 1

    def _own(self, kwargs: dict, why: str):
        """The model's own forward over `kwargs`, counted with the reason."""
        self._counted(TRANSFORMERS, why)
        model = self._model()
        assert model is not None
        return model(**kwargs)


class Executor(Passes):
    """A plain Llama's passes on packed weights (see the module docstring): embedding, plain layers, final
    norm and head. `kernel`: with spec.cpu.gemv's panels for few-row passes; `native`: the layers' small ops on
    its library (None: where it is there)."""
    kind = "plain Llama layers on packed weights"

    def __init__(self, model, kernel: bool, native: bool | None = None, shed: bool = False, reorder: bool = True):
        base = model.model
        self.embed, self.norm, self.rotary = base.embed_tokens, base.norm, base.rotary_emb
        self.config = model.config
        groups = self.groups = {g: prepack.group(g, kernel, shed) for g in plainllama.grouped_linears(model)}
        self.linears: dict = {}
        for g, packed in groups.items():
            self.linears.update(zip(g, packed.members))
        for m in model.modules():
            if type(m) is torch.nn.Linear and m not in self.linears:
                self.linears[m] = prepack.packed_forward(m, kernel, shed_weight=shed)
        for p in self.linears.values():
            p.reorder = reorder
        self.head = self.linears[model.lm_head]
        super().__init__(model, self.head.most, any(p.shed for p in self.linears.values()) and bool(self.head.most))
        self.native = gemv.library() is not None if native is None else native
        self.layers = [plainllama.layer_forward(layer, groups, self.linears, self.native)
                       for layer in plainllama.layers_of(model)]
        self.modules = list(model.modules())[1:]    # (its parts: the model itself only through the weak reference)
        self._hook_dicts = [d for m in [model, *self.modules] for d in (m._forward_pre_hooks, m._forward_hooks,
                                                                         m._backward_pre_hooks, m._backward_hooks)]
        self._vars = [vars(m) for m in [model, *self.modules]]
        self._dropping = [layer.self_attn for layer in plainllama.layers_of(model)]
        self._recorders: frozenset = frozenset()     # the hook ids last found to be transformers' recorders alone
        self._table: tuple | None = None         # the rotary tables: (inv_freq's identity and version, cos, sin)
        self._watches: list = []                 # (ids, start): see watch
        self._watch_lock = threading.Lock()

    def watch(self, ids: torch.Tensor, start):
        """Hand a prompt's layer inputs on as a pass makes them (a draft making its cache from them need not
        have every layer's held at once): the first pass from position 0 whose ids are the first T of `ids`
        [n] calls start(T), which returns take (or None), and then take(i, x) with layer i's input x [T, H]
        (the pass's own tensor: read it before returning) for each layer in turn. Returns cancel(), which
        drops the watch if no pass has taken it."""
        entry = (ids, start)
        with self._watch_lock:
            self._watches.append(entry)

        def cancel() -> None:
            with self._watch_lock:
                self._watches = [w for w in self._watches if w is not entry]
        return cancel

    def _watchers(self, ids: torch.Tensor, past: int) -> list:
        """The takes of the watches this pass (ids [1, T] from position `past`) meets, each started once."""
        if past != 0 or not self._watches:
            return []
        T = ids.shape[1]
        with self._watch_lock:
            met = [w for w in self._watches if T <= len(w[0]) and torch.equal(w[0][:T].to(ids.device), ids[0])]
            self._watches = [w for w in self._watches if not any(w is m for m in met)]
        return [take for take in (start(T) for _, start in met) if take is not None]

    # --- the calls it follows ----------------------------------------------------------------------

    def declines(self, kwargs: dict) -> str | None:
        """Why a forward call with `kwargs` runs the model's own forward, or None where this runs it."""
        other = [k for k, v in kwargs.items() if k not in FOLLOWED and v is not None]
        if other:
            return f"the call passes {other[0]}"
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1 or not ids.shape[1]:
            return "not one sequence of ids"
        if not isinstance(kwargs.get("logits_to_keep", 0), int):
            return "logits_to_keep is not a count"
        if kwargs.get("output_hidden_states") not in (None, False, True):
            return "hidden states asked for by index"
        cache = hf.layer_cache(kwargs)
        if cache is not None and self._use_cache(kwargs) and not hf.plain_cache(cache):
            return f"its cache is a {type(cache).__name__}, not a DynamicCache of full layers"
        cfg = self.config
        if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "output_attentions", False):
            return "attention other than SDPA's, or its weights asked for"
        return self._modules_decline()

    def _modules_decline(self) -> str | None:
        """A module of the model with hooks of its own (transformers' output recorders aside) or its forward
        replaced, or its attention in training mode (dropout): each of these is honoured by the model's own
        forward only. (Checked every call: hooks come and go; the common case, none, is one pass over the
        hook dicts in C.)"""
        model = self._model()
        patched = any(map(operator.contains, self._vars, itertools.repeat("forward")))
        if patched or any(self._hook_dicts):
            # (hooks' handle ids are never reused: the same ids are the same hooks, found recorders last time)
            ids = frozenset(itertools.chain.from_iterable(self._hook_dicts))
            if patched or ids != self._recorders:
                for m in [model, *self.modules]:
                    if m._forward_pre_hooks or m._backward_pre_hooks or m._backward_hooks or \
                            not all(map(_recorder, m._forward_hooks.values())):
                        return f"hooks on a {type(m).__name__}"
                    if "forward" in vars(m):
                        return f"a {type(m).__name__}'s forward is replaced"
                self._recorders = ids
        if (model is not None and model.training) or any(m.training for m in self._dropping):
            return "the model is in training mode"
        return None

    def _use_cache(self, kwargs: dict) -> bool:
        use = kwargs.get("use_cache")
        return bool(getattr(self.config, "use_cache", True) if use is None else use)

    def _mask(self, mask, position_ids, past: int, T: int):
        """The mask the layers attend under: None (one sequence, causal), a 4-D mask (bool where it is
        allowed/blocked only, as spec.hf.masked_step's), or False where this does not follow it (padding)."""
        if mask is None:
            if position_ids is not None and T > 1 and not bool((position_ids[0, 1:] - position_ids[0, :-1] == 1).all()):
                return False                     # (transformers may read a step back as another packed sequence)
            return None
        if mask.dim() == 2:
            return None if mask.shape == (1, past + T) and bool(mask.all()) else False
        if mask.dim() != 4 or mask.shape[0] != 1 or tuple(mask.shape[-2:]) != (T, past + T):
            return False
        if mask.dtype == torch.bool or not mask.is_floating_point():
            return mask.bool()
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min
        return allowed if bool((allowed | blocked).all()) else mask

    def forward(self, kwargs: dict, threads: int | None = None):
        """As __call__; `threads`: the products' (0 oneDNN everywhere, n the kernel over n threads for
        few rows), forced whatever the pass (the probes); None: as the pass's rows and torch's threads say."""
        why = self.declines(kwargs)
        if why is None:
            ids, cache = kwargs["input_ids"], hf.layer_cache(kwargs)
            if not self._use_cache(kwargs):
                cache = None
            elif cache is None:
                cache = hf.new_cache(self._model())
            past = hf.cache_len(cache) if cache is not None else 0
            mask = self._mask(kwargs.get("attention_mask"), kwargs.get("position_ids"), past, ids.shape[1])
            if mask is not False:
                return self.run(ids, cache, kwargs.get("position_ids"), mask, kwargs.get("logits_to_keep") or 0,
                                bool(kwargs.get("output_hidden_states")), threads, past)
            why = "an attention mask over padding, or positions that step back"
        return self._own(kwargs, why)

    # --- a pass ------------------------------------------------------------------------------------

    def rotary_tables(self, position_ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, D] at `position_ids`: rows of the model's rotary module's own tables, made by it once
        for the first positions and again past them (each position's row is its own: freqs = position x
        inv_freq), where its rope type is static; a dynamic one's module is called per pass."""
        rotary = self.rotary
        kind = getattr(rotary, "rope_type", "default")
        if "dynamic" in kind or kind == "longrope":
            return rotary(x, position_ids)
        inv = rotary.inv_freq
        table, need = self._table, int(position_ids.max()) + 1
        if table is None or table[0] != (id(inv), inv._version) or table[1].shape[1] < need:
            length = max(need, 256, 2 * table[1].shape[1] if table is not None else 0)
            cos, sin = rotary(x, torch.arange(length, device=x.device)[None])
            table = self._table = ((id(inv), inv._version), cos, sin)
        index = position_ids[0]     # (index_select: a gather by [] of a prefill's rows is split over torch's threads)
        return table[1].index_select(1, index), table[2].index_select(1, index)

    def embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of `ids` [1, T]: [1, T, H]. Where the head is the embedding (tied: SmolLM2's)
        and its weight was given back, its rows are read from the head's panels (the same values): read from
        the weight's file mapping, each token brought back about 1 MB of it (Linux 6.x maps a page cache's
        large folio whole at a fault; ext4 makes them for a file written in large blocks), 80 of its 113 MB
        after a 64-token prompt on SmolLM2's 135M shape with random weights."""
        head = self.head
        if head.shed and head.small is not None and self.embed.weight is head.param:
            rows = ids.reshape(-1).tolist()
            if rows and 0 <= min(rows) and max(rows) < head.param.shape[0]:
                panels = head.small.keep[0]       # [ceil(V / 16), H, 16]: row v at [v // 16, :, v % 16]
                # row by row: one gather of several rows (panels[ids // 16, :, ids % 16]) is split over
                # torch's threads, whose team then spins beside the kernel's worker through the pass
                return torch.stack([panels[v // 16, :, v % 16] for v in rows]).view(*ids.shape, -1)
        return F.embedding(ids, self.embed.weight)     # (an id outside the vocabulary: its error, as the model's)

    def run(self, ids: torch.Tensor, cache, position_ids, mask, keep: int, hidden: bool,
            threads: int | None = None, past: int = 0) -> Output:
        """One pass of `ids` [1, T] on top of `cache` (None: none; `past` positions held), positions
        `position_ids` [1, T] (None: past, past + 1, ...), under `mask` (see `_mask`); the logits of the last
        `keep` rows (0: all), the hidden states where `hidden`."""
        T = ids.shape[1]
        kernel, serial = self.threads(T) if threads is None else (threads, threads > 1 and T <= self.most)
        if threads is None:
            self._counted(KERNEL if self.on_kernel(kernel, T) else ONEDNN)
        takers = self._watchers(ids, past)
        with torch.no_grad():
            x = self.embedded(ids)
            if position_ids is None:
                position_ids = torch.arange(past, past + T, device=ids.device)[None]
            cos, sin = self.rotary_tables(position_ids, x)
            # every layer's input side by side in one tensor [1, T, layers + 1, H] (spec.hf.hidden_states
            # then hands a run of them on as a view), each layer's output freed as the next is made
            states = x.new_empty(*x.shape[:2], len(self.layers) + 1, x.shape[2]) if hidden else None
            if states is not None:
                plainllama.copy_into(states[:, :, 0], x, serial)
            mark = heap.size() if T >= LONG_ROWS else None
            for i, layer in enumerate(self.layers):
                for take in takers:
                    take(i, x[0])
                x = layer(x, mask, cos, sin, cache, kernel, serial)
                if mark is not None:
                    mark = heap.release(mark, HEAP_GROWTH)
                if states is not None:
                    plainllama.copy_into(states[:, :, i + 1], x, serial)
            if T >= TRIM_ROWS:
                heap.trim()         # (the pass's own freed temporaries: not held through the decode after it)
            if states is None and keep:
                x = x[:, -keep:]
            norm = gemv.rms if self.native else plainllama.rms
            x = norm(x, self.norm.weight, self.norm.variance_epsilon)
            if states is not None:
                plainllama.copy_into(states[:, :, -1], x, serial)
                x = x[:, -keep:] if keep else x
            return Output(self.head(x, kernel), cache, states.unbind(2) if states is not None else None)


class _Products(TorchFunctionMode):
    """While the model's own forward runs a pass, in the calling thread only (a torch function mode is
    thread-local): each F.linear over one of the model's plain nn.Linear weights and biases (`packed`: id of
    the weight -> (weight, bias, its Packed)) runs on the packed weights with the pass's `threads`; every
    other call runs as it would."""

    def __init__(self, packed: dict, threads: int):
        super().__init__()
        self.packed, self.threads = packed, threads

    def __torch_function__(self, func, types, given=(), kwargs=None):     # (torch passes them by position)
        if func is F.linear and len(given) >= 2 and not kwargs:
            found = self.packed.get(id(given[1]))
            if found is not None and found[0] is given[1] and found[1] is (given[2] if len(given) > 2 else None):
                return found[2](given[0], self.threads)
        return func(*given, **(kwargs or {}))


class Linears(Passes):
    """A model of another architecture (or layers spec.cpu.plainllama does not run): its own forward, unchanged,
    run in the calling thread under a torch function mode (`_Products`) that sends each of its plain
    nn.Linear products to the packed weights; hooks, masks, caches and the rest are the model's own. With
    autograd on over weights that want gradients, the model's own forward runs (the packed products keep
    none)."""
    kind = "the model's own forward, its linears on packed weights"

    def __init__(self, model, kernel: bool, shed: bool = False, reorder: bool = True):
        self.linears = {m: prepack.packed_forward(m, kernel, shed_weight=shed) for m in model.modules()
                        if type(m) is torch.nn.Linear}
        for p in self.linears.values():
            p.reorder = reorder
        self._by_weight = {id(m.weight): (m.weight, m.bias, p) for m, p in self.linears.items()}
        most = prepack.kernel_rows() if kernel else 0
        super().__init__(model, most, bool(most) and any(p.shed for p in self.linears.values()))

    def threads(self, rows: int) -> tuple[int, bool]:
        """As Passes.threads, the kernel on the calling thread alone: the model's own torch ops run at torch's
        threads, and where they wake torch's thread team its spinning takes the core a split would need
        (measured: a SmolLM2-sized Qwen2 at 2 torch threads, split over 2 against 1: 1.05x the one-token
        step, 1.08x the 9-row pass)."""
        kernel, _ = super().threads(rows)
        return min(kernel, 1), False

    def forward(self, kwargs: dict, threads: int | None = None):
        ids = kwargs.get("input_ids")
        if ids is None:
            return self._own(kwargs, "no input_ids")
        if torch.is_grad_enabled() and any(w.requires_grad for w, _, _ in self._by_weight.values()):
            return self._own(kwargs, "autograd on, over weights that want gradients")
        rows = ids.numel()
        kernel = self.threads(rows)[0] if threads is None else threads
        if threads is None:
            self._counted(KERNEL if self.on_kernel(kernel, rows) else ONEDNN)
        model = self._model()
        assert model is not None
        with _Products(self._by_weight, kernel):
            return model(**kwargs)


# --- which models get one ---------------------------------------------------------------------------

# model -> its Executor (made once per model and weights; the decision itself is spec.probe's memo)
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def executor_for(model) -> Passes | None:
    """`model`'s executor (an Executor for a plain Llama, else Linears), or None where its own forward runs
    its passes (`describe` says why)."""
    return decision(model)[0]


def decision(model) -> tuple[Passes | None, str | None]:
    """(the executor or None, why None or why no kernel: None where the kernel runs), decided once per model,
    dtype and device (spec.probe: 'executor'), the executor made again if the linears' weights changed."""
    if not isinstance(model, torch.nn.Module) or next(model.parameters(), None) is None:
        return None, "not a torch model with parameters"
    if _FIRST and _refusal(model) is None and _kernel_refusal() is None and prepack.shedding():
        _decided_first(model)
    with _LOCK:
        why, kernel, plain = probe.once(model, "executor", _decide)
        if kernel is None:
            return None, why
        made = _MADE.get(model)
        if made is None or made.key != weights_key(model) or bool(made.most) != kernel or \
                isinstance(made, Executor) != (plain is None):
            shed = kernel and prepack.shedding()
            made = _MADE[model] = Executor(model, kernel, shed=shed) if plain is None else Linears(model, kernel, shed)
        return made, why


# question -> ask: what is decided about a model before an executor that gives its weights back is made
# (spec.runner's verdict, registered there with `first`)
_FIRST: dict = {}


def first(question: str, ask) -> None:
    """Have spec.probe question `question`, asked by `ask(model)`, decided before any executor that gives its
    weights back is made, where that executor is asked for first (`executor_for`, `describe`): spec.runner's
    verdict runs the model's own forward, which read back every weight already given back, beside its panels
    (SmolLM2: peak 1,454 MB against 994). Its probe's replay then makes the executor (asked inside it)."""
    _FIRST[question] = ask


def _decided_first(model) -> None:
    for question, ask in _FIRST.items():
        if probe.asking(model, question):
            continue
        try:
            ask(model)
        except Exception as e:  # noqa: BLE001 - a refusal, or a model no runner takes: its executor is decided alone
            log.debug("spec.cpu.executor: %s on %s first: %s: %s", question, type(model).__name__, type(e).__name__, e)


def describe(model) -> str:
    """Which path produces `model`'s logits in spec's runners, and why (for the report)."""
    ex, why = decision(model)
    if ex is None:
        return f"{TRANSFORMERS} (the model's own forward): {why}"
    made = f"spec.cpu.executor: {ex.kind}"
    if isinstance(ex, Linears):
        made += f"; not plain layers: {probe.once(model, 'executor', _decide)[2]}"
    threads, split = torch.get_num_threads(), ex.threads(1)[0]
    if ex.most and threads <= prepack.KERNEL_THREADS:
        over = f"panels over {split} threads" if split > 1 else "one thread"
        return (f"{KERNEL} (spec.cpu.gemv, {prepack.ISA_NAMES.get(gemv.isa(), 'ISA ' + str(gemv.isa()))}, {over}) "
                f"for passes of 1-{ex.most} rows, {ONEDNN} above ({made})")
    if ex.most:
        why = f"{threads} torch threads, above the kernel's {prepack.KERNEL_THREADS}"
    return f"{ONEDNN} for every pass (no kernel: {why}) ({made})"


def passes(model) -> dict:
    """The passes `model`'s Executor has run, by path, and why calls went to the model's own forward
    ({} where it has none)."""
    made = _MADE.get(model) if isinstance(model, torch.nn.Module) else None
    if made is None:
        return {}
    with made._count:
        out = dict(made.passes)
        if made.declined:
            out["declined"] = dict(made.declined)
        return out


def plain_expected(model) -> bool:
    """Whether `model` is to run on an Executor, as far as can be told without probing it (its probe may still
    refuse it: executor_for then says); nothing is made or run, so the probes of spec.runner, which run the
    model's own forward, still come before any weight is given back."""
    return _refusal(model) is None and _plain_refusal(model) is None


def _refusal(model) -> str | None:
    """Why `model` gets no executor before any probe (None: it may)."""
    if os.environ.get("SPEC_PREPACK", "1") == "0":
        return "switched off (SPEC_PREPACK=0)"
    if not prepack.available(model):
        return "not fp32 on a CPU with oneDNN"
    if hf.tensor_parallel_size(model) > 1 or hf.device_map(model) is not None:
        return "split over processes or devices"
    size = prepack.linear_bytes(model)
    if size < prepack.MIN_BYTES:
        return (f"its linears are {size / 2 ** 20:.1f} MB, under the {prepack.MIN_BYTES >> 20} MB where packed "
                f"weights pay (they fit in the CPU's caches)")
    if not prepack.fits(size):
        return f"a packed copy of its {size >> 20} MB of linears would take more than half the memory available"
    return None


def _plain_refusal(model) -> str | None:
    """Why `model`'s layers do not run as plain tensors (None: they do)."""
    if os.environ.get("SPEC_PLAIN_LAYERS", "1") == "0":
        return "SPEC_PLAIN_LAYERS=0"
    return plainllama.supports(model)


def _kernel_refusal() -> str | None:
    if os.environ.get("SPEC_GEMV", "1") == "0":
        return "SPEC_GEMV=0"
    if gemv.library() is None:
        return f"spec.cpu.gemv's library is not available ({gemv.reason()})"
    if gemv.isa() not in prepack.KERNEL_ROWS:
        return "this CPU has neither AVX-512F nor AVX2+FMA"
    return None


def _decide(model) -> tuple[str | None, bool | None, str | None]:
    """(why, kernel, plain): kernel None where the model gets no executor (why says why), else whether it runs
    the kernel (why: why not, or None); plain: why its layers do not run as plain tensors (None: they do, on an
    Executor; else its own forward runs on Linears). Each executor tried is held to the model's own forward
    within the probe's tolerance (`agrees`): on oneDNN everywhere, then on the kernel everywhere it runs; an
    Executor that fails its probe leaves Linears to try, and Linears that fail leave the model's own forward."""
    why = _refusal(model)
    if why is not None:
        return why, None, None
    no_kernel, plain = _kernel_refusal(), _plain_refusal(model)
    for kind in ([Executor] if plain is None else []) + [Linears]:
        ex, failed, kernel_why = _tried(model, kind, no_kernel)
        if ex is not None:
            if kernel_why is not None:
                log.debug("spec.cpu.executor: %s runs oneDNN alone: %s", type(model).__name__, kernel_why)
            if bool(ex.most) == (kernel_why is None):
                _MADE[model] = ex                # (the one probed: its copies are not made twice)
            return kernel_why, kernel_why is None, plain
        if kind is Executor:
            plain = f"its plain layers {failed}"
        else:
            why = failed
    return f"its passes {why}", None, plain


def _tried(model, kind, no_kernel: str | None) -> tuple[Passes | None, str, str | None]:
    """(a `kind` executor of `model` that agrees with its own forward, or None; why not; why it runs no
    kernel, or None)."""
    try:
        shed = no_kernel is None and prepack.shedding()
        # The model's own logits first: where the weights move out of memory (prepack.shed), nothing reads them
        # after, and the oneDNN probe runs on an executor that makes no copy of them
        refs = references(model, prepack.kernel_rows() if no_kernel is None else 0)
        ex = kind(model, False, reorder=False) if shed else kind(model, no_kernel is None)
        if not agrees(model, ex, threads=0, refs=refs):
            return None, "were off the model's own forward by more than the probe's tolerance", no_kernel
        if shed:
            del ex
            heap.trim()      # (the probes' logits and passes, freed: the packed copies are made in their room)
            ex = kind(model, True, shed=True)
        if no_kernel is None and not agrees(model, ex, threads=1, refs=refs):
            no_kernel = "the kernel's logits were off the model's own by more than the probe's tolerance"
        del refs
        heap.trim()
    except Exception as e:       # (a transformers release whose parts take other arguments: its own forward runs)
        log.debug("spec.cpu.executor: %s's passes on %s failed here (%s: %s)", type(model).__name__, kind.__name__,
                  type(e).__name__, e)
        return None, f"failed here ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})", no_kernel
    return ex, "", no_kernel


def references(model, most: int) -> dict:
    """The model's own forward's logits that `agrees` holds an executor to, over the probe's ids: {n: the
    logits of the first n ids}, for every n it asks for on oneDNN and, with `most` (the kernel's rows), on
    the kernel."""
    ids = probe.ids(model, probe.probe_length(model), next(model.parameters()).device)
    ns = {1, 3, ids.numel()} | ({min(most, ids.numel()), min(ids.numel(), 1 + 2 * most)} if most else set())
    return {n: hf.authors_forward(model, ids[:min(n, ids.numel())]) for n in ns}


def agrees(model, ex: Passes, threads: int, refs: dict | None = None) -> bool:
    """`ex`'s logits with its products on `threads` (0 oneDNN, 1 the kernel for 1 to `most` rows) are within
    the probe's tolerance of the model's own forward's over the probe's ids: cache-free for the first id,
    the first 3 and the first `most` (all of them on oneDNN), and, on an Executor (whose cache handling is its
    own), cached, fed as a prefix, one row, then the rest (at most `most` rows). (Linears run the model's own
    forward, cache and all; the runner probe's replay holds their cached passes to the model's.)"""
    ids = probe.ids(model, probe.probe_length(model), next(model.parameters()).device)
    tol = probe.tolerance(model)
    fn = lambda **kwargs: ex.forward(kwargs, threads)      # noqa: E731
    own = (lambda n: refs[n]) if refs is not None else (lambda n: hf.authors_forward(model, ids[:n]))  # noqa: E731
    cuts = sorted({min(n, ids.numel()) for n in (1, 3, ex.most if threads else ids.numel())})
    for n in cuts:
        if not probe.close(hf.authors_forward(model, ids[:n], fn), own(n), tol):
            return False
    if not isinstance(ex, Executor):
        return True
    end = min(ids.numel(), 1 + 2 * ex.most) if threads else ids.numel()
    full = own(end)
    cache = hf.new_cache(model)
    for start, stop in ((0, end // 2), (end // 2, end // 2 + 1), (end // 2 + 1, end)):
        got = hf.step(model, ids[start:stop], cache, position_ids=torch.arange(start, stop)[None], fn=fn)[0]
        if not probe.close(got, full[start:stop], tol):
            return False
    return True
