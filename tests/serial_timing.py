"""Timing cases run alone under pytest-xdist (`pytest -n 2`, `pytest -n auto`).

A perf or gate case times the decoders against each other and against the model's step
costs; with another worker decoding on the next core its numbers are a measurement of the
contention, not of the code (on this 2-core machine a 12-layer step took 215 ms instead of
68 ms under load). Skipping them under xdist would make `pytest -n 2` report fewer passes
than `pytest`, so instead they keep the machine to themselves: every test of a distributed
run takes a lock on a file the controller hands its workers, shared for ordinary tests and
exclusive for timing ones, over its setup, call and teardown (fixtures such as the perf
suite's measured step costs are timed in setup). While a timing case holds it, the other
workers wait before their next test; a worker that wants to time first stops new ordinary
tests from starting (a turnstile lock), so it is not starved by a stream of short ones.

Without xdist (a plain `pytest`) nothing here does anything. The locks are POSIX `flock`s;
where there is no `fcntl` (Windows) timing cases are not isolated, and say so once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

TIMING_MARKERS = ("perf", "gate")
_KEY = "spec_timing_lock_dir"
_DIR = pytest.StashKey[Path]()
_FILES = pytest.StashKey[tuple]()


def is_timing(item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in TIMING_MARKERS)


def under_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


# --- the controller: one lock directory a run, handed to every worker ------------------------

def pytest_configure(config):
    if under_xdist_worker(config) or config.getoption("dist", "no") == "no":
        return
    config.stash[_DIR] = Path(tempfile.mkdtemp(prefix="spec-timing-lock-"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    lock_dir = node.config.stash.get(_DIR, None)
    if lock_dir is not None:
        node.workerinput[_KEY] = str(lock_dir)


def pytest_unconfigure(config):
    lock_dir = config.stash.get(_DIR, None)
    if lock_dir is not None:
        shutil.rmtree(lock_dir, ignore_errors=True)
    files = config.stash.get(_FILES, None)
    if files is not None:
        for f in files:
            f.close()


# --- a worker: shared lock for ordinary tests, exclusive for timing ones ----------------------

def _lock_files(config):
    files = config.stash.get(_FILES, None)
    if files is None:
        lock_dir = Path(config.workerinput[_KEY])
        files = (open(lock_dir / "turnstile", "a+b"), open(lock_dir / "machine", "a+b"))  # noqa: SIM115
        config.stash[_FILES] = files
    return files


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    config = item.config
    if not under_xdist_worker(config) or _KEY not in config.workerinput:
        yield
        return
    if fcntl is None:  # pragma: no cover - Windows
        if is_timing(item):
            warnings.warn("no fcntl here: timing cases run next to other xdist workers", stacklevel=1)
        yield
        return
    turnstile, machine = (f.fileno() for f in _lock_files(config))
    timing = is_timing(item)
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        # A timing case holds the turnstile until it has the machine, so no new ordinary test
        # starts in between; an ordinary test only passes through it.
        if not timing:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(machine, fcntl.LOCK_EX if timing else fcntl.LOCK_SH)
    finally:
        if timing:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(machine, fcntl.LOCK_UN)


def timed_alone() -> bool:
    """True in an xdist worker, where pytest-benchmark turns itself off but the timing cases
    still have the machine to themselves (see the module docstring)."""
    return "PYTEST_XDIST_WORKER" in os.environ
