"""Question files: the benchmarks' format, one JSON object a line with per-prompt identity.

Spec-Bench's data/spec_bench/question.jsonl (480 questions) and SPEED-Bench's files hold lines such as

    {"question_id": 81, "category": "writing", "turns": ["Compose an engaging travel blog post ...", "..."]}

`read` checks every line (a JSON object with an integer or string question_id, a non-empty string
category and a non-empty list of string turns; blank lines skipped; question ids unique) and says the
file, the line and the key of the first problem. Only the first turn is run. `select` keeps the
categories asked for and the first N questions of each, in the file's order. Spec-Bench's first 80
questions are MT-bench's, each under its MT-bench category (writing, roleplay, ...); Spec-Bench's own
tables pool them as one, mt_bench, and so does `select` with merge_mt_bench.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

KEYS = ("question_id", "category", "turns")
MT_BENCH = "mt_bench"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


class QuestionError(ValueError):
    """A question file or a selection the user can fix: the message names the file, line and key."""


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str                  # as the file says
    turns: tuple[str, ...]
    line: int                      # 1-based line of the file
    group: str = ""                # what the table pools it under: its category, or mt_bench (merge_mt_bench)

    @property
    def text(self) -> str:
        """The prompt run: the first turn."""
        return self.turns[0]

    @property
    def where(self) -> str:
        return f"question {self.question_id} (line {self.line})"


def _field(where: str, obj: dict, key: str):
    if key not in obj:
        raise QuestionError(f"{where}: missing key {key!r} (each line needs {', '.join(KEYS)})")
    value = obj[key]
    if key == "question_id" and not (isinstance(value, (int, str)) and not isinstance(value, bool)):
        raise QuestionError(f"{where}: 'question_id' must be an integer or a string, got {value!r}")
    if key == "category" and not (isinstance(value, str) and value.strip()):
        raise QuestionError(f"{where}: 'category' must be a non-empty string, got {value!r}")
    if key == "turns" and not (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
        raise QuestionError(f"{where}: 'turns' must be a non-empty list of strings, got {str(value)[:80]}")
    if key == "turns" and not value[0].strip():
        raise QuestionError(f"{where}: 'turns' starts with an empty turn (the first turn is the prompt)")
    return value


def parse_line(text: str, where: str, number: int) -> Question:
    """One line as a Question; `where` (the file and line) starts any error."""
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise QuestionError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise QuestionError(f"{where}: expected a JSON object with {', '.join(KEYS)}, got {type(obj).__name__}")
    qid, category, turns = (_field(where, obj, key) for key in KEYS)
    return Question(qid, category, tuple(turns), number, category)


def read(path: Path) -> list[Question]:
    """Every question in the file, checked; QuestionError names the file, the line and the key."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise QuestionError(f"--questions: cannot read {str(path)!r}: {err}") from None
    questions, seen = [], {}
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"--questions: {path}, line {number}"
        q = parse_line(text, where, number)
        if q.question_id in seen:
            raise QuestionError(f"{where}: question_id {q.question_id!r} repeats line {seen[q.question_id]} "
                                "(ids name the prompts in the report, so each must be unique)")
        seen[q.question_id] = number
        questions.append(q)
    if not questions:
        raise QuestionError(f"--questions: {str(path)!r} holds no question (one JSON object a line: "
                            f"{', '.join(KEYS)})")
    return questions


def groups(questions: list[Question]) -> list[str]:
    """The groups in the order they first appear."""
    return list(dict.fromkeys(q.group for q in questions))


def select(questions: list[Question], *, categories: list[str] | None = None, limit: int | None = None,
           merge_mt_bench: bool = False) -> list[Question]:
    """The questions to run: grouped (merge_mt_bench: MT-bench's eight categories as mt_bench), those of
    `categories` (group names; None: all), the first `limit` of each group (None: all), in the file's order.
    An unknown category or an empty selection is a QuestionError."""
    if merge_mt_bench:
        questions = [Question(q.question_id, q.category, q.turns, q.line,
                              MT_BENCH if q.category in MT_BENCH_CATEGORIES else q.category) for q in questions]
    known = groups(questions)
    unknown = [c for c in categories or [] if c not in known]
    if unknown:
        raise QuestionError(f"--categories: no question in {', '.join(map(repr, unknown))}; the file has "
                            f"{', '.join(known)}")
    kept, counts = [], {}
    for q in questions:
        if categories is not None and q.group not in categories:
            continue
        counts[q.group] = counts.get(q.group, 0) + 1
        if limit is None or counts[q.group] <= limit:
            kept.append(q)
    if not kept:
        raise QuestionError("no question selected: nothing to run")
    return kept
