"""spec.theory pinned at hand-computed values and at its argument limits: the paper's Eq. 1,
Theorem 3.8 / 3.11 and Corollary 3.9 for small cases, optimal gamma by brute force, the
inverses at their end points, and every refusal naming its argument."""

from __future__ import annotations

import re

import pytest
import torch
from oracles import relative_tolerance

from spec import theory


# Scalar float arithmetic rounds a few ulps; a bound of 256 fp64 eps (oracles) catches any slip in a formula.
REL = relative_tolerance(torch.float64)


def test_eq1_small_cases_by_hand():
    assert theory.expected_tokens_per_round(0.5, 1) == 1.5
    assert theory.expected_tokens_per_round(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert theory.expected_tokens_per_round(0.0, 7) == 1.0
    assert theory.expected_tokens_per_round(1.0, 7) == 8.0
    assert theory.expected_tokens_per_round(0.9, 0) == 1.0


def test_theorem_3_8_small_cases_by_hand():
    # (1 - 0.5^3) / ((1 - 0.5)(2 * 0.25 + 1)) = 1.75 / 1.5
    assert theory.expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5, rel=REL)
    assert theory.expected_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2, rel=REL)
    # costed: the verify pass at 1 + slope * gamma steps: 1.75 / (0.5 + 1 + 0.1 * 2)
    assert theory.expected_speedup_costed(0.5, 2, 0.25, 0.1) == pytest.approx(1.75 / 1.7, rel=REL)
    assert theory.expected_speedup_costed(0.5, 2, 0.25) == theory.expected_speedup(0.5, 2, 0.25)


def test_theorem_3_11_small_cases_by_hand():
    # (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)) = 0.5 * (0.5 + 3) / 0.875
    assert theory.arithmetic_growth(0.5, 2, 0.25) == pytest.approx(0.5 * 3.5 / 0.875, rel=REL)
    assert theory.arithmetic_growth(1.0, 3, 0.0) == 1.0      # every drafted token kept: no waste
    assert theory.arithmetic_growth(0.0, 3, 0.5) == 5.5      # nothing kept: all gamma drafts and their verify


def test_corollary_3_9_by_hand_and_at_alpha_equal_c():
    assert theory.corollary_bound(0.8, 0.1) == pytest.approx(1.8 / 1.1, rel=REL)
    assert theory.corollary_bound(0.3, 0.3) is None          # needs alpha > c strictly
    assert theory.corollary_bound(0.2, 0.5) is None
    assert theory.corollary_bound(0.5, 0.0) == 1.5


def brute_force_optimal_gamma(alpha, c, max_gamma, slope=0.0):
    """The first gamma in 1..max_gamma with the largest costed Theorem 3.8 value, written out."""
    best_g, best = None, -1.0
    for g in range(1, max_gamma + 1):
        tokens = sum(alpha**i for i in range(g + 1))
        value = tokens / (g * c + 1 + slope * g)
        if value > best * (1 + 1e-12):
            best_g, best = g, value
    return best_g


@pytest.mark.parametrize("alpha,c,max_gamma,slope", [
    (0.8, 0.05, 64, 0.0), (0.6, 0.2, 64, 0.0), (0.95, 0.01, 64, 0.0), (0.9, 0.1, 8, 0.0),
    (0.85, 0.04, 16, 0.06), (0.7, 0.1, 16, 0.3), (0.99, 0.0, 5, 0.0), (0.5, 0.4, 10, 0.0)])
def test_optimal_gamma_equals_brute_force(alpha, c, max_gamma, slope):
    assert theory.optimal_gamma(alpha, c, max_gamma, verify_slope=slope) == \
        brute_force_optimal_gamma(alpha, c, max_gamma, slope)


def test_optimal_gamma_limits():
    assert theory.optimal_gamma(0.0, 0.5) == 1            # nothing accepted: the least drafting, never 0
    assert theory.optimal_gamma(0.99, 0.0, max_gamma=5) == 5   # free drafts: the cap itself
    assert theory.optimal_gamma(1.0, 0.0, max_gamma=1) == 1
    assert theory.optimal_gamma(1.0, 0.0) == 64               # the default cap
    # seed-like pair (alpha 0.8, c 0.47): Theorem 3.8 gives 1.224, 1.258, 1.225 for gamma 1, 2, 3 (by hand)
    assert theory.optimal_gamma(0.8, 0.47) == 2


def test_alpha_from_accepted_small_cases():
    assert theory.alpha_from_accepted([1], [2]) == 0.5            # one success, one failure
    assert theory.alpha_from_accepted([2, 2], [2, 2]) == 1.0      # censored rounds only: no failure seen
    assert theory.alpha_from_accepted([0, 0], [3, 3]) == 0.0
    assert theory.alpha_from_accepted([3, 1, 0], [3, 4, 2]) == 4 / 6


def test_alpha_from_distributions_small_case():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.5, 0.0]])
    assert theory.alpha_from_distributions(p, q) == pytest.approx((0.5 + 0.5) / 2, rel=relative_tolerance(torch.float32))


def test_implied_alpha_end_points_and_values():
    assert theory.implied_alpha(5.0, 4) == 1.0                    # the cap: exactly 1
    assert theory.implied_alpha(1.0, 4) == pytest.approx(0.0, abs=1e-11)
    assert theory.implied_alpha(1.5, 1) == pytest.approx(0.5, abs=1e-11)
    assert theory.implied_alpha(1.75, 2) == pytest.approx(0.5, abs=1e-11)   # 1 + a + a^2 = 1.75


def test_implied_c_by_hand():
    # alpha 0.5, gamma 2: 1.75 tokens a round; a speedup of 1.25 means a round costs 1.4 steps: c = 0.2
    assert theory.implied_c(1.25, 0.5, 2) == pytest.approx(0.2, rel=REL)
    assert theory.implied_c(1.75, 0.5, 2) == 0.0


@pytest.mark.parametrize("call,match", [
    (lambda: theory.expected_tokens_per_round(1.5, 2), r"alpha must be in \[0, 1\], got 1.5"),
    (lambda: theory.expected_tokens_per_round(-0.1, 2), r"alpha must be in \[0, 1\], got -0.1"),
    (lambda: theory.expected_tokens_per_round(0.5, -1), r"gamma must be an integer >= 0, got -1"),
    (lambda: theory.expected_tokens_per_round(0.5, 2.0), r"gamma must be an integer >= 0, got 2.0"),
    (lambda: theory.expected_speedup(0.5, -2, 0.1), r"gamma must be an integer >= 0, got -2"),
    (lambda: theory.expected_speedup(0.5, 2, -0.1), r"c must be >= 0, got -0.1"),
    (lambda: theory.arithmetic_growth(0.5, -1, 0.1), r"gamma must be an integer >= 0, got -1"),
    (lambda: theory.arithmetic_growth(0.5, 2, -1.0), r"c must be >= 0, got -1.0"),
    (lambda: theory.arithmetic_growth(2.0, 2, 0.1), r"alpha must be in \[0, 1\], got 2.0"),
    (lambda: theory.corollary_bound(0.5, -0.5), r"c must be >= 0, got -0.5"),
    (lambda: theory.corollary_bound(1.5, 0.5), r"alpha must be in \[0, 1\], got 1.5"),
    (lambda: theory.expected_speedup_costed(0.5, -1, 0.1), r"gamma must be an integer >= 0, got -1"),
    (lambda: theory.expected_speedup_costed(0.5, 2, -0.1), r"c must be >= 0, got -0.1"),
    (lambda: theory.expected_speedup_costed(1.1, 2, 0.1), r"alpha must be in \[0, 1\], got 1.1"),
    (lambda: theory.expected_speedup_costed(0.5, 2, 0.1, -0.01), r"verify_slope must be >= 0, got -0.01"),
    (lambda: theory.optimal_gamma(0.5, -0.1), r"c must be >= 0, got -0.1"),
    (lambda: theory.optimal_gamma(-0.5, 0.1), r"alpha must be in \[0, 1\], got -0.5"),
    (lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=0), r"max_gamma must be an integer >= 1, got 0"),
    (lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=True), r"max_gamma must be an integer >= 1, got True"),
    (lambda: theory.optimal_gamma(0.5, -0.1, max_gamma=0), r"c must be >= 0, got -0.1"),   # c is checked first
    # gamma is checked before the verify line's arguments, whichever else is wrong
    (lambda: theory.expected_speedup_costed(0.5, -1, 0.1, -0.01), r"gamma must be an integer >= 0, got -1"),
    (lambda: theory.alpha_from_accepted([1, 2], [3]), "accepted_per_round and drafted_per_round must have the same length"),
    (lambda: theory.alpha_from_accepted([4], [3]), r"accepted count 4 outside \[0, drafted=3\]"),
    (lambda: theory.alpha_from_accepted([-1], [3]), r"accepted count -1 outside \[0, drafted=3\]"),
    (lambda: theory.alpha_from_accepted([], []), "no drafted token: alpha cannot be estimated"),
    (lambda: theory.alpha_from_accepted([0, 0], [0, 0]), "no drafted token: alpha cannot be estimated"),
    (lambda: theory.alpha_from_distributions(torch.ones(3), torch.ones(1, 3)),
     r"p and q must be \[positions, vocab\] with equal positions, got \(3,\) and \(1, 3\)"),
    (lambda: theory.alpha_from_distributions(torch.ones(1, 3), torch.ones(3)),
     r"p and q must be \[positions, vocab\] with equal positions, got \(1, 3\) and \(3,\)"),
    (lambda: theory.alpha_from_distributions(torch.ones(2, 3), torch.ones(1, 3)),
     r"p and q must be \[positions, vocab\] with equal positions, got \(2, 3\) and \(1, 3\)"),
    (lambda: theory.alpha_from_distributions(torch.ones(2), torch.ones(2, 3)),   # equal first sizes, p 1-D
     r"p and q must be \[positions, vocab\] with equal positions, got \(2,\) and \(2, 3\)"),
    (lambda: theory.implied_alpha(5.5, 4), r"tokens_per_round must be in \[1, gamma\+1=5\], got 5.5"),
    (lambda: theory.implied_alpha(0.5, 4), r"tokens_per_round must be in \[1, gamma\+1=5\], got 0.5"),
    (lambda: theory.implied_c(0.0, 0.5, 2), "speedup must be > 0, got 0.0"),
    (lambda: theory.implied_c(-1.0, 0.5, 2), "speedup must be > 0, got -1.0"),
])
def test_refusals_name_the_argument(call, match):
    with pytest.raises(ValueError) as err:
        call()
    assert re.fullmatch(match, str(err.value)), str(err.value)  # the whole message, nothing around it


def test_alpha_from_distributions_in_reduced_precision():
    """bf16 / fp16 distributions are summed in fp64: the same alpha as their fp64 values."""
    p = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.875, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.5, 0.0]])
    for dtype in (torch.bfloat16, torch.float16):
        # 0.75 and 0.625, all values exact in both dtypes
        assert theory.alpha_from_distributions(p.to(dtype), q.to(dtype)) == 0.6875
