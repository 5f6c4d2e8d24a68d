"""The questions in process: spec.experiment's steps (the pair `python -m spec` loads, its timing and its
diagnosis) on the first turns, and each question's record as an Outcome.

The chat template: each first turn becomes one user turn in the tokenizer's chat template, ready for the
assistant's answer, as the benchmarks prompt instruction-tuned models. A pair without one (no tokenizer, or
a tokenizer without a template, as the shipped code pair) is fed the turn as plain text, and `prompts`
says so (its second value), as does `plain` asking for it.
"""

from __future__ import annotations

from spec import experiment, models, theory
from spec.bench.questions import Question
from spec.bench.table import Outcome
from spec.experiment.records import PromptRecord, Prompts, Summary

# what each question's JSON keeps of its experiment record (spec.experiment.records.PromptRecord.to_json)
RECORD_KEYS = ("alpha", "accept_rate", "rounds", "drafted", "accepted", "greedy_s_repeats", "spec_s_repeats",
               "stop_reason", "greedy_stop_reason", "text", "drafted_per_round", "accepted_per_round")


def no_template(pair: models.Pair, plain: bool) -> str | None:
    """Why the first turns go in as plain text, or None when the tokenizer's chat template wraps them."""
    if plain:
        return "--plain"
    if pair.tokenizer is None:
        return "the model has no tokenizer: its prompt bytes are the ids"
    if not getattr(pair.tokenizer, "chat_template", None):
        return "the tokenizer has no chat template"
    return None


def prompts(pair: models.Pair, questions: list[Question], name: str, *, plain: bool, ignore_eos: bool,
            max_new_tokens: int) -> tuple[Prompts, str | None]:
    """(the first turns as Prompts, why they are plain text or None where the chat template wrapped them);
    an error names the question."""
    why = no_template(pair, plain)
    ps = experiment.encoded(pair, [q.text for q in questions], name, chat=why is None, ignore_eos=ignore_eos,
                            max_new_tokens=max_new_tokens, names=[q.where for q in questions])
    return ps, why


def outcome(question: Question, r: PromptRecord) -> Outcome:
    """A question's experiment record as an Outcome: its target passes are its speculative rounds."""
    div = r.divergence
    return Outcome(question, r.prompt_tokens, list(r.greedy.tokens), list(r.spec.tokens), r.greedy_s, r.spec_s,
                   verdict=None if div is None else str(div.verdict), message=None if div is None else div.message,
                   pass_tokens=len(r.spec.tokens), passes=len(r.spec.rounds),
                   detail={k: v for k, v in r.to_json().items() if k in RECORD_KEYS})


def costs(summary: Summary) -> tuple[float | None, float, str]:
    """(c, the verify pass's cost in target steps, where they come from) for Theorem 3.8: both from the timed
    runs where they tell (spec.experiment.in_run), else c as the summary has it and a verify pass of one step
    (the theorem's own assumption)."""
    if summary.in_run is not None:
        return summary.in_run.c, summary.in_run.verify_over_step, "both from the timed runs"
    return summary.c, 1.0, "c as measured, a verify pass taken as one target step"


def figures(questions: list[Question], records: list[PromptRecord], summary: Summary):
    """figures(outcomes) -> (alpha, predicted speedup) over those outcomes' records: alpha pooled from their
    rounds (spec.theory.alpha_from_accepted), and Theorem 3.8 with the verify pass priced at its measured cost
    (spec.theory.expected_speedup_costed) at the run's gamma, with the run's c (`costs`)."""
    by_id = {q.question_id: r for q, r in zip(questions, records)}
    c, verify, _ = costs(summary)

    def of(outcomes: list[Outcome]) -> tuple[float | None, float | None]:
        alpha, _, _ = experiment.pooled([by_id[o.question.question_id] for o in outcomes])
        if alpha is None or c is None:
            return alpha, None
        return alpha, theory.expected_speedup_costed(alpha, summary.theory_gamma, c, verify_fixed=verify)
    return of


def theory_line(summary: Summary) -> str:
    c, verify, basis = costs(summary)
    if c is None:
        return "Thm 3.8: - (no c measured)"
    return (f"Thm 3.8: E[tokens/round] / (gamma c + verify) at gamma={summary.theory_gamma}, c={c:.3f}, verify pass "
            f"{verify:.2f} target steps ({basis}); alpha per category")


def theory_json(summary: Summary) -> dict:
    """What the Theorem 3.8 column was priced with."""
    c, verify, basis = costs(summary)
    return {"gamma": summary.gamma, "theory_gamma": summary.theory_gamma, "c": c, "verify_over_step": verify,
            "priced_from": basis, "alpha": summary.alpha, "c_from_steps": summary.c}
