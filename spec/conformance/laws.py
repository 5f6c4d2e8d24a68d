"""The sampling laws' shared pieces: the scenarios, sample sizes and level, the check of a decoder's
joint law against the exact one (`check_law`), and Algorithm 1 on exact laws with deliberate bugs
(`law_sampler`, the negative controls). The properties that use them are test_sampling_law,
test_one_sided, test_trees, test_engine and test_endpoint; a library module, so that no property module
imports another.
"""

from __future__ import annotations

import pytest
import torch

from spec.conformance.kit import (SMALL_PROMPT, ExactLaw, joint_fit, run, small_pair, small_pair_bf16,
                                  small_pair_gap)
from spec.conformance.levels import ALPHA, N, sample_size  # noqa: F401 (the laws' names for them)

GAMMA, JOINT = 2, 3

BIAS = dict(sequence_bias={(2,): 1.5, (1, 3): -2.0}, bad_words_ids=[[3, 3]])
COMBINED = dict(temperature=0.8, top_k=3, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                sequence_bias={(2,): 1.0, (1, 3): -1.5})
SCENARIOS = {   # T != 1 in the first: a q taken at another temperature than the one sampled shows only there
    "T=0.6": dict(temperature=0.6),
    "T=1.3,top_k=3,top_p=0.9": dict(temperature=1.3, top_k=3, top_p=0.9),
    "repetition_penalty=1.5,no_repeat_ngram_size=3": dict(repetition_penalty=1.5, no_repeat_ngram_size=3),
    "repetition_penalty=3": dict(repetition_penalty=3.0),
    "T=1.3,min_p=0.3": dict(temperature=1.3, min_p=0.3),
    "sequence_bias,bad_words_ids": BIAS,
    "combined": COMBINED,
    "bf16 draft,fp32 target,T=0.6": dict(temperature=0.6),
    "draft support misses target mass": {},
}
BF16 = "bf16 draft,fp32 target,T=0.6"
GAP = "draft support misses target mass"     # kit.small_pair_gap: q = 0 where p has 65% of its mass
# Below budget 1 (the default run checks every built-in adapter at 0.25) three scenarios stand for all:
# every option at once, the mixed-precision pair and the draft whose support misses target mass
# (classes no option reaches). A sample size is never cut below N, so the cheaper run has fewer scenarios.
SMALL_BUDGET_SCENARIOS = ("combined", BF16, GAP)
DRAFT_SCENARIOS = (BF16, GAP)     # what they test is the draft model's: model-free drafters run them at budget >= 1


def pair_for(scenario):
    return small_pair_bf16() if scenario == BF16 else small_pair_gap() if scenario == GAP else small_pair()


def check_law(prop, impl, budget, scenario, target, draft, options, record_property, n=None):
    """Fail property `prop` unless the decoder's first JOINT tokens after SMALL_PROMPT (gamma GAMMA,
    n runs, default sample_size(budget)) fit the target's exact processed joint law under `options`."""
    gen = torch.Generator().manual_seed(1234)
    n = n or sample_size(budget)
    samples = [tuple(run(impl, target, draft, SMALL_PROMPT, gamma=GAMMA, max_new_tokens=JOINT, do_sample=True,
                         generator=gen, **options)[:JOINT]) for _ in range(n)]
    short = [s for s in samples if len(s) != JOINT]
    assert not short, f"property {prop}: {impl.name} returned fewer than {JOINT} tokens: {short[:3]}"
    fit, table = joint_fit(f"joint law of the first {JOINT} tokens", samples,
                           ExactLaw(target, **options).joint(SMALL_PROMPT, JOINT))
    assert fit.df > 0
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {ALPHA})")
    if fit.rejects(ALPHA):
        why = "outcomes of exact probability 0 were sampled" if fit.impossible else f"p = {fit.pvalue:.3g} < {ALPHA}"
        pytest.fail(f"property {prop} violated by {impl.name} ({scenario}, gamma={GAMMA}, "
                    f"draft={'model' if draft is not None else 'none'}): {why}\n"
                    f"  {fit}\n{table}", pytrace=False)


# --- negative controls: the check's power at this sample size -----------------------------------

def law_sampler(P, Q, prompt, gen, *, bug=None, Q_sampled=None, P_residual=None, P_bonus=None, gamma=GAMMA,
                max_new_tokens=JOINT):
    """Algorithm 1 on exact laws: P, Q map a context to the processed p, q. Bugs:
    resample-from-p   on rejection draw from p instead of norm(max(0, p - q))
    bonus-from-q      the bonus token after all gamma accepted is drawn from q
    q-mismatch        the draft samples from Q_sampled, the ratio uses Q (another temperature; the
                      raw logits; fp32 where the draft sampled in bf16)
    P_residual, P_bonus   the p the residual / the bonus token is taken from, when not P (a processor
                          left out there)
    penalty-per-round the processors of every row of a round (target and draft) see the sequence as
                      it was when the round began: a penalty counted once a round, not once a token
    shared-noise      each draft token is drawn from q by inverse CDF from a uniform u, and the same u is
                      reused in its acceptance test (vLLM PR #54282's class)
    residual-on-draft-support   the residual max(0, p - q) normalised over the draft's support (q > 0)
                      only: target mass the draft never proposes is lost"""
    draw = lambda probs: int(torch.multinomial(probs, 1, generator=gen))  # noqa: E731
    uniform = lambda: float(torch.rand((), generator=gen, dtype=torch.float64))  # noqa: E731
    out = []
    while len(out) < max_new_tokens:
        g = min(gamma, max_new_tokens - len(out) - 1)
        ctx = tuple(prompt) + tuple(out)
        seen = (lambda c: ctx) if bug == "penalty-per-round" else (lambda c: None)  # noqa: E731
        drafts, us = [], []
        for i in range(g):
            c = ctx + tuple(drafts)
            if bug == "shared-noise":
                us.append(uniform())
                cdf = (Q_sampled or Q)(c, seen(c)).cumsum(0)
                drafts.append(min(int((cdf <= us[-1]).sum()), len(cdf) - 1))
            else:
                drafts.append(draw((Q_sampled or Q)(c, seen(c))))
        k = 0
        while k < g:
            c = ctx + tuple(drafts[:k])
            p, q = P(c, seen(c)), Q(c, seen(c))
            x = drafts[k]
            if (us[k] if us else uniform()) * float(q[x]) < float(p[x]):
                k += 1
            else:
                break
        if k < g:
            r = ((P_residual or P)(c, seen(c)) - q).clamp(min=0)
            r = r * (q > 0) if bug == "residual-on-draft-support" and float((r * (q > 0)).sum()) > 0 else r
            last = draw(p if bug == "resample-from-p" else r / r.sum())
        else:
            last_ctx = ctx + tuple(drafts)
            last = draw(Q(last_ctx) if bug == "bonus-from-q" and g else (P_bonus or P)(last_ctx, seen(last_ctx)))
        out += drafts[:k] + [last]
    return tuple(out[:max_new_tokens])
