"""spec.eagle: an EAGLE-style head over the target's features, trained by recipes/train_eagle.py.

The head is trained here on a tiny fp64 Llama's own greedy text (seconds), then used through the
public API: greedy output equal to plain greedy for chains and trees, single prompts and batches;
a trained head accepted more often than an untrained one (the contract carries what a head needs);
a saved head loads back to the same proposals, and on another target it is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from architectures import cached_model

from spec import eagle, greedy_generate, speculative_generate
from spec.protocols import Drafter, Need

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "train_eagle.py"


def _recipe():
    spec_ = importlib.util.spec_from_file_location("train_eagle", RECIPE)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (8,), generator=gen).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def trained():
    """(target, a head trained on 16 of its greedy continuations, that head's draft vocabulary)."""
    te, target = _recipe(), cached_model("llama")
    data = te.features(target, te.corpus(target, _prompts(16, seed=0), 24))
    ids = te.draft_vocabulary(data, 128)
    head, losses = te.train(target, data, ids, steps=200, batch=64, say=lambda *a: None)
    assert losses[-1] < losses[0] * 0.8, losses                    # it learned something
    return target, head, ids


@pytest.mark.parametrize("branches, gamma", [(1, 1), (1, 3), (2, 3), (3, 2)])
def test_eagle_drafts_keep_greedys_output(trained, branches, gamma):
    target, head, _ = trained
    draft = eagle.EagleDraft(head, branches=branches)
    assert isinstance(draft, Drafter) and Need.HIDDEN in draft.needs and (Need.TREES in draft.needs) == (branches > 1)
    for prompt in _prompts(4, seed=1):
        out = speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=20)
        assert out.tokens == greedy_generate(target, prompt, max_new_tokens=20).tokens
        assert out.rounds[0].drafted == 0 and out.drafted > 0        # no state before the first round


def test_eagle_in_a_batch_is_each_rows_greedy(trained):
    target, head, _ = trained
    prompts = _prompts(3, seed=2)
    outs = speculative_generate(target, eagle.EagleDraft(head), prompts, gamma=3, max_new_tokens=16)
    assert [o.tokens for o in outs] == [greedy_generate(target, p, max_new_tokens=16).tokens for p in prompts]


def test_a_trained_head_is_accepted_more_often_than_an_untrained_one(trained):
    """On the text it was trained on (a random tiny model's text does not generalise from 16
    sequences), the trained head is accepted more often than the untrained one (which proposes
    the target's argmax at the state it heard, the token just emitted): the recipe's training
    reaches the drafter through the public API. (That each state is the right position's is
    test_tree.py's hidden-state test, against the cache-free forward.)"""
    target, head, ids = trained
    prompts = _prompts(16, seed=0)[:6]
    te = _recipe()
    good = te.evaluate(target, head, prompts, gamma=3, new_tokens=16)
    blank = te.evaluate(target, eagle.EagleHead(target, ids), prompts, gamma=3, new_tokens=16)
    assert good["equal"] and blank["equal"]
    assert good["alpha"] > blank["alpha"] + 0.05, (good["alpha"], blank["alpha"])


def test_a_saved_head_loads_to_the_same_proposals_and_is_refused_on_another_target(trained, tmp_path):
    target, head, _ = trained
    path = tmp_path / "head.pt"
    eagle.save(head, target, path, {"note": "test"})
    again = eagle.load(path, target)
    f = torch.randn(5, head.out.out_features, generator=torch.Generator().manual_seed(4))
    x = torch.tensor([1, 2, 3, 4, 5])
    assert torch.equal(again.logits(again.step(f, x)), head.logits(head.step(f, x)))
    from spec.models import build_gpt_neox
    with pytest.raises(ValueError, match="trained for a target with hidden size 64 and 256 logits"):
        eagle.load(path, build_gpt_neox("tiny-target", seed=0))


def test_branches_must_be_a_positive_integer(trained):
    with pytest.raises(ValueError, match="branches must be an integer >= 1"):
        eagle.EagleDraft(trained[1], branches=0)
