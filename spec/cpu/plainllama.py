"""Llama decoder layers in plain tensors, for the target's fp32 CPU passes.

On a CPU whose matrix products run on spec's packed weights (spec.cpu.prepack), a SmolLM2 step spent about
8 ms of its ~28 outside them at one thread: module dispatch, kwargs plumbing, HF's RMSNorm, rotary and
attention wrappers, and for a pass of several rows `repeat_kv`'s copies of the keys and values
(docs/log/benchmarks.md, "Plain-tensor decoder layers"). `layer_forward` is the same computation as
transformers' `LlamaDecoderLayer.forward` with its SDPA attention, op for op: RMSNorm, the packed q/k/v
products, rotary (rotate-half), the cache's own update (spec.hf.cache_update), SDPA (grouped heads without
copies), o, residual, RMSNorm, SiLU-gated MLP, residual.

It is a function of plain arguments, called by spec.cpu.executor for each layer of a pass: no module's
`forward` is replaced, and no module is called. What a layer call cannot follow (hooks, training, attention
weights asked for) the executor decides once per pass, before any layer runs, by running the model's own
forward instead. `supports(model)` names why a model cannot run here (None: it can).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from spec import hf
from spec.cpu import gemv


def _classes():
    from transformers.models.llama import modeling_llama as ml
    return ml.LlamaDecoderLayer, ml.LlamaAttention, ml.LlamaMLP, ml.LlamaRMSNorm


def layers_of(model) -> list:
    """The model's decoder layers (its base model's `layers`), or [] where it has none there."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def supports(model) -> str | None:
    """Why `model` cannot run as plain tensors here (its embedding, layers, final norm and head), or None
    where it can."""
    layer_cls, attn_cls, mlp_cls, norm_cls = _classes()
    layers = layers_of(model)
    if not layers or any(type(layer) is not layer_cls for layer in layers):
        return f"{type(model).__name__}'s decoder layers are not transformers' LlamaDecoderLayer"
    cfg = hf.text_config(model)
    if len(layers) != getattr(cfg, "num_hidden_layers", len(layers)):
        return "the config runs fewer decoder layers than the model holds"
    for layer in layers:
        parts = (layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if tuple(map(type, parts)) != (attn_cls, mlp_cls, norm_cls, norm_cls):
            return "a decoder layer's attention, MLP or norms are not Llama's own classes"
        linears = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                  [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a decoder layer's projections are not plain nn.Linear"
    base = model.model
    if type(getattr(base, "embed_tokens", None)) is not torch.nn.Embedding or base.embed_tokens.max_norm is not None:
        return "its input embedding is not a plain nn.Embedding"
    if type(getattr(base, "norm", None)) is not norm_cls:
        return "its final norm is not Llama's RMSNorm"
    if type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return "its LM head is not a plain nn.Linear"
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


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward for fp32 x, in its order."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _groups(layer) -> tuple[tuple, tuple]:
    a, mlp = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj), (mlp.gate_proj, mlp.up_proj)


def grouped_linears(model) -> list[tuple]:
    """The linears a plain layer runs as one product each (they read the same x): per layer, (q, k, v)
    and (gate, up)."""
    return [g for layer in layers_of(model) for g in _groups(layer)]


def causal_mask(T: int, L: int) -> torch.Tensor:
    """The bool mask [1, 1, T, L] of T rows fed after L - T cached positions (True: may attend): row t
    sees keys up to L - T + t, as transformers builds it for one unpadded sequence."""
    return torch.ones(T, L, dtype=torch.bool).tril(L - T)[None, None]


def _sdpa(q, k, v, mask, scale: float, grouped: bool) -> torch.Tensor:
    B, T = q.shape[0], q.shape[2]
    L = k.shape[2]
    if mask is None and 1 < T < L:             # (SDPA's is_causal is top-left: rows after a cache need the mask)
        mask = causal_mask(T, L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=mask is None and T > 1,
                                          enable_gqa=grouped).transpose(1, 2).reshape(B, T, -1)


# A pass whose products are split over spec.cpu.gemv's own threads (`serial`) keeps its elementwise work on
# the calling thread: torch's add or copy of a prefill's rows splits over torch's threads and wakes their
# team, whose spinning then takes a core from the kernel's next product (SmolLM2, 700 rows, 2 threads: the
# prefill 0.89 -> 0.66 s). NumPy's add and copy are the same sums and bytes, on one thread.

def _plus(x: torch.Tensor, y: torch.Tensor, serial: bool) -> torch.Tensor:
    """x + y (the residual)."""
    if not serial or x.requires_grad or y.requires_grad:
        return x + y
    out = torch.empty_like(x)                  # (memory torch allocates: NumPy's own arrays grew a 2-thread prefill)
    np.add(x.numpy(), y.numpy(), out=out.numpy())
    return out


def copy_into(dst: torch.Tensor, src: torch.Tensor, serial: bool) -> None:
    """dst[...] = src (a pass's hidden states kept)."""
    if serial:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def layer_forward(layer, groups: dict, linears: dict, native: bool = False):
    """`layer`'s computation in plain tensors, its products through `groups` ({(q, k, v) or (gate, up): a
    spec.cpu.prepack.Group, x -> their outputs side by side}) and `linears` ({nn.Linear: its
    spec.cpu.prepack.Packed}, for o and down). Returns `forward(x, mask, cos, sin, cache, threads, serial)`:
    x [B, T, H] the layer's input; mask None (one sequence, causal: row t sees keys up to L - T + t) or the
    4-D mask to attend under; cos, sin the rotary tables [B, T, D]; cache the model's cache object (None:
    none); threads the products' (spec.cpu.prepack.Packed: 0 oneDNN, n the kernel over n threads); serial:
    the cache appended by one thread (hf.cache_update). `native`: RMSNorm, rotary, attention and the SiLU
    gate on spec.cpu.gemv's library (one call each instead of two to six torch ops), where it covers the call
    (attention: one sequence, an AVX-512F CPU), else torch's."""
    a, mlp = layer.self_attn, layer.mlp
    qkv_g, gate_up_g = (groups[g] for g in _groups(layer))
    o_p, down_p = linears[a.o_proj], linears[mlp.down_proj]
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    D, index, scale, grouped = a.head_dim, a.layer_idx, a.scaling, a.num_key_value_groups > 1
    H, KV = a.q_proj.out_features // D, a.k_proj.out_features // D
    norm, swiglu = (gemv.rms, gemv.silu_mul) if native else (rms, _silu_mul)

    def forward(x, mask, cos, sin, cache, threads: int, serial: bool = False):
        B, T = x.shape[:2]
        qkv = qkv_g(norm(x, n1.weight, n1.variance_epsilon), threads)       # [B, T, heads q | k | v x D]
        if native and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == B * T * D:
            qkv = gemv.rotary_(qkv, H + KV, cos, sin).view(B, T, H + 2 * KV, D).transpose(1, 2)
            q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
        else:
            qkv = qkv.view(B, T, H + 2 * KV, D).transpose(1, 2)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            qk = qkv[:, :H + KV]
            qk = qk * c + _rotate_half(qk) * s                             # q's heads and k's in one go
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KV:]
        if cache is not None:
            k, v = hf.cache_update(cache, k, v, index)
        o = gemv.attend(q, k, v, mask, scale, threads if serial else 1) if native else None  # [B, T, H*D] | None
        if o is None:
            o = _sdpa(q, k, v, mask, scale, grouped)
        x = _plus(x, o_p(o, threads), serial)
        h = norm(x, n2.weight, n2.variance_epsilon)
        return _plus(x, down_p(swiglu(gate_up_g(h, threads)), threads), serial)

    return forward
