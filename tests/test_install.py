"""The install a newcomer and CI make: README's test line, the extras it names, and the lock.

.ci/run reads the `pip install ... && pytest` line under "Run the tests" from README.md and runs it
in a brand-new virtual environment; requirements/constraints.txt pins every package it installs.
These checks fail when the three drift apart: an extra the README names that pyproject lacks, or
a dependency added to pyproject without `bash requirements/refresh`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent


def _readme_test_line() -> str:
    """The line .ci/run runs, found the way .ci/run finds it (its own awk program)."""
    script = (ROOT / ".ci" / "run").read_text()
    awk = re.search(r"line=\$\(awk '([^']+)' README.md\)", script).group(1)
    return subprocess.run(["awk", awk, str(ROOT / "README.md")], capture_output=True, text=True,
                          check=True).stdout.strip()


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_ci_runs_the_readme_test_line_with_the_lock():
    line = _readme_test_line()
    assert line.startswith("pip install torch==") and line.endswith("&& pytest"), line
    assert "-c requirements/constraints.txt" in line
    # llama.cpp through the portable, flag-keyed build (never pip's native one: it crashes on AMX CPUs)
    assert "bash requirements/build-llama" in line and "llama]" not in line and ",llama" not in line, line
    # the real model the realmodel tests need, fetched by the same line (what CI runs is what a user runs)
    assert line.endswith("&& python -m spec.realmodel && pytest"), line


def test_the_lock_pins_everything_the_readme_installs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r'"\.\[([a-z,]+)\]"', _readme_test_line()).group(1).split(",")
    extras.append("llama")          # installed by requirements/build-llama at the lock's version
    assert set(extras) <= set(project["optional-dependencies"]), extras
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in extras:
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    pinned = {_name(line) for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wanted <= pinned, f"not in requirements/constraints.txt (run bash requirements/refresh): {wanted - pinned}"
    assert "torch" in pinned
