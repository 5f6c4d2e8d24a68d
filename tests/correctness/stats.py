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
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from spec import hf
from spec.models import gpt_neox_config

IMPOSSIBLE = 1e-12  # a cell with exact probability at most this must never be observed


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

def reference_probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None) -> torch.Tensor:
    """Temperature, then top-k (ties with the k-th logit kept), then top-p (the smallest
    prefix of the sorted distribution whose mass reaches top_p), in float64, written
    independently of spec.sampling.probabilities."""
    z = [float(v) / temperature for v in logits.double().tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = [i for i in order if z[i] > -math.inf]
    if top_k is not None and top_k < len(z):
        kth = z[order[top_k - 1]]
        kept = [i for i in kept if z[i] >= kth]
    m = z[kept[0]]
    w = {i: math.exp(z[i] - m) for i in kept}
    total = sum(w.values())
    if top_p is not None and top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in kept:                      # kept is in descending order
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += w[i] / total
        w = {i: w[i] for i in nucleus}
        total = sum(w.values())
    out = torch.zeros(len(z), dtype=torch.float64)
    for i, v in w.items():
        out[i] = v / total
    return out


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

def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square(df)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(x, 0.0) / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: float) -> float:
    """The critical value c with P(chi-square(df) > c) = alpha."""
    lo, hi = 0.0, df + 100.0 + 50.0 * math.sqrt(df)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, df: float, lam: float) -> float:
    """P(X > x) for a noncentral chi-square(df, lam): a Poisson(lam/2) mixture of central ones."""
    mu = lam / 2
    j0 = int(mu)
    span = int(12 * math.sqrt(mu + 1) + 12)
    total = 0.0
    for j in range(max(0, j0 - span), j0 + span):
        logw = -mu + j * math.log(mu) - math.lgamma(j + 1) if mu > 0 else (0.0 if j == 0 else -math.inf)
        total += math.exp(logw) * chi2_sf(x, df + 2 * j)
    return total


def power(df: int, lam: float, alpha: float) -> float:
    """Probability that Pearson's test at level alpha rejects when the noncentrality is lam."""
    return ncx2_sf(chi2_isf(alpha, df), df, lam)


def worst_case_power(n: int, df: int, tv: float, alpha: float) -> float:
    """Power against the least detectable shift of total variation `tv` with n samples:
    sum d^2/p >= (sum |d|)^2 = 4 tv^2 (Cauchy-Schwarz), so the noncentrality is at least 4 n tv^2."""
    return power(df, 4 * n * tv * tv, alpha)


@dataclass
class Fit:
    """The outcome of one goodness-of-fit test."""
    name: str
    stat: float
    df: int
    pvalue: float
    n: int
    impossible: list = field(default_factory=list)   # (stratum, cell, count) seen with probability 0

    def rejects(self, alpha: float) -> bool:
        return bool(self.impossible) or self.pvalue < alpha

    def __str__(self) -> str:
        text = f"{self.name}: chi2={self.stat:.1f} df={self.df} p={self.pvalue:.3g} n={self.n}"
        if self.impossible:
            text += f"; outcomes of probability 0 seen (stratum, cell, count): {self.impossible[:5]}"
        return text


def goodness_of_fit(name: str, strata: dict, min_expected: float = 5.0) -> Fit:
    """Pearson's chi-square summed over strata: {key: (observed counts [C], cell probabilities [C])}.

    Within each stratum the expected counts are n_s * probabilities; cells are pooled,
    smallest expected first, until each pooled cell expects at least `min_expected`
    (the pooling depends on the probabilities only, so the test keeps its level).
    A stratum that pools into a single cell adds nothing. The total is chi-square with
    the summed degrees of freedom under the null (conditionally on the stratum sizes)."""
    stat, df, total, impossible = 0.0, 0, 0, []
    for key, (observed, probs) in strata.items():
        obs = [int(v) for v in observed]
        pr = [float(v) for v in probs]
        n = sum(obs)
        total += n
        if n == 0:
            continue
        impossible += [(key, c, o) for c, (o, p) in enumerate(zip(obs, pr)) if p <= IMPOSSIBLE and o > 0]
        cells = sorted(((n * p, o) for p, o in zip(pr, obs) if p > IMPOSSIBLE), key=lambda c: c[0])
        bins, e_acc, o_acc = [], 0.0, 0
        for e, o in cells:
            e_acc, o_acc = e_acc + e, o_acc + o
            if e_acc >= min_expected:
                bins.append([e_acc, o_acc])
                e_acc, o_acc = 0.0, 0
        if bins and e_acc > 0:
            bins[-1][0] += e_acc
            bins[-1][1] += o_acc
        if len(bins) < 2:
            continue
        stat += sum((o - e) ** 2 / e for e, o in bins)
        df += len(bins) - 1
    return Fit(name, stat, df, chi2_sf(stat, df) if df else 1.0, total, impossible)


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
