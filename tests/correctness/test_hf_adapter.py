"""spec.hf's peers (HF generate, assisted generation, prompt lookup) run exactly what they claim.

generate() fills every field of the GenerationConfig it is passed that is left unset from the
model's own generation_config (5.17 and 5.24). Every real checkpoint ships an EOS there, so
`eos_token_id=None` used to stop at it anyway: a model whose generation_config holds the very
token greedy emits third shows it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from spec import greedy_generate, hfref
from spec.models import perturbed_copy

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93]
NEW = 20


@pytest.fixture(scope="module")
def eos_target(target):
    """The fp64 tiny target, its generation_config's EOS set to the third token greedy emits
    (a token that occurs nowhere before it, so greedy would stop there), and a repetition
    penalty that would change greedy's choices if it leaked into the reference."""
    model = copy.deepcopy(target)
    free = greedy_generate(model, PROMPT, max_new_tokens=NEW).tokens
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    model.generation_config.eos_token_id = eos
    model.generation_config.repetition_penalty = 3.0
    return model, free, eos


def test_hf_greedy_without_eos_runs_to_max_new_tokens(eos_target):
    model, free, eos = eos_target
    before = model.generation_config.to_dict()
    out = hfref.hf_greedy(model, torch.tensor(PROMPT), NEW, eos_token_id=None)
    assert len(out) == NEW and out == free
    assert model.generation_config.to_dict() == before  # the model's own config is put back


def test_hf_greedy_with_eos_stops_there(eos_target):
    model, free, eos = eos_target
    out = hfref.hf_greedy(model, torch.tensor(PROMPT), NEW, eos_token_id=eos)
    assert out == free[:free.index(eos) + 1]


def test_hf_assisted_without_eos_runs_to_max_new_tokens(eos_target):
    model, free, _ = eos_target
    assistant = hfref.assistant_for(model, perturbed_copy(model, noise=0.1, seed=3, dtype=torch.float32))
    out = hfref.hf_assisted(model, assistant, torch.tensor(PROMPT), 3, NEW, eos_token_id=None)
    assert out == free


def test_hf_prompt_lookup_without_eos_runs_to_max_new_tokens(eos_target):
    model, free, _ = eos_target
    # a prompt that repeats itself, so that lookup drafts something
    prompt = PROMPT * 3
    expected = greedy_generate(model, prompt, max_new_tokens=NEW).tokens
    out = hfref.hf_prompt_lookup(model, torch.tensor(prompt), NEW, eos_token_id=None)
    assert out == expected and len(out) == NEW


def test_peer_table_withholds_speed_when_outputs_differ():
    """The CLI's peer table: a peer that stopped early did other work, so no speed ratio."""
    import types

    from spec.experiment import report
    from spec.experiment.records import Peer, PromptRecord
    greedy = list(range(10, 30))

    def rec(i, toks):  # greedy 2.5 s, speculative 1.0 / 1.7 s: HF 2.5x greedy's speed, ours 1.7x HF's
        peer = Peer("hf_assisted", tokens=toks, times=[1.0], identical=toks == greedy)
        return PromptRecord(index=i, prompt="p", prompt_tokens=1, greedy=types.SimpleNamespace(tokens=greedy),
                            spec=types.SimpleNamespace(tokens=greedy), greedy_times=[2.5], spec_times=[1.0 / 1.7],
                            trace_repeat=0, peers=[peer])
    table = report.peer_table([rec(1, greedy), rec(2, greedy[:3]), rec(3, greedy[:5] + [99] + greedy[6:])])
    lines = table.splitlines()
    row = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in "123"}
    assert "2.50x" in row["1"] and "1.70x" in row["1"] and "YES" in row["1"]
    assert "2.50x" not in row["2"] and "1.70x" not in row["2"]
    assert "NO: 3 tokens where greedy made 20 (it stopped early)" in row["2"]
    assert "NO: differs at new token 5 (99 vs greedy's 15)" in row["3"]


def test_hf_assisted_puts_both_configs_back_even_when_generate_fails(eos_target, monkeypatch):
    """One HF peer layer (hfref.hf_generate): gamma is set on the assistant's generation_config only for
    the call; afterwards, and after a failing call, target and assistant hold their own configs."""
    model, free, _ = eos_target
    assistant = hfref.assistant_for(model, perturbed_copy(model, noise=0.1, seed=3, dtype=torch.float32))
    before = model.generation_config.to_dict(), assistant.generation_config.to_dict()
    assert hfref.hf_assisted(model, assistant, torch.tensor(PROMPT), 4, NEW) == free
    assert (model.generation_config.to_dict(), assistant.generation_config.to_dict()) == before
    seen = []

    def failing(*args, **kwargs):
        seen.append(assistant.generation_config.num_assistant_tokens)
        raise RuntimeError("generate failed")

    monkeypatch.setattr(model, "generate", failing)
    with pytest.raises(RuntimeError, match="generate failed"):
        hfref.hf_assisted(model, assistant, torch.tensor(PROMPT), 4, NEW)
    assert seen == [4] and assistant.generation_config.num_assistant_tokens != 4
    assert (model.generation_config.to_dict(), assistant.generation_config.to_dict()) == before
