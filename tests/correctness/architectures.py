"""Tiny seeded decoder-only causal LMs of every family transformers can build (issue 13).

Each model is built from its transformers config class with the common size fields
shrunk (hidden 64, 2-3 layers, vocab 256, a few heads and experts) and seeded random
weights: no checkpoint, no download, well under a second a model. One generic recipe
walks `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`; `OVERRIDES` holds what a family needs on top
(a consistent Mamba head split, a layer pattern with one layer of each kind, ...).

Shape rules that make the models useful for testing speculative decoding:
  - every model shares vocab 256 and the special ids pad 0, bos 1, eos 2, so any two
    families can be a target/draft pair (spec.validate.check_pair compares bos/eos);
  - sliding-window layers get a window of SLIDING_WINDOW (8) tokens: a prompt plus 24 new
    tokens crosses it, also in the middle of a verify pass;
  - a hybrid gets a layer of each kind it has (attention + recurrent, dense + MoE);
  - fp64 where the family runs in fp64 on CPU (one-token vs block logits then agree to
    ~1e-15, so a divergence is a bug, not a tie), else fp32 (see `Arch.dtype`).

`REGISTRY` is the curated list the test suite runs: the families issue 13 names plus
enough others to pass 60. `all_families()` yields every causal-LM model type of the
installed transformers (the sweep's input); model types a release lacks are skipped, so
this file imports under 5.17 as well as 5.24.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field

import torch

VOCAB = 256
PAD, BOS, EOS = 0, 1, 2
SLIDING_WINDOW = 8
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
LAYERS = 2

# Size fields shared by many configs, and the small value each gets (only where the
# family's config has the field). Names differ between families for the same idea.
SMALL = {
    # width
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "n_embed": HIDDEN, "emb_dim": HIDDEN,
    "embedding_dim": HIDDEN, "word_embed_proj_dim": HIDDEN, "embedding_size": HIDDEN,
    # depth
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "decoder_layers": LAYERS, "num_decoder_layers": LAYERS, "num_blocks": LAYERS,
    # heads
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "attention_heads": HEADS, "num_decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "d_head": HEAD_DIM,
    "attention_head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "attention_head_size": HEAD_DIM,
    # feed-forward
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "decoder_ffn_dim": 128, "d_inner": 128,
    "ffn_hidden_size": 128, "dff": 128, "d_ff": 128, "intermediate_size_mlp": 128, "dense_intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "expert_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 64, "shared_experts_intermediate_size": 64, "feed_forward_size": 128,
    # vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "max_target_positions": 256, "max_seq_len": 256, "context_length": 256,
    # mixture of experts: a few experts, two routed per token, one group
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "num_experts_per_token": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_num_shared_experts": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    # multi-head latent attention (DeepSeek, Kimi)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    # sparse-attention indexers
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 16,
    # state-space / linear attention
    "state_size": 8, "mamba_d_state": 8, "ssm_state_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "attention_hidden_size": HIDDEN,
    "mamba_chunk_size": 16, "chunk_size": 16,
    # sliding windows
    "attention_window_size": SLIDING_WINDOW, "sliding_window_size": SLIDING_WINDOW, "window_size": SLIDING_WINDOW,
    "local_attention": SLIDING_WINDOW,
    # multi-token prediction heads are not part of a causal LM's forward
    "num_nextn_predict_layers": 0,
    # sharper random weights and an untied head: tiny random models otherwise decode almost
    # context-free (the argmax follows the last token), which would hide a lost cache
    "initializer_range": 0.2, "init_std": 0.2, "tie_word_embeddings": False,
    "vocab_size_per_layer_input": VOCAB,
}

# Per-layer lists that must match the depth: resampled to one entry of each kind.
LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types", "attention_layers",
               "attn_layers", "indexer_types", "no_rope_layers", "layer_rope_theta",
               "num_attention_heads_per_layer")


@dataclass
class Arch:
    """One registry entry: how to build a tiny model of a family, and what spec should do with it."""
    name: str                                   # transformers model_type
    kind: str                                   # cache kind: full, sliding, moe, recurrent, hybrid, nocache, ...
    overrides: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64          # fp32 where the family does not run in fp64 on CPU (see why)
    why_fp32: str = ""
    expect: str = "exact"                       # "exact" or "refused": what spec should do (from the sweep)
    refusal: str = ""                           # words the refusal message must contain

    def build(self, seed: int = 0, dtype: torch.dtype | None = None):
        return build(self.name, seed=seed, dtype=dtype or self.dtype, overrides=self.overrides)


# What a family needs on top of the generic recipe (field meanings in its config class).
# Hybrids: one layer of each kind; Mamba heads split so that heads * head_dim = expand * hidden.
OVERRIDES = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, expand=2),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             mamba_n_heads=8, mamba_d_head=16),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128),
    # Zamba ties one shared attention block across its hybrid layers: it needs two of them.
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, n_mamba_heads=2,
                  layers_block_type=None,
                  attention_head_dim=2 * HIDDEN // HEADS, attention_hidden_size=2 * HIDDEN),
    "zamba2": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, n_mamba_heads=8,
                   hybrid_layer_ids=[1, 3], attention_head_dim=2 * HIDDEN // HEADS, attention_hidden_size=2 * HIDDEN),
    "kimi_linear": dict(num_key_value_heads=HEADS),
    # local attention, chunk 16: longer than the probe's 12 tokens, so only the positions check past
    # the chunk (spec.positions.cross_length) sees its padding path (LSH layers: test_reformer_lengths.py)
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[16, 16],
                     axial_pos_embds_dim=[32, 32], local_attn_chunk_length=16, max_position_embeddings=256),
    # Qwen2/Qwen3 have sliding layers only when asked: layers from max_window_layers on slide.
    "qwen2": dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1, layer_types=None),
    "qwen3": dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1, layer_types=None),
    "phi3": dict(sliding_window=SLIDING_WINDOW),
    "mixtral": dict(sliding_window=SLIDING_WINDOW),
    "starcoder2": dict(sliding_window=SLIDING_WINDOW),
    "phimoe": dict(sliding_window=SLIDING_WINDOW),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=1),
    "recurrent_gemma": dict(num_hidden_layers=3, lru_width=HIDDEN, block_types=["recurrent", "attention"]),
    "xlstm": dict(qk_dim_factor=1.0, v_dim_factor=1.0),
}


def _kinds_cycle(values: list, n: int) -> list:
    kinds = list(dict.fromkeys(map(_hashable, values)))
    return [values[[_hashable(v) for v in values].index(kinds[i % len(kinds)])] for i in range(n)]


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _small_kwargs(cls, default: dict, depth: int = 0) -> dict:
    """Constructor kwargs that shrink a config of class `cls` whose defaults are `default`."""
    kw = {k: v for k, v in SMALL.items() if k in default}
    for key, value in {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS,
                       "decoder_start_token_id": BOS}.items():
        if key in default:
            kw[key] = value
    if default.get("sliding_window") is not None:
        kw["sliding_window"] = SLIDING_WINDOW
    if "qk_rope_head_dim" in default:      # multi-head latent attention: rotary runs on the rope part
        kw["head_dim"] = SMALL["qk_rope_head_dim"]
    if "kv_lora_rank" in default and "num_key_value_heads" in default:  # keys come per query head
        kw["num_key_value_heads"] = HEADS
    if default.get("rotary_dim"):
        kw["rotary_dim"] = 8
    if "is_decoder" in default:            # BERT-likes are causal LMs only as decoders
        kw["is_decoder"] = True
    if default.get("per_layer_config"):    # per-layer overrides keyed by the default depth's indices
        kw["per_layer_config"] = None
    if "use_mamba_kernels" in default:     # the CUDA kernels are not on this machine: the torch path
        kw["use_mamba_kernels"] = False
    layers = LAYERS
    for key in LAYER_LISTS:
        if isinstance(default.get(key), list) and default[key]:
            layers = max(layers, min(len(dict.fromkeys(map(_hashable, default[key]))), 4))
    for key in LAYER_LISTS:
        if isinstance(default.get(key), list) and default[key]:
            kw[key] = _kinds_cycle(default[key], layers)
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_blocks"):
        if key in kw:
            kw[key] = layers
    # Nested configs (multimodal wrappers, DBRX's attn/ffn parts): shrink them the same way.
    for key, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        sub_default = default.get(key)
        if depth > 2 or not isinstance(sub_default, dict):
            continue
        if getattr(sub_cls, "model_type", "") in ("", None) or sub_cls.__name__ == "AutoConfig":
            from transformers import CONFIG_MAPPING
            sub_type = sub_default.get("model_type", "")
            if sub_type not in CONFIG_MAPPING:  # (the lazy mapping has no working .get in 5.17)
                continue
            sub_cls = CONFIG_MAPPING[sub_type]
        sub_kw = _small_kwargs(sub_cls, sub_default, depth + 1)
        kw[key] = {**sub_default, **sub_kw}
    return kw


def small_config(model_type: str, overrides: dict | None = None):
    """The family's config with size fields shrunk, special ids unified and `overrides` applied."""
    from transformers import CONFIG_MAPPING
    # The causal-LM class's own config where it differs from the family's (MusicGen: the
    # decoder's config, not the composite text+audio one)
    cls = getattr(model_class(model_type), "config_class", None) or CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls().to_dict()
        kw = _small_kwargs(cls, default)
        kw.update(overrides or {})
        return cls(**kw)


def model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, overrides: dict | None = None):
    """A tiny `model_type` causal LM with seeded weights, in eval mode, in `dtype`."""
    config = small_config(model_type, overrides)
    # Eager kernels: the same arithmetic on every machine, and fp64 works (grouped_mm is fp32/bf16 only).
    config._attn_implementation = "eager"
    try:
        config._experts_implementation = "eager"
    except (AttributeError, ValueError, TypeError):  # 5.17 may lack the switch
        pass
    cls = model_class(model_type)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    if callable(getattr(model, "set_default_language", None)):  # X-MOD: one adapter per language
        model.set_default_language(config.languages[0])
    return model.to(dtype).eval()


def all_families() -> list[str]:
    """Every causal-LM model type of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "state", "mems", "past_buckets_states")


def cache_kind(model) -> str:
    """What kind of incremental state the model keeps, read from the model (not its name):
    'full', 'sliding' (some layers slide), 'recurrent' (only linear-attention/SSM layers),
    'hybrid' (attention + recurrent layers), '+moe' appended for mixture-of-experts;
    'no-cache' when forward takes no cache argument, 'custom:<kwarg>' for a non-Cache kwarg."""
    import inspect

    from transformers import DynamicCache
    params = inspect.signature(type(model).forward).parameters
    kwargs = [k for k in CACHE_KWARGS if k in params]
    if not kwargs:
        return "no-cache"
    if kwargs[0] not in ("cache", "past_key_values"):
        return f"custom:{kwargs[0]}"
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - configs DynamicCache cannot read
        layers = []
    names = {type(layer).__name__ for layer in layers}
    linear = any("LinearAttention" in n for n in names)
    attention = any(n in ("DynamicLayer", "DynamicSlidingWindowLayer") or "AndFull" in n or "AndSliding" in n
                    for n in names)
    sliding = any(getattr(layer, "is_sliding", False) for layer in layers)
    if linear:
        kind = "hybrid" if attention else "recurrent"
    elif getattr(model, "_is_stateful", False):
        kind = "stateful"
    else:
        kind = "sliding" if sliding else "full"
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = max((getattr(cfg, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                       "moe_num_experts"))
    return kind + ("+moe" if isinstance(experts, int) and experts > 1 else "")


# --- the registry the suite runs ------------------------------------------------------------
# expect: what spec must do with the family, from the sweep's evidence (tests/sweep_architectures.py)
#   "exact"            the model's cached forward is exact (block passes included): spec must equal
#                      the cache-free reference, greedy and speculative
#   "refused"          the model has no usable incremental path (no cache argument, or one that is
#                      not a causal KV cache): spec must refuse it up front with a clear error
#   "exact_or_refused" the model's cache is exact for one-token steps but its multi-token pass on a
#                      non-empty state is not (Mamba-style mixers that rescan from zero), or its state
#                      is not a Cache (RWKV's `state`, xLSTMCache, RecurrentGemma's module buffers):
#                      spec may decode it exactly (snapshot + one-token re-feed) or refuse it, never
#                      run it wrong
FULL, SLIDING, MOE, MLA, RECURRENT, HYBRID, CUSTOM, NOCACHE = (
    "full", "sliding", "moe", "mla", "recurrent", "hybrid", "custom-state", "no-cache")

_FAMILIES = [
    # name, cache kind, expect
    ("gpt2", FULL, "exact"), ("gptj", FULL, "exact"), ("llama", FULL, "exact"), ("gpt_neox", FULL, "exact"),
    ("gpt_neo", SLIDING, "exact"), ("gpt_bigcode", FULL, "exact"), ("codegen", FULL, "exact"),
    ("ctrl", FULL, "exact"), ("biogpt", FULL, "exact"), ("xglm", FULL, "exact"), ("opt", FULL, "exact"),
    ("bloom", FULL, "exact"), ("mpt", FULL, "exact"), ("falcon", FULL, "exact"), ("phi", FULL, "exact"),
    ("gemma", FULL, "exact"), ("olmo", FULL, "exact"), ("olmo2", FULL, "exact"), ("glm", FULL, "exact"),
    ("glm4", FULL, "exact"), ("cohere", FULL, "exact"), ("stablelm", FULL, "exact"),
    ("persimmon", FULL, "exact"), ("granite", FULL, "exact"), ("helium", FULL, "exact"),
    ("nemotron", FULL, "exact"), ("smollm3", FULL, "exact"), ("seed_oss", FULL, "exact"),
    ("diffllama", FULL, "exact"), ("bitnet", FULL, "exact"), ("ernie4_5", FULL, "exact"),
    ("apertus", FULL, "exact"), ("arcee", FULL, "exact"), ("trocr", FULL, "exact"),
    ("deepseek_v2", MLA, "exact"), ("deepseek_v3", MLA, "exact"),
    # sliding windows (window 8 < prompt + generation)
    ("mistral", SLIDING, "exact"), ("ministral", SLIDING, "exact"), ("qwen2", SLIDING, "exact"),
    ("qwen3", SLIDING, "exact"), ("gemma2", SLIDING, "exact"), ("gemma3_text", SLIDING, "exact"),
    ("phi3", SLIDING, "exact"), ("starcoder2", SLIDING, "exact"), ("cohere2", SLIDING, "exact"),
    ("olmo3", SLIDING, "exact"), ("exaone4", SLIDING, "exact"), ("vaultgemma", SLIDING, "exact"),
    ("granite_swa", SLIDING, "exact"),
    # mixtures of experts (some also sliding)
    ("mixtral", MOE, "exact"), ("phimoe", MOE, "exact"), ("gpt_oss", MOE, "exact"),
    ("qwen2_moe", MOE, "exact"), ("qwen3_moe", MOE, "exact"), ("olmoe", MOE, "exact"),
    ("granitemoe", MOE, "exact"), ("jetmoe", MOE, "exact"), ("ernie4_5_moe", MOE, "exact"), ("dots1", MOE, "exact"),
    # recurrent, linear attention, hybrids
    ("mamba2", RECURRENT, "exact"), ("bamba", HYBRID, "exact"), ("granitemoehybrid", HYBRID, "exact"),
    ("falcon_h1", HYBRID, "exact"), ("qwen3_next", HYBRID, "exact"), ("kimi_linear", HYBRID, "exact"),
    ("lfm2", HYBRID, "exact"), ("nemotron_h", HYBRID, "exact"), ("zamba2", HYBRID, "exact"),
    ("mamba", RECURRENT, "exact_or_refused"), ("falcon_mamba", RECURRENT, "exact_or_refused"),
    ("jamba", HYBRID, "exact_or_refused"), ("zamba", HYBRID, "exact_or_refused"),
    ("recurrent_gemma", CUSTOM, "exact_or_refused"), ("rwkv", CUSTOM, "exact_or_refused"),
    ("xlstm", CUSTOM, "exact_or_refused"),
    # no usable cache
    # openai-gpt: exact only by recomputing the whole sequence each pass; reformer: its LSH/chunked
    # attention cache (`past_buckets_states`) is not a Cache; xlnet: the forward is not causal
    ("openai-gpt", NOCACHE, "exact"), ("reformer", NOCACHE, "exact_or_refused"), ("xlnet", NOCACHE, "refused"),
    # BERT-likes as decoders that count positions from padding_idx + 1 and skip pad tokens
    # (spec.positions: "counted"); 0-based positions shift every position embedding
    ("roberta", FULL, "exact"), ("roberta-prelayernorm", FULL, "exact"), ("xlm-roberta", FULL, "exact"),
    ("xlm-roberta-xl", FULL, "exact"), ("xmod", FULL, "exact"), ("camembert", FULL, "exact"),
    ("data2vec-text", FULL, "exact"),
    # one LM head per audio codebook: not one stream of tokens
    ("musicgen", FULL, "refused"), ("musicgen_melody", FULL, "refused"),
]

# Where a family does not run in fp64 on CPU, the reason (it is then built in fp32).
FP32_ONLY: dict[str, str] = {
    "xglm": "its fp64 attention overflows when the input holds the pad id (modeling_xglm fills float64's "
            "minimum into a float32 mask)",
}

# Families left out of the registry, and why (the sweep still runs every family it can build).
EXCLUDED: dict[str, str] = {
    "dbrx": "its nested attn_config/ffn_config (model_type '') are not shrunk by the generic recipe, and "
            "DbrxAttentionConfig lacks rope_theta when rebuilt from a dict",
}

# One family per cache kind: the default (fast) run. The rest run under `-m thorough`.
FAST = ("gpt2", "bloom", "deepseek_v3", "trocr", "mistral", "gemma2", "qwen3", "gpt_oss", "mixtral", "mamba2",
        "falcon_h1", "qwen3_next", "mamba", "rwkv", "recurrent_gemma", "openai-gpt", "xlnet", "roberta", "musicgen")

# (family, check) pairs that fail on the code this registry was written against (branch `arch`,
# base 0504d76): marked xfail(strict=True), so each must still fail there. Empty it as fixes land.
# Measured with `pytest -m "thorough or not thorough" tests/correctness/test_architectures.py` on 0504d76.
KNOWN_FAILING_ON_BASE: set[tuple[str, str]] = set()  # emptied once spec.runner landed (issue 13)


# The runner path (spec/runner.py) each family must take; kv-cache unless listed. The path is the
# design: recurrent states snapshot, Mamba-style mixers whose multi-token pass drops the state step
# one token at a time, cache-less or one-token-inexact forwards recompute. A rollback broken for one
# kind makes the probe fall through to another path, so this pin is what catches it.
EXPECTED_PATH: dict[str, str] = {
    'mamba2': 'state-snapshot',
    'bamba': 'state-snapshot',
    'granitemoehybrid': 'state-snapshot',
    'falcon_h1': 'state-snapshot',
    'qwen3_next': 'state-snapshot',
    'kimi_linear': 'state-snapshot',
    'nemotron_h': 'state-snapshot',   # recompute under transformers 5.24: its kv-cache replay failed there too
    'zamba2': 'recompute',
    'mamba': 'state-stepwise',
    'falcon_mamba': 'state-stepwise',
    'jamba': 'state-stepwise',
    'zamba': 'state-stepwise',
    'recurrent_gemma': 'recompute',
    'rwkv': 'state-snapshot',
    'xlstm': 'state-snapshot',
    'openai-gpt': 'recompute',
    'reformer': 'recompute',
    'xlnet': 'refused',
    'musicgen': 'refused',
    'musicgen_melody': 'refused',
}

# How each family counts positions (spec/positions.py); "explicit" (0-based) unless listed.
# Found by the probe from the model's behaviour; pinned here so that a change to how positions
# are chosen or passed fails a test, not only the exactness checks of the families it breaks.
EXPECTED_POSITIONS: dict[str, str] = {
    **{name: "counted" for name in ("roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl", "xmod",
                                    "camembert", "data2vec-text")},
    # forwards that take no position_ids (ALiBi, recurrent states), or whose positions break
    # when given (Reformer pads to its chunk length), count for themselves
    **{name: "own" for name in ("bloom", "mpt", "trocr", "mamba2", "mamba", "falcon_mamba", "rwkv", "xlstm",
                                "reformer")},
}


def _registry() -> list[Arch]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = []
    for name, kind, expect in _FAMILIES:
        if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or name in EXCLUDED:
            continue  # an older transformers without this family
        dtype = torch.float32 if name in FP32_ONLY else torch.float64
        out.append(Arch(name, kind, OVERRIDES.get(name, {}), dtype, FP32_ONLY.get(name, ""), expect))
    return out


REGISTRY: list[Arch] = _registry()
BY_NAME: dict[str, Arch] = {a.name: a for a in REGISTRY}


@functools.lru_cache(maxsize=None)
def cached_model(name: str, seed: int = 0):
    """The registry's model of `name` (built once a process: the tests share it). Built outside
    inference mode whatever test asks first: parameters made inside it are inference tensors, which
    a later test that calls the model with autograd on cannot use (the order of tests must not matter)."""
    with torch.inference_mode(False):
        return BY_NAME[name].build(seed)


@functools.lru_cache(maxsize=None)
def draft_model(target: str, family: str | None = None, seed: int = 1):
    """A draft for `target`: family None -> the target with seeded weight noise (agrees partly);
    else a model of `family` (same or DIFFERENT from the target's), which shares the vocabulary
    size and the pad/bos/eos ids, as every registry model does."""
    with torch.inference_mode(False):           # (as cached_model)
        if family is None:
            from spec.models import perturbed_copy
            return perturbed_copy(cached_model(target), noise=0.2, seed=seed)
        arch = BY_NAME.get(family) or Arch(family, "?", OVERRIDES.get(family, {}))
        return arch.build(seed)


def with_biases(model, seed: int = 0, scale: float = 0.2):
    """`model` with every 1-D parameter (biases, norm weights) moved by seeded noise of `scale`, so that a
    wrong position table or a dropped bias cannot hide behind zero biases and unit norms."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype))
    return model
