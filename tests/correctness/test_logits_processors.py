"""spec.processors against transformers' own RepetitionPenaltyLogitsProcessor and
NoRepeatNGramLogitsProcessor (the reference semantics), row by row, and its argument checks.
End to end (greedy vs HF generate, sampling law by chi-square) is tests/conformance."""

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


@pytest.mark.parametrize("kwargs, name", [(dict(repetition_penalty=0), "repetition_penalty"),
                                          (dict(repetition_penalty="2"), "repetition_penalty"),
                                          (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
                                          (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Processors(**kwargs)
