"""The one place that knows which transformers release is installed.

Everything version-specific lives here: the cache keyword of `forward`, how a
DynamicCache is built and cropped, how HF `generate()` is asked for plain greedy
decoding and for assisted generation. Supported: transformers 5.17 (the GPU
image's) up to the newest 5.x.

  - 5.17 takes `past_key_values=`; 5.24 renamed it `cache=` and warns on the old name.
  - `DynamicCache.crop(n)`: 5.17 reads a positive n as the length to keep (deprecated),
    5.24 raises on it. A negative n (tokens to remove) means the same in both, so we
    only ever pass a negative n.
  - `generate()` (5.17 and 5.24 alike) fills every unset field of the GenerationConfig it
    is given from the model's own generation_config: the HF peers below (hf_greedy, and
    hf_generate, the one peer the CLI, the perf suite and the conformance kit call) set the
    model's aside for the call, so that eos_token_id=None means no EOS stop.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import weakref

import torch
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.cache_utils import DynamicLayer


# The keyword a model's forward takes its cache under: `cache` (5.24), `past_key_values`
# (5.17's attention models), `cache_params` (5.17's Mamba family), `state` (RWKV). A
# forward with none of these has no cache we can drive (OpenAI-GPT, XLNet's `mems`).
CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "state")


@functools.lru_cache(maxsize=None)
def forward_params(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def cache_kwarg(model) -> str | None:
    params = forward_params(type(model))
    return next((k for k in CACHE_KWARGS if k in params), None)


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


def step(model, ids: torch.Tensor, cache=None, *, position_ids: torch.Tensor | None = None, keep: int = 0,
         use_cache: bool = True, fn=None, mask_len: int | None = None, hidden: list | None = None):
    """Run `ids` (1-D) through `model` on top of `cache` (None: the model builds its own).
    Returns (logits [n or keep, vocab], the cache the model returned).

    position_ids ([1, n]) are passed where the forward takes them; None passes none (the
    model counts for itself: spec.positions says which a model needs). `keep` > 0 computes
    the LM head on the last `keep` positions only. use_cache=False is a cache-free pass
    over `ids` alone. mask_len: an all-ones attention mask over that many positions (cache
    and new), for positions that may step back (a pad token's, counted the RoBERTa way):
    given positions and no mask, transformers reads a step back as the start of another
    packed sequence and masks across it. hidden: a list that receives the last layer's hidden
    states of the same positions as the logits, [n or keep, H] (for drafters that read them)."""
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
        hidden.append(last_hidden(out)[-logits.shape[0]:][-keep:] if keep else last_hidden(out)[-logits.shape[0]:])
    return (logits[-keep:] if keep else logits), (returned_cache(out) if use_cache else None)


def last_hidden(out) -> torch.Tensor:
    """The last layer's hidden states of a forward's output, [n, H] (the decoder's, for an
    encoder-decoder model): what the LM head reads."""
    states = getattr(out, "hidden_states", None) or getattr(out, "decoder_hidden_states", None)
    if not states:
        raise ValueError(f"{type(out).__name__} carries no hidden states")
    return states[-1][0]


def authors_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] of the model's forward over `ids` (1-D) called as its authors call it:
    the ids and an all-ones attention mask, no positions, no cache. The reference spec reproduces."""
    params = forward_params(type(model))
    kwargs = {"input_ids": ids[None]}
    if "attention_mask" in params:
        kwargs["attention_mask"] = torch.ones_like(ids)[None]
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return model(**kwargs).logits[0]


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


def _greedy_config(max_new_tokens: int, eos_token_id) -> GenerationConfig:
    """Plain greedy decoding for exactly max_new_tokens, or to `eos_token_id` (None: no EOS).

    Every field left unset here would be filled by generate() from the model's own
    generation_config (5.17 and 5.24 alike: `_prepare_generation_config` updates the
    None fields from it), so this config is only half the fix: `as_only_config`
    puts it in place of the model's for the call."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                           num_beams=1)
    # generate() compares pad_token_id with single ids: the first of an EOS list stands in.
    first_eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    cfg.pad_token_id = first_eos if first_eos is not None else 0
    return cfg


@contextlib.contextmanager
def as_only_config(cfg: GenerationConfig, *models):
    """`cfg` as the generation config of each of `models` for the duration of a generate() call.

    generate() merges the model's generation_config into the config it is passed, None
    fields first: a model shipped with an EOS (every real checkpoint) would stop there
    although eos_token_id=None was asked for, and a shipped repetition_penalty or
    min_length would change the "greedy" reference. With the model's config replaced by
    `cfg` itself there is nothing left to merge in."""
    saved = [m.generation_config for m in models]
    try:
        for m in models:
            m.generation_config = copy.deepcopy(cfg)
        yield
    finally:
        for m, old in zip(models, saved):
            m.generation_config = old


@torch.inference_mode()
def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """New tokens of `model.generate(do_sample=False)`: the reference oracle.
    eos_token_id=None: exactly max_new_tokens tokens, whatever the model's own generation_config says."""
    ids = prompt.reshape(1, -1).to(model.device)
    cfg = _greedy_config(max_new_tokens, eos_token_id)
    with as_only_config(cfg, model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, ids.shape[1]:].tolist()


def assistant_for(target, draft):
    """The draft as HF assisted generation will take it.

    HF refuses a pair whose logit widths differ (pythia-12b 50688 vs pythia-410m
    50304). We widen a copy of the draft's head with zero rows: a zero logit never
    beats a trained model's top logit in practice, and HF's output is the target's
    greedy output whatever the draft proposes, so exactness does not depend on it."""
    width = logit_width(target)
    if logit_width(draft) == width:
        return draft
    if logit_width(draft) > width:
        raise ValueError(f"draft: logit width {logit_width(draft)} exceeds the target's {width}")
    wide = copy.deepcopy(draft)
    rows = vocab_rows(wide)
    # HF also feeds the draft every id the target emits, so the embedding grows too.
    wide.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        wide.get_output_embeddings().weight[rows:].zero_()
        wide.get_input_embeddings().weight[rows:].zero_()
    return wide


@contextlib.contextmanager
def _seeded_global_rng(generator, device):
    """HF generate() takes no generator and samples from torch's global RNG: seed that from
    `generator` for the call, and put the global state back afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if generator is not None:
            torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=generator)))
        yield


def _generation_config(max_new_tokens, eos, do_sample, temperature, top_k, top_p, min_p, min_new_tokens,
                       repetition_penalty, no_repeat_ngram_size, sequence_bias, bad_words_ids,
                       top_k_as_given) -> GenerationConfig:
    """Every option hf_generate takes, set explicitly (see as_only_config)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or 0, num_beams=1,
                           do_sample=do_sample,
                           eos_token_id=eos, pad_token_id=(eos[0] if isinstance(eos, list) else eos) or 0,
                           repetition_penalty=repetition_penalty or 1.0,
                           no_repeat_ngram_size=no_repeat_ngram_size or 0)
    if do_sample:
        cfg.temperature, cfg.top_p = float(temperature), 1.0 if top_p is None else top_p
        cfg.top_k = top_k if top_k_as_given else top_k or 0   # 0: no top-k (None would become 50)
        cfg.min_p = min_p
    if sequence_bias is not None:   # HF's list form [[ids], bias] (its dict form wants float biases)
        cfg.sequence_bias = [[list(ids), float(bias)] for ids, bias in dict(sequence_bias).items()]
    if bad_words_ids is not None:
        cfg.bad_words_ids = [list(ids) for ids in bad_words_ids]
    return cfg


@torch.inference_mode()
def hf_generate(target, input_ids, *, max_new_tokens, eos_token_id=None, do_sample=False, temperature=1.0,
                top_k=None, top_p=None, repetition_penalty=None, no_repeat_ngram_size=None, min_p=None,
                min_new_tokens=None, sequence_bias=None, bad_words_ids=None, generator=None,
                assistant=None, gamma=None, schedule: str = "constant", prompt_lookup_num_tokens=None,
                top_k_as_given=False, **generation_options) -> list[int]:
    """New tokens of target.generate(): the one HF peer (assisted generation, prompt lookup, plain
    decoding) for the CLI, the perf suite and the conformance kit.

    Assisted by `assistant` (gamma tokens a round, `schedule` "constant" or HF's "heuristic"; the
    confidence threshold zeroed so that every round drafts gamma) or by prompt lookup, with every
    option set explicitly and an all-ones attention mask (without one, HF masks every prompt position
    equal to pad_token_id). HF reads gamma from the assistant's own generation_config, not from
    generate()'s: target's and assistant's configs are replaced for the call and put back after it,
    whatever happens (as_only_config). input_ids: a list of ints or a 1-D or (1, n) tensor.
    generation_options: further GenerationConfig fields, set as given. top_k_as_given: pass top_k=None
    on as None, which HF fills with its default of 50 (the harness mistake; for the kit's own tests)."""
    eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    cfg = _generation_config(max_new_tokens, eos, do_sample, temperature, top_k, top_p, min_p, min_new_tokens,
                             repetition_penalty, no_repeat_ngram_size, sequence_bias, bad_words_ids, top_k_as_given)
    for key, value in generation_options.items():
        setattr(cfg, key, value)
    if prompt_lookup_num_tokens is not None:
        cfg.prompt_lookup_num_tokens = prompt_lookup_num_tokens
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(target.device)
    kwargs = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(as_only_config(cfg, target))
        if assistant is not None:
            stack.enter_context(as_only_config(GenerationConfig(
                num_assistant_tokens=gamma, num_assistant_tokens_schedule=schedule,
                assistant_confidence_threshold=0.0, eos_token_id=eos, pad_token_id=cfg.pad_token_id), assistant))
            kwargs["assistant_model"] = assistant
        stack.enter_context(_seeded_global_rng(generator, target.device))
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def hf_assisted(target, assistant, prompt: torch.Tensor, gamma: int, max_new_tokens: int,
                eos_token_id=None, schedule: str = "constant") -> list[int]:
    """New tokens of HF assisted generation with `gamma` draft tokens a round (hf_generate)."""
    return hf_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       assistant=assistant, gamma=gamma, schedule=schedule)


def hf_prompt_lookup(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                     num_tokens: int = 10, max_ngram: int = 2) -> list[int]:
    """New tokens of HF's prompt-lookup decoding (`prompt_lookup_num_tokens`): greedy,
    drafting by n-gram match in the prompt and output so far, verified by `model` (hf_generate)."""
    return hf_generate(model, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram)


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
    kwargs = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids, "use_cache": True,
              cache_kwarg(model): cache}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    return model(**kwargs).logits[:, -keep:]


def tree_step(model, ids: torch.Tensor, cache, *, position_ids: torch.Tensor, mask: torch.Tensor,
              keep: int, hidden: list | None = None) -> torch.Tensor:
    """Run `ids` (1-D) on top of `cache` (whose positions are 0 .. cached - 1) with explicit
    `position_ids` [n] and a custom attention mask [n, cached + n] (True: may attend), passed as
    HF's ready-made 4-D additive mask (0 or the dtype's minimum), which transformers 5 hands to the
    attention as it is. A custom mask bypasses the model's sliding window, so the window is put in
    here, counted in positions as a chain's pass counts it; a model with both kinds of layers
    (config.layer_types) gets one mask per kind, the mapping its forward takes. Returns the
    logits of the last `keep` positions, [keep, V]."""
    dtype = next(model.parameters()).dtype
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    mask = mask.cpu()
    masks = {"full_attention": mask}
    if isinstance(window, int) and window > 0:
        cached = mask.shape[1] - ids.numel()
        keys = torch.cat([torch.arange(cached), position_ids.cpu()])
        masks["sliding_attention"] = mask & (position_ids.cpu()[:, None] - keys[None, :] < window)

    def additive(m: torch.Tensor) -> torch.Tensor:
        return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)[None, None].to(ids.device)

    kinds = set(getattr(cfg, "layer_types", None) or ())
    if "sliding_attention" in masks and kinds:
        attention_mask = {kind: additive(masks.get(kind, mask)) for kind in kinds}
    else:
        attention_mask = additive(masks.get("sliding_attention", mask))
    params = forward_params(type(model))
    kwargs = {"input_ids": ids[None], "attention_mask": attention_mask, "position_ids": position_ids[None],
              "use_cache": True, cache_kwarg(model): cache}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep
    if hidden is not None:
        kwargs["output_hidden_states"] = True
    out = model(**kwargs)
    if hidden is not None:
        hidden.append(last_hidden(out)[-keep:])
    return out.logits[0, -keep:]


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


def hf_greedy_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_token_id=None) -> list[list[int]]:
    """Each row's new tokens from `model.generate(do_sample=False)` on a left-padded batch, cut
    after its EOS: HF's batch, the greedy peer of spec's batches."""
    cfg = _greedy_config(max_new_tokens, eos_token_id)
    with as_only_config(cfg, model):
        out = model.generate(input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             generation_config=cfg)
    rows = out[:, input_ids.shape[1]:].tolist()
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]
