"""The sampling laws' shared pieces: the scenarios, sample sizes and level, the check of a decoder's
joint law against the exact one (`check_law`), and Algorithm 1 on exact laws with deliberate bugs
(`law_sampler`, the negative controls, and `sampling_power`, the controls sampling_law is shown to reject),
and the wide-vocabulary law (`sampling_law_wide`). The properties that use them are test_sampling_law,
test_one_sided, test_trees and test_engine (the served ones take their level from levels.py, without torch);
a library module, so that no property module imports another, and the suite's own tests
(tests/test_conform_*.py) call these, never a property module.
"""

from __future__ import annotations

import copy

import pytest
import torch

from spec.conformance import checks
from spec.conformance.endpoint import UnsupportedRequest
from spec.conformance.kit import (SMALL_PROMPT, ExactLaw, expect_rejected, joint_fit, small_pair, small_pair_bf16,
                                  small_pair_gap, zoo)
from spec.conformance.stats import law_fit
from spec.conformance.subject import decoder_subject
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


def _sampled(prop, impl, subject, prompt, law, n, depth, tokens=None, options=None):
    """The one sampling-law check (checks.sampling_law) on an in-process subject: n samples one after another
    from its generator, `options` the decoder's keywords (temperature among them); a decoder that cannot
    take them skips the test with the reason."""
    options = dict(options or {})
    temperature = options.pop("temperature", 1.0)
    try:
        return checks.sampling_law(subject, prompt, law, [None] * n, depth=depth, tokens=tokens,
                                   temperature=temperature, options=options)
    except UnsupportedRequest as why:
        pytest.skip(str(why))
    except checks.TooShort as short:
        raise AssertionError(f"property {prop}: {short}") from None


def check_law(prop, impl, budget, scenario, target, draft, options, record_property, n=None):
    """Fail property `prop` unless the decoder's first JOINT tokens after SMALL_PROMPT (gamma GAMMA,
    n runs, default sample_size(budget)) fit the target's exact processed joint law under `options`."""
    subject = decoder_subject(impl, target, draft, gamma=GAMMA, generator=torch.Generator().manual_seed(1234))
    fitted = _sampled(prop, impl, subject, SMALL_PROMPT, ExactLaw(target, **options).joint(SMALL_PROMPT, JOINT),
                      n or sample_size(budget), JOINT, options=options)
    fit, table = fitted.fit, fitted.worst()
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


def _control(name):
    """(scenario the fit is against, the sampler's P and Q, its Q_sampled, its bug) for one control."""
    target, draft = small_pair()
    plain = lambda options: (ExactLaw(target, **options), ExactLaw(draft, **options))  # noqa: E731
    if name == "q-mismatch":        # the draft samples at T=0.5, the ratio uses q at T=1
        return "T=1", (ExactLaw(target), ExactLaw(draft)), ExactLaw(draft, temperature=0.5), "q-mismatch"
    if name == "q-from-raw-logits":  # HF #47932's class: q from the raw logits, tokens from processed ones
        return "combined", (ExactLaw(target, **COMBINED), ExactLaw(draft)), ExactLaw(draft, **COMBINED), "q-mismatch"
    if name == "min_p-ignored":      # SGLang #10617's class
        return "T=1.3,min_p=0.3", plain(dict(temperature=1.3)), None, None
    if name == "bias-ignored":       # the same class for logit bias / bad words
        return "sequence_bias,bad_words_ids", plain({}), None, None
    if name == "penalty-per-round":  # SGLang PR #33643's class: processor state updated once a round
        options = SCENARIOS["repetition_penalty=1.5,no_repeat_ngram_size=3"]
        return "repetition_penalty=1.5,no_repeat_ngram_size=3", plain(options), None, "penalty-per-round"
    if name == "repetition-penalty-per-round":  # the same, repetition penalty alone
        return "repetition_penalty=3", plain(dict(repetition_penalty=3.0)), None, "penalty-per-round"
    if name == "bf16-q-in-ratio":    # DeepSpec #31's class: drafted in bf16, the ratio's q in fp32
        t32, d16 = small_pair_bf16()
        return (BF16, (ExactLaw(t32, temperature=0.6), ExactLaw(copy.deepcopy(d16).float(), temperature=0.6)),
                ExactLaw(d16, temperature=0.6), "q-mismatch")
    if name == "bf16-correct":       # the same pair, q the bf16 one it was drawn from: no false alarm
        t32, d16 = small_pair_bf16()
        return BF16, (ExactLaw(t32, temperature=0.6), ExactLaw(d16, temperature=0.6)), None, None
    if name in ("residual-on-draft-support", "gap-correct"):   # a draft that never proposes kit.GAP_TOKEN
        target, gap = small_pair_gap()
        return GAP, (ExactLaw(target), ExactLaw(gap)), None, CONTROLS[name]
    scenario = "T=1"
    return scenario, plain({}), None, CONTROLS[name]


CONTROLS = {"correct": None, "resample-from-p": "resample-from-p", "bonus-from-q": "bonus-from-q",
            "q-mismatch": "q-mismatch", "q-from-raw-logits": "q-mismatch", "min_p-ignored": None,
            "bias-ignored": None, "penalty-per-round": "penalty-per-round",
            "repetition-penalty-per-round": "penalty-per-round", "bf16-q-in-ratio": "q-mismatch",
            "bf16-correct": None, "shared-noise": "shared-noise",
            "residual-on-draft-support": "residual-on-draft-support", "gap-correct": None}
PASSING = ("correct", "bf16-correct", "gap-correct")
REFERENCE = dict(SCENARIOS, **{"T=1": {}})


def sampling_power(budget, control, record_property):
    """At the sample size sampling_law uses, the check rejects each bug and passes the correct sampler."""
    scenario, (P, Q), Q_sampled, bug = _control(control)
    target = pair_for(scenario)[0]
    gen = torch.Generator().manual_seed(99)
    n = sample_size(budget)
    samples = [law_sampler(P, Q, SMALL_PROMPT, gen, bug=bug, Q_sampled=Q_sampled) for _ in range(n)]
    fit, table = joint_fit(f"joint law of the first {JOINT} tokens", samples,
                           ExactLaw(target, **REFERENCE[scenario]).joint(SMALL_PROMPT, JOINT))
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {ALPHA})")
    if control in PASSING:
        assert not fit.rejects(ALPHA), f"the correct sampler was rejected (false alarm): {fit}\n{table}"
    else:
        expect_rejected("sampling_power", f"the {control} bug", fit, ALPHA, table)


# --- a wide vocabulary: where a default top-k of 50 (HF's, filled in for top_k=None) bites ----------

WIDE_ARCH = "llama"                 # kit.zoo: 640-wide logits, about 80% of the mass beyond the top 50
WIDE_PROMPT = (5, 9, 5, 9, 5, 9, 5)  # repeats, so prompt lookup drafts too
WIDE_NEW = 3                        # gamma 2: the first token is the first draft's accept or its residual
WIDE_N = 100                        # samples at budget 1 and below: a cut of 80% of the mass shows at once


def wide_sample_size(budget: float) -> int:
    return max(WIDE_N, round(WIDE_N * budget))


WIDE_NAME = "first token on a 640-wide vocabulary"


def wide_law(law) -> dict:
    """{(token,): probability} of the first new token after WIDE_PROMPT under `law` (an ExactLaw), every id."""
    return {(t,): p for t, p in enumerate(law(WIDE_PROMPT).tolist())}


def wide_table(fitted) -> str:
    """The 6 tokens whose counts deviate most from their expected counts."""
    n = fitted.fit.n
    worst = sorted(range(len(fitted.cells)), key=lambda i: -abs(fitted.observed[i] - n * fitted.probs[i]))[:6]
    return "    token: observed vs expected  " + ", ".join(
        f"{fitted.cells[i][0]}: {fitted.observed[i]} vs {n * fitted.probs[i]:.1f}" for i in worst)


def wide_fit(firsts, law):
    """Chi-square fit of the first new token's law (640 cells, pooled to expected >= 5) and the
    cells that deviate most (for the negative controls' samples)."""
    fitted = law_fit(WIDE_NAME, [(t,) for t in firsts], wide_law(law))
    return fitted.fit, wide_table(fitted)


def sampling_law_wide(impl, budget, record_property):
    """The first token on a 640-wide vocabulary at T=1, no top-k, no top-p: a decoder (or an
    adapter) that truncates the distribution where it was not asked to (HF fills top_k=None with
    50) never samples beyond the top 50, which hold about 80% of the mass here."""
    z = zoo(WIDE_ARCH)
    draft = None if impl.draft == "none" else z["partial"]
    subject = decoder_subject(impl, z["target"], draft, gamma=GAMMA, generator=torch.Generator().manual_seed(4321))
    fitted = _sampled("sampling_law_wide", impl, subject, WIDE_PROMPT, wide_law(ExactLaw(z["target"])),
                      wide_sample_size(budget), 1, tokens=WIDE_NEW)
    fit, table = fitted.fit, wide_table(fitted)
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {ALPHA})")
    if fit.rejects(ALPHA):
        pytest.fail(f"property sampling_law_wide violated by {impl.name} (T=1, no top-k or top-p, gamma={GAMMA}, "
                    f"draft={'model' if draft is not None else 'none'}):\n  {fit}\n{table}", pytrace=False)
