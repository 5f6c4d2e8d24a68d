"""spec.sampling's values, pinned against Hugging Face's own logits warpers, fp64 softmax and
hand-computed cases: ties, top-p exactly at a cumulative boundary, top-k at and past the
vocabulary, temperature extremes, bf16/fp16 logits, batched rows.

HF's generate() applies temperature, then top-k, then top-p (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, in that order), the order spec.sampling documents.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracles import assert_logits_close
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from spec import sampling


def hf_probabilities(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """HF's warpers on a [rows, V] float64 batch, then softmax."""
    scores = logits.double().reshape(-1, logits.shape[-1])
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1).reshape(logits.shape)


OPTIONS = [dict(), dict(temperature=0.7), dict(temperature=2.5), dict(top_k=1), dict(top_k=4), dict(top_k=11),
           dict(top_p=0.3), dict(top_p=0.9), dict(temperature=0.5, top_k=6, top_p=0.8),
           dict(temperature=1.7, top_k=3, top_p=0.95)]


@pytest.mark.parametrize("options", OPTIONS, ids=[str(o) or "plain" for o in OPTIONS])
def test_probabilities_equal_hf_warpers(options):
    """Random logits, 12 wide, 16 rows at once (each row filtered on its own)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 12, generator=gen, dtype=torch.float64) * 3
    ours = sampling.probabilities(logits, options.get("temperature", 1.0), options.get("top_k"), options.get("top_p"))
    want = hf_probabilities(logits, **options)
    assert ours.dtype == torch.float64 and ours.shape == logits.shape
    assert_logits_close(ours, want)
    assert torch.equal(ours > 0, want > 0)  # the same tokens may be sampled


def test_plain_softmax_by_hand():
    logits = torch.tensor([0.0, math.log(2.0), math.log(5.0)], dtype=torch.float64)
    assert_logits_close(sampling.probabilities(logits), torch.tensor([0.125, 0.25, 0.625], dtype=torch.float64))
    # temperature 0.5 squares the odds: 1 : 4 : 25
    t = sampling.probabilities(logits, temperature=0.5)
    assert_logits_close(t, torch.tensor([1, 4, 25], dtype=torch.float64) / 30)


def test_top_k_keeps_every_token_tied_with_the_kth():
    """HF's rule (and spec's): remove tokens strictly below the k-th logit, so ties survive."""
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 2.0], dtype=torch.float64)
    ours = sampling.probabilities(logits, top_k=2)
    # kept: 3.0 and the three 2.0s
    w = torch.tensor([math.e, 0, 1, 1, 0, 1], dtype=torch.float64)
    assert_logits_close(ours, w / w.sum())
    assert torch.equal(ours, hf_probabilities(logits, top_k=2))


@pytest.mark.parametrize("top_k", [6, 7, 1000])
def test_top_k_at_or_past_the_vocabulary_changes_nothing(top_k):
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0], dtype=torch.float64)
    assert torch.equal(sampling.probabilities(logits, top_k=top_k), logits.softmax(-1))


def test_top_p_one_keeps_even_a_vanishing_token():
    """top_p = 1 filters nothing, not even a token whose mass is below rounding: the mass before it
    rounds to 1.0, and a filter that ran at top_p = 1 would drop it."""
    logits = torch.tensor([0.0, -60.0, 3.0], dtype=torch.float64)
    ours = sampling.probabilities(logits, top_p=1.0)
    assert torch.equal(ours, logits.softmax(-1)) and ours[1] > 0


def test_top_k_one_is_one_hot_per_row():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.9]], dtype=torch.float64)
    want = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(sampling.probabilities(logits, top_k=1), want)


# Probabilities 1/2, 1/4, 1/8, 1/8: cumulative masses before each token 0, 1/2, 3/4, 7/8.
DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64).log()


@pytest.mark.parametrize("top_p,kept", [(0.5 - 1e-9, 1), (0.5 + 1e-9, 2), (0.75 - 1e-9, 2), (0.75 + 1e-9, 3),
                                        (0.875 + 1e-9, 4), (1.0, 4), (1e-9, 1)])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, kept):
    """Either side of each cumulative boundary: the nucleus is the fewest most-likely tokens
    whose mass reaches top_p (the first token always stays)."""
    ours = sampling.probabilities(DYADIC, top_p=top_p)
    mass = [0.5, 0.25, 0.125, 0.125][:kept]
    want = torch.tensor(mass + [0.0] * (4 - kept), dtype=torch.float64) / sum(mass)
    # the last two tokens tie: which of them a 3-token nucleus keeps is the sort's choice
    assert_logits_close(ours.sort(descending=True).values, want, what=f"top_p {top_p}")
    assert int((ours > 0).sum()) == int((hf_probabilities(DYADIC, top_p=top_p) > 0).sum()) == kept


def test_top_p_exactly_on_a_boundary_keeps_the_set_that_reaches_it():
    """top_p = 3/4 = p1 + p2 exactly (as floats): {p1, p2} reaches it, the third is dropped."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    assert float(probs.log().softmax(-1)[:2].sum()) == 0.75  # the boundary is exact in fp64
    ours = sampling.probabilities(probs.log(), top_p=0.75)
    assert_logits_close(ours, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    # HF's TopPLogitsWarper differs here: it drops tokens whose ascending cumulative mass is
    # <= 1 - top_p, and its rounded sum 1/8 + 1/8 lands a hair above 1/4, so it keeps three.
    # Off the exact boundary the two agree (the test above).


def test_top_p_with_tied_tokens_keeps_the_right_count():
    """Four equal tokens, top_p 0.5: two of them are kept (which two is the sort's choice,
    as in HF); each gets 1/2."""
    ours = sampling.probabilities(torch.zeros(4, dtype=torch.float64), top_p=0.5)
    assert int((ours > 0).sum()) == 2 and torch.allclose(ours[ours > 0], torch.full((2,), 0.5, dtype=torch.float64))
    assert int((hf_probabilities(torch.zeros(4, dtype=torch.float64), top_p=0.5) > 0).sum()) == 2


def test_top_p_then_renormalised_after_top_k():
    """top-k first, then top-p on the renormalised survivors (HF's order)."""
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64).log()
    # top_k=2 leaves 0.5 and 0.3 -> 0.625, 0.375; top_p 0.6 keeps 0.625 alone
    assert torch.equal(sampling.probabilities(logits, top_k=2, top_p=0.6),
                       torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    # whereas top-p 0.6 on the raw distribution would keep two tokens (0.5 < 0.6)
    assert int((sampling.probabilities(logits, top_p=0.6) > 0).sum()) == 2


def test_minus_infinity_logits_never_get_mass():
    logits = torch.tensor([-math.inf, 0.0, 1.0, -math.inf], dtype=torch.float64)
    for opts in (dict(), dict(top_k=3), dict(top_p=0.99), dict(temperature=0.1)):
        p = sampling.probabilities(logits, **opts)
        assert p[0] == 0 and p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("temperature", [1e-4, 1e-2, 1e2, 1e4])
def test_temperature_extremes_against_fp64(temperature):
    logits = torch.tensor([1.0, 3.0, 2.9, -2.0], dtype=torch.float64)
    want = (logits / temperature).softmax(-1)
    assert_logits_close(sampling.probabilities(logits, temperature=temperature), want)
    if temperature <= 1e-2:
        # 3.0 vs 2.9: odds e^(0.1 / T), 1 : e^10 at T = 0.01
        assert sampling.probabilities(logits, temperature=temperature)[1] > 1 - 1e-4
    else:
        assert torch.allclose(want, torch.full((4,), 0.25, dtype=torch.float64), atol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_logits_are_processed_in_fp32(dtype):
    """bf16/fp16 logits are cast up before dividing by the temperature and the softmax:
    the result is the fp64 softmax of the same (rounded) logits to fp32 precision."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 64, generator=gen) * 4).to(dtype)
    for opts in (dict(), dict(temperature=0.3), dict(temperature=0.3, top_k=5, top_p=0.9)):
        ours = sampling.probabilities(logits, opts.get("temperature", 1.0), opts.get("top_k"), opts.get("top_p"))
        assert ours.dtype == torch.float32
        want = hf_probabilities(logits.double(), **opts)
        assert_logits_close(ours.double(), want, torch.float32, str(opts))   # fp32's bound: processed in fp32
        assert torch.equal(ours > 0, want > 0)


def test_float32_logits_stay_float32():
    logits = torch.tensor([0.0, 1.0], dtype=torch.float32)
    assert sampling.probabilities(logits, temperature=0.5).dtype == torch.float32


# --- residual ------------------------------------------------------------------------------

def test_residual_by_hand():
    p = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    # max(0, p - q) = [0, 0.3, 0], normalised
    assert torch.allclose(sampling.residual(p, q), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    q2 = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert torch.allclose(sampling.residual(p, q2), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(p, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))  # inputs untouched


def test_residual_where_p_is_below_q_everywhere_falls_back_to_p():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.6, 0.6], dtype=torch.float64)  # not a distribution: rounding taken to the extreme
    assert torch.equal(sampling.residual(p, q), p)


# --- sample ---------------------------------------------------------------------------------

def test_sample_is_torch_multinomial_with_the_same_generator():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    ours = [int(sampling.sample(probs, torch.Generator().manual_seed(s))) for s in range(50)]
    want = [int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(s))[0]) for s in range(50)]
    assert ours == want and len(set(ours)) > 1
    token = sampling.sample(probs, torch.Generator().manual_seed(0))
    assert token.dim() == 0 and token.dtype == torch.long


def test_sample_never_draws_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    draws = {int(sampling.sample(probs, gen)) for _ in range(200)}
    assert draws == {1, 3}
    assert int(sampling.sample(torch.tensor([0.0, 0.0, 1.0]), gen)) == 2
