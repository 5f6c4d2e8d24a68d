"""The regression gate: what is exact is compared exactly, what is noisy only as ratios.

Greedy decoding of the shipped pair is deterministic on a CPU at a fixed thread count, so
the accepted tokens of every round, the acceptance at each draft position and alpha on
fixed prompts are exact numbers: any change is a behaviour change, shown as old vs new.
Speed is compared only as ratios timed side by side in one run (speculative / greedy,
HF assisted / ours), against the baseline's ratio less a tolerance chosen from the
run-to-run spread measured on this machine (docs/BENCHMARKS.md). A failure is a short
table, not a traceback.

Each side-by-side round (repeat) gives its own ratio, and the verdict is the repeats':
all inside the allowed range, a pass; all outside it on one side, a failure; some in and
some out, "too noisy to judge": the spread between repeats is wider than the distance
from the bound it would judge, so neither verdict is supported. That outcome is a skip
that names every repeat and the spread (`pytest -rs` lists it), never a failure and never
a silent pass: on a box loaded by other jobs one slow round used to fail the gate, and
the rerun passed. What is exact (acceptance) stays strict whatever the load.

The baseline lives in tests/perf/baseline.json. After an intended change:
    SPEC_UPDATE_BASELINE=1 pytest -m gate     (rewrites the exact section, prints old vs new)
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

BASELINE = Path(__file__).with_name("baseline.json")


def load() -> dict:
    return json.loads(BASELINE.read_text(encoding="utf-8"))


def per_position_acceptance(results, gamma: int) -> list[list[int]]:
    """[accepted, tested] for draft positions 1..gamma, pooled: position i is tested in a round
    that drafted at least i tokens and accepted the first i-1 (later ones are never tested)."""
    counts = [[0, 0] for _ in range(gamma)]
    for r in results:
        for drafted, accepted in zip(r.drafted_per_round, r.accepted_per_round):
            for i in range(min(drafted, accepted + 1)):
                counts[i][1] += 1
                counts[i][0] += i < accepted
    return counts


def exact_figures(results, gamma: int, alpha: float) -> dict:
    return {"accepted_per_round": [r.accepted_per_round for r in results],
            "per_position_acceptance": per_position_acceptance(results, gamma),
            "alpha": alpha}


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 48 else text[:45] + "..."


def exact_changes(old: dict, new: dict) -> list[list[str]]:
    rows = []
    for key in sorted(set(old) | set(new)):
        if key == "accepted_per_round":
            for i, (a, b) in enumerate(zip(old.get(key, []), new.get(key, []))):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    rows.append([f"prompt {i + 1}: accepted per round (from round {at + 1})",
                                 _short(a[at:]), _short(b[at:])])
            if len(old.get(key, [])) != len(new.get(key, [])):
                rows.append(["prompts", str(len(old.get(key, []))), str(len(new.get(key, [])))])
        elif old.get(key) != new.get(key):
            rows.append([key, _short(old.get(key)), _short(new.get(key))])
    return rows


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def dump(data: dict) -> str:
    """JSON with every list of numbers on one line, so a diff of the file reads like the table."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[[\d\s,.\-e]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[")
                  .replace(" ]", "]"), text) + "\n"


def check_exact(pair_key: str, figures: dict) -> None:
    """Fail with an old-vs-new table when the pair's exact figures moved; with
    SPEC_UPDATE_BASELINE=1, write the new ones instead (and say what changed)."""
    data = load()
    old = data["exact"].get(pair_key)
    changes = exact_changes(old or {}, figures)
    if os.environ.get("SPEC_UPDATE_BASELINE") == "1":
        data["exact"][pair_key] = figures
        BASELINE.write_text(dump(data), encoding="utf-8")
        if changes:
            print(table(f"updated {BASELINE.name} for {pair_key}:", ["what", "old", "new"], changes))
        return
    if old is None:
        pytest.skip(f"no exact baseline for {pair_key} in {BASELINE.name} (SPEC_UPDATE_BASELINE=1 writes one)")
    if changes:
        pytest.fail(table(f"regression gate: acceptance of {pair_key} changed (a behaviour change; if intended, "
                          f"SPEC_UPDATE_BASELINE=1 pytest -m gate)", ["what", "baseline", "now"], changes),
                    pytrace=False)


PASS, FAIL, TOO_NOISY = "pass", "fail", "too noisy"


@dataclass(frozen=True)
class Verdict:
    """The judgement of one ratio measured over repeats against an allowed range [lo, hi]."""
    name: str
    repeats: tuple[float, ...]
    lo: float = -math.inf
    hi: float = math.inf

    @property
    def outcome(self) -> str:
        inside = [self.lo <= r <= self.hi for r in self.repeats]
        if all(inside):
            return PASS
        if all(r < self.lo for r in self.repeats) or all(r > self.hi for r in self.repeats):
            return FAIL
        return TOO_NOISY

    @property
    def median(self) -> float:
        return statistics.median(self.repeats)

    @property
    def spread(self) -> float:
        return max(self.repeats) - min(self.repeats)

    def allowed(self) -> str:
        if self.hi == math.inf:
            return f">= {self.lo:.2f}"
        if self.lo == -math.inf:
            return f"<= {self.hi:.2f}"
        return f"{self.lo:.2f}..{self.hi:.2f}"

    def distance(self) -> float:
        """How far the median lies from the nearest bound (negative: outside the range)."""
        return min(self.median - self.lo, self.hi - self.median)

    def describe(self) -> str:
        shown = ", ".join(f"{r:.2f}" for r in self.repeats)
        return (f"{self.name}: repeats {shown} (spread {self.spread:.2f}) against {self.allowed()}: "
                f"{sum(self.lo <= r <= self.hi for r in self.repeats)} of {len(self.repeats)} inside; "
                f"the median {self.median:.2f} is {abs(self.distance()):.2f} "
                f"{'inside' if self.distance() >= 0 else 'outside'}")


def judge(name: str, repeats, lo: float = -math.inf, hi: float = math.inf) -> Verdict:
    """The verdict on a ratio from its per-repeat values (see the module's docstring)."""
    repeats = tuple(float(r) for r in repeats)
    if not repeats:
        raise ValueError(f"{name}: no repeats to judge")
    return Verdict(name, repeats, lo, hi)


def speed_verdict(pair_key: str, name: str, repeats) -> Verdict | None:
    """A side-by-side ratio's repeats against baseline x (1 - tolerance); None without a baseline."""
    speed = load()["speed"]
    base = speed["ratios"].get(pair_key, {}).get(name)
    if base is None:
        return None
    return judge(name, repeats, lo=base * (1 - speed["tolerance"]))


def settle(verdicts: list[Verdict], tables: dict[str, str] | None = None) -> None:
    """Act on verdicts judged together: any failure fails (its table, no traceback); else any
    that is too noisy skips, naming each one's repeats and spread; else nothing (a pass)."""
    failed = [v for v in verdicts if v.outcome == FAIL]
    if failed:
        pytest.fail("\n\n".join((tables or {}).get(v.name) or v.describe() for v in failed), pytrace=False)
    noisy = [v for v in verdicts if v.outcome == TOO_NOISY]
    if noisy:
        pytest.skip("regression gate: too noisy to judge (the repeats disagree: their spread is wider than the "
                    "distance from the bound). " + "; ".join(v.describe() for v in noisy))


def speed_table(pair_key: str, verdict: Verdict, measured: float, detail: str = "") -> str:
    speed = load()["speed"]
    base = speed["ratios"][pair_key][verdict.name]
    shown = ", ".join(f"{r:.2f}" for r in verdict.repeats)
    return table(f"regression gate: {verdict.name} of {pair_key} fell below the tolerance "
                 f"({speed['tolerance']:.0%} under the baseline; {detail})".replace("; )", ")"),
                 ["ratio", "baseline", "now", "repeats", "allowed", "change"],
                 [[verdict.name, f"{base:.2f}x", f"{measured:.2f}x", shown, f">= {verdict.lo:.2f}x",
                   f"{measured / base - 1:+.0%}"]])


def check_speed(pair_key: str, name: str, measured: float, detail: str = "", repeats=None) -> None:
    """Judge a side-by-side ratio: `measured` (the headline, shown) and its per-repeat values (default:
    the headline alone, judged as it is) against baseline x (1 - tolerance). Fails with a one-row table
    when every repeat fell below; skips as too noisy when they straddle the floor."""
    verdict = speed_verdict(pair_key, name, [measured] if repeats is None else repeats)
    if verdict is None:
        pytest.skip(f"no {name} baseline for {pair_key} in {BASELINE.name} (measured {measured:.2f}x)")
    settle([verdict], {name: speed_table(pair_key, verdict, measured, detail)})
