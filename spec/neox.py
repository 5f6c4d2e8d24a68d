"""A GPT-NeoX forward pass in plain tensors, for the draft (gpt-fast's technique).

A small draft's step is mostly fixed costs paid on every one of the gamma steps
of every round: module dispatch, cache objects, mask building, output dataclasses,
and small ops on badly shaped operands. Here the draft's weights are read once and
a step is ~20 plain tensor ops on a preallocated KV buffer; rolling the cache back
is setting an integer. On the shipped 1-layer draft (CPU, one thread) a step went
from 1.1 ms through the model's forward to 0.4 ms.

Only the draft runs here. Its logits match the Hugging Face model's to float
rounding (tests/correctness/test_neox.py), and whatever it proposes, the target
decides every emitted token, so this path cannot change the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(model) -> bool:
    """True for a GPT-NeoX causal LM with GELU MLPs and standard rotary embeddings."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    return (getattr(cfg, "model_type", None) == "gpt_neox" and hasattr(model, "gpt_neox")
            and cfg.hidden_act in ("gelu", "gelu_new") and rope.get("rope_type", "default") == "default")


class NeoXDraft:
    """`model` run in plain tensors on its own KV buffer of `max_len` positions, as a Runner
    (spec.protocols): `draft(ids, keep)` feeds ids after the positions the buffer holds and
    returns the logits of the last `keep` of them (0: all); `crop(keep)` forgets every
    position from `keep` on."""

    def __init__(self, model, max_len: int):
        if not supports(model):
            raise ValueError(f"draft: plain-tensor step needs a GPT-NeoX model, got {type(model).__name__}")
        cfg, core = model.config, model.gpt_neox
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.heads
        self.parallel = cfg.use_parallel_residual
        self.gelu = "tanh" if cfg.hidden_act != "gelu" else "none"
        # MKL multiplies x @ W faster with W stored [in, out] than [out, in] (measured on this
        # project's CPU: a 6x128 @ 128x512 product 10 us vs 21; a 4608x128 head 93 us vs 117 for one row):
        # on CPU the draft keeps a transposed copy of each matrix, viewed back to [out, in].
        prep = (lambda w: w.detach().t().contiguous().t()) if self.device.type == "cpu" else (lambda w: w.detach())
        ln = lambda m: (m.normalized_shape, m.weight.detach(), m.bias.detach(), m.eps)  # noqa: E731
        lin = lambda m: (prep(m.weight), None if m.bias is None else m.bias.detach())  # noqa: E731
        self.embed = core.embed_in.weight.detach()
        self.head = prep(model.get_output_embeddings().weight)
        self.layers = [(ln(layer.input_layernorm), ln(layer.post_attention_layernorm),
                        *lin(layer.attention.query_key_value), *lin(layer.attention.dense),
                        *lin(layer.mlp.dense_h_to_4h), *lin(layer.mlp.dense_4h_to_h))
                       for layer in core.layers]
        self.final_ln = ln(core.final_layer_norm)
        # Rotary tables for every position, computed as HF does (fp32, then cast).
        rotary = core.rotary_emb
        freqs = torch.arange(max_len, device=self.device, dtype=torch.float)[:, None] * rotary.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(rotary, "attention_scaling", 1.0)
        self.cos = (emb.cos() * scale).to(self.dtype)[:, None, None, :]   # [position, 1, 1, rot]
        self.sin = (emb.sin() * scale).to(self.dtype)[:, None, None, :]
        self.rot = emb.shape[-1]
        # [layer, batch 1, head, position, head_dim]: 4-D per layer, as SDPA's fused CPU kernel wants.
        shape = (len(self.layers), 1, self.heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.max_len = max_len
        self.len = 0

    def crop(self, keep: int) -> None:
        self.len = min(self.len, keep)

    def __len__(self) -> int:
        return self.len

    def _rotate(self, x, cos, sin):
        """GPT-NeoX's rotary embedding on the first `rot` dims of the last axis (rotate-half form)."""
        r, half = self.rot, self.rot // 2
        x_rot = x[..., :r]
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * cos + rotated * sin, x[..., r:]), dim=-1)

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Logits [keep or len(ids), vocab] of the last `keep` of `ids` (1-D), fed after the cached
        positions. No autograd: the weights are detached, and the decode loop runs in inference mode."""
        T, start = ids.numel(), self.len
        end = start + T
        if end > self.max_len:
            raise ValueError(f"ids: {T} tokens after {start} cached overflow the draft's buffer of {self.max_len}")
        H, D = self.heads, self.head_dim
        cos, sin = self.cos[start:end], self.sin[start:end]
        # A single query sees every cached key; several need the causal mask, offset by `start`.
        mask = None if T == 1 else (torch.arange(end, device=self.device)[None, :]
                                    <= torch.arange(start, end, device=self.device)[:, None])
        x = F.embedding(ids, self.embed)                                      # [T, hidden]
        for i, (ln1, ln2, w_qkv, b_qkv, w_o, b_o, w_up, b_up, w_down, b_down) in enumerate(self.layers):
            qkv = F.linear(F.layer_norm(x, *ln1), w_qkv, b_qkv).view(T, H, 3, D)
            qk = self._rotate(qkv[:, :, :2], cos, sin)                        # q and k in one go
            self.k[i, 0, :, start:end] = qk[:, :, 1].transpose(0, 1)
            self.v[i, 0, :, start:end] = qkv[:, :, 2].transpose(0, 1)
            attn = F.scaled_dot_product_attention(qk[:, :, 0].transpose(0, 1)[None], self.k[i, :, :, :end],
                                                  self.v[i, :, :, :end], attn_mask=mask)
            attn = F.linear(attn[0].transpose(0, 1).reshape(T, H * D), w_o, b_o)
            mlp_in = x if self.parallel else x + attn
            mlp = F.linear(F.gelu(F.linear(F.layer_norm(mlp_in, *ln2), w_up, b_up), approximate=self.gelu),
                           w_down, b_down)
            x = x + attn + mlp if self.parallel else mlp_in + mlp
        self.len = end
        return F.linear(F.layer_norm(x[-keep:] if keep else x, *self.final_ln), self.head)
