"""gamma="auto" (spec.autogamma): the controller converges on the optimum its measurements
imply, and a verify pass that grows with gamma does not drive it to max_gamma."""

from __future__ import annotations

import random

import pytest

from spec import theory
from spec.autogamma import AutoGamma

DRAFT_S = 0.4e-3   # per drafted token
STEP_S = 10e-3     # a one-token target pass


def simulate(alpha: float, verify_per_token_s: float, rounds: int = 400, seed: int = 0) -> AutoGamma:
    """Feed AutoGamma the rounds it asks for: capped-geometric acceptance at `alpha`, and a
    verify pass of STEP_S + verify_per_token_s per drafted token (noise-free costs)."""
    rng, auto = random.Random(seed), AutoGamma()
    for _ in range(rounds):
        g = auto.gamma
        k = 0
        while k < g and rng.random() < alpha:
            k += 1
        auto.observe(drafted=g, accepted=k, draft_s=g * DRAFT_S, verify_s=STEP_S + verify_per_token_s * g)
    return auto


def alpha_estimate(auto: AutoGamma) -> float:
    return min(auto.successes / (auto.successes + auto.failures), 0.999)


def test_flat_verify_pass_gives_theorem_3_8s_gamma():
    auto = simulate(0.8, 0.0)
    assert auto.verify_line() == pytest.approx((STEP_S, 0.0), abs=1e-12)
    assert auto.gamma == theory.optimal_gamma(alpha_estimate(auto), DRAFT_S / STEP_S, auto.max_gamma)


def test_growing_verify_pass_is_fitted_and_priced():
    """0.6 ms a drafted token on a 10 ms step: the CPU's ~0.06 slope. The controller must
    fit the line and settle at the costed optimum, well short of max_gamma, where pricing
    the pass flat at its current time would keep pushing gamma up."""
    auto = simulate(0.85, 0.6e-3)
    step, slope = auto.verify_line()
    # The slope is shrunk toward flat by SLOPE_PRIOR, so it comes out a little low.
    assert step == pytest.approx(STEP_S, rel=0.1) and slope == pytest.approx(0.6e-3, rel=0.25)
    alpha = alpha_estimate(auto)
    want = theory.optimal_gamma(alpha, DRAFT_S / STEP_S, auto.max_gamma, verify_slope=0.06)
    assert abs(auto.gamma - want) <= 1
    # Priced flat at its time for gamma 12, the pass would ask for a longer gamma still
    # (the climb the line prevents); the costed optimum is far below.
    flat = theory.optimal_gamma(alpha, DRAFT_S / (STEP_S + 0.6e-3 * 12), auto.max_gamma)
    assert flat > 12 and want <= 8 and auto.gamma <= 9


def test_a_few_noisy_rounds_do_not_fit_a_steep_line():
    """Two timed rounds at 5 and 4 tokens whose verify times differ by 20% of noise: no
    steep slope, and no drop of gamma. Unshrunk, least squares fits 0.2 steps a token here."""
    auto = AutoGamma()
    auto.observe(drafted=5, accepted=5, draft_s=0.0, verify_s=0.0)          # prefill round, untimed
    auto.observe(drafted=5, accepted=3, draft_s=5 * DRAFT_S, verify_s=STEP_S)
    auto.observe(drafted=4, accepted=4, draft_s=4 * DRAFT_S, verify_s=STEP_S * 0.8)
    step, slope = auto.verify_line()
    assert slope < 0.1 * (0.2 * STEP_S)   # a tenth of the unshrunk fit (0.2 steps a token)
    assert auto.gamma >= 4


def test_alpha_estimate_converges():
    auto = simulate(0.7, 0.0, rounds=2000, seed=1)
    assert alpha_estimate(auto) == pytest.approx(0.7, abs=0.03)


def test_first_round_is_not_timed():
    auto = AutoGamma()
    auto.observe(drafted=5, accepted=5, draft_s=99.0, verify_s=99.0)  # the prefill round
    assert auto.passes == 0 and auto.gamma == 5
    auto.observe(drafted=5, accepted=2, draft_s=5 * DRAFT_S, verify_s=STEP_S)
    assert auto.passes == 1 and auto.verify_line() == (STEP_S, 0.0)


def test_costs_are_priced_in_one_token_steps_not_in_the_mean_pass():
    """A scripted clock: a verify pass of exactly 10 ms + 1 ms a drafted token, a draft of 2 ms a
    token, rounds alternating 2 and 6 drafted. c is draft time over the line's intercept (0.2),
    not over the mean pass (2/14), and the slope is in steps (0.1, shrunk a little by the prior);
    the two pricings choose different gammas here, and the controller must take the first."""
    auto = AutoGamma()
    auto.observe(drafted=4, accepted=4, draft_s=9.0, verify_s=9.0)            # prefill round, untimed
    for i in range(400):
        g = 2 if i % 2 else 6
        auto.observe(drafted=g, accepted=g if g == 6 else g - 1, draft_s=2e-3 * g, verify_s=10e-3 + 1e-3 * g)
    alpha, c, slope = auto.priced()
    assert c == pytest.approx(0.2, rel=0.02) and slope == pytest.approx(0.1, rel=0.05)
    right = theory.optimal_gamma(alpha, c, auto.max_gamma, verify_slope=slope)
    mean_priced = theory.optimal_gamma(alpha, 2e-3 / 14e-3, auto.max_gamma, verify_slope=1e-3 / 14e-3)
    assert right != mean_priced and auto.gamma == right


@pytest.mark.parametrize("max_gamma", [1, 3, 7])
def test_at_full_acceptance_gamma_climbs_to_max_gamma_and_never_past_it(max_gamma):
    """Every draft accepted at a near-free draft cost: Theorem 3.8 always wants a longer gamma, and
    the controller must stop at max_gamma (the loop sizes its token buffer by it)."""
    auto = AutoGamma(start=1, max_gamma=max_gamma)
    seen = []
    for _ in range(50):
        g = auto.gamma
        seen.append(g)
        auto.observe(drafted=g, accepted=g, draft_s=1e-6 * g, verify_s=10e-3)
    assert max(seen) <= max_gamma and auto.gamma == max_gamma


def test_auto_gamma_in_the_loop_stays_within_max_gamma_on_a_self_draft():
    """End to end: a draft identical to the target (alpha 1) under gamma="auto"; no round drafts
    more than the controller's max_gamma, and the output is greedy's."""
    from spec import build_gpt_neox, greedy_generate, speculative_generate
    target = build_gpt_neox("tiny-draft", seed=3, vocab_size=64)
    out = speculative_generate(target, target, [1, 2, 3], gamma="auto", max_new_tokens=80)
    assert out.tokens == greedy_generate(target, [1, 2, 3], max_new_tokens=80).tokens
    assert out.accepted == out.drafted > 0 and max(out.drafted_per_round) <= AutoGamma().max_gamma
