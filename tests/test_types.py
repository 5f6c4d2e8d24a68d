"""The decode loop is typed against its protocols: mypy over the files `[tool.mypy]` in
pyproject.toml names (the loop, its drafters and runners, the chooser, the acceptance rule) finds
nothing. Imports beyond those files are not followed, so torch and transformers are Any and the
run takes seconds; what it checks is spec's own contracts (spec/protocols.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="the type check needs mypy (in the `test` extra)")
ROOT = Path(__file__).resolve().parent.parent


def _mypy(*files: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--config-file",
                           str(ROOT / "pyproject.toml"), *files], cwd=cwd, capture_output=True, text=True)


def test_the_loop_and_what_it_runs_on_type_check():
    run = _mypy()
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_check_rejects_a_drafter_that_breaks_the_protocol(tmp_path):
    """Negative control: a batch drafter without `select` handed to the loop's type is an error."""
    (tmp_path / "half.py").write_text(
        "from spec.protocols import BatchDrafter\n\n\n"
        "class Half:\n"
        "    def draft(self, seq, n, gs, live):\n        return [], []\n\n"
        "    def observe(self, n, accepted, live):\n        pass\n\n"
        "    def process(self, steps, live):\n        pass\n\n"
        "    def __len__(self):\n        return 0\n\n\n"
        "drafter: BatchDrafter = Half()\n")
    run = _mypy(str(tmp_path / "half.py"), "spec/protocols.py")
    assert run.returncode == 1 and 'missing following "BatchDrafter" protocol member' in run.stdout \
        and run.stdout.rstrip().splitlines()[-2].endswith("select"), run.stdout + run.stderr
