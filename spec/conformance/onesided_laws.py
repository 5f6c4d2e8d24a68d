"""The one-sided processors' shared pieces (test_one_sided.py has the properties and their docstring): the
scenarios, the sample sizes, the controls listed as below the check's power, the wrong variants' laws, and
the bodies of one_sided_law, one_sided_power and one_sided_greedy. A library module, so that no test module
imports a property module (tests/test_conform_*.py call these)."""

from __future__ import annotations

import pytest
import torch

from spec.conformance import kit
from spec.conformance.kit import (SMALL_PROMPT, ExactLaw, check_against_hf, expect_rejected, greedy, joint_fit,
                                  small_pair)
from spec.conformance.laws import ALPHA, JOINT, check_law, law_sampler, sample_size

# {scenario: (the option under test, every option of the scenario)}. Chosen by the exact laws and the
# controls below on the kit's pair: a temperature beside an option flattens the laws where the option
# alone would leave the target nearly deterministic (no degrees of freedom) or bite only the target.
BAD_WORDS = [[3, 0], [2, 0], [1, 1]]   # the draft's favourite continuations (0 after 3 and 2, 1 after 1)
ONE_SIDED = {
    "min_p=0.3": ("min_p", dict(min_p=0.3)),
    "bad_words_ids": ("bad_words_ids", dict(bad_words_ids=BAD_WORDS)),
    "temperature=0.4": ("temperature", dict(temperature=0.4)),
    "T=1.5,top_k=2": ("top_k", dict(temperature=1.5, top_k=2)),
    "T=2,top_p=0.6": ("top_p", dict(temperature=2.0, top_p=0.6)),
    "T=1.5,repetition_penalty=4": ("repetition_penalty", dict(temperature=1.5, repetition_penalty=4.0)),
    "T=2,no_repeat_ngram_size=2": ("no_repeat_ngram_size", dict(temperature=2.0, no_repeat_ngram_size=2)),
    "sequence_bias": ("sequence_bias", dict(sequence_bias={(0,): -2.5, (1, 1): -3.0})),
}
SMALL_BUDGET_ONE_SIDED = ("min_p=0.3", "bad_words_ids")
VARIANTS = ("target_only", "draft_only", "q_raw", "q_processed", "residual_raw", "bonus_raw")
EXACT_VARIANTS = ("target_only",)
# min-p's q-processed variant moves the law little (df 5 on the pair): its scenario takes 4 x the
# sample size at budget >= 1 (1600 at budget 1: rejected at p ~ 1e-6), N below budget 1.
SIZE_FACTOR = {"min_p=0.3": 4}
# Below the check's power at the sample size (p between 1e-3 and 0.05 at seed 99): raise --budget.
UNDERPOWERED = {("T=2,no_repeat_ngram_size=2", "q_raw")}
UNDERPOWERED_BELOW_BUDGET_1 = {("min_p=0.3", "q_processed")}


def one_sided_size(budget: float, scenario: str) -> int:
    return sample_size(budget) * (SIZE_FACTOR.get(scenario, 1) if budget >= 1 else 1)


def _small_budget_skip(budget, scenario):
    if budget < 1 and scenario not in SMALL_BUDGET_ONE_SIDED:
        pytest.skip(f"budget {budget:g} < 1 runs one_sided_law in {', '.join(SMALL_BUDGET_ONE_SIDED)} only")


def one_sided_law(impl, budget, scenario, record_property):
    _small_budget_skip(budget, scenario)
    if impl.draft == "none" and budget < 1:
        pytest.skip(f"{impl.name} drafts without a model: one side is a model's law (run at budget >= 1)")
    target, draft = small_pair()
    check_law("one_sided_law", impl, budget, scenario, target, None if impl.draft == "none" else draft,
              ONE_SIDED[scenario][1], record_property, n=one_sided_size(budget, scenario))


def variant_laws(scenario: str, variant: str) -> dict:
    """law_sampler's P, Q and its bug's stand-ins for one variant: the option under test left out of
    the side(s) the variant names."""
    option, options = ONE_SIDED[scenario]
    rest = {k: v for k, v in options.items() if k != option}
    target, draft = small_pair()
    p, q, p_raw, q_raw = ExactLaw(target, **options), ExactLaw(draft, **options), ExactLaw(target, **rest), \
        ExactLaw(draft, **rest)
    return {"target_only": dict(P=p, Q=q_raw), "draft_only": dict(P=p_raw, Q=q),
            "q_raw": dict(P=p, Q=q_raw, Q_sampled=q), "q_processed": dict(P=p, Q=q, Q_sampled=q_raw),
            "residual_raw": dict(P=p, Q=q, P_residual=p_raw), "bonus_raw": dict(P=p, Q=q, P_bonus=p_raw)}[variant]


def one_sided_power(budget, scenario, variant, record_property):
    """At one_sided_law's sample size, each wrong variant is rejected, the exact one passes."""
    _small_budget_skip(budget, scenario)
    laws = variant_laws(scenario, variant)
    P, Q = laws.pop("P"), laws.pop("Q")
    gen = torch.Generator().manual_seed(99)
    samples = [law_sampler(P, Q, SMALL_PROMPT, gen, **laws) for _ in range(one_sided_size(budget, scenario))]
    fit, table = joint_fit(f"joint law of the first {JOINT} tokens", samples,
                           ExactLaw(small_pair()[0], **ONE_SIDED[scenario][1]).joint(SMALL_PROMPT, JOINT))
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n})")
    assert fit.df > 0
    if variant in EXACT_VARIANTS:
        assert not fit.rejects(ALPHA), f"{variant} is exact (Algorithm 1 with an honest q) but was rejected: {fit}"
    else:
        expect_rejected("one_sided_power", f"{variant} ({ONE_SIDED[scenario][0]}) in {scenario}", fit, ALPHA, table,
                        underpowered=underpowered(budget, scenario, variant))


def underpowered(budget: float, scenario: str, variant: str) -> bool:
    """Whether this control is listed as below the check's power at this budget (an xfail if not rejected)."""
    return (scenario, variant) in UNDERPOWERED or (budget < 1 and (scenario, variant) in UNDERPOWERED_BELOW_BUDGET_1)


# --- greedy: the processors that change an argmax --------------------------------------------------

GREEDY_ARCH = "gpt-neox"
GREEDY_PROMPT = (7, 42, 7, 42, 7, 42, 9)
GREEDY_NEW = 12


def greedy_options(option: str) -> dict:
    """The option with values drawn from the free greedy continuation, so that it changes it."""
    free = greedy(GREEDY_ARCH, GREEDY_PROMPT, GREEDY_NEW)
    return {"repetition_penalty": dict(repetition_penalty=2.0),
            "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
            "sequence_bias": dict(sequence_bias={(free[1],): -4.0, (free[4], free[5]): -3.0}),
            "bad_words_ids": dict(bad_words_ids=[[free[2]], [free[5], free[6]]])}[option]


GREEDY_OPTIONS = ("repetition_penalty", "no_repeat_ngram_size", "sequence_bias", "bad_words_ids")


def one_sided_greedy(impl, option):
    draft_kind = "none" if impl.draft == "none" else "partial"
    options = greedy_options(option)
    assert kit.hf_greedy(GREEDY_ARCH, GREEDY_PROMPT, GREEDY_NEW, kit._frozen(options)) != \
        greedy(GREEDY_ARCH, GREEDY_PROMPT, GREEDY_NEW), f"{option}: the example must change greedy output"
    check_against_hf("one_sided_greedy", impl, GREEDY_ARCH, draft_kind, list(GREEDY_PROMPT), 4, GREEDY_NEW,
                     dict(options, eos_token_id=None))
