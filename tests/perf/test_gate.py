"""The exact half of the regression gate (`pytest -m gate`; see gate.py): accepted tokens per
round, per-position acceptance and alpha of greedy speculative decoding on fixed prompts,
compared exactly with tests/perf/baseline.json. The speed half is in test_cpu_speed.py
(the cases marked gate)."""

from __future__ import annotations

import pytest

import gate
from perfkit import NEW_TOKENS, acceptance
from spec import speculative_generate

pytestmark = [pytest.mark.perf, pytest.mark.gate]
GAMMA = 5


def test_acceptance_is_exactly_the_baseline(cpu_pair, cpu_greedy):
    results = [speculative_generate(cpu_pair.target, cpu_pair.draft, p, gamma=GAMMA, max_new_tokens=NEW_TOKENS)
               for p in cpu_pair.prompts]
    assert [r.tokens for r in results] == cpu_greedy  # exactness first; the gate's figures come from exact runs
    gate.check_exact(cpu_pair.key, gate.exact_figures(results, GAMMA, acceptance(results)["alpha"]))


def test_per_position_acceptance_by_hand():
    """Rounds (drafted, accepted): (5, 5) tests positions 1-5, all pass; (5, 2) tests 1-3, passes 1-2;
    (3, 0) tests 1 and fails; (2, 2) tests 1-2, both pass (a round cut short by max_new_tokens).
    Position 1: tested in all 4 rounds, passed in 3; position 2: tested in 3, passed in 3;
    position 3: tested in (5, 5) and (5, 2), passed in 1; positions 4 and 5: only (5, 5)."""
    class R:
        def __init__(self, drafted, accepted):
            self.drafted_per_round, self.accepted_per_round = drafted, accepted

    counts = gate.per_position_acceptance([R([5, 5], [5, 2]), R([3, 2], [0, 2])], 5)
    assert counts == [[3, 4], [3, 3], [1, 2], [1, 1], [1, 1]]


def test_changes_are_shown_old_against_new():
    old = {"accepted_per_round": [[5, 5, 1], [2]], "alpha": 0.8, "per_position_acceptance": [[1, 2]]}
    new = {"accepted_per_round": [[5, 4, 1], [2]], "alpha": 0.75, "per_position_acceptance": [[1, 2]]}
    rows = gate.exact_changes(old, new)
    assert rows == [["prompt 1: accepted per round (from round 2)", "[5, 1]", "[4, 1]"],
                    ["alpha", "0.8", "0.75"]]


def test_exact_failure_is_a_short_table_without_traceback():
    stored = gate.load()["exact"]["shipped-pair"]
    with pytest.raises(pytest.fail.Exception) as failure:
        gate.check_exact("shipped-pair", {**stored, "alpha": 0.5})
    assert not failure.value.pytrace
    lines = str(failure.value).splitlines()
    assert "acceptance of shipped-pair changed" in lines[0] and lines[1].split() == ["what", "baseline", "now"]
    assert lines[3].split() == ["alpha", repr(stored["alpha"]), "0.5"] and len(lines) == 4


def test_speed_failure_names_the_ratio_and_the_allowance():
    speed = gate.load()["speed"]
    base = speed["ratios"]["shipped-pair"]["speculative / greedy"]
    floor = base * (1 - speed["tolerance"])
    gate.check_speed("shipped-pair", "speculative / greedy", floor * 1.01)  # inside the tolerance: passes
    with pytest.raises(pytest.fail.Exception) as failure:
        gate.check_speed("shipped-pair", "speculative / greedy", base / 2)
    assert not failure.value.pytrace
    row = str(failure.value).splitlines()[-1].split()
    assert row == ["speculative", "/", "greedy", f"{base:.2f}x", f"{base / 2:.2f}x", ">=", f"{floor:.2f}x", "-50%"]
