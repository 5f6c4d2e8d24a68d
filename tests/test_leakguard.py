"""The leak guard (tests/leakguard.py) fails the test that leaves a patch behind, names it and the
attribute, and restores the attribute so that the next test runs on the real thing."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

LEAKY = '''
import torch
import spec.models


def test_leaks_cuda_availability():
    torch.cuda.is_available = lambda: True          # no undo: a leak


def test_leaks_a_loader_and_a_backend_flag():
    spec.models.load_model = lambda *a, **k: "stand-in"
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark


def test_runs_on_the_real_thing_afterwards():
    assert torch.cuda.is_available() is False
    assert spec.models.load_model.__module__ == "spec.models"


def test_a_patch_undone_by_monkeypatch_is_no_leak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spec.models, "load_model", lambda *a, **k: None)
'''


def test_the_guard_fails_the_leaking_test_and_restores(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest_subprocess("-p", "leakguard", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=4, errors=2)
    result.stdout.fnmatch_lines([
        "*test_leaky.py::test_leaks_cuda_availability left process-wide state changed (restored now): "
        "torch.cuda.is_available (was <function is_available*, left as <function test_leaks_cuda_availability.<locals>*",
        "*test_leaky.py::test_leaks_a_loader_and_a_backend_flag left process-wide state changed*"
        "torch.backends.cudnn.benchmark (was False, left as True)*spec.models.load_model*",
    ])
