"""Per-question outcomes pooled by category: the table `spec bench` prints and the JSON it writes.

An Outcome is one question's two runs, plain greedy (the reference: in process spec's greedy decoding,
over HTTP the server without speculation) and the decoder under test (speculative), as token ids and wall
times. Identity is the ids' equality, nothing else; where they differ, the verdict is the diagnosis's
("tie": a proven numerical tie; "bug"; anything else, or none, counts as a failure). A category pools its
outcomes: times and tokens are summed before dividing, so a long answer weighs by its length, as in
Spec-Bench. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spec.bench.questions import Question, groups

ALL = "all"


@dataclass
class Outcome:
    """One question's runs: greedy's new ids and the decoder under test's, each with its wall seconds
    (the median over repeats, prefill included)."""
    question: Question
    prompt_tokens: int
    greedy: list[int]
    spec: list[int]                 # a repeat that differs from greedy, if any did
    greedy_s: float
    spec_s: float
    verdict: str | None = None      # where the ids differ: "tie", "bug", or "unknown" (not diagnosed)
    message: str | None = None      # the diagnosis, as spec.diagnose words it
    pass_tokens: int | None = None  # the new tokens the counted target passes produced ...
    passes: int | None = None       # ... and how many passes (None: not known)
    detail: dict = field(default_factory=dict)   # more of the run for the JSON (in process: its record)

    @property
    def identical(self) -> bool:
        return list(self.greedy) == list(self.spec)

    @property
    def tie(self) -> bool:
        return not self.identical and self.verdict == "tie"

    @property
    def failed(self) -> bool:
        """Differs, and not at a proven tie: a bug, or a difference nobody diagnosed."""
        return not self.identical and not self.tie

    def to_json(self) -> dict:
        q = self.question
        return {"question_id": q.question_id, "category": q.category, "group": q.group, "line": q.line,
                "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.spec),
                "greedy_new_tokens": len(self.greedy), "greedy_s": self.greedy_s, "spec_s": self.spec_s,
                "speedup": _ratio(self.greedy_s, self.spec_s), "tokens_per_round": _ratio(self.pass_tokens, self.passes),
                "ids_identical": self.identical, "verdict": None if self.identical else (self.verdict or "unknown"),
                "divergence": self.message, "greedy_tokens": list(self.greedy), "spec_tokens": list(self.spec),
                **self.detail}


def _ratio(a, b):
    return a / b if a is not None and b else None


@dataclass
class Category:
    """A category's outcomes pooled (ALL: every question). alpha and predicted: what the caller's figures
    give (in process: the acceptance and Theorem 3.8's speedup; None where unknown)."""
    name: str
    outcomes: list[Outcome]
    alpha: float | None = None
    predicted: float | None = None

    @property
    def prompts(self) -> int:
        return len(self.outcomes)

    @property
    def identical(self) -> int:
        return sum(o.identical for o in self.outcomes)

    @property
    def ties(self) -> int:
        return sum(o.tie for o in self.outcomes)

    @property
    def failures(self) -> int:
        return sum(o.failed for o in self.outcomes)

    def _sum(self, name: str):
        values = [getattr(o, name) for o in self.outcomes]
        return None if any(v is None for v in values) else sum(values)

    @property
    def speedup(self) -> float | None:
        """Total greedy seconds over total speculative seconds."""
        return _ratio(self._sum("greedy_s"), self._sum("spec_s"))

    @property
    def greedy_tok_s(self) -> float | None:
        return _ratio(sum(len(o.greedy) for o in self.outcomes), self._sum("greedy_s"))

    @property
    def spec_tok_s(self) -> float | None:
        return _ratio(sum(len(o.spec) for o in self.outcomes), self._sum("spec_s"))

    @property
    def tokens_per_round(self) -> float | None:
        """Mean accepted tokens: new tokens per target pass, pooled (None where passes are not known)."""
        return _ratio(self._sum("pass_tokens"), self._sum("passes"))

    def to_json(self) -> dict:
        return {"category": self.name, "prompts": self.prompts, "identical": self.identical, "ties": self.ties,
                "failures": self.failures, "greedy_s": self._sum("greedy_s"), "spec_s": self._sum("spec_s"),
                "greedy_tok_s": self.greedy_tok_s, "spec_tok_s": self.spec_tok_s, "speedup": self.speedup,
                "tokens_per_round": self.tokens_per_round, "alpha": self.alpha, "predicted_speedup": self.predicted}


def categories(outcomes: list[Outcome], figures: Callable[[list[Outcome]], tuple] | None = None) -> list[Category]:
    """One Category per group, in the file's order, then ALL; figures(outcomes) -> (alpha, predicted)."""
    if not outcomes:
        raise ValueError("no outcome: a verdict over zero prompts would be vacuous")
    parts = [(g, [o for o in outcomes if o.question.group == g]) for g in groups([o.question for o in outcomes])]
    out = []
    for name, some in parts + [(ALL, list(outcomes))]:
        alpha, predicted = figures(some) if figures is not None else (None, None)
        out.append(Category(name, some, alpha, predicted))
    return out


# --------------------------------------------------------------------------- the table


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def identical_cell(c: Category) -> str:
    """'3/3', '2/3, 1 tie', '1/3, 2 BUG'."""
    cell = f"{c.identical}/{c.prompts}"
    if c.ties:
        cell += f", {c.ties} tie"
    if c.failures:
        cell += f", {c.failures} BUG"
    return cell


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: the first column left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def render(cats: list[Category], greedy: str = "greedy", spec: str = "spec") -> str:
    """The table: one row per category and ALL; the alpha and Theorem 3.8 columns only where known."""
    theory = any(c.alpha is not None or c.predicted is not None for c in cats)
    header = ["category", "prompts", "identical", "tok/round", f"{greedy} tok/s", f"{spec} tok/s", "speedup"]
    header += ["alpha", "Thm 3.8"] if theory else []
    rows = []
    for c in cats:
        row = [c.name, str(c.prompts), identical_cell(c), fmt(c.tokens_per_round), fmt(c.greedy_tok_s, 1),
               fmt(c.spec_tok_s, 1), fmt(c.speedup, 2, "x")]
        rows.append(row + ([fmt(c.alpha, 3), fmt(c.predicted, 2, "x")] if theory else []))
    return format_table(header, rows)


def difference_lines(outcomes: list[Outcome], reference: str = "greedy") -> tuple[list[str], list[str]]:
    """(ties, failures): a line for each question whose output is not `reference`'s."""
    ties, failures = [], []
    for o in outcomes:
        if o.identical:
            continue
        head = f"{o.question.where}, {o.question.category}"
        if o.tie:
            ties.append(f"{head}: differs from {reference}, a proven numerical tie (not a failure):\n  {o.message}")
        else:
            failures.append(f"spec bench: FAIL: {head}: output differs from {reference}'s ("
                            f"{o.verdict or 'not diagnosed'}):\n  {o.message or 'no diagnosis'}")
    return ties, failures


# --------------------------------------------------------------------------- JSON


def _plain(obj):
    """JSON values: NaN and infinities as null, tuples as lists, anything else as its text."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def verdict(cats: list[Category]) -> dict:
    """The run's verdict from ALL (the last category): 1 when a question's output differs beyond a proven tie."""
    every = cats[-1]
    return {"prompts": every.prompts, "identical": every.identical, "ties": every.ties, "failures": every.failures,
            "exit_status": 1 if every.failures else 0}
