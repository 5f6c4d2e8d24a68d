"""The exact half of the regression gate (`pytest -m gate`; see gate.py): accepted tokens per
round, per-position acceptance and alpha of greedy speculative decoding on fixed prompts,
compared exactly with tests/perf/baseline.json. The speed half is in test_cpu_speed.py
(the cases marked gate)."""

from __future__ import annotations

import pytest

import gate
from perfkit import NEW_TOKENS, SideBySide, acceptance
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
    assert row == ["speculative", "/", "greedy", f"{base:.2f}x", f"{base / 2:.2f}x", f"{base / 2:.2f}", ">=",
                   f"{floor:.2f}x", "-50%"]


# --- the speed verdict on scripted side-by-side timings -------------------------------------------
# Three rounds of three prompts, as test_cpu_speed.py times them: [round][prompt] seconds of the
# baseline (greedy) and of the candidate (speculative). The floor is the stored baseline's.

def _floor() -> float:
    speed = gate.load()["speed"]
    return speed["ratios"]["shipped-pair"]["speculative / greedy"] * (1 - speed["tolerance"])


def _timed(per_round_speedups: list[float]) -> SideBySide:
    """Side-by-side seconds whose rounds give these speedups (each prompt a little different)."""
    candidate = [[1.0, 1.2, 0.8] for _ in per_round_speedups]
    baseline = [[s * c for c in row] for s, row in zip(per_round_speedups, candidate)]
    outputs = [None] * len(candidate[0])                        # one output a prompt (not looked at here)
    return SideBySide(outputs, outputs, baseline, candidate)


def _check(run: SideBySide) -> None:
    gate.check_speed("shipped-pair", "speculative / greedy", run.mean_speedup, repeats=run.round_speedups)


def test_scripted_clean_pass_passes():
    floor = _floor()
    run = _timed([1.3 * floor, 1.25 * floor, 1.35 * floor])
    assert run.round_speedups == pytest.approx([1.3 * floor, 1.25 * floor, 1.35 * floor])
    assert gate.speed_verdict("shipped-pair", "speculative / greedy", run.round_speedups).outcome == gate.PASS
    _check(run)                                               # returns: no failure, no skip


def test_scripted_clean_regression_fails_with_its_table():
    floor = _floor()
    run = _timed([0.7 * floor, 0.75 * floor, 0.72 * floor])     # every round well under the floor
    with pytest.raises(pytest.fail.Exception) as failure:
        _check(run)
    assert not failure.value.pytrace and "fell below the tolerance" in str(failure.value)
    assert f"{0.7 * floor:.2f}, {0.75 * floor:.2f}, {0.72 * floor:.2f}" in str(failure.value)   # the rounds


def test_scripted_noisy_rounds_are_too_noisy_to_judge_not_a_failure():
    """One round slowed by another job: the rounds straddle the floor, their spread (here 0.8 of the
    floor) is wider than the median's distance from it. Skipped, with every round and the spread."""
    floor = _floor()
    run = _timed([1.3 * floor, 0.5 * floor, 1.2 * floor])
    verdict = gate.speed_verdict("shipped-pair", "speculative / greedy", run.round_speedups)
    assert verdict.outcome == gate.TOO_NOISY and verdict.spread > abs(verdict.distance())
    with pytest.raises(pytest.skip.Exception) as skipped:
        _check(run)
    text = str(skipped.value)
    assert "too noisy to judge" in text and f"spread {0.8 * floor:.2f}" in text
    assert f"{1.3 * floor:.2f}, {0.5 * floor:.2f}, {1.2 * floor:.2f}" in text and "2 of 3 inside" in text
    # and the other way: a regression with one lucky round is not failed on the other two either
    lucky = _timed([0.7 * floor, 1.1 * floor, 0.6 * floor])
    with pytest.raises(pytest.skip.Exception, match="too noisy to judge"):
        _check(lucky)


def test_a_band_is_judged_on_both_sides_and_settled_with_the_speed():
    """The Theorem 3.8 band (lo..hi) the same way; any failure wins over too noisy, too noisy over a pass."""
    inside, below, above = gate.judge("band", [0.9, 1.0]), gate.judge("band", [0.5, 0.55], 0.6, 1.3), \
        gate.judge("band", [1.4, 1.5], 0.6, 1.3)
    assert (inside.outcome, below.outcome, above.outcome) == (gate.PASS, gate.FAIL, gate.FAIL)
    straddles = gate.judge("band", [0.5, 0.9, 1.4], 0.6, 1.3)
    assert straddles.outcome == gate.TOO_NOISY
    assert gate.judge("band", [0.9], 0.6, 1.3).outcome == gate.PASS       # one round (--benchmark-disable)
    gate.settle([inside])
    with pytest.raises(pytest.skip.Exception):
        gate.settle([inside, straddles])
    with pytest.raises(pytest.fail.Exception, match="band: repeats 0.50, 0.55"):
        gate.settle([straddles, below])
