"""Helpers for the statistical tests of speculative sampling (test_sampling.py).

- TableLM: a causal LM whose logits are a fixed table indexed by the last two
  tokens of the context. It speaks the same interface as a Hugging Face model
  (config, embeddings, forward(input_ids, cache=..., logits_to_keep=...), a
  DynamicCache), so speculative_generate runs on it unchanged, about ten times
  faster than on the smallest GPT-NeoX.
- Oracle: exact next-token distributions of a model, computed from scratch (a
  fresh cache, the full context in one pass) and processed by an independent
  implementation of temperature / top-k / top-p.
- Goodness of fit: Pearson's chi-square over one or several strata (each stratum
  a multinomial with known cell probabilities), with cells pooled to an expected
  count of at least 5, and outcomes of probability zero counted as impossible.
- Power: the noncentral chi-square tail, for the power statements in the header
  of test_sampling.py.

Chi-square tails use torch.special.gammaincc (regularised upper incomplete gamma),
so the suite needs no scipy.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from spec import hf
from spec.conformance.stats import (IMPOSSIBLE, Fit, chi2_isf, chi2_sf, goodness_of_fit,  # noqa: F401
                                    ncx2_sf, power, reference_probabilities, worst_case_power)
from spec.models import gpt_neox_config


# --- a table-lookup language model ------------------------------------------------------

class TableLM(torch.nn.Module):
    """Next-token logits = table[previous token, last token] (previous = `rows` at the
    start of the context): a second-order Markov chain with a Hugging Face interface.

    The KV cache carries the context itself (the token ids stored as keys), so the
    model is a true function of the whole cached prefix and DynamicCache.crop rolls it
    back exactly as it does a transformer's."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        start_rows, rows, width = table.shape
        if start_rows != rows + 1:
            raise ValueError(f"table must be [rows + 1, rows, width], got {tuple(table.shape)}")
        self.rows, self.width = rows, width
        self.register_buffer("table", table.reshape(-1, width).contiguous())
        self.config = gpt_neox_config(dict(hidden_size=1, num_hidden_layers=1, num_attention_heads=1,
                                           intermediate_size=1, vocab_size=width))
        self.embed = torch.nn.Embedding(rows, 1)                 # rows: the ids it can be fed
        self.head = torch.nn.Linear(1, width, bias=False)        # width: its logits' width

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, past_key_values=None, **_):
        cache = cache if cache is not None else past_key_values
        if cache is None:  # a cache-free pass: the context is just input_ids
            cache = DynamicCache()
        new = input_ids.reshape(1, 1, -1, 1)
        keys = cache.update(new, new, 0)[0]               # the whole context's ids
        n, keep = keys.shape[2], logits_to_keep or new.numel()
        tail = ([self.rows] + keys[0, 0, max(n - keep - 1, 0):, 0].tolist())[-keep - 1:]
        # tail: the token before the first kept position (or the start marker), ..., the last token
        idx = [tail[j] * self.rows + tail[j + 1] for j in range(keep)]
        return SimpleNamespace(logits=self.table[idx][None])


def random_table(rows: int, width: int, *, seed: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows + 1, rows, width, generator=gen, dtype=torch.float64)).to(dtype)


def noisy_table(table: torch.Tensor, *, noise: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (table.double() + noise * torch.randn(table.shape, generator=gen, dtype=torch.float64)).to(dtype)


# --- exact distributions -----------------------------------------------------------------

class Oracle:
    """Exact processed next-token distributions of `model` (memoised by context)."""

    def __init__(self, model, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
        self.model, self.options = model, dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self, context) -> torch.Tensor:
        key = tuple(int(t) for t in context)
        if key not in self._memo:
            logits = hf.forward(self.model, torch.tensor(key), hf.new_cache(self.model), keep=1)[-1]
            self._memo[key] = reference_probabilities(logits, **self.options)
        return self._memo[key]


def widen(q: torch.Tensor, width: int) -> torch.Tensor:
    """q over the draft's range, zero beyond it."""
    out = torch.zeros(width, dtype=torch.float64)
    out[: q.shape[-1]] = q.double()
    return out


# --- goodness of fit -------------------------------------------------------------------

def binomial_z(successes: int, n: int, p: float) -> float:
    """Standardised deviation of a binomial count from its mean n p."""
    return (successes - n * p) / math.sqrt(n * p * (1 - p))


def z_two_sided(alpha: float) -> float:
    """The z with P(|N(0, 1)| > z) = alpha."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) > alpha else (lo, mid)
    return (lo + hi) / 2
