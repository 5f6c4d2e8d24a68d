"""`python -m spec bench --questions FILE.jsonl`: a benchmark's questions, greedy against speculative decoding,
prompt by prompt, every output checked token for token (spec/bench/__init__.py lists the steps).

This module parses the options (the pair and run groups are `python -m spec`'s own, spec/__main__.py), calls
the steps and prints; only the standard library is imported before the options are parsed, so --help and
option errors are instant.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import spec.__main__ as cli
from spec import defaults

DESCRIPTION = (
    "Runs a benchmark's question file (Spec-Bench's question.jsonl, SPEED-Bench's: one JSON object a line with\n"
    "question_id, category and turns) prompt by prompt: plain greedy decoding and the chosen drafter, or a served\n"
    "engine (--impl) against the same model served without speculation (--reference). Reports per category the\n"
    "speedup, tokens/s, mean accepted tokens and whether each output is token-identical to greedy's; a\n"
    "difference is diagnosed, numerical tie or bug.")

EPILOG = (
    "prompts: the first turn of each question (multi-turn questions run their first turn only), as one user\n"
    "  turn in the tokenizer's chat template, ready for the answer. A pair without a chat template (no tokenizer,\n"
    "  or one without a template, as the shipped code pair) is fed the turn as plain text and the header says\n"
    "  so ('chat template: none'); --plain asks for plain text. Served: the reference server's template.\n"
    "columns (per category, then all):\n"
    "  prompts       questions run\n"
    "  identical     outputs whose token ids equal greedy's (N/M); ', K tie': differ at a proven numerical tie\n"
    "                (the target's top-2 gap at the first divergent position within its dtype's noise; served:\n"
    "                the reference's top-2 logprob gap within its measured noise); ', K BUG': differ otherwise\n"
    "  tok/round     mean accepted tokens (Spec-Bench's): new tokens / target forward passes, summed over the\n"
    "                category's questions; a pass is one speculative round (its accepted drafts plus the token the\n"
    "                target adds), the first carrying the prefill, the last possibly cut by EOS or\n"
    "                --max-new-tokens. Served: 1 + accepted / draft rounds from the engine's /metrics counters\n"
    "  greedy tok/s  greedy's new tokens / its wall seconds (prefill included), summed over the category\n"
    "  spec tok/s    the same for speculative decoding (served: the reference and the impl)\n"
    "  speedup       total greedy wall seconds / total speculative wall seconds (prefill included)\n"
    "  alpha         per-token acceptance, the MLE from the category's rounds\n"
    "  Thm 3.8       Theorem 3.8's expected speedup for that alpha at the run's gamma, with c (draft time per\n"
    "                drafted token / greedy time per token) and the verify pass's cost (in target steps), both\n"
    "                measured on the timed runs of every question: E[tokens/round] / (gamma c + verify)\n"
    "a time is the median of --repeats runs (greedy and speculative alternate question by question).\n"
    "output: a table on stdout, every question's ids, times and diagnosis in --out/bench.json.\n"
    "exit status: 0 every output identical to greedy (or differing only at proven numerical ties), 1 an\n"
    "  output differs beyond a tie (a bug), 2 bad options or question file, missing weights, a server that\n"
    "  cannot be reached.")

# python -m spec's options bench does not take, set only so that its checks (cli.checked) read them.
UNTAKEN = ("prompts", "features", "chat", "peer")
# The pair and run options a served run does not take, and the value each has when not given.
NOT_SERVED = {"real": False, "target": None, "draft": None, "gamma": None, "tp": 1, "device": "cpu",
              "target_dtype": "fp32", "draft_dtype": "fp32", "draft_impl": "auto", "threads": None}


class BenchError(Exception):
    """A problem the user can fix: exit 2."""


def _categories(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected category names separated by commas, got {text!r}")
    return names


def _served_url(text: str) -> str:
    from spec.conformance.endpoint import parse_name

    try:
        url = parse_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if url is None:
        raise argparse.ArgumentTypeError(f"expected openai:URL (e.g. openai:http://127.0.0.1:8000/v1), got {text!r}")
    return url


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("questions")
    g.add_argument("--questions", type=Path, required=True, metavar="FILE.jsonl",
                   help="question file: one JSON object a line with question_id, category and turns")
    g.add_argument("--categories", type=_categories, metavar="A,B",
                   help="only these categories (as the table names them)")
    g.add_argument("--limit", type=cli._positive_int, metavar="N", help="the first N questions of each category")
    g.add_argument("--merge-mt-bench", action="store_true",
                   help="pool MT-bench's eight categories (writing, roleplay, reasoning, math, coding, extraction, "
                        "stem, humanities) as mt_bench, as Spec-Bench's tables do")
    g.add_argument("--plain", action="store_true", help="feed each first turn as plain text, not in the chat template")
    cli.add_pair_options(p)
    cli.add_run_options(p, prompt_options=False, peer=False)
    s = p.add_argument_group("served (instead of a pair)")
    s.add_argument("--impl", type=_served_url, metavar="openai:URL",
                   help="a served engine with speculation (OpenAI-compatible, on 127.0.0.1)")
    s.add_argument("--reference", type=_served_url, metavar="openai:URL",
                   help="the same model served without speculation: greedy's outputs and times")
    s.add_argument("--model", help="the served model's name (default: the one the servers list)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("spec-results"),
                   help="output folder for bench.json (default: ./spec-results)")
    o.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    p.set_defaults(repeats=1, **dict.fromkeys(UNTAKEN))
    return p


def parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.impl is None) != (args.reference is None):
        parser.error("argument --impl/--reference: give both (the engine under test and the same model served "
                     "without speculation) or neither")
    if args.impl is None:
        if args.model is not None:
            parser.error("argument --model: only with --impl (a served model's name)")
        if args.tp > 1:
            parser.error("argument --tp: not with bench (a split target is not benchmarked here)")
        return cli.checked(parser, args)
    given = [name for name, default in NOT_SERVED.items() if getattr(args, name) != default]
    if given:
        parser.error(f"argument --{given[0].replace('_', '-')}: not with --impl (a served engine brings its own "
                     "model, draft and settings)")
    args.max_new_tokens_default = args.max_new_tokens is None
    args.max_new_tokens = args.max_new_tokens or defaults.CPU_MAX_NEW_TOKENS
    return args


# --------------------------------------------------------------------------- run


def questions_of(args):
    from spec.bench import questions

    chosen = questions.select(questions.read(args.questions), categories=args.categories, limit=args.limit,
                              merge_mt_bench=args.merge_mt_bench)
    return chosen, f"{args.questions}, first turns"


def out_folder(out: Path) -> None:
    """--out exists and is a folder before anything runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BenchError(f"--out: cannot create {str(out)!r}: {err}") from None


def chat_line(why_plain: str | None, whose: str = "the tokenizer's") -> str:
    """The header's word on the chat template: `whose` wraps each first turn, or why none does."""
    if why_plain is None:
        return f"chat template: {whose} (each first turn as one user turn)"
    return f"chat template: none ({why_plain}): each first turn fed as plain text"


def run_local(args, chosen: list, name: str, say) -> tuple[dict, list, list]:
    """In process: (what bench.json says of the run, the outcomes, the categories)."""
    from spec import experiment
    from spec.bench import local, table
    from spec.experiment import report

    try:
        experiment.setup(seed=args.seed, threads=args.threads, out=args.out)
        pair, pair_info = cli.load(args, experiment, say)
        ps, why_plain = local.prompts(pair, chosen, name, plain=args.plain, ignore_eos=args.ignore_eos,
                                      max_new_tokens=args.max_new_tokens)
        print(cli.header(args, pair_info, ps))
        print(chat_line(why_plain))
        records, summary = cli.decode_all(args, experiment, pair, pair_info, ps, say, peers=False)
    except experiment.UsageError as err:
        raise BenchError(str(err)) from None
    outcomes = [local.outcome(q, r) for q, r in zip(chosen, records)]
    cats = table.categories(outcomes, local.figures(chosen, records, summary))
    run = {"mode": "in-process", "pair": pair_info.to_json(), "machine": report.machine_info(args.device),
           "chat_template": why_plain is None, "plain_text_because": why_plain, "eos_token_id": ps.eos,
           "theory": local.theory_json(summary), "theory_line": local.theory_line(summary),
           "warnings": experiment.consistency_warnings(summary)}
    return run, outcomes, cats


def run_served(args, chosen: list, name: str, say) -> tuple[dict, list, list]:
    """Over HTTP: (what bench.json says of the run, the outcomes, the categories)."""
    from spec.bench import served, table
    from spec.conformance.endpoint import EndpointError

    test = ref = None
    try:
        test, ref = served.connect(args.impl, args.reference, args.model)
        ids, chat = served.prompt_ids(ref, chosen, plain=args.plain)
        why_plain = None if chat else ("--plain" if args.plain else "the reference server applies none")
        run = {"mode": "served", "impl": args.impl, "reference": args.reference, "model": test.model,
               "impl_identity": test.identity(), "reference_identity": ref.identity(), "chat_template": chat,
               "plain_text_because": why_plain}
        print(f"impl: {args.impl} ({run['impl_identity'] or test.dialect}) | reference: {args.reference} "
              f"({run['reference_identity'] or ref.dialect}) | model: {test.model}")
        print(f"prompts: {len(chosen)} ({name}) | max new tokens: {args.max_new_tokens} | "
              f"EOS: {'ignored' if args.ignore_eos else 'stops'} | repeats: {args.repeats}")
        print(chat_line(why_plain, "the reference server's"))
        outcomes = served.run(test, ref, chosen, ids, max_new_tokens=args.max_new_tokens,
                              ignore_eos=args.ignore_eos, repeats=args.repeats, say=say)
    except EndpointError as err:
        raise BenchError(str(err)) from None
    finally:
        for side in (test, ref):
            if side is not None:
                side.close()
    return run, outcomes, table.categories(outcomes)


def finish(args, run: dict, outcomes: list, cats: list, say) -> int:
    """The table, the ties and failures, bench.json; the exit status."""
    from spec import __version__
    from spec.bench import table

    served = run["mode"] == "served"
    print()
    print(table.render(cats, *(("reference", "impl") if served else ("greedy", "spec"))))
    if run.get("theory_line"):
        print(run["theory_line"])
    if run.get("warnings"):
        print("WARNING: the run's own figures disagree: " + "; ".join(run["warnings"]))
    ties, failures = table.difference_lines(outcomes, "the reference" if served else "greedy")
    for line in ties:
        print(line)
    for line in failures:
        print(line, file=sys.stderr)
    verdict = table.verdict(cats)
    path = args.out / "bench.json"
    table.write_json(path, {"spec_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "options": {k: v for k, v in cli.options(args).items() if k not in UNTAKEN}, **run,
                            "questions_file": str(args.questions), "verdict": verdict,
                            "categories": [c.to_json() for c in cats], "questions": [o.to_json() for o in outcomes]})
    print(f"wrote {path}")
    if not verdict["failures"]:
        say(f"done: {verdict['identical']} of {verdict['prompts']} outputs identical to greedy"
            + (f", {verdict['ties']} at proven numerical ties" if verdict["ties"] else ""))
    return verdict["exit_status"]


def main(argv=None) -> int:
    from spec.bench.questions import QuestionError

    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_:  # argparse: --help (0) or a bad option (2, message already on stderr)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    say = cli.Progress(args.quiet)
    try:
        chosen, name = questions_of(args)   # a bad file is said before any model loads
        out_folder(args.out)
        run, outcomes, cats = (run_served if args.impl else run_local)(args, chosen, name, say)
        return finish(args, run, outcomes, cats, say)
    except (BenchError, QuestionError) as err:
        print(f"spec bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spec bench: interrupted", file=sys.stderr)
        return 130
