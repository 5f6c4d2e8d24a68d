"""Llama decoder layers in plain tensors, for the target's fp32 CPU passes (issue 43).

On a CPU whose matrix products run on spec's packed linears (spec.cpu.prepack), a SmolLM2 step spent about
8 ms of its ~28 outside them at one thread: module dispatch, kwargs plumbing, HF's RMSNorm, rotary and
attention wrappers, and for a pass of several rows `repeat_kv`'s copies of the keys and values
(docs/BENCHMARKS.md, "Plain-tensor decoder layers"). `layer_forward` is the same computation as
transformers' `LlamaDecoderLayer.forward` with its SDPA attention, op for op: RMSNorm, the packed q/k/v
products, rotary (rotate-half), the cache's own `update`, SDPA under the mask the model built (grouped
heads without copies), o, residual, RMSNorm, SiLU-gated MLP, residual. The model keeps its own embedding,
cache object, mask, rotary tables, final norm and head; only each layer's body changes.

`supports(model)` names why a model cannot run here (None: it can). spec.cpu.prepack swaps these forwards in
beside the packed linears where `prepack.layers_used` says so: the model supported, not switched off
(SPEC_PLAIN_LAYERS=0), and its logits within the probe's tolerance of the model's own (spec.probe
'plain layers', once per model); spec.runner's probe then replays cached passes through them. A call
with anything this code does not do (hooks on the layer's parts, output_attentions, training, an
argument it does not know) runs the layer's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec import hf
from spec.cpu import gemv

# Layer arguments this code reads, or knows to change nothing here (the model passes them to every layer).
KNOWN = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


def _classes():
    from transformers.models.llama import modeling_llama as ml
    return ml.LlamaDecoderLayer, ml.LlamaAttention, ml.LlamaMLP, ml.LlamaRMSNorm


def layers_of(model) -> list:
    """The model's decoder layers (its base model's `layers`), or [] where it has none there."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def supports(model) -> str | None:
    """Why `model`'s layers cannot run as plain tensors here, or None where they can."""
    layer_cls, attn_cls, mlp_cls, norm_cls = _classes()
    cfg = hf.text_config(model)
    layers = layers_of(model)
    if not layers or any(type(layer) is not layer_cls for layer in layers):
        return f"{type(model).__name__}'s decoder layers are not transformers' LlamaDecoderLayer"
    for layer in layers:
        parts = (layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if tuple(map(type, parts)) != (attn_cls, mlp_cls, norm_cls, norm_cls):
            return "a decoder layer's attention, MLP or norms are not Llama's own classes"
        linears = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                  [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a decoder layer's projections are not plain nn.Linear"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r}: this code runs SiLU"
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return f"attention {getattr(cfg, '_attn_implementation', None)!r}: this code runs the SDPA path"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 splits the products"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up side by side in the last axis (as gemv.silu_mul)."""
    inner = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inner]) * gate_up[..., inner:]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward for fp32 x, in its order."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _groups(layer) -> tuple[tuple, tuple]:
    a, mlp = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj), (mlp.gate_proj, mlp.up_proj)


def grouped_linears(model) -> list[tuple]:
    """The linears a plain layer runs as one product each (they read the same x): per layer, (q, k, v)
    and (gate, up)."""
    return [g for layer in layers_of(model) for g in _groups(layer)]


def layer_forward(layer, groups: dict, linears: dict, native: bool = False):
    """`layer`'s forward in plain tensors, its products through `groups` ({(q, k, v) or (gate, up): a
    function x -> their outputs side by side}, spec.cpu.prepack.Group) and `linears` ({nn.Linear: its
    forward}, for o and down): a function with the layer forward's arguments, to be set as the layer's
    `forward` while a pass runs. `native`: RMSNorm, rotary, attention and the SiLU gate on spec.cpu.gemv's
    library (one call each instead of two to six torch ops; see spec_rms, spec_rotary, spec_attend and
    spec_silu_mul), where it covers the call (attention: one sequence, an AVX-512F CPU), else torch's."""
    a, mlp = layer.self_attn, layer.mlp
    qkv_g, gate_up_g = (groups[g] for g in _groups(layer))
    o_p, down_p = linears[a.o_proj], linears[mlp.down_proj]
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    parts = (a, mlp, n1, n2, a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    own = type(layer).forward.__get__(layer)
    D, index, scale, grouped = a.head_dim, a.layer_idx, a.scaling, a.num_key_value_groups > 1
    H, KV = a.q_proj.out_features // D, a.k_proj.out_features // D
    norm, swiglu = (gemv.rms, gemv.silu_mul) if native else (_rms, _silu_mul)

    def forward(hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        cache = hf.layer_cache(kwargs)
        if (layer.training or position_embeddings is None or hidden_states.dtype != torch.float32
                or any(k not in KNOWN and k not in hf.LAYER_CACHE_KWARGS and v is not None
                       for k, v in kwargs.items())
                or kwargs.get("output_attentions") or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks
                or any(p._forward_hooks or p._forward_pre_hooks for p in parts)):
            return own(hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs)
        x = hidden_states
        B, T = x.shape[:2]
        cos, sin = position_embeddings
        qkv = qkv_g(norm(x, n1.weight, n1.variance_epsilon))                # [B, T, heads q | k | v x D]
        if native and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == B * T * D:
            qkv = gemv.rotary_(qkv, H + KV, cos, sin).view(B, T, H + 2 * KV, D).transpose(1, 2)
            q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
        else:
            qkv = qkv.view(B, T, H + 2 * KV, D).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            qk = qkv[:, :H + KV]
            qk = qk * cos + _rotate_half(qk) * sin                         # q's heads and k's in one go
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KV:]
        if cache is not None:
            k, v = hf.cache_update(cache, k, v, index)
        causal = T > 1 and attention_mask is None
        if causal and k.shape[2] > T:          # (as transformers' SDPA path: an empty static cache's prefill)
            k, v = k[:, :, :T], v[:, :, :T]
        o = gemv.attend(q, k, v, attention_mask, scale) if native else None       # [B, T, H * D], or None
        if o is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale, is_causal=causal,
                                               enable_gqa=grouped).transpose(1, 2).reshape(B, T, -1)
        x = x + o_p(o)
        h = norm(x, n2.weight, n2.variance_epsilon)
        return x + down_p(swiglu(gate_up_g(h)))

    return forward


def forwards(model, groups: dict, linears: dict, native: bool | None = None) -> dict:
    """{decoder layer: its plain forward} for a model `supports` accepts (see `layer_forward`; `native`
    None: where spec.cpu.gemv's library is there)."""
    if native is None:
        native = gemv.library() is not None
    return {layer: layer_forward(layer, groups, linears, native) for layer in layers_of(model)}
