"""Sampling conformance: the decoder samples exactly from the target's processed distribution.

Properties:
  sampling_law             the joint law of the first 3 new tokens (gamma 2: two drafts, then the
                           bonus or the token after a rejection, so acceptance, the residual
                           norm(max(0, p - q)) and the bonus all take part) ~ prod p, by Pearson's
                           chi-square against the exact law (kit.ExactLaw: 64 cells, pooled to an
                           expected count >= 5), at level ALPHA. Scenarios (HF's option names): temperature
                           alone; temperature + top-k + top-p; the stateful processors (repetition
                           penalty and no-repeat n-gram: a rejected draft token leaking into their
                           state, or a penalty counted once a round instead of once a token, changes
                           the law); min_p; logit bias (sequence_bias, bad_words_ids); all of them at
                           once ("combined": a q taken from the draft's raw logits while its tokens
                           are drawn from processed ones shows there); a bf16 draft against an fp32
                           target (the draft's logits shifted by 256, where bf16 rounds them to a
                           spacing of 1-2: a q taken in fp32 while the draft sampled in bf16 shows);
                           a draft whose support misses target mass (kit.small_pair_gap: q = 0 at a
                           token the target gives 22% of its first token: a residual normalised
                           over the draft's support never emits it).
  sampling_power           negative controls, independent of --impl: Algorithm 1 run on the exact laws
                           (no models) with a deliberate bug of each class must be rejected by the
                           same check at the same sample size, and run correctly must pass. It shows
                           what sampling_law can see at this budget (the bf16 control runs on a
                           draft whose logits are shifted by 256, so that bf16 rounding moves q).
                           A control that is not rejected fails (kit.expect_rejected), never xfails.
  sampling_law_wide        the first token on a 640-wide vocabulary, no top-k: a truncation nobody
                           asked for (HF's default top_k=50) shows there; with its own control.
  determinism              the same seeded generator gives the same tokens; other seeds other tokens.
A failure gives the p-value and the cells that deviate most (observed vs expected).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from spec.conformance.kit import (BF16_OFFSET, SMALL_PROMPT, ExactLaw, expect_rejected, run, shifted_logits,
                                  small_pair, small_pair_bf16, zoo)
from spec.conformance.stats import worst_case_power

from spec.conformance.laws import (ALPHA, CONTROLS, DRAFT_SCENARIOS, GAMMA, JOINT, N, SCENARIOS,
                                   SMALL_BUDGET_SCENARIOS, WIDE_ARCH, WIDE_PROMPT, check_law, pair_for, sampling_law_wide,
                                   sampling_power, wide_fit, wide_sample_size)

@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sampling_law(impl, budget, scenario, record_property):
    if budget < 1 and scenario not in SMALL_BUDGET_SCENARIOS:
        pytest.skip(f"budget {budget:g} < 1 runs the sampling law in {', '.join(SMALL_BUDGET_SCENARIOS)} only")
    if budget < 1 and scenario in DRAFT_SCENARIOS and impl.draft == "none":
        pytest.skip(f"{impl.name} drafts without a model: the scenario's draft takes no part (run at budget >= 1)")
    target, draft = pair_for(scenario)
    check_law("sampling_law", impl, budget, scenario, target, None if impl.draft == "none" else draft,
              SCENARIOS[scenario], record_property)


@pytest.mark.parametrize("control", list(CONTROLS))
def test_sampling_power(budget, control, record_property):
    """At the sample size sampling_law uses, the check rejects each bug and passes the correct sampler
    (laws.sampling_power)."""
    sampling_power(budget, control, record_property)


def bf16_q_distance(d16) -> list[float]:
    """Total variation between the bf16 draft's q and the same weights' q computed in fp32, at T=0.6,
    over every context of the first 3 tokens (21)."""
    q16, q32 = ExactLaw(d16, temperature=0.6), ExactLaw(copy.deepcopy(d16).float(), temperature=0.6)
    contexts = [SMALL_PROMPT + tuple(s) for k in range(JOINT) for s in itertools.product(range(4), repeat=k)]
    return [0.5 * float((q16(c) - q32(c)).abs().sum()) for c in contexts]


def test_bf16_rounding_moves_q(record_property):
    """Why the bf16 control has power: on the bf16 scenario's draft (logits shifted by 256) bf16 moves
    q by a total variation of up to 0.39; the shift itself changes its fp32 law by 1e-5 only. The same
    draft unshifted moves by at most 0.004, which n = 400 cannot see (worst-case power 0.001)."""
    shifted = bf16_q_distance(small_pair_bf16()[1])
    draft = small_pair()[1]
    plain = bf16_q_distance(copy.deepcopy(draft).to(torch.bfloat16))
    record_property("evidence", f"TV(bf16 q, fp32 q): shifted draft max {max(shifted):.3f} mean "
                                f"{sum(shifted) / len(shifted):.3f}; unshifted max {max(plain):.4f}")
    assert max(shifted) > 0.3 and sum(shifted) / len(shifted) > 0.1
    assert max(plain) <= 0.004 and worst_case_power(N, 13, max(plain), ALPHA) < 0.01
    fp32 = ExactLaw(copy.deepcopy(small_pair_bf16()[1]).float())
    shifted_fp32 = ExactLaw(shifted_logits(draft, BF16_OFFSET))   # the draft is fp32
    unshifted = ExactLaw(draft)
    for c in (SMALL_PROMPT, SMALL_PROMPT + (0, 3)):
        assert float(fp32.logits(c).min()) > BF16_OFFSET - 8   # the logits are large ...
        assert torch.allclose(shifted_fp32(c), unshifted(c), atol=1e-4)   # ... and the law is the draft's


# --- a wide vocabulary: where a default top-k of 50 (HF's, filled in for top_k=None) bites ----------

def test_sampling_law_wide(impl, budget, record_property):
    """The first token on a 640-wide vocabulary at T=1, no top-k, no top-p (laws.sampling_law_wide)."""
    sampling_law_wide(impl, budget, record_property)


@pytest.mark.parametrize("control", ["correct", "top-k-50"])
def test_sampling_law_wide_power(budget, control, record_property):
    """Negative control for sampling_law_wide at its sample size: exact sampling passes; the same
    law cut to its top 50 (the default HF fills in for top_k=None) is rejected."""
    target = zoo(WIDE_ARCH)["target"]
    sampled = ExactLaw(target, top_k=50 if control == "top-k-50" else None)(WIDE_PROMPT)
    gen = torch.Generator().manual_seed(77)
    firsts = torch.multinomial(sampled, wide_sample_size(budget), replacement=True, generator=gen).tolist()
    fit, table = wide_fit(firsts, ExactLaw(target))
    record_property("evidence", f"p = {fit.pvalue:.3g}")
    if control == "correct":
        assert not fit.rejects(ALPHA), f"exact sampling was rejected (false alarm): {fit}\n{table}"
    else:
        expect_rejected("sampling_law_wide", "a top-50 cut", fit, ALPHA, table)


def test_determinism(impl):
    target, draft = small_pair()
    draft = None if impl.draft == "none" else draft

    def tokens(seed):
        gen = torch.Generator().manual_seed(seed)
        return [run(impl, target, draft, SMALL_PROMPT, gamma=GAMMA, max_new_tokens=8, do_sample=True, generator=gen)
                for _ in range(6)]
    first, again, other = tokens(0), tokens(0), tokens(1)
    if first != again:
        pytest.fail(f"property determinism violated by {impl.name}\n  the same seeded generator gave different "
                    f"samples:\n  {first}\n  {again}", pytrace=False)
    if first == other:
        pytest.fail(f"property determinism violated by {impl.name}\n  seeds 0 and 1 gave the same 6 samples "
                    f"{first}: the generator is ignored", pytrace=False)
