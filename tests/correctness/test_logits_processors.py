"""spec.processors against transformers' own RepetitionPenaltyLogitsProcessor and
NoRepeatNGramLogitsProcessor (the reference semantics), row by row, and its argument checks.
End to end (greedy vs HF generate, sampling law by chi-square) is spec/conformance (the kit)."""

from __future__ import annotations

import pytest
import torch
from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from spec.processors import Processors


@pytest.mark.parametrize("penalty, ngram", [(1.3, None), (0.7, None), (None, 1), (None, 2), (None, 3), (2.0, 2)])
def test_rows_match_hf_processors(penalty, ngram):
    gen = torch.Generator().manual_seed(0)
    hf = []
    if penalty:
        hf.append(RepetitionPenaltyLogitsProcessor(penalty))
    if ngram:
        hf.append(NoRepeatNGramLogitsProcessor(ngram))
    ours = Processors(penalty, ngram)
    for _ in range(20):
        seq = torch.randint(0, 6, (int(torch.randint(1, 14, (), generator=gen)) + 4,), generator=gen)  # repeats
        start, rows = seq.numel() - 4, 4
        logits = torch.randn(rows, 10, generator=gen, dtype=torch.float64) * 3
        got = ours(logits, seq, start)
        for i in range(rows):
            expected = logits[i:i + 1].clone()
            for proc in hf:
                expected = proc(seq[None, :start + i], expected)
            assert torch.equal(got[i], expected[0]), (seq.tolist(), start + i)


def test_off_is_identity_and_narrow_rows_ignore_wide_ids():
    assert not Processors() and not Processors(1.0, 0)
    seq = torch.tensor([1, 9, 1])      # 9: beyond a 4-wide draft head, must not index it
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0]])
    out = Processors(2.0, 1)(logits, seq, 3)
    assert out.tolist() == [[1.0, float("-inf"), -1.0, 3.0]]


def test_the_first_ngram_is_banned_as_soon_as_it_exists():
    """A prefix of exactly n tokens holds one n-gram; if its first n-1 tokens are also the last n-1
    (a run of one id), the next id is banned already. HF agrees."""
    for n in (2, 3):
        seq = torch.full((n,), 5)
        logits = torch.zeros(1, 8, dtype=torch.float64)
        expected = NoRepeatNGramLogitsProcessor(n)(seq[None], logits.clone())[0]
        got = Processors(None, n)(logits, seq, n)[0]
        assert torch.equal(got, expected) and got[5] == float("-inf") and torch.isfinite(got[:5]).all()


def test_ids_exactly_one_past_a_narrow_head_are_ignored():
    seq = torch.tensor([4, 1, 4, 1])   # 4 is one past a 4-wide draft head
    # prefix [4, 1, 4]: 1 penalised (2.0 -> 1.0), 4 skipped; "4 1" seen, so 1 after 4 is banned
    out = Processors(2.0, 2)(torch.tensor([[1.0, 2.0, -1.0, 3.0]]), seq, 3)
    assert out.tolist() == [[1.0, float("-inf"), -1.0, 3.0]]
    # prefix [4, 1, 4, 1]: "1 4" seen, so 4 after 1 is banned, but the head has no row 4
    out = Processors(1.5, 2)(torch.tensor([[1.0, 3.0, -1.0, 3.0]]), seq, 4)
    assert out.tolist() == [[1.0, 2.0, -1.0, 3.0]]


def test_half_precision_logits_are_processed_in_fp32():
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 6, (12,), generator=gen)
    logits = (torch.randn(4, 10, generator=gen) * 3).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        got = Processors(1.3, 2)(logits.to(dtype), seq, 8)
        assert got.dtype == torch.float32
        assert torch.equal(got, Processors(1.3, 2)(logits.to(dtype).float(), seq, 8))


@pytest.mark.parametrize("kwargs, name", [(dict(repetition_penalty=0), "repetition_penalty"),
                                          (dict(repetition_penalty="2"), "repetition_penalty"),
                                          (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
                                          (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Processors(**kwargs)
