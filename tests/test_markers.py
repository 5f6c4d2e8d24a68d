"""Markers compose: whatever -m, -k or path a run is given, thorough tests run only when asked
for and GPU tests skip with a reason where there is no CUDA. Checked by running pytest, with
this repository's conftest.py and pytest.ini, on a scratch project of one test per marker mix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SCRATCH_TESTS = """
import pytest

def test_plain(): pass

@pytest.mark.perf
def test_perf(): pass

@pytest.mark.gpu
def test_gpu(): pass

@pytest.mark.gpu
@pytest.mark.perf
def test_gpu_perf(): pass

@pytest.mark.thorough
def test_thorough(): pass

@pytest.mark.perf
@pytest.mark.thorough
def test_perf_thorough(): pass
"""


@pytest.fixture
def scratch(pytester):
    pytester.makeini((ROOT / "pytest.ini").read_text(encoding="utf-8").replace("testpaths = tests\n", ""))
    pytester.makeconftest((ROOT / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_mix=SCRATCH_TESTS)
    return pytester


def _outcomes(pytester, *args) -> dict[str, str]:
    """test name -> passed / skipped (gpu without CUDA); deselected tests are absent."""
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)
    reports = result.reprec.getreports("pytest_runtest_logreport")
    out = {}
    for r in reports:
        name = r.nodeid.split("::")[-1]
        if r.when == "call" or (r.when == "setup" and r.skipped):
            out[name] = "skipped" if r.skipped else r.outcome
    return out


GPU = "passed" if torch.cuda.is_available() else "skipped"


@pytest.mark.parametrize("args, expected", [
    ((), {"test_plain": "passed", "test_perf": "passed", "test_gpu": GPU, "test_gpu_perf": GPU}),
    (("-m", "not perf"), {"test_plain": "passed", "test_gpu": GPU}),
    (("-m", "perf"), {"test_perf": "passed", "test_gpu_perf": GPU}),
    (("-k", "perf"), {"test_perf": "passed", "test_gpu_perf": GPU}),
    (("-m", "not gpu"), {"test_plain": "passed", "test_perf": "passed"}),
    (("-m", "thorough"), {"test_thorough": "passed", "test_perf_thorough": "passed"}),
    (("-m", "perf and thorough"), {"test_perf_thorough": "passed"}),
    (("-m", "not gpu", "--thorough"), {"test_plain": "passed", "test_perf": "passed", "test_thorough": "passed",
                                       "test_perf_thorough": "passed"}),
    (("-k", "thorough"), {}),
], ids=["default", "not-perf", "perf", "k-perf", "not-gpu", "m-thorough", "perf-and-thorough",
        "thorough-option", "k-thorough"])
def test_markers_compose(scratch, args, expected):
    assert _outcomes(scratch, *args) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_skip_names_the_reason(scratch):
    result = scratch.runpytest_inprocess("-p", "no:cacheprovider", "-rs", "-m", "gpu")
    result.stdout.fnmatch_lines(["*gpu: no CUDA device on this machine*"])
