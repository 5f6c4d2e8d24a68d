"""The paper's performance model (Leviathan, Kalman & Matias 2023, section 3).

alpha: expected per-token acceptance, E[beta] with beta = sum_x min(p(x), q(x)).
gamma: draft tokens a round.  c: cost of one draft step / cost of one target step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check(alpha: float, gamma: int | None = None, c: float | None = None) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma is not None and (not isinstance(gamma, int) or gamma < 0):
        raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
    if c is not None and c < 0:
        raise ValueError(f"c must be >= 0, got {c}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Eq. 1: (1 - alpha^(gamma+1)) / (1 - alpha); gamma + 1 at alpha = 1."""
    _check(alpha, gamma)
    # Summed as 1 + alpha + ... + alpha^gamma (Horner), not as the quotient: near alpha = 1
    # the quotient cancels catastrophically (1e-8 off at 1 - 1e-12) and stops being monotone.
    total = 1.0
    for _ in range(gamma):
        total = 1.0 + alpha * total
    return total


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: expected walltime improvement over plain decoding."""
    _check(alpha, gamma, c)
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0)


def arithmetic_growth(alpha: float, gamma: int, c_hat: float) -> float:
    """Theorem 3.11: factor by which total arithmetic operations grow."""
    _check(alpha, gamma, c_hat)
    return (gamma * c_hat + gamma + 1.0) / expected_tokens_per_round(alpha, gamma)


def corollary_bound(alpha: float, c: float) -> float | None:
    """Corollary 3.9: if alpha > c some gamma gives at least (1 + alpha) / (1 + c)."""
    _check(alpha, None, c)
    return (1.0 + alpha) / (1.0 + c) if alpha > c else None


def expected_speedup_costed(alpha: float, gamma: int, c: float, verify_slope: float = 0.0,
                            verify_fixed: float = 1.0) -> float:
    """Theorem 3.8 with the verify pass priced at its cost: a (gamma+1)-token target pass
    costing verify_fixed + verify_slope * gamma one-token steps (spec.experiment.measure.verify_line
    fits both). verify_fixed = 1, verify_slope = 0 is the theorem (a pass bound by reading
    the weights, as on a GPU); a small model on one CPU core measured 1.2 to 1.6 steps for
    gamma 5 to 10, and SmolLM2-135M ~1.5 already at gamma 1 (fixed > 1)."""
    _check(alpha, gamma, c)
    if not verify_slope >= 0:
        raise ValueError(f"verify_slope must be >= 0, got {verify_slope}")
    if not verify_fixed > 0:
        raise ValueError(f"verify_fixed must be > 0, got {verify_fixed}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + verify_fixed + verify_slope * gamma)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64, verify_slope: float = 0.0,
                  verify_fixed: float = 1.0) -> int:
    """The integer gamma in [1, max_gamma] that maximises Theorem 3.8 (with a verify line, the
    costed form above: a dearer verify pass for more tokens favours a shorter gamma)."""
    _check(alpha, None, c)
    if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < 1:
        raise ValueError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
    return max(range(1, max_gamma + 1),
               key=lambda g: expected_speedup_costed(alpha, g, c, verify_slope, verify_fixed))


def alpha_from_accepted(accepted_per_round: Sequence[int], drafted_per_round: Sequence[int]) -> float:
    """Maximum-likelihood alpha from per-round accepted counts.

    A round that drafted g tokens and accepted k < g saw k successes and one
    failure; k = g is censored (g successes, no failure seen). For this capped
    geometric variable the MLE is successes / (successes + failures).
    accepted/drafted is not alpha: tokens after the first rejection are never tested."""
    if len(accepted_per_round) != len(drafted_per_round):
        raise ValueError("accepted_per_round and drafted_per_round must have the same length")
    successes = failures = 0
    for k, g in zip(accepted_per_round, drafted_per_round):
        if not 0 <= k <= g:
            raise ValueError(f"accepted count {k} outside [0, drafted={g}]")
        successes += k
        failures += k < g
    if successes + failures == 0:
        raise ValueError("no drafted token: alpha cannot be estimated")
    return successes / (successes + failures)


def alpha_from_distributions(p: torch.Tensor, q: torch.Tensor) -> float:
    """alpha = mean over positions of sum_x min(p(x), q(x)) = 1 - total variation.

    p, q: [positions, vocab] probabilities; a narrower q (draft's padded width is
    smaller) is zero beyond its width."""
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != q.shape[0]:
        raise ValueError(f"p and q must be [positions, vocab] with equal positions, got {tuple(p.shape)} and {tuple(q.shape)}")
    width = min(p.shape[1], q.shape[1])
    beta = torch.minimum(p[:, :width].double(), q[:, :width].double()).sum(-1)
    return float(beta.mean())


def implied_alpha(tokens_per_round: float, gamma: int, tol: float = 1e-12) -> float:
    """Invert Eq. 1: the alpha whose expected tokens per round is the given value."""
    if not 1.0 <= tokens_per_round <= gamma + 1:
        raise ValueError(f"tokens_per_round must be in [1, gamma+1={gamma + 1}], got {tokens_per_round}")
    if tokens_per_round == gamma + 1:  # only alpha = 1 reaches the cap
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:  # Eq. 1 is increasing in alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, gamma) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


def implied_c(speedup: float, alpha: float, gamma: int) -> float:
    """Invert Theorem 3.8: the cost ratio c that explains a measured speedup."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    return (expected_tokens_per_round(alpha, gamma) / speedup - 1.0) / gamma
