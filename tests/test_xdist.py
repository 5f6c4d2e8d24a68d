"""The suite across pytest-xdist workers (`pytest -n 2`): timing cases run with nothing beside
them (tests/serial_timing.py), and the results are those of a serial run.

Checked on a scratch project of sleeping tests that log when they ran, run in a subprocess
under `-n 2` with this repository's serial_timing plugin: no ordinary test may be running while
a perf or gate case runs, both workers must have run tests, and the outcomes equal a serial
run's. The scratch project does not import torch, so its workers start in about a second."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is in the `test` extra: pip install -e '.[test]'")

TESTS = Path(__file__).resolve().parent

SCRATCH_TESTS = """
import json, os, time
import pytest

LOG = os.environ["SPEC_XDIST_LOG"]

def _run(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER", "main"), start, time.monotonic()]) + "\\n")

@pytest.mark.parametrize("i", range(16))
def test_plain(i): _run(f"plain{i}", 0.05)

@pytest.mark.perf
@pytest.mark.parametrize("i", range(3))
def test_perf(i): _run(f"perf{i}", 0.3)

@pytest.mark.gate
def test_gate(): _run("gate", 0.3)

@pytest.mark.parametrize("i", range(16, 32))
def test_plain_late(i): _run(f"plain{i}", 0.05)

@pytest.mark.skip(reason="counted the same either way")
def test_skipped(): pass
"""


@pytest.fixture
def scratch(pytester, tmp_path):
    pytester.makeini("[pytest]\nmarkers =\n    perf: timing\n    gate: timing\n")
    pytester.makepyfile(test_scratch=SCRATCH_TESTS)
    return pytester


def _run_spread(pytester, log: Path):
    """`pytest -n 2` with only xdist and serial_timing loaded (no torch, no hypothesis: fast workers)."""
    env = {"SPEC_XDIST_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for key, value in env.items():
        pytester._monkeypatch.setenv(key, value)
    result = pytester.runpytest_subprocess("-p", "xdist", "-p", "serial_timing", "-p", "no:cacheprovider",
                                           "-n", "2", timeout=120)
    return result, [json.loads(line) for line in log.read_text().splitlines()]


def test_timing_cases_run_alone_and_counts_match_serial(scratch, tmp_path):
    result, runs = _run_spread(scratch, tmp_path / "runs.log")
    # A serial run of the scratch file: 32 plain + 3 perf + 1 gate pass, 1 skipped.
    assert result.parseoutcomes() == {"passed": 36, "skipped": 1}
    assert sorted(r[0] for r in runs) == sorted([f"plain{i}" for i in range(32)] + ["perf0", "perf1", "perf2", "gate"])
    assert {r[1] for r in runs} == {"gw0", "gw1"}, "both workers should have run tests"
    for name, worker, start, end in runs:
        if name.startswith("plain"):
            continue
        beside = [r[0] for r in runs if r[0] != name and r[2] < end and start < r[3]]
        assert not beside, f"{name} (on {worker}) ran while {beside} ran"
