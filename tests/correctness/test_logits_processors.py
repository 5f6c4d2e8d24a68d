"""spec.processors and spec.sampling's min-p against transformers' own LogitsProcessors (the
reference semantics: RepetitionPenalty, NoRepeatNGram, SequenceBias, NoBadWords, MinNewTokensLength,
MinP), row by row, in the order HF's generate() builds them, and their argument checks.
End to end (greedy vs HF generate, sampling law by chi-square) is spec/conformance (the kit)."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_logits_close
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor,
                          NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper)

from spec.processors import Processors
from spec.sampling import probabilities


def hf_processed(procs, logits, seq, start):
    """HF's processors applied to each row with exactly its own prefix: row i predicts seq[start + i]."""
    rows = []
    for i in range(logits.shape[0]):
        row = logits[i:i + 1].clone()
        for proc in procs:
            row = proc(seq[None, :start + i], row)
        rows.append(row[0])
    return torch.stack(rows)


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
        got, expected = ours(logits, seq, start), hf_processed(hf, logits, seq, start)
        for i in range(rows):
            assert torch.equal(got[i], expected[i]), (seq.tolist(), start + i)


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


# Every option at once, in HF's order (generate() builds: sequence bias, repetition penalty,
# no-repeat n-gram, bad words, min_new_tokens): [1, 2] -> 3 and (0,) biased, [3] and [2, 5] banned,
# EOS 4 masked until 3 new tokens (the prompt is the first 5 ids), [4] dropped from the bad words
# because it is an EOS id (HF's rule).
OPTIONS = [
    dict(sequence_bias={(0,): 1.5, (1, 2, 3): -2.0, (5, 5): 0.75}),
    dict(bad_words_ids=[[3], [2, 5], [4]]),
    dict(min_new_tokens=3),
    dict(sequence_bias={(2,): -1.25, (4, 1): 3.0}, repetition_penalty=1.3, no_repeat_ngram_size=2,
         bad_words_ids=[[1, 1]], min_new_tokens=2),
]


def hf_rows(options, eos, prompt_len):
    procs = []
    if "sequence_bias" in options:
        procs.append(SequenceBiasLogitsProcessor(sequence_bias=[[list(k), v] for k, v in options["sequence_bias"].items()]))
    if options.get("repetition_penalty"):
        procs.append(RepetitionPenaltyLogitsProcessor(options["repetition_penalty"]))
    if options.get("no_repeat_ngram_size"):
        procs.append(NoRepeatNGramLogitsProcessor(options["no_repeat_ngram_size"]))
    if "bad_words_ids" in options:
        procs.append(NoBadWordsLogitsProcessor(options["bad_words_ids"], eos))
    if options.get("min_new_tokens"):
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, options["min_new_tokens"], eos))
    return procs


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_bias_bad_words_and_min_new_tokens_match_hf(options):
    gen = torch.Generator().manual_seed(1)
    eos, prompt_len = [4], 5
    ours = Processors(**options, eos_ids=eos, prompt_len=prompt_len)
    hf = hf_rows(options, eos, prompt_len)
    bit = 0
    for _ in range(40):
        seq = torch.randint(0, 6, (prompt_len + 6,), generator=gen)
        start, rows = prompt_len, 6          # rows see 0..5 new tokens: min_new_tokens bites, then not
        logits = torch.randn(rows, 8, generator=gen, dtype=torch.float64) * 3
        got, expected = ours(logits, seq, start), hf_processed(hf, logits, seq, start)
        for i in range(rows):
            assert torch.equal(got[i], expected[i]), (options, seq.tolist(), start + i)
            bit += not torch.equal(got[i], logits[i])
    assert bit > 40  # the options changed most rows: the comparison is not between untouched logits


def test_min_new_tokens_needs_an_eos_and_drops_eos_bad_words():
    assert not Processors(min_new_tokens=5)                      # no EOS id: HF adds no processor either
    only_eos = Processors(bad_words_ids=[[4]], eos_ids=[4])
    assert not only_eos                                          # the EOS-only bad word is dropped
    logits = torch.zeros(1, 6)
    assert torch.equal(Processors(min_new_tokens=2, eos_ids=[4], prompt_len=3)(logits, torch.arange(6), 4)[0],
                       torch.tensor([0, 0, 0, 0, float("-inf"), 0]))   # 1 new token so far < 2


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, None), (1.3, 5)])
def test_min_p_matches_hf_warper_after_temperature_and_top_k(min_p, temperature, top_k):
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        logits = torch.randn(1, 12, generator=gen, dtype=torch.float64) * 2
        expected = logits.clone()
        if temperature != 1.0:
            expected = TemperatureLogitsWarper(temperature)(None, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        expected = MinPLogitsWarper(min_p)(None, expected).softmax(-1)[0]
        got = probabilities(logits[0], temperature, top_k, None, min_p)
        assert torch.equal(got > 0, expected > 0), (logits, min_p)
        assert_logits_close(got, expected)


@pytest.mark.parametrize("kwargs, name", [(dict(min_new_tokens=-1), "min_new_tokens"),
                                          (dict(min_new_tokens=1.5), "min_new_tokens"),
                                          (dict(sequence_bias={(): 1.0}), "sequence_bias"),
                                          (dict(sequence_bias={(1,): "x"}), "sequence_bias"),
                                          (dict(sequence_bias={}), "sequence_bias"),
                                          (dict(bad_words_ids=[]), "bad_words_ids"),
                                          (dict(bad_words_ids=[[-1]]), "bad_words_ids")])
def test_bad_new_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Processors(**kwargs)
