"""Every named mutant in tests/mutate.py still applies: its text occurs exactly once in its file.

A refactor that moves the code a mutant targets must move the mutant too; otherwise
`python tests/mutate.py` would report it as not applied, and the bug it stands for would be guarded
by nothing anyone runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from mutate import MUTANTS, ROOT


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_text_occurs_once(name):
    _, old, new, *where = MUTANTS[name]
    path = Path(ROOT, where[0] if where else "spec/decode.py")
    assert path.read_text().count(old) == 1, f"{name}: its text is not in {path.relative_to(ROOT)} exactly once"
    assert old != new
