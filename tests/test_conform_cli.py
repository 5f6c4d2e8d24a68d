"""`python -m spec conform`: option errors (exit 2) in-process, and end to end in a subprocess
(thorough: a fresh interpreter costs tens of seconds here) against spec and a broken decoder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import spec.__main__ as cli
from spec import conform

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv", [["conform", "--budget", "0"], ["conform", "--impl", "no-such-decoder"],
                                  ["conform", "--impl", "/no/such/file.py:generate"],
                                  ["conform", "--impl", "spec.decode:no_such_function"]])
def test_conform_bad_options_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_conform_row_names():
    assert conform._split("tests/conformance/test_greedy.py::test_greedy_exact[llama-partial]") == \
        ("greedy_exact", "llama-partial")
    assert conform._split("tests/conformance/test_sampling_law.py::test_determinism") == ("determinism", "")


TOKEN_CHANGED = '''
from spec.impls import spec_generate
from spec import greedy_generate

def generate(target, draft, input_ids, *, gamma, max_new_tokens, **options):
    """Wrong on purpose: the token after the greedy continuation's first 3 is replaced."""
    tokens = spec_generate(target, draft, input_ids, gamma=gamma, max_new_tokens=max_new_tokens, **options)
    if len(tokens) > 3:
        tokens[3] = (tokens[3] + 1) % 500
    return tokens
'''


@pytest.mark.thorough
@pytest.mark.slow
@pytest.mark.parametrize("impl, expected_exit", [("spec", 0), ("BROKEN", 1)])
def test_conform_end_to_end(tmp_path, impl, expected_exit):
    if impl == "BROKEN":
        (tmp_path / "broken.py").write_text(textwrap.dedent(TOKEN_CHANGED))
        impl = f"{tmp_path / 'broken.py'}:generate"
    out = tmp_path / "conformance.json"
    run = subprocess.run([sys.executable, "-m", "spec", "conform", "--impl", impl, "--out", str(out),
                          "-k", "greedy_exact and gpt-neox-partial"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == expected_exit, run.stdout + run.stderr
    report = json.loads(out.read_text())
    (row,) = [r for r in report["results"] if r["property"] == "greedy_exact"]
    assert row["outcome"] == ("passed" if expected_exit == 0 else "failed")
    if expected_exit:
        assert "property greedy_exact violated" in row["evidence"] and "BUG" in row["evidence"]
        assert "FAIL" in run.stdout
