"""gamma="auto": Theorem 3.8's optimal gamma from alpha and c measured during the run."""

from __future__ import annotations

from spec import theory


class AutoGamma:
    """Re-estimates alpha (capped-geometric MLE with a weak prior) and c (draft step
    time / target pass time) after every round, and drafts the gamma that maximises
    the expected speedup. The first round is left out of the timing: it carries
    the prompt's prefill in both models."""

    def __init__(self, start: int = 5, max_gamma: int = 16, prior_alpha: float = 0.7, prior_weight: float = 4.0):
        self.gamma, self.max_gamma = start, max_gamma
        self.successes, self.failures = prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight
        self.draft_s = self.draft_steps = self.verify_s = 0.0
        self.verify_passes = 0
        self.rounds = 0

    def observe(self, *, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        self.successes += accepted
        self.failures += accepted < drafted
        if self.rounds == 1 or drafted == 0:
            return
        self.draft_s += draft_s
        self.draft_steps += drafted
        self.verify_s += verify_s
        self.verify_passes += 1
        alpha = self.successes / (self.successes + self.failures)
        c = (self.draft_s / self.draft_steps) / (self.verify_s / self.verify_passes)
        self.gamma = theory.optimal_gamma(min(alpha, 0.999), c, self.max_gamma)
