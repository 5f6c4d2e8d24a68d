"""The divergence diagnosis tells a numerical tie from a bug, with position and gap."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import logit_tolerance

from spec import greedy_generate
from spec.diagnose import diagnose, first_difference

PROMPT = [3, 141, 59, 26]


def test_agreement_is_no_divergence(target):
    tokens = greedy_generate(target, PROMPT, max_new_tokens=8).tokens
    assert diagnose(target, PROMPT, tokens, list(tokens)) is None


def test_wrong_token_is_a_bug_with_position_and_gap(target):
    tokens = greedy_generate(target, PROMPT, max_new_tokens=8).tokens
    wrong = tokens[:5] + [(tokens[5] + 1) % 500] + tokens[6:]
    d = diagnose(target, PROMPT, tokens, wrong)
    assert (d.position, d.expected, d.actual, d.verdict) == (5, tokens[5], wrong[5], "bug")
    assert d.gap_step > d.noise and d.gap_block > d.noise
    with torch.no_grad():
        logits = target(torch.tensor([PROMPT + tokens[:5]])).logits[0, -1]
    assert d.noise <= logit_tolerance(torch.float64, logits)  # fp64's rounding
    assert "first divergence at new token 5" in str(d) and "BUG" in str(d)


def test_length_difference_is_a_bug(target):
    tokens = greedy_generate(target, PROMPT, max_new_tokens=8).tokens
    d = diagnose(target, PROMPT, tokens, tokens + [1, 2])
    assert d.position == 8 and d.expected is None and d.verdict == "bug"
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


def test_exact_tie_is_a_tie(target):
    """Make two LM-head rows identical: their logits tie exactly at every position, so
    picking either is a numerical tie, and the diagnosis must say so."""
    tied = copy.deepcopy(target)
    tokens = greedy_generate(tied, PROMPT, max_new_tokens=6).tokens
    head = tied.get_output_embeddings().weight
    twin = (tokens[3] + 7) % 500
    with torch.no_grad():
        head[twin] = head[tokens[3]]
    tokens = greedy_generate(tied, PROMPT, max_new_tokens=6).tokens
    # the tie makes argmax pick the lower id; the other choice is as good.
    other = twin if tokens[3] != twin else tokens[3]
    low, high = sorted((tokens[3], twin))
    flipped = tokens[:3] + [high]
    d = diagnose(tied, PROMPT, tokens[:3] + [low], flipped)
    with torch.no_grad():
        logits = tied(torch.tensor([PROMPT + tokens[:3]])).logits[0, -1]
    assert d.position == 3 and d.verdict == "tie"
    assert d.gap_step == pytest.approx(0.0, abs=logit_tolerance(torch.float64, logits))
    assert "numerical tie" in str(d)
    del other


def test_one_rule_and_one_record_for_every_subject():
    """spec.diagnose.judge is the verdict of every subject (HF targets here, served models in
    spec.conformance.endpoints, llama.cpp and in-process decoders through spec.conformance.subject's
    Subject.judge): a token within the noise is a tie, beyond it a bug, outside the reference's two best a
    bug, a length difference a bug."""
    from spec.conformance import endpoints, subject
    from spec.diagnose import Divergence, Scores, judge
    assert endpoints.Divergence is Divergence and subject.Divergence is Divergence and subject.judge is judge

    def at(gap, noise, top2=None):
        return lambda i: Scores(gap, noise, top2)
    assert judge([1, 2, 3], [1, 2, 3], at(0.0, 1.0)) is None
    tie = judge([1, 2, 3], [1, 5, 3], at(0.1, 0.2), reference="reference", scale="logprob")
    assert (tie.position, tie.expected, tie.actual, tie.verdict) == (1, 2, 5, "tie")
    assert str(tie) == ("first divergence at new token 1: reference 2, got 5; reference top-2 logprob gap 0.1, "
                        "measured noise 0.2: numerical tie")
    assert judge([1, 2, 3], [1, 5, 3], at(0.3, 0.2)).verdict == "bug"
    assert judge([1, 2, 3], [1, 5, 3], at(0.0, 0.2, frozenset({2, 9}))).verdict == "bug"   # 5 is not among the two best
    assert judge([1, 2, 3], [1, 5, 3], at(0.0, 0.2, frozenset({2, 5}))).verdict == "tie"
    length = judge([1, 2], [1, 2, 3], at(0.0, 1e9), noise=1e9)
    assert length.verdict == "bug" and "a length difference" in str(length) and str(length).endswith("BUG")
    shapes = judge([4, 6], [4, 7], lambda i: Scores(0.01, 0.5, replay=[2, 3]))
    assert str(shapes).endswith("numerical tie; the engine's own block pass of width [2, 3] gives 7")
