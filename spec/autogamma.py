"""gamma="auto": Theorem 3.8's optimal gamma from alpha and costs measured during the run."""

from __future__ import annotations

from spec import theory
from spec.defaults import DEFAULT_GAMMA, MAX_AUTO_GAMMA

# Prior strength of a flat verify pass, in drafted-tokens squared: the fitted slope counts
# half once the drafted counts' squared deviations sum to this (e.g. 25 rounds a token off
# their mean). Without it, rounds at 5 and 4 tokens with noisy timings fitted slopes that
# sent gamma to 1 (measured on the shipped pair).
SLOPE_PRIOR = 25.0


class AutoGamma:
    """After every round, re-estimates alpha (capped-geometric MLE with a weak prior), the
    draft's time per token, and the verify pass's time as a line in the tokens drafted,
    and drafts the gamma that maximises the expected speedup.

    The line matters where a longer verify pass costs more (a small model on a CPU core:
    ~1.3 one-token steps for 6 tokens, ~1.6 for 11). Priced at its time for the current
    gamma alone, a dearer pass lowers c, which raises gamma, which makes the pass dearer
    still: the loop would climb to max_gamma. While every timed round drafted the same
    number of tokens there is no slope to fit and the pass is priced flat (Theorem 3.8's
    assumption); rounds at other gammas give the slope. The first round is left out of
    the timing: it carries the prompt's prefill in both models.

    A GammaPolicy (spec.protocols): the loop reads `gamma` before each round and reports the
    round to `observe`, timing it because `timed` is set."""
    timed = True

    def __init__(self, start: int = DEFAULT_GAMMA, max_gamma: int = MAX_AUTO_GAMMA, prior_alpha: float = 0.7,
                 prior_weight: float = 4.0):
        self.gamma, self.max_gamma = start, max_gamma
        self.successes, self.failures = prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight
        self.draft_s = self.draft_steps = 0.0
        self.passes = self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0  # verify_s against drafted
        self.rounds = 0

    def observe(self, *, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        self.successes += accepted
        self.failures += accepted < drafted
        if self.rounds == 1 or drafted == 0:
            return
        self.draft_s += draft_s
        self.draft_steps += drafted
        self.passes += 1
        self.sum_x += drafted
        self.sum_y += verify_s
        self.sum_xx += drafted * drafted
        self.sum_xy += drafted * verify_s
        alpha, c, slope = self.priced()
        self.gamma = theory.optimal_gamma(alpha, c, self.max_gamma, verify_slope=slope)

    def priced(self) -> tuple[float, float, float]:
        """What gamma is chosen from: (alpha, c, verify slope), both costs in one-token target
        steps, a step being the verify line's intercept (a pass drafting nothing), not the mean
        pass: priced against the mean pass, a dearer pass for a longer gamma would lower c."""
        step, slope = self.verify_line()
        alpha = self.successes / (self.successes + self.failures)
        return min(alpha, 0.999), (self.draft_s / self.draft_steps) / step, slope / step

    def verify_line(self) -> tuple[float, float]:
        """(time of a pass drafting nothing, added time per drafted token): least squares,
        with the slope shrunk toward 0 (the theorem's flat pass) by SLOPE_PRIOR, so that a
        few rounds at a neighbouring gamma cannot fit a steep line to timing noise."""
        n = self.passes
        mean_x, mean_y = self.sum_x / n, self.sum_y / n
        sxx = self.sum_xx - n * mean_x ** 2
        sxy = self.sum_xy - n * mean_x * mean_y
        slope = max(0.0, sxy / (max(sxx, 0.0) + SLOPE_PRIOR))
        # Noise can put the intercept near or under zero; a pass never costs less than a
        # fraction of the mean one.
        step = max(mean_y - slope * mean_x, 0.25 * mean_y)
        return step, slope
