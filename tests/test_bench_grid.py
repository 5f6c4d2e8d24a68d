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


def test_a_childs_peak_is_its_own_not_its_parents():
    """A child's peak RSS is read from VmHWM, which starts afresh at exec: getrusage's ru_maxrss carries the
    parent's high-water mark over (the grid's own ~480 MB was every llama.cpp Q4_1 child's peak)."""
    import subprocess
    import sys
    ballast = bytearray(400 << 20)
    for at in range(0, len(ballast), 4096):
        ballast[at] = 1                         # (resident: this process's peak is at least 400 MB)
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'recipes')!r}); import bench_grid; "
            "print(bench_grid.peak_rss_mb())")
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1 < child < 200, f"the child read {child:.0f} MB: its parent's peak, not its own"
    del ballast
