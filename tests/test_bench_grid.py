"""recipes/bench_grid.py's random-weight models: SmolLM2's shapes as SmolLM2 has them (the head is the
embedding), the same weights in every child process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _recipe():
    loader = importlib.util.spec_from_file_location("bench_grid", ROOT / "recipes" / "bench_grid.py")
    recipe = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(recipe)
    return recipe


def test_a_random_shape_ties_its_head_to_its_embedding_and_is_the_same_each_time(monkeypatch):
    recipe = _recipe()
    monkeypatch.setitem(recipe.SHAPES, "tiny", (64, 2, 4, 2, 128))
    model, tok = recipe.load("tiny")
    assert tok is None
    assert model.lm_head.weight is model.model.embed_tokens.weight, "an untied head: not SmolLM2's shape"
    again, _ = recipe.load("tiny")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert float(model.model.embed_tokens.weight.std()) > 0.01 and not model.training
