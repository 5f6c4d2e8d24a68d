"""Eq. 1 and Theorem 3.8 against measurement, with a draft whose alpha is set by construction.

SyntheticDraft proposes the target's true greedy token with probability alpha at each
position (seeded, so each run is the same) and runs its real draft's forward pass, so
its cost is real. Two checks per alpha:
  1. tokens per round: a long run (4 prompts x 200 tokens) on the cheap tiny fp64 target;
     the mean over full rounds must fall in Eq. 1's mean +- 4 standard errors
     (capped-geometric variance, number of rounds), and the alpha estimated from the
     per-round counts within 4 binomial standard errors of the alpha set. Statistics
     need rounds, not realism.
  2. speed: the CPU perf pair, greedy and speculative side by side; measured speedup
     reported next to Theorem 3.8's prediction from alpha and the c of this draft.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from perfkit import NEW_TOKENS, acceptance, assert_same_tokens, prediction, report, side_by_side
from spec import build_gpt_neox, greedy_generate, speculative_generate, theory
from spec.experiment.measure import cost_ratio
from synthetic import SyntheticDraft, tokens_per_round_interval

pytestmark = pytest.mark.perf
GAMMA = 5
LONG_TOKENS, LONG_PROMPTS = 200, 4


@pytest.fixture(scope="module")
def tiny_long():
    """Tiny fp64 target (no ties), a 1-layer draft as wide as it (every id proposable), and
    the target's greedy continuations of four prompts."""
    target = build_gpt_neox("tiny-target", seed=1, dtype=torch.float64)
    base = build_gpt_neox("tiny-draft", seed=2, vocab_size=target.config.vocab_size)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (6 + 3 * i,), generator=gen).tolist() for i in range(LONG_PROMPTS)]
    refs = {tuple(p): greedy_generate(target, p, max_new_tokens=LONG_TOKENS).tokens for p in prompts}
    return target, base, refs


@pytest.fixture(scope="module")
def synthetic_costs(cpu_pair, cpu_greedy):
    """c of the wrapped draft (its real forward plus the logit replacement) against the CPU target."""
    wrapper = SyntheticDraft(cpu_pair.draft, {}, alpha=0.5)
    return cost_ratio(cpu_pair.target, wrapper, cpu_pair.prompts[0])


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_synthetic_acceptance(benchmark, alpha, tiny_long, cpu_pair, cpu_greedy, synthetic_costs, cpu_verify):
    # 1. Tokens per round against Eq. 1 over many rounds.
    target, base, refs = tiny_long
    draft = SyntheticDraft(base, refs, alpha, seed=0)
    full_rounds, accepted, drafted = [], [], []
    for prompt, expected in refs.items():
        r = speculative_generate(target, draft, list(prompt), gamma=GAMMA, max_new_tokens=LONG_TOKENS)
        assert r.tokens == expected
        # rounds that drafted fewer (at the end of max_new_tokens) follow a different cap
        full_rounds += [t for t, g in zip(r.tokens_per_round, r.drafted_per_round) if g == GAMMA]
        accepted += r.accepted_per_round
        drafted += r.drafted_per_round
    # The estimator sees every tested draft token as a Bernoulli(alpha) trial.
    alpha_hat = theory.alpha_from_accepted(accepted, drafted)
    trials = sum(accepted) + sum(k < g for k, g in zip(accepted, drafted))
    assert abs(alpha_hat - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / trials), (alpha_hat, alpha, trials)
    measured_tpr = statistics.fmean(full_rounds)
    lo, hi = tokens_per_round_interval(alpha, GAMMA, len(full_rounds), z=4.0)
    expected_tpr = theory.expected_tokens_per_round(alpha, GAMMA)
    assert lo <= measured_tpr <= hi, (f"alpha={alpha}: {measured_tpr:.3f} tokens/round over {len(full_rounds)} rounds, "
                                      f"Eq. 1 gives {expected_tpr:.3f}, 4-sigma interval {lo:.3f}..{hi:.3f}")

    # 2. Speed on the CPU pair, same alpha, side by side with greedy (two prompts: reported, not gated).
    prompts = cpu_pair.prompts[:2]
    refs_cpu = {tuple(p): t for p, t in zip(prompts, cpu_greedy)}
    synthetic = SyntheticDraft(cpu_pair.draft, refs_cpu, alpha, seed=0)

    def spec(prompt):
        return speculative_generate(cpu_pair.target, synthetic, prompt, gamma=GAMMA, max_new_tokens=NEW_TOKENS)

    def greedy(prompt):
        return greedy_generate(cpu_pair.target, prompt, max_new_tokens=NEW_TOKENS).tokens

    run = side_by_side(benchmark, greedy, spec, prompts, rounds=1)
    results = run.candidate
    assert_same_tokens(cpu_pair.target, prompts, run.baseline, [r.tokens for r in results], "synthetic")
    acc = acceptance(results)
    pred = prediction(acc["alpha"], GAMMA, synthetic_costs, cpu_verify)
    report(benchmark, hardware="cpu", pair=cpu_pair.key, alpha_set=alpha, long_alpha=alpha_hat,
           long_rounds=len(full_rounds),
           long_tokens_per_round=measured_tpr, eq1_tokens_per_round=expected_tpr, interval=f"{lo:.3f}..{hi:.3f}",
           **{f"timed_{k}": v for k, v in acc.items()}, **pred,
           predicted_speedup_at_set_alpha=theory.expected_speedup(alpha, GAMMA, synthetic_costs.c),
           measured_speedup=run.mean_speedup, measured_over_predicted=run.mean_speedup / pred["predicted_speedup"])
