"""recipes/bench_revisions.py, the batch-1 speed check against another revision, run on a small
budget: both revisions' `spec` side by side in one process, each run with its own modules.
In a child process, since the recipe swaps `spec` in sys.modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.util, json, sys, tempfile
from pathlib import Path
root = Path(sys.argv[1])
loader = importlib.util.spec_from_file_location("bench_revisions", root / "recipes" / "bench_revisions.py")
recipe = importlib.util.module_from_spec(loader)
loader.loader.exec_module(recipe)
recipe.MAX_NEW = 6
with tempfile.TemporaryDirectory() as tmp:
    sides = {"base": recipe.import_spec(recipe.export("HEAD", Path(tmp) / "base")), "head": recipe.import_spec(root)}
    out = {"files": {}, "tokens": {}, "lazy": {}}
    pairs, ids = recipe.workloads(recipe.activate(sides["head"]), real=False)
    for side, modules in sides.items():
        spec = recipe.activate(modules)
        import spec.decode as decode          # a lazy import made now finds this side's module
        out["files"][side] = [spec.__file__, modules["spec.decode"].__file__]
        out["lazy"][side] = decode.__file__
        for name, (model, draft, gamma) in pairs.items():
            runs = [recipe.time_once(spec, model, draft, gamma, x) for x in ids[:2]]
            assert all(seconds > 0 and 1 <= rounds <= 6 for seconds, _, rounds in runs)
            out["tokens"].setdefault(name, {})[side] = [tokens for _, tokens, _ in runs]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_revision_benchmark_runs_each_revision_on_its_own_modules():
    if not (ROOT / ".git").exists():
        pytest.skip("recipes/bench_revisions.py exports a revision with git: this checkout is not a git clone")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT / "tests")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    base, head = out["files"]["base"], out["files"]["head"]
    assert all(str(ROOT) not in f for f in base) and all(f.startswith(str(ROOT / "spec")) for f in head)
    assert out["lazy"] == {"base": base[1], "head": head[1]}
    assert set(out["tokens"]) == {"pair speculative g5", "pair greedy", "loop: tiny target, pair draft g5",
                                  "loop: tiny greedy"}
    for name, sides in out["tokens"].items():      # HEAD and the working tree decode the same tokens
        assert sides["base"] == sides["head"] and all(len(t) == 6 for t in sides["head"]), name
