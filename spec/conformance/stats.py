"""The conformance kit's statistics: exact warped distributions, written independently of
spec.sampling, and Pearson's chi-square with pooled cells. Tails from a regularized incomplete gamma
in pure Python (no scipy, and no torch: a served-model run imports neither; only
reference_probabilities, which takes a model's logits, imports torch). tests/correctness/stats.py
re-exports these for the correctness suite."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

IMPOSSIBLE = 1e-12  # a cell with exact probability at most this must never be observed


def reference_probabilities(logits, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None, min_p: float | None = None):
    """Temperature, then top-k (ties with the k-th logit kept), then top-p (the smallest
    prefix of the sorted distribution whose mass reaches top_p), then min-p (drop what is less
    likely than min_p times the most likely token), in float64, written independently of
    spec.sampling.probabilities. `logits` a tensor; the result a float64 tensor."""
    import torch

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
    if min_p is not None:
        top = max(w.values())
        w = {i: v for i, v in w.items() if v >= min_p * top}
        total = sum(w.values())
    out = torch.zeros(len(z), dtype=torch.float64)
    for i, v in w.items():
        out[i] = v / total
    return out


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df / 2, x / 2)."""
    if df <= 0:
        return 1.0
    return gammaincc(df / 2, max(x, 0.0) / 2)


_EPS = 1e-16
_TINY = 1e-300


def gammaincc(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), for a > 0, x >= 0: the series of P(a, x) below x < a + 1 (Q = 1 - P,
    not small there), Lentz's continued fraction for Q above (relative accuracy down to the smallest doubles,
    the p-values of a rejected control's 1e-179 included)."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * _EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    b = x + 1 - a                      # modified Lentz for the continued fraction of Q
    c, d = 1 / _TINY, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < _EPS:
            break
    return math.exp(log_front) * h


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


def homogeneity(name: str, a: list, b: list, min_expected: float = 5.0):
    """Pearson's chi-square test that two samples of outcomes come from one law (a 2 x C table); cells are
    pooled, rarest first by their joint count, until each expects at least `min_expected` in each sample."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells = sorted(set(ca) | set(cb), key=lambda c: (ca[c] + cb[c], str(c)))
    bins, acc = [], [0, 0]
    for c in cells:
        acc = [acc[0] + ca[c], acc[1] + cb[c]]
        if (acc[0] + acc[1]) * min(na, nb) / (na + nb) >= min_expected:
            bins.append(acc)
            acc = [0, 0]
    if bins and acc != [0, 0]:
        bins[-1] = [bins[-1][0] + acc[0], bins[-1][1] + acc[1]]
    stat = 0.0
    for oa, ob in bins:
        total = oa + ob
        for observed, n in ((oa, na), (ob, nb)):
            expected = n * total / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = max(0, len(bins) - 1)
    return Fit(name, stat, df, chi2_sf(stat, df) if df else 1.0, na + nb)


@dataclass
class LawFit:
    """Samples (each a tuple of tokens: a cell) fitted to a law {cell: probability}: the Fit, and per cell
    the observed count and probability (`law`'s cells in its order, then the sampled cells it leaves out:
    outcomes of probability 0; where the law has a cell None, the pooled rest of a law known in part,
    every sample outside its cells counts there instead)."""
    fit: Fit
    cells: list
    observed: list[int]
    probs: list[float]
    samples: list = field(default_factory=list, repr=False)   # as drawn, in order

    def worst(self, k: int = 10) -> str:
        """A table of the k cells that deviate most: observed against expected, and z."""
        n = self.fit.n
        rows = sorted((((o - n * p) / math.sqrt(n * p) if p > 0 else (math.inf if o else 0.0), s, o, n * p)
                       for s, o, p in zip(self.cells, self.observed, self.probs)),
                      key=lambda r: (r[0], r[1] is None, r[1] or ()))     # (None: the pooled rest, last)
        worst = sorted(rows, key=lambda r: -abs(r[0]))[:k]
        table = "\n".join(f"    {str(list(s)):<14} {o:>7} {e:>10.1f} {z:>+8.2f}" for z, s, o, e in worst)
        return f"    {'tokens':<14} {'observed':>7} {'expected':>10} {'z':>8}\n{table}"


def law_fit(name: str, samples: list[tuple], law: dict, stratum: str = "all") -> LawFit:
    """Pearson's chi-square of the sampled cells against the exact law (goodness_of_fit, one stratum)."""
    pooled = None in law
    cells = list(law) + ([] if pooled else sorted(set(samples) - set(law)))
    index = {s: i for i, s in enumerate(cells)}
    observed = [0] * len(cells)
    for s in samples:
        observed[index[s] if s in index else index[None]] += 1
    probs = [law.get(s, 0.0) for s in cells]
    return LawFit(goodness_of_fit(name, {stratum: (observed, probs)}), cells, observed, probs, list(samples))
