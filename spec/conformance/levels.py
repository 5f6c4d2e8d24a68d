"""The level and sample sizes every statistical property shares (sampling laws, engine laws, served laws):
a library module without torch, so that a served-model run (test_endpoint.py) imports none."""

from __future__ import annotations

ALPHA = 1e-3        # level of each chi-square test
N = 400             # generations per scenario at budget 1 and below


def sample_size(budget: float) -> int:
    """N x budget, never below N: under N the negative controls (test_sampling_power) lose their
    power, so a small budget shrinks the hypothesis searches only."""
    return max(N, round(N * budget))
