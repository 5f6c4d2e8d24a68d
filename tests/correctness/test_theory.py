"""spec.theory against the paper's closed forms, direct summation, the seed notebook's
numbers, and properties the formulas must have for every alpha, gamma and c."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec import theory

# --- named strategies --------------------------------------------------------------------

def acceptance_rates(lo: float = 0.0, hi: float = 1.0):
    """alpha: per-token acceptance probability."""
    return st.floats(lo, hi, allow_nan=False)


def cost_ratios(lo: float = 0.0, hi: float = 2.0):
    """c: draft step time / target step time (a draft can even be slower than the target)."""
    return st.floats(lo, hi, allow_nan=False)


def draft_lengths(lo: int = 1, hi: int = 16):
    """gamma: draft tokens a round."""
    return st.integers(lo, hi)


def seeds():
    return st.integers(0, 2**32 - 1)


def distributions(width: int):
    """A probability vector of `width` entries, some of them exactly zero."""
    weights = st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1.0)), min_size=width, max_size=width)
    return weights.filter(lambda w: sum(w) > 0).map(lambda w: [x / sum(w) for x in w])


# --- helpers: the capped-geometric distribution summed term by term ---------------------

def accepted_pmf(alpha: float, gamma: int) -> list[float]:
    """P(K = k), k = 0..gamma: accepted drafts a round, a geometric count capped at gamma.
    k < gamma: k acceptances then a rejection; k = gamma: all gamma accepted."""
    return [alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma]


def tokens_by_summation(alpha: float, gamma: int) -> float:
    """E[K + 1]: every round also emits the target's own token."""
    return sum((k + 1) * p for k, p in enumerate(accepted_pmf(alpha, gamma)))


def simulate_accepted(alpha: float, gamma: int, rounds: int, seed: int) -> list[int]:
    """Per-round accepted counts when each drafted token passes independently with probability alpha."""
    passes = np.random.default_rng(seed).random((rounds, gamma)) < alpha
    return np.cumprod(passes, axis=1).sum(axis=1).tolist()


# --- the closed forms --------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [0, 1, 2, 3, 5, 7, 10, 16])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.62, 0.75, 0.8, 0.9, 0.99, 1.0])
def test_eq1_equals_the_mean_of_the_capped_geometric(alpha, gamma):
    assert sum(accepted_pmf(alpha, gamma)) == pytest.approx(1.0, abs=1e-12)
    assert theory.expected_tokens_per_round(alpha, gamma) == pytest.approx(tokens_by_summation(alpha, gamma), rel=1e-12)


def test_eq1_published_value():
    # Section 3 / Figure 2 of the paper: alpha = 0.8, gamma = 5 gives about 3.69 tokens a round.
    assert round(theory.expected_tokens_per_round(0.8, 5), 2) == 3.69


@pytest.mark.parametrize("alpha,gamma,c", [(0.8, 5, 0.05), (0.75, 7, 0.1), (0.6, 3, 0.5), (0.9, 1, 0.0)])
def test_theorem_3_8_is_tokens_per_round_over_round_cost(alpha, gamma, c):
    # A round costs gamma draft steps (c each) plus one target pass (1) and yields E[K + 1] tokens;
    # plain decoding yields 1 token per target step.
    per_round_cost = gamma * c + 1
    assert theory.expected_speedup(alpha, gamma, c) == pytest.approx(tokens_by_summation(alpha, gamma) / per_round_cost)


def test_theorem_3_8_worked_value():
    # alpha 0.8, gamma 5, c 0.05: 3.69 tokens for 1.25 target-step costs.
    assert theory.expected_speedup(0.8, 5, 0.05) == pytest.approx(3.68928 / 1.25, rel=1e-5)


@pytest.mark.parametrize("alpha,gamma,c_hat", [(0.8, 5, 0.0), (0.7, 3, 0.1), (0.0, 4, 0.2)])
def test_theorem_3_11_counts_operations_per_emitted_token(alpha, gamma, c_hat):
    # A round runs gamma + 1 target positions and gamma draft steps (c_hat each) for E[K + 1] tokens.
    ops = (gamma + 1) + gamma * c_hat
    assert theory.arithmetic_growth(alpha, gamma, c_hat) == pytest.approx(ops / tokens_by_summation(alpha, gamma))


def test_gamma_1_attains_corollary_3_9_exactly():
    # The corollary's bound is Theorem 3.8 at gamma = 1: (1 + alpha) / (1 + c).
    assert theory.expected_speedup(0.7, 1, 0.2) == pytest.approx(theory.corollary_bound(0.7, 0.2))
    assert theory.corollary_bound(0.2, 0.7) is None


@pytest.mark.parametrize("bad", [dict(alpha=-0.1, gamma=5, c=0.1), dict(alpha=1.1, gamma=5, c=0.1),
                                 dict(alpha=0.5, gamma=-1, c=0.1), dict(alpha=0.5, gamma=5, c=-0.1),
                                 dict(alpha=0.5, gamma=2.5, c=0.1)])
def test_out_of_range_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        theory.expected_speedup(**bad)


# --- the seed notebook (A100, pythia-12b fp32 + pythia-410m bf16, gamma 5) ---------------
# Per prompt: tokens per round, accept rate (accepted/drafted), greedy seconds, speculative seconds.
SEED = [(3.3, 0.47, 8.98, 9.07), (4.0, 0.61, 8.99, 7.52), (4.9, 0.80, 8.99, 6.08),
        (4.6, 0.73, 8.98, 6.57), (4.7, 0.74, 8.98, 6.46)]
SEED_GAMMA = 5


def test_seed_tokens_per_round_imply_alpha_075_to_092():
    alphas = [theory.implied_alpha(tpr, SEED_GAMMA) for tpr, *_ in SEED]
    assert [round(a, 2) for a in alphas] == [0.75, 0.83, 0.92, 0.89, 0.90]
    for (tpr, *_), a in zip(SEED, alphas):
        assert theory.expected_tokens_per_round(a, SEED_GAMMA) == pytest.approx(tpr, abs=1e-9)


def test_seed_accept_rate_is_not_alpha():
    # accepted/drafted is (tokens per round - 1) / gamma (up to EOS and the short last round),
    # well below the per-token alpha the same rounds imply.
    for tpr, accept_rate, *_ in SEED:
        assert accept_rate == pytest.approx((tpr - 1) / SEED_GAMMA, abs=0.025)
        assert theory.implied_alpha(tpr, SEED_GAMMA) - accept_rate > 0.1


def test_seed_speedups_imply_c_046_to_048_on_every_prompt():
    speedups = [g / s for _, _, g, s in SEED]
    assert [round(x, 2) for x in speedups] == [0.99, 1.20, 1.48, 1.37, 1.39]
    assert sum(speedups) / len(speedups) == pytest.approx(1.284, abs=1e-3)
    for (tpr, _, g, s) in SEED:
        c = theory.implied_c(g / s, theory.implied_alpha(tpr, SEED_GAMMA), SEED_GAMMA)
        assert 0.46 <= c <= 0.48, (tpr, c)


def test_seed_alphas_with_a_cheap_draft_predict_26x_to_39x():
    # Same alphas, c = 0.05 (a draft step 1/20 of a target step): Theorem 3.8 at gamma 5.
    # docs/FACTS.md: at gamma = 5 the values are 2.64x to 3.92x ("2.6x to 3.9x").
    predicted = [theory.expected_speedup(theory.implied_alpha(tpr, SEED_GAMMA), SEED_GAMMA, 0.05) for tpr, *_ in SEED]
    assert [round(x, 2) for x in predicted] == [2.64, 3.20, 3.92, 3.68, 3.76]
    assert all(2.3 <= x <= 4.3 for x in predicted)
    # gamma chosen by optimal_gamma does better still.
    for tpr, *_ in SEED:
        a = theory.implied_alpha(tpr, SEED_GAMMA)
        assert theory.expected_speedup(a, theory.optimal_gamma(a, 0.05), 0.05) >= theory.expected_speedup(a, 5, 0.05)


# --- properties ----------------------------------------------------------------------------

@given(gamma=draft_lengths(0, 64), c=cost_ratios())
def test_alpha_zero_leaves_only_the_cost(gamma, c):
    assert theory.expected_speedup(0.0, gamma, c) == pytest.approx(1 / (gamma * c + 1))


@given(gamma=draft_lengths(0, 64), c=cost_ratios())
def test_alpha_one_accepts_every_draft(gamma, c):
    assert theory.expected_speedup(1.0, gamma, c) == pytest.approx((gamma + 1) / (gamma * c + 1))
    # and the closed form is continuous there (no jump at the special case)
    assert theory.expected_speedup(1.0 - 1e-9, gamma, c) == pytest.approx((gamma + 1) / (gamma * c + 1), rel=1e-6)


@given(a=acceptance_rates(), b=acceptance_rates(), gamma=draft_lengths(), c=cost_ratios())
def test_speedup_increases_with_alpha(a, b, gamma, c):
    lo, hi = sorted((a, b))
    assert theory.expected_speedup(lo, gamma, c) <= theory.expected_speedup(hi, gamma, c)
    if hi - lo > 1e-6:
        assert theory.expected_speedup(lo, gamma, c) < theory.expected_speedup(hi, gamma, c)


@given(alpha=acceptance_rates(), gamma=draft_lengths(), c1=cost_ratios(), c2=cost_ratios())
def test_speedup_decreases_with_c(alpha, gamma, c1, c2):
    lo, hi = sorted((c1, c2))
    assert theory.expected_speedup(alpha, gamma, lo) >= theory.expected_speedup(alpha, gamma, hi)


@given(alpha=acceptance_rates(), c=cost_ratios(), max_gamma=draft_lengths(1, 64))
def test_optimal_gamma_is_a_true_maximum(alpha, c, max_gamma):
    best = theory.optimal_gamma(alpha, c, max_gamma)
    assert 1 <= best <= max_gamma
    top = theory.expected_speedup(alpha, best, c)
    assert all(theory.expected_speedup(alpha, g, c) <= top for g in range(1, max_gamma + 1))


def verify_slopes(hi: float = 0.5):
    """Extra cost of a verify pass per drafted token, in one-token target steps."""
    return st.floats(0.0, hi, allow_nan=False)


@given(alpha=acceptance_rates(), gamma=draft_lengths(), c=cost_ratios())
def test_costed_speedup_with_a_flat_verify_pass_is_theorem_3_8(alpha, gamma, c):
    assert theory.expected_speedup_costed(alpha, gamma, c, 0.0) == theory.expected_speedup(alpha, gamma, c)


@given(alpha=acceptance_rates(), gamma=draft_lengths(), c=cost_ratios(), slope=verify_slopes())
def test_costed_speedup_prices_the_pass_at_one_plus_slope_gamma_steps(alpha, gamma, c, slope):
    want = theory.expected_tokens_per_round(alpha, gamma) / (gamma * c + 1 + slope * gamma)
    assert math.isclose(theory.expected_speedup_costed(alpha, gamma, c, slope), want, rel_tol=1e-12)


@given(alpha=acceptance_rates(), c=cost_ratios(), slope=verify_slopes(), max_gamma=draft_lengths(1, 64))
def test_costed_optimal_gamma_is_a_true_maximum(alpha, c, slope, max_gamma):
    best = theory.optimal_gamma(alpha, c, max_gamma, verify_slope=slope)
    top = theory.expected_speedup_costed(alpha, best, c, slope)
    assert all(theory.expected_speedup_costed(alpha, g, c, slope) <= top for g in range(1, max_gamma + 1))


@given(alpha=acceptance_rates(0.0, 0.99), c=cost_ratios(), s1=verify_slopes(), s2=verify_slopes())
def test_a_dearer_verify_pass_never_lengthens_the_optimal_gamma(alpha, c, s1, s2):
    lo, hi = sorted((s1, s2))
    assert theory.optimal_gamma(alpha, c, 64, verify_slope=hi) <= theory.optimal_gamma(alpha, c, 64, verify_slope=lo)


def test_negative_verify_slope_is_rejected():
    with pytest.raises(ValueError, match="verify_slope must be >= 0"):
        theory.expected_speedup_costed(0.8, 5, 0.1, -0.1)


@given(alpha=acceptance_rates(), c=cost_ratios(0.0, 1.0))
def test_corollary_3_9_holds_at_the_optimal_gamma(alpha, c):
    bound = theory.corollary_bound(alpha, c)
    if alpha > c:
        assert bound >= 1.0
        best = theory.optimal_gamma(alpha, c)
        assert theory.expected_speedup(alpha, best, c) >= bound * (1 - 1e-12)
    else:
        assert bound is None


@given(tpr=st.floats(1.0, 6.0), gamma=st.just(5))
def test_implied_alpha_inverts_eq1(tpr, gamma):
    assert theory.expected_tokens_per_round(theory.implied_alpha(tpr, gamma), gamma) == pytest.approx(tpr, abs=1e-9)


@given(alpha=acceptance_rates(0.0, 0.999), gamma=draft_lengths(), c=cost_ratios(0.0, 1.0))
def test_implied_c_inverts_theorem_3_8(alpha, gamma, c):
    assert theory.implied_c(theory.expected_speedup(alpha, gamma, c), alpha, gamma) == pytest.approx(c, abs=1e-9)


# --- estimating alpha ------------------------------------------------------------------------

def test_alpha_from_accepted_by_hand():
    # rounds: 5 of 5 (censored: 5 passes), 2 of 5 (2 passes, 1 failure), 0 of 5 (1 failure), 3 of 3 (censored)
    assert theory.alpha_from_accepted([5, 2, 0, 3], [5, 5, 5, 3]) == pytest.approx(10 / 12)
    with pytest.raises(ValueError):
        theory.alpha_from_accepted([6], [5])
    with pytest.raises(ValueError):
        theory.alpha_from_accepted([0], [0])


@given(alpha=acceptance_rates(0.05, 0.95), seed=seeds())
def test_alpha_from_accepted_recovers_alpha_from_simulated_rounds(alpha, seed):
    gamma, rounds = 5, 2000
    accepted = simulate_accepted(alpha, gamma, rounds, seed)
    estimate = theory.alpha_from_accepted(accepted, [gamma] * rounds)
    # Every tested draft token is a Bernoulli(alpha) trial: successes + failures of them.
    trials = sum(accepted) + sum(k < gamma for k in accepted)
    assert abs(estimate - alpha) <= 5 * math.sqrt(alpha * (1 - alpha) / trials)


@given(alpha=acceptance_rates(0.3, 0.95), seed=seeds())
def test_accepted_over_drafted_underestimates_alpha(alpha, seed):
    gamma, rounds = 5, 2000
    accepted = simulate_accepted(alpha, gamma, rounds, seed)
    accept_rate = sum(accepted) / (gamma * rounds)
    # E[accepted/drafted] = (alpha + ... + alpha^gamma) / gamma, below alpha for 0 < alpha < 1.
    expected_rate = sum(alpha**k for k in range(1, gamma + 1)) / gamma
    assert abs(accept_rate - expected_rate) <= 5 * math.sqrt(0.25 / rounds)
    assert theory.alpha_from_accepted(accepted, [gamma] * rounds) - accept_rate > 0.05


def test_alpha_from_distributions_by_hand():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    # row 1: sum min = 0.5; row 2: disjoint, 0.0
    assert theory.alpha_from_distributions(p, q) == pytest.approx(0.25)
    assert theory.alpha_from_distributions(p, p) == pytest.approx(1.0)


def test_alpha_from_distributions_with_a_narrower_draft():
    # The target's extra (padding) column gets probability 0.25; the 3-wide draft has none there.
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.25, 0.25]])
    assert theory.alpha_from_distributions(p, q) == pytest.approx(0.75)
    assert theory.alpha_from_distributions(p, torch.nn.functional.pad(q, (0, 1))) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        theory.alpha_from_distributions(p, q[0])


@given(p=distributions(6), q=distributions(6))
def test_alpha_from_distributions_is_one_minus_total_variation(p, q):
    p, q = torch.tensor([p], dtype=torch.float64), torch.tensor([q], dtype=torch.float64)
    tv = 0.5 * (p - q).abs().sum()
    assert theory.alpha_from_distributions(p, q) == pytest.approx(1 - float(tv), abs=1e-12)


@given(p=distributions(6), q=distributions(4))
def test_alpha_from_distributions_narrow_q_is_zero_padded(p, q):
    p, q = torch.tensor([p], dtype=torch.float64), torch.tensor([q], dtype=torch.float64)
    padded = torch.nn.functional.pad(q, (0, 2))
    assert theory.alpha_from_distributions(p, q) == pytest.approx(1 - 0.5 * float((p - padded).abs().sum()), abs=1e-12)
