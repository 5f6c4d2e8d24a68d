"""OpenVINO GenAI (spec/conformance/openvino.py) as a subject: its speculative decoding (a draft model,
prompt lookup) against its own plain greedy, token for token, on SmolLM2-135M-Instruct (the fp32 export
as the target, the int8 weight-compressed export as the draft), the five seed prompts x 64 tokens.
A divergence passes only as a numerical tie, by spec.diagnose against spec's fp32 transformers model;
and each speculative mode must have speculated (fewer generation steps than tokens, by the pipeline's
own counters), or its exactness proves nothing.

Skipped with the reason when SPEC_OPENVINO_PYTHON is unset (a venv with openvino-genai and optimum-intel:
recipes/openvino_setup.sh) or the real model is not in the cache. The first run exports the model to
OpenVINO IR into the cache (fp32 and int8, about two minutes); later runs take about a minute and a half
on 2 cores."""

from __future__ import annotations

import pytest

from spec import realmodel
from spec.conformance import openvino
from spec.diagnose import Verdict, diagnose
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS

PYTHON, WHY = openvino.python()
pytestmark = [pytest.mark.realmodel, pytest.mark.skipif(PYTHON is None, reason=str(WHY))]

N = 64
K = 5          # num_assistant_tokens
MODES = ("plain", "draft", "lookup")


@pytest.fixture(scope="module")
def outcome():
    """(the fp32 transformers model, prompt ids, {mode: [Run per prompt]})."""
    if not realmodel.converted():
        pytest.skip(f"SmolLM2-135M-Instruct is not in the cache ({realmodel.fp32_dir()}): `python -m spec.realmodel`")
    target_dir, draft_dir = openvino.models(PYTHON, "int8", say=lambda msg: None)
    model, tok = realmodel.load(say=lambda msg: None)
    prompts = [encode_prompt(tok, text) for text in SEED_PROMPTS]
    runs = {}
    for mode in MODES:
        with openvino.Pipeline(PYTHON, target_dir, mode=mode, draft=draft_dir) as pipe:
            runs[mode] = [pipe.generate(ids, N, k=K) for ids in prompts]
    return model, prompts, runs


def verdicts(model, prompts, reference, runs) -> list[str]:
    """The failures: per prompt, a divergence from the reference that is not a proven tie."""
    bad = []
    for i, (ids, ref, run) in enumerate(zip(prompts, reference, runs)):
        d = diagnose(model, ids, ref.tokens, run.tokens)
        if d is not None and d.verdict != Verdict.TIE:
            bad.append(f"prompt {i}: {d}")
    return bad


def speculated(runs) -> str | None:
    """None when the runs drafted and accepted tokens (fewer generation steps than tokens), else why not."""
    tokens, steps = sum(len(r.tokens) for r in runs), sum(r.steps for r in runs)
    if steps >= tokens:
        return f"did not speculate: {steps} generation steps for {tokens} tokens"
    return None


def test_plain_greedy_emits_one_token_a_step(outcome):
    """The reference is plain greedy: n tokens, one generation step each, no draft counters; so the
    steps counter the speculative checks read means what they take it to mean."""
    _, _, runs = outcome
    for run in runs["plain"]:
        assert len(run.tokens) == N
        assert run.steps == N and run.drafted is None
    assert speculated(runs["plain"]) is not None     # the non-vacuity check refuses plain decoding


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_speculative_equals_its_own_plain_greedy(outcome, mode):
    model, prompts, runs = outcome
    assert [len(r.tokens) for r in runs[mode]] == [N] * len(prompts)
    assert speculated(runs[mode]) is None, f"{mode}: {speculated(runs[mode])}"
    if mode == "draft":
        assert sum(r.accepted for r in runs[mode]) > 0
    assert verdicts(model, prompts, runs["plain"], runs[mode]) == []


def test_the_exactness_check_rejects_a_changed_token(outcome):
    """Negative control: the draft model's runs with one token changed (at position 20, to the id after
    it) are rejected for every prompt: the verdict is not vacuous either."""
    model, prompts, runs = outcome
    broken = [openvino.Run(r.tokens[:20] + [(r.tokens[20] + 1) % 49152] + r.tokens[21:], r.seconds, r.drafted,
                           r.accepted, r.steps) for r in runs["draft"]]
    assert len(verdicts(model, prompts, runs["plain"], broken)) == len(prompts)
