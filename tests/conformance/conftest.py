"""Fixtures of the conformance kit: the decoder under test (`pytest --impl NAME`) and the budget.

`--impl`: spec (default), hf-assisted, hf-prompt-lookup, module:function or path/to/file.py:function
(see spec/impls.py for the interface). `--conform-budget B` scales every example count and sample
size by B (default 1: the kit against spec fits in about a minute of this CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The chi-square machinery and the prompt strategies live with the correctness suite.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "correctness"))

from spec import impls  # noqa: E402


@pytest.fixture(scope="session")
def impl(pytestconfig):
    name = pytestconfig.getoption("--impl")
    try:
        return impls.load(name)
    except Exception as err:  # a bad --impl is a usage error, not 60 failing tests
        raise pytest.UsageError(f"--impl {name!r}: {type(err).__name__}: {err}") from None


@pytest.fixture(scope="session")
def budget(pytestconfig) -> float:
    value = pytestconfig.getoption("--conform-budget")
    if not value > 0:
        raise pytest.UsageError(f"--conform-budget must be a number > 0, got {value}")
    return value
