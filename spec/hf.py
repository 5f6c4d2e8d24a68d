"""The one place that knows which transformers release is installed.

Everything version-specific the runtime needs lives here: the cache keyword of `forward`, how
a DynamicCache is built, cropped and regathered, how masks and positions are passed. (HF's own
decoders, generate() as the suite's reference, are spec.hfref.) Supported: transformers 5.17
(the GPU image's) up to the newest 5.x.

  - 5.17 takes `past_key_values=`; 5.24 renamed it `cache=` and warns on the old name.
  - `DynamicCache.crop(n)`: 5.17 reads a positive n as the length to keep (deprecated),
    5.24 raises on it. A negative n (tokens to remove) means the same in both, so we
    only ever pass a negative n.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer


# The keyword a model's forward takes its cache under: `cache` (5.24), `past_key_values`
# (5.17's attention models), `cache_params` (5.17's Mamba family), `state` (RWKV). A
# forward with none of these has no cache we can drive (OpenAI-GPT, XLNet's `mems`).
CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "state")


def forward_params(model_class: type) -> frozenset[str]:
    """The keywords `model_class.forward` takes (read once per class)."""
    return _forward_params(model_class)


@functools.lru_cache(maxsize=None)
def _forward_params(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(getattr(model_class, "forward")).parameters)


def cache_kwarg(model) -> str | None:
    params = forward_params(type(model))
    return next((k for k in CACHE_KWARGS if k in params), None)


def _cache_name(model) -> str:
    """cache_kwarg for a model known to take a cache (batches and trees run only on those)."""
    name = cache_kwarg(model)
    if name is None:
        raise ValueError(f"{type(model).__name__}'s forward takes no cache ({', '.join(CACHE_KWARGS)})")
    return name


def returned_cache(out):
    """The cache object a forward returned, under whichever name this release uses."""
    for name in ("cache", "past_key_values", "cache_params", "state"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


def new_cache(model) -> DynamicCache:
    """A cache of full attention layers for every layer, sliding-window ones included.

    The model's own cache (`DynamicCache(config=...)`) keeps only the last window of a
    sliding layer and cannot be rewound once the window is full. Full layers keep every
    position; the model's sliding-window mask still hides what lies outside the window
    (the same mask its cache-free forward uses), so the logits are the same and a
    rollback is a plain crop, in every release."""
    return DynamicCache()


def new_static_cache(model, max_len: int) -> StaticCache:
    """A preallocated cache: fixed shapes, so a compiled step never recompiles."""
    return StaticCache(config=model.config, max_cache_len=max_len)


# A decoder layer's forward takes the cache under the model's name for it: `cache` (5.24 on),
# `past_key_values` (5.17).
LAYER_CACHE_KWARGS = ("cache", "past_key_values")


def layer_cache(kwargs: dict):
    """The cache a model handed one of its decoder layers (kwargs of the layer's forward), or None."""
    return next((kwargs[k] for k in LAYER_CACHE_KWARGS if kwargs.get(k) is not None), None)


def cache_update(cache, key: torch.Tensor, value: torch.Tensor, layer: int):
    """The cache's own `update` for one layer's new keys and values: the layer's whole keys and values
    back. (5.17 takes `cache_kwargs` after the layer, 5.24 `kwargs`; neither is needed here.)

    A full layer of a DynamicCache on CPU is appended to in place (`_appended`): its keys and values become
    the first positions of buffers with room for more (ROOM), and the next append writes into that room, on
    the calling thread, instead of DynamicLayer.update's torch.cat, which copies the whole layer each pass
    (at 2,000 positions, SmolLM2: 92 MB a step) and, past torch's grain size, wakes torch's thread team,
    whose spinning afterwards takes a core from a pass whose products run on spec.cpu.gemv's own threads.
    The layer's tensors hold the same values in the same shape as the cache's own update leaves (a crop
    slices them as any tensor); what lies past them in their buffer is not theirs, and is written over by
    the next append (a view of a longer past, kept from before a crop, is not the cache's: copy the cache
    to keep one). A layer a prefill starts is first made by the cache's own update with no positions."""
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False) and key.device.type == "cpu":
        if layer >= len(cache.layers) or not getattr(cache.layers[layer], "is_initialized", True):
            cache.update(key[..., :0, :], value[..., :0, :], layer)     # (the layer made, empty: the cache's own)
        lay = cache.layers[layer]
        if type(lay) is DynamicLayer and lay.keys.device.type == "cpu" and lay.keys.dtype == key.dtype and \
                lay.keys.dim() == 4 and lay.values.shape == lay.keys.shape:
            lay.keys, lay.values = _appended(lay.keys, key), _appended(lay.values, value)
            return lay.keys, lay.values
    return cache.update(key, value, layer)


# Positions a layer's buffer holds past what it is given (cache_update): half as many again as it holds, from
# MIN_ROOM to ROOM (one copy per ROOM appended on a long sequence). The room is resident as a rule (torch's
# allocator hands out heap memory the pass's temporaries wrote): 256 positions of it were 12 MB of SmolLM2's
# peak after a 64-token prompt.
ROOM, MIN_ROOM = 256, 32


def _appended(held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """held [B, H, n, D] with new [B, H, T, D] after it along positions: written into the room held's buffer
    has past n where held is the first n positions of one (as this leaves them), else into a new buffer
    with room to spare (ROOM; torch allocates it); NumPy copies, on the calling thread. The first n + T
    positions of the buffer back."""
    import numpy as np
    B, H, n, D = held.shape
    T = new.shape[-2]
    room = held.stride(1) // D if D else 0
    if held.stride() == (H * room * D, room * D, D, 1) and held.storage_offset() == 0 and n + T <= room and \
            held.untyped_storage().nbytes() >= B * H * room * D * held.element_size():
        buf = held.as_strided((B, H, room, D), held.stride())
    else:
        buf = held.new_empty(B, H, n + T + min(ROOM, max(MIN_ROOM, (n + T) // 2)), D)
        np.copyto(buf.detach().numpy()[:, :, :n], held.detach().numpy())
    np.copyto(buf.detach().numpy()[:, :, n:n + T], new.detach().numpy())
    return buf[:, :, :n + T]


def plain_cache(cache) -> bool:
    """`cache` is a DynamicCache of full layers only (or of none yet): one whose positions are the
    sequence's, from 0, every layer holding them all (what spec.cpu.executor runs a pass on)."""
    return type(cache) is DynamicCache and not getattr(cache, "offloading", False) and \
        all(type(layer) is DynamicLayer for layer in cache.layers)


def cache_len(cache) -> int:
    return int(cache.get_seq_length())  # 5.17's StaticCache answers with a tensor


def crop(cache, keep: int) -> None:
    """Drop every cached position from `keep` on (the rejected draft tokens)."""
    if isinstance(cache, StaticCache):
        # 5.17's static layers cannot crop; in every version the write position is
        # `cumulative_length`, and the causal mask hides what lies beyond it.
        for layer in cache.layers:
            layer.cumulative_length.fill_(min(keep, int(layer.cumulative_length)))
        return
    surplus = cache.get_seq_length() - keep
    if surplus > 0:
        cache.crop(-surplus)


# Each model's compiled one-token step (compile_step), kept for later runners: compiling takes
# seconds on a GPU, minutes on a small CPU. Keyed weakly: nothing is stored on the model.
COMPILED_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Cached:
    """A model and its KV cache. `cached(ids)` feeds ids after the positions the cache
    holds and returns their logits; `crop(keep)` forgets every position from `keep` on.

    static_len: a preallocated StaticCache of at least that many positions, with the one-token
    step compiled (the `compiled` draft). The compiled step is kept (COMPILED_STEPS) and
    reused by later calls: compiling takes seconds on a GPU, minutes on a small CPU."""

    def __init__(self, model, static_len: int | None = None):
        self.model = model
        self.step = None
        if static_len is None:
            self.cache = new_cache(model)
        else:
            # Rounded up to a power of two (at least 256): the compiled step is specialised to
            # the cache's shape, and an exact length would recompile for every prompt length.
            self.cache = new_static_cache(model, max(256, 1 << (static_len - 1).bit_length()))
            self.step = COMPILED_STEPS.get(model)
            if self.step is None:
                self.step = COMPILED_STEPS[model] = compile_step(model)

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        return forward(self.model, ids, self.cache, keep, self.step)

    def crop(self, keep: int) -> None:
        crop(self.cache, keep)

    def __len__(self) -> int:
        return cache_len(self.cache)


def compile_step(model):
    """The model's forward compiled for one-token steps on a StaticCache (gpt-fast's
    technique): CUDA graphs on GPU cut the per-layer kernel-launch cost that makes
    a small draft launch-bound; on CPU it still fuses the step's small ops."""
    mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else "default"
    return torch.compile(model.forward, mode=mode, dynamic=False, fullgraph=False)


def text_config(model):
    """The config of the model's text decoder (a multimodal or encoder-decoder config's), or the
    model's own config where it has no parts."""
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def step(model, ids: torch.Tensor, cache=None, *, position_ids: torch.Tensor | None = None, keep: int = 0,
         use_cache: bool = True, fn=None, mask_len: int | None = None, hidden: list | None = None,
         layers: tuple[int, ...] = (-1,)):
    """Run `ids` (1-D) through `model` on top of `cache` (None: the model builds its own).
    Returns (logits [n or keep, vocab], the cache the model returned).

    position_ids ([1, n]) are passed where the forward takes them; None passes none (the
    model counts for itself: spec.positions says which a model needs). `keep` > 0 computes
    the LM head on the last `keep` positions only. use_cache=False is a cache-free pass
    over `ids` alone. mask_len: an all-ones attention mask over that many positions (cache
    and new), for positions that may step back (a pad token's, counted the RoBERTa way):
    given positions and no mask, transformers reads a step back as the start of another
    packed sequence and masks across it. hidden: a list that receives the hidden states of every
    position the forward ran at `layers` (indices into the output's hidden_states), [n, L, H] (for
    drafters that read them). fn: what runs the call in the model's place, taking the forward's keywords (a
    compiled step, spec.cpu.executor's Executor); None: the model."""
    params = forward_params(type(model))
    kwargs = {"input_ids": ids[None], "use_cache": use_cache}
    if hidden is not None:
        kwargs["output_hidden_states"] = True
    if mask_len is not None and "attention_mask" in params:
        kwargs["attention_mask"] = torch.ones(1, mask_len, dtype=torch.long, device=ids.device)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    if position_ids is not None and "position_ids" in params:
        kwargs["position_ids"] = position_ids
    name = cache_kwarg(model)
    if use_cache and cache is not None and name is not None:
        kwargs[name] = cache
    out = (fn or model)(**kwargs)
    logits = out.logits[0]
    if hidden is not None:
        hidden.append(hidden_states(out, layers))
    return (logits[-keep:] if keep else logits), (returned_cache(out) if use_cache else None)


def hidden_states(out, layers: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """A forward's hidden states at `layers` (indices into its hidden_states: 0 the embeddings, -1
    the last layer's, what the LM head reads), [n, len(layers), H] (the decoder's, for an
    encoder-decoder model)."""
    states = getattr(out, "hidden_states", None) or getattr(out, "decoder_hidden_states", None)
    if not states:
        raise ValueError(f"{type(out).__name__} carries no hidden states")
    for layer in layers:
        if not -len(states) <= layer < len(states):
            raise ValueError(f"layers: {layer} is not a layer of this model's {len(states)} hidden states "
                             f"(0 the embeddings .. {len(states) - 1}, or -1 the last)")
    picked = [states[layer][0] for layer in layers]
    view = _side_by_side(picked) if 2 * len(picked) > len(states) else None    # (a few: copied, the rest freed)
    return view if view is not None else torch.stack(picked, dim=1)


def _side_by_side(picked: list) -> torch.Tensor | None:
    """[n, len(picked), H] as a view where the states already lie so in one tensor, equally spaced (as
    spec.cpu.executor keeps them): no copy of a long prompt's states; else None."""
    first = picked[0]
    if len(picked) < 2 or first.dim() != 2 or any(p.shape != first.shape or p.stride() != first.stride()
                                                   or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                                                   for p in picked):
        return None
    gap = picked[1].storage_offset() - first.storage_offset()
    if gap <= 0 or any(p.storage_offset() != first.storage_offset() + i * gap for i, p in enumerate(picked)):
        return None
    return first.as_strided((first.shape[0], len(picked), first.shape[1]), (first.stride(0), gap, first.stride(1)),
                            first.storage_offset())


def authors_forward(model, ids: torch.Tensor, fn=None) -> torch.Tensor:
    """Logits [n, vocab] of the model's forward over `ids` (1-D) called as its authors call it:
    the ids and an all-ones attention mask, no positions, no cache. The reference spec reproduces.
    `fn`: what runs the call in the model's place (spec.cpu.executor's Executor, in its probe)."""
    params = forward_params(type(model))
    kwargs = {"input_ids": ids[None]}
    if "attention_mask" in params:
        kwargs["attention_mask"] = torch.ones_like(ids)[None]
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (fn or model)(**kwargs).logits[0]


def forward(model, ids: torch.Tensor, cache, keep: int = 0, step_fn=None) -> torch.Tensor:
    """Run `ids` (1-D) at positions len(cache).. through `model` on top of `cache` (mutated in
    place); return logits [n, vocab]. (0-based positions: a draft's, or a model spec.positions
    found to count that way.)

    `step_fn`, from compile_step, runs one-token inputs; longer ones (prefill, catch-up) run eagerly."""
    fn = step_fn if step_fn is not None and ids.numel() == 1 else None
    start = cache_len(cache)
    positions = torch.arange(start, start + ids.numel(), device=ids.device)[None]
    return step(model, ids, cache, position_ids=positions, keep=keep, fn=fn)[0]


def vocab_rows(model) -> int:
    """Rows of the input embedding: the ids this model can be fed."""
    return model.get_input_embeddings().num_embeddings


def logit_width(model) -> int:
    """Width of the LM head's output (Pythia pads it beyond the tokenizer)."""
    return model.get_output_embeddings().weight.shape[0]


# --- targets split across processes or devices (spec/parallel.py) ---------------------------------
# Tensor parallelism: 5.2x loads a model split over a `torchrun` group with
# `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`; passing `tp_plan=`/`tp_size=`
# to from_pretrained is the older form, deprecated since. The split model's weights are DTensors
# (their .shape is the whole weight's), its `tp_size` says into how many parts, and `_device_mesh`
# holds the process group. A device_map split (accelerate) leaves `hf_device_map` on the model.

def tensor_parallel_kwargs(tp_size: int) -> dict:
    """from_pretrained keyword arguments that split a model over `tp_size` processes of the
    running torch.distributed group (transformers' own plan for the architecture)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # a release without DistributedConfig takes the plan directly
        return {"tp_plan": "auto", "tp_size": tp_size}
    if "tp_size" not in inspect.signature(DistributedConfig).parameters:
        return {"tp_plan": "auto", "tp_size": tp_size}
    return {"distributed_config": DistributedConfig(tp_size=tp_size)}


def has_tp_plan(model_or_config) -> bool:
    """Whether transformers has a tensor-parallel plan for this architecture."""
    cfg = getattr(model_or_config, "config", model_or_config)
    if getattr(cfg, "base_model_tp_plan", None):
        return True
    return bool(getattr(model_or_config, "_tp_plan", None))


def tensor_parallel_size(model) -> int:
    """Into how many processes the model's weights are split by tensor parallelism (1: not split)."""
    size = getattr(model, "_tp_size", None)
    return int(size) if isinstance(size, int) and size > 1 else 1


def tensor_parallel_group(model):
    """The torch.distributed process group the model's tensor-parallel collectives run over."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh.get_group("tp") if "tp" in names else mesh.get_group()


def device_map(model) -> dict | None:
    """The device map accelerate dispatched the model with (module name -> device), if any."""
    found = getattr(model, "hf_device_map", None)
    return dict(found) if isinstance(found, dict) else None


# --- Batches (spec.batch): several sequences on one DynamicCache, left-padded --------------------

def batch_step(model, ids: torch.Tensor, cache, *, position_ids: torch.Tensor, attention_mask: torch.Tensor,
               keep: int) -> torch.Tensor:
    """Run `ids` [B, m] through `model` on top of `cache` (B rows, mutated in place), with
    `position_ids` [B, m] and a 2-D `attention_mask` [B, cached + m] (0 at padding, as HF's
    left-padded generate passes it). Returns the logits of the last `keep` columns, [B, keep, V]."""
    params = forward_params(type(model))
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids,
                              "use_cache": True, _cache_name(model): cache}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    return model(**kwargs).logits[:, -keep:]


def tree_step(model, ids: torch.Tensor, cache, *, position_ids: torch.Tensor, mask: torch.Tensor,
              keep: int, hidden: list | None = None, layers: tuple[int, ...] = (-1,), fn=None) -> torch.Tensor:
    """Run `ids` (1-D) on top of `cache` (whose positions are 0 .. cached - 1) with explicit
    `position_ids` [n] and a custom attention mask [n, cached + n] (True: may attend): masked_step
    for one row. Returns the logits of the last `keep` positions, [keep, V] (hidden: receives every
    position's states at `layers`, [n, L, H])."""
    cached = mask.shape[1] - ids.numel()
    keys = torch.cat([torch.arange(cached, device=position_ids.device), position_ids])
    out = masked_step(model, ids[None], cache, position_ids=position_ids[None], mask=mask[None],
                      key_positions=keys[None], keep=keep, hidden=hidden, layers=layers, fn=fn)
    return out[0]


def masked_step(model, ids: torch.Tensor, cache, *, position_ids: torch.Tensor, mask: torch.Tensor,
                key_positions: torch.Tensor, keep: int, hidden: list | None = None,
                layers: tuple[int, ...] = (-1,), fn=None) -> torch.Tensor:
    """Run `ids` [B, m] on top of `cache` with explicit `position_ids` [B, m] and a custom attention
    mask [B, m, cached + m] (True: may attend; `key_positions` [B, cached + m] the position of each
    key column), passed as HF's ready-made 4-D additive mask (0 or the dtype's minimum), which
    transformers 5 hands to the attention as it is. A custom mask bypasses the model's sliding
    window, so the window is put in here, counted in positions as a chain's pass counts it; a model
    with both kinds of layers (config.layer_types) gets one mask per kind, the mapping its forward
    takes. Returns the logits of the last `keep` columns, [B, keep, V] (hidden: receives, for a
    single row, every position's states at `layers`, [m, L, H]). fn: as step's."""
    dtype = next(model.parameters()).dtype
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    mask = mask.cpu()
    masks = {"full_attention": mask}
    if isinstance(window, int) and window > 0:
        masks["sliding_attention"] = mask & (position_ids.cpu()[:, :, None] - key_positions.cpu()[:, None, :] < window)

    def additive(m: torch.Tensor) -> torch.Tensor:
        return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)[:, None].to(ids.device)

    kinds = set(getattr(cfg, "layer_types", None) or ())
    if "sliding_attention" in masks and kinds:
        attention_mask = {kind: additive(masks.get(kind, mask)) for kind in kinds}
    else:
        attention_mask = additive(masks.get("sliding_attention", mask))
    params = forward_params(type(model))
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": attention_mask,
                              "position_ids": position_ids, "use_cache": True, _cache_name(model): cache}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    if hidden is not None:
        kwargs["output_hidden_states"] = True
    out = (fn or model)(**kwargs)
    if hidden is not None:
        hidden.append(hidden_states(out, layers))
    return out.logits[:, -keep:]


def keep_positions(cache, kept: torch.Tensor) -> None:
    """Keep only the cached positions `kept` (indices, in order) in every full layer: a verified
    tree's accepted path moved up behind the sequence (the rejected branches dropped)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, t.index_select(-2, kept.to(t.device)))


def takes_batch_masks(model) -> bool:
    """The forward takes the 2-D attention mask and the positions a left-padded batch needs."""
    params = forward_params(type(model))
    return {"attention_mask", "position_ids"} <= params and cache_kwarg(model) in ("cache", "past_key_values")


def regather(cache, rows: list[int], starts: list[int], width: int) -> None:
    """Rebuild every layer of `cache` from batch rows `rows` (in that order), new row i holding the
    old row's cached columns starts[i] .. starts[i] + width (a start below 0: that many padding
    columns first, zeros, masked by the caller). Only full layers (DynamicLayer: keys and values
    [B, heads, len, dim]) can be regathered. One slice a row and one copy a tensor: a gather with
    a per-element index was 6x slower here (16 rows x 150 positions)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            parts = [t[r, :, max(s, 0):s + width] for r, s in zip(rows, starts)]
            parts = [torch.nn.functional.pad(p, (0, 0, width - p.shape[1], 0)) if p.shape[1] < width else p
                     for p in parts]
            setattr(layer, name, torch.stack(parts))


def keep_row_columns(cache, row: int, columns: torch.Tensor, width: int) -> None:
    """Row `row` of every full layer of `cache` keeps only its cached columns `columns` (in order),
    right-aligned in `width` columns with zeros on their left (masked by the caller)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            kept = t[row, :, columns.to(t.device)]
            t[row] = torch.nn.functional.pad(kept, (0, 0, width - kept.shape[1], 0))


def regatherable(cache) -> bool:
    """Every layer of `cache` a full attention layer (what `regather` can rebuild)."""
    return all(type(layer) is DynamicLayer and getattr(layer, "keys", None) is not None
               and layer.keys.dim() == 4 for layer in cache.layers)


def join_rows(caches: list, order: torch.Tensor):
    """One cache holding the rows of `caches` (full layers, [B_i, heads, len_i, dim] each), every row
    right-aligned in the longest length with zeros on its left, in `order` (indices into the rows
    of all caches in turn). The first cache object is reused and returned."""
    width = max(cache_len(c) for c in caches)
    for i, layer in enumerate(caches[0].layers):
        for name in ("keys", "values"):
            parts = [getattr(c.layers[i], name) for c in caches]
            parts = [torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0)) for t in parts]
            setattr(layer, name, torch.cat(parts)[order])
    return caches[0]


