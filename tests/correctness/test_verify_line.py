"""The verify pass priced as a fixed cost plus a per-token slope (spec.experiment.measure.verify_line,
spec.theory with verify_fixed, spec.experiment.predicted_speedup); values worked by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spec import experiment, theory
from spec.experiment import measure


def test_verify_line_recovers_fixed_and_slope(monkeypatch, target):
    # one-token step 10 ms; a pass drafting g >= 1 costs 15 + 0.5 g ms: 1.5 + 0.05 g steps.
    # The one-token step is not on that line: a line through it would read fixed = 1.
    fake = lambda model, ids, gammas, repeats=6: {g: (15.0 + 0.5 * g if g else 10.0) / 1e3 for g in gammas}
    monkeypatch.setattr(measure, "pass_times", fake)
    line = measure.verify_line(target, [1, 2, 3], max_gamma=16)
    assert line.fixed == pytest.approx(1.5) and line.slope == pytest.approx(0.05)
    assert line.measured[0] == 1.0 and line.measured[16] == pytest.approx(2.3)
    assert line.cost(0) == 1.0 and line.cost(4) == pytest.approx(1.7)


class ScriptedPasses:
    """Stands in for measure.pass_times: records what it was asked, answers from a table of ms."""

    def __init__(self, ms_of):
        self.ms_of, self.calls = ms_of, []

    def __call__(self, model, ids, gammas, repeats=6):
        self.calls.append((model, ids, list(gammas), repeats))
        return {g: self.ms_of(g) / 1e3 for g in gammas}


@pytest.mark.parametrize("ms_of, max_gamma", [
    (lambda g: 10.0 if g == 0 else (14.0 if g == 1 else 12.0 + g), 16),   # a bump at g = 1
    (lambda g: 10.0 if g == 0 else 5.0 + 1.0 * g, 16),                     # fixed 0.5 step: below one
    (lambda g: 10.0 if g == 0 else 30.0 - g, 16),                          # falling: slope clamped to 0
    (lambda g: 10.0 if g == 0 else -2.0 + 4.0 * g, 16),                     # intercept -0.2: clamped to 0
    (lambda g: 10.0 if g == 0 else 2.0 + 3.0 * g + (2.0 if g == 3 else 0.0), 6),
    (lambda g: 10.0 if g == 0 else 12.0 + g, 7)])
def test_verify_line_asks_for_its_gammas_and_fits_only_passes_that_draft(monkeypatch, target, ms_of, max_gamma):
    """The g >= 1 passes are fitted by least squares (numpy's polyfit here, not spec's sums); the
    one-token step only sets the unit. A negative slope is clamped to 0 (then the line is flat at the
    mean) and a negative intercept to 0."""
    np = pytest.importorskip("numpy")
    fake = ScriptedPasses(ms_of)
    monkeypatch.setattr(measure, "pass_times", fake)
    line = measure.verify_line(target, [1, 2, 3], max_gamma=max_gamma, repeats=3)
    expected_gammas = sorted({0, 1, 2, max(1, max_gamma // 4), max(1, max_gamma // 2), max_gamma})
    assert fake.calls == [(target, [1, 2, 3], expected_gammas, 3)]
    assert expected_gammas == {16: [0, 1, 2, 4, 8, 16], 6: [0, 1, 2, 3, 6], 7: [0, 1, 2, 3, 7]}[max_gamma]
    assert all(type(g) is int for g in fake.calls[0][2])
    xs = [g for g in expected_gammas if g >= 1]
    ys = [ms_of(g) / ms_of(0) for g in xs]
    slope, fixed = np.polyfit(xs, ys, 1)
    if slope < 0:
        slope, fixed = 0.0, float(np.mean(ys))
    assert line.slope == pytest.approx(slope, abs=1e-12)
    assert line.fixed == pytest.approx(max(fixed, 0.0), abs=1e-12)
    assert line.measured == pytest.approx({g: ms_of(g) / ms_of(0) for g in expected_gammas})
    assert measure.verify_line(target, [1, 2, 3], max_gamma=max_gamma).slope == line.slope
    assert fake.calls[-1][3] == 6  # repeats' default
    measure.verify_line(target, [1, 2, 3])
    assert fake.calls[-1][2] == [0, 1, 2, 4, 8, 16]  # max_gamma's default


def test_costed_speedup_with_a_fixed_verify_cost():
    # alpha 0.8, gamma 4: 1 + .8 + .64 + .512 + .4096 = 3.3616 tokens a round; c = 0;
    # a 5-token pass costs 1.5 + 0.05 * 4 = 1.7 steps.
    assert theory.expected_speedup_costed(0.8, 4, 0.0, 0.05, 1.5) == pytest.approx(3.3616 / 1.7)
    assert theory.expected_speedup_costed(0.8, 4, 0.1, 0.0, 1.0) == pytest.approx(theory.expected_speedup(0.8, 4, 0.1))
    with pytest.raises(ValueError, match="verify_fixed"):
        theory.expected_speedup_costed(0.8, 4, 0.1, 0.0, 0.0)


def test_a_dearer_fixed_cost_lengthens_the_optimal_gamma():
    # A fixed cost is paid once a round, whatever gamma: the more it is, the more a round should carry.
    # alpha 0.6, c 0.1, slope 0, fixed 1 (Theorem 3.8):
    # g=1: 1.6/1.1 = 1.4545; g=2: 1.96/1.2 = 1.6333; g=3: 2.176/1.3 = 1.6738; g=4: 2.3056/1.4 = 1.6469 -> 3
    assert theory.optimal_gamma(0.6, 0.1, 16) == 3
    # fixed 2: g=3: 2.176/2.3 = .9461; g=4: 2.3056/2.4 = .9607; g=5: 2.38336/2.5 = .9533 -> 4
    assert theory.optimal_gamma(0.6, 0.1, 16, verify_fixed=2.0) == 4


def test_predicted_speedup_from_the_rounds():
    # 10 tokens of greedy in 1.0 s: a step is 0.1 s. Rounds drafted 0, 3, 2 tokens; a pass of
    # g >= 1 costs 1.5 + 0.1 g steps: 1 + 1.8 + 1.7 = 4.5 steps = 0.45 s, plus 0.05 s of drafting.
    spec = SimpleNamespace(trace=[SimpleNamespace(draft_s=0.02), SimpleNamespace(draft_s=0.03)],
                           drafted_per_round=[0, 3, 2])
    rec = SimpleNamespace(greedy_s=1.0, greedy=SimpleNamespace(tokens=[0] * 10), spec=spec)
    assert experiment.predicted_speedup([rec], 1.5, 0.1) == pytest.approx(1.0 / 0.5)
    assert experiment.predicted_speedup([rec], 1.0, 0.0) == pytest.approx(1.0 / 0.35)
