"""`python -m spec conform --impl NAME [--budget B]`: the conformance kit as a report.

Runs the property tests of spec/conformance (shipped with the package; pytest, in-process, with the
kit's own configuration, spec/conformance/kit.ini) against the decoder named by --impl
(spec/conformance/impls.py: spec, hf-assisted, hf-prompt-lookup, llama-cpp, openai:URL with --reference openai:URL,
module:function or
path/to/file.py:function), prints one row per property and case (pass / FAIL / skipped / xfail,
with the evidence: hypothesis's smallest counterexample and the diagnosis, or the p-value and the
observed-vs-expected table) and writes conformance.json. Exit status: 0 when properties ran and
none failed, 1 when a property failed, 2 for bad options, 3 when no property ran (a -k that
matches nothing, a decoder that skips everything), 4 when a served model drafted nothing while a
property ran (`not speculating`: a plain server, or speculation that fell back): none is a pass.

A served model (`--impl openai:URL`) runs only the served properties (test_endpoint.py is all that is
collected: the other property modules build Hugging Face models at import), and the run imports neither
torch nor transformers (tests/test_conform_layout.py checks it in a child process).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spec import clock
from spec.conformance import ci, provenance

KIT = Path(__file__).resolve().parent
NOTHING_RAN = 3
NOT_SPECULATING = 4         # a served model drafted nothing while a property ran: nothing certified


class Collector:
    """A pytest plugin that keeps each test's outcome and evidence."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        row = self.rows.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "evidence": "",
                                                   "seconds": 0.0})
        row["seconds"] += report.duration
        for key, value in report.user_properties:  # record_property("evidence", ...) on a pass
            if key == "evidence" and report.when == "call" and report.passed:
                row["evidence"] = str(value)
        if report.when == "call" and hasattr(report, "wasxfail"):
            row["outcome"] = "xfail" if report.skipped else "failed"
            row["evidence"] = report.wasxfail if report.skipped else f"XPASS(strict): {report.wasxfail}"
        elif report.skipped:
            row["outcome"] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            row["evidence"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            row["outcome"] = "failed" if report.when == "call" else "error"
            row["evidence"] = report.longreprtext.strip()
            if report.when == "call" and _not_speculating(row["evidence"]):
                row["outcome"] = "not-speculating"


def _not_speculating(evidence: str) -> bool:
    from spec.conformance.endpoints import NOT_SPECULATING as PREFIX
    return any(line.strip().removeprefix("Failed: ").startswith(PREFIX) for line in evidence.splitlines())


def _split(nodeid: str, impl: str = "") -> tuple[str, str]:
    """(property, case) of a test id; the decoder's own id (the impl parameter) is left out."""
    name = nodeid.split("::")[-1]
    base, _, case = name.partition("[")
    case = case.removesuffix("]")
    if impl:
        case = case.replace(f"-{impl}-", "-")
    for cut in (f"{impl}-", f"-{impl}"):
        if impl and (case.startswith(cut) or case.endswith(cut)):
            case = case.removeprefix(cut) if case.startswith(cut) else case.removesuffix(cut)
            break
    else:
        case = "" if case == impl else case
    return base.removeprefix("test_"), case


def _summary(evidence: str, width: int) -> str:
    lines = [ln.strip() for ln in evidence.splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].startswith("property "):
        lines = lines[1:]  # the row already names the property: show the case and the verdict
    text = " | ".join(lines[:3])
    return text if len(text) <= width else text[:width - 3] + "..."


def parse_args(argv):
    p = argparse.ArgumentParser(prog="spec conform", description=(
        "Run the conformance kit (greedy exactness, length and EOS rules, sampling laws by chi-square, "
        "determinism, stateful processors) against a speculative decoder and report each property."),
        epilog=("exit status: 0: properties ran and none failed; 1: a property failed; 2: bad options; "
                "3: no property ran (a -k that matches nothing, a decoder that skips everything); "
                "4: a served model drafted nothing while a property ran (not speculating). "
                "Only 0 is a pass."))
    p.add_argument("--impl", default="spec",
                   help="decoder under test: spec, hf-assisted, hf-prompt-lookup, module:function or "
                        "path/to/file.py:function (default: %(default)s)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="scale example counts and sample sizes (default 1: about a minute for spec on a CPU)")
    p.add_argument("--out", type=Path, default=Path("conformance.json"), help="JSON report (default: %(default)s)")
    p.add_argument("--no-shrink", action="store_true",
                   help="report hypothesis's first counterexample unshrunk (faster when many properties fail)")
    p.add_argument("-k", dest="keyword", help="only the properties matching this pytest -k expression")
    p.add_argument("--model", default=None, help="a model file for the engine adapters that take one "
                                                 "(llama-cpp: a .gguf, run on its own vocabulary); for "
                                                 "openai:URL the served model's name (default: the one "
                                                 "/v1/models lists)")
    p.add_argument("--repro", type=Path, default=None, metavar="DIR",
                   help="for each failed property of a served model, write a standalone reproduction script "
                        "(Python standard library only) to DIR and rerun it once to confirm it reproduces")
    p.add_argument("--reference", default=None,
                   help="for --impl openai:URL: openai:URL of the same model served without speculation")
    p.add_argument("--control", default=None,
                   help="for --impl openai:URL: openai:URL of the same speculative engine started in its "
                        "deterministic / batch-invariant mode (vLLM: VLLM_BATCH_INVARIANT=1); a crowd property "
                        "that fails replays its crowd there: 'survives the control: bug' or 'vanishes under the "
                        "control: batch-shape effect'")
    p.add_argument("--junitxml", type=Path, default=None, metavar="PATH",
                   help="also write the report as JUnit XML (one test case per property and case, a failure "
                        "carrying its diagnosis), as CI systems read it")
    p.add_argument("--summary", type=Path, default=None, metavar="PATH",
                   help="also write a Markdown summary (the verdict, each failed property with its diagnosis, "
                        "every property's row); appended to $GITHUB_STEP_SUMMARY too where that is set")
    return p.parse_args(argv)


def _usage_error(args) -> str | None:
    """Why these options cannot run (exit 2), or None."""
    if not args.budget > 0:
        return f"--budget must be a number > 0, got {args.budget}"
    for option, path in (("--out", args.out), ("--junitxml", args.junitxml), ("--summary", args.summary)):
        if path is not None and path.is_dir():
            return f"{option} must be a file path, got the folder {path}"
    if not (KIT / "kit.ini").is_file():
        return f"the conformance kit is missing from {KIT} (a broken install of spec)"
    try:
        import hypothesis  # noqa: F401 - the kit's searches
        import pytest  # noqa: F401
    except ImportError as err:
        return f"the conformance kit needs pytest and hypothesis ({err}): pip install 'spec[conform]'"
    from spec.conformance import impls
    try:
        impls.load(args.impl, model=args.model, reference=args.reference, control=args.control)
    except Exception as err:
        return f"--impl {args.impl!r}: {err}"
    return None


SERVED = "test_endpoint.py"    # the served properties: all an openai:URL subject runs


def _served(args) -> bool:
    from spec.conformance import endpoint
    return endpoint.parse_name(args.impl) is not None


def _pytest_args(args) -> list[str]:
    # -c: the kit's own configuration (and rootdir), whatever project this is run from; a served model
    # collects only its own properties (the others import torch and transformers to build their models)
    where = KIT / SERVED if _served(args) else KIT
    out = [str(where), "-c", str(KIT / "kit.ini"), f"--rootdir={KIT}", f"--impl={args.impl}",
           f"--conform-budget={args.budget}", "-q", "-p", "no:cacheprovider", "--no-header", "-rN"]
    if args.model:
        out.append(f"--conform-model={args.model}")
    if args.reference:
        out.append(f"--conform-reference={args.reference}")
    if args.control:
        out.append(f"--conform-control={args.control}")
    if args.keyword:
        out += ["-k", args.keyword]
    if args.no_shrink:
        out.append("--conform-no-shrink")
    return out


def _report(args, collector, wall) -> dict:
    command = " ".join(["python -m spec conform", *args.argv])
    meta = provenance.meta(command, llama=args.impl.split(":")[0] == "llama-cpp")
    # the versions the table's head names (read without importing: a served run imports no torch)
    versions = {name: meta["versions"].get(name, "not installed") for name in ("transformers", "torch")}
    rows = []
    for nodeid, row in collector.rows.items():
        prop, case = _split(nodeid, args.impl)
        rows.append(dict(property=prop, case=case, **row))
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("passed", "failed", "error", "not-speculating", "skipped", "xfail")}
    print(f"\nconformance of {args.impl!r} (budget {args.budget:g}; transformers {versions['transformers']}, "
          f"torch {versions['torch']}; {wall:.0f} s)")
    print(f"{'property':<22} {'case':<44} {'result':<8} evidence")
    for r in rows:
        result = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "not-speculating": "NO-SPEC"}.get(
            r["outcome"], r["outcome"])
        print(f"{r['property']:<22} {r['case'][:44]:<44} {result:<8} {_summary(r['evidence'], 160)}")
    print("  ".join(f"{k} {v}" for k, v in counts.items() if v))
    report = {"meta": meta, "impl": args.impl, "model": args.model, "reference": args.reference, "control": args.control,
              "budget": args.budget,
              **versions,
              "python": meta["versions"]["python"], "seconds": round(wall, 1), "counts": counts, "results": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


def _reproductions(args, collector) -> None:
    """--repro DIR: a script per failed property (spec.conformance.repro), each rerun once; the report
    line says whether it reproduced."""
    from spec.conformance import repro
    failed = [nodeid for nodeid, row in collector.rows.items()
              if row["outcome"] == "failed" or row["outcome"] == "xfail" and nodeid in repro.RECORDED]
    for nodeid, (script, said) in repro.write(args.repro, failed).items():
        row = collector.rows[nodeid]
        row["repro"] = str(script) if script else None
        row["evidence"] = f"{said}\n{row['evidence']}" if script else f"{row['evidence']}\n({said})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    args.argv = argv
    error = _usage_error(args)
    if error:
        print(f"spec conform: error: {error}", file=sys.stderr)
        return 2
    import pytest

    collector = Collector()
    code, wall = clock.timed(lambda: pytest.main(_pytest_args(args), plugins=[collector]))
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.INTERRUPTED):
        print(f"spec conform: error: pytest exited with {code!r}", file=sys.stderr)
        return 2
    if args.repro is not None:
        _reproductions(args, collector)
    report = _report(args, collector, wall)
    code = _verdict(args, report, none_collected=code == pytest.ExitCode.NO_TESTS_COLLECTED)
    if args.junitxml is not None:
        ci.write_junit(report, args.junitxml)
        print(f"wrote {args.junitxml}")
    for path in ci.write_summary(report, code, args.summary):
        print(f"wrote the summary to {path}")
    return code


def _verdict(args, report: dict, none_collected: bool) -> int:
    """The exit status (the --help epilog's), saying why where it is not 0 or 1."""
    rows, counts = report["results"], report["counts"]
    if counts["failed"] or counts["error"]:
        return 1
    if counts["not-speculating"]:
        print(f"spec conform: {counts['not-speculating']} properties ran while {args.impl!r} drafted nothing (its "
              f"speculation counters did not move, or it has none): not speculating, exit {NOT_SPECULATING}, not "
              f"a pass", file=sys.stderr)
        return NOT_SPECULATING
    # pytest's exit 5: no test collected, or (spec.conformance.plugin) none of the decoder's own ran
    if none_collected or not (counts["passed"] or counts["xfail"]):
        why = "no property matched -k" if not rows else "every property of the decoder was skipped"
        print(f"spec conform: error: no property ran for {args.impl!r} ({why}): exit {NOTHING_RAN}, not a pass",
              file=sys.stderr)
        return NOTHING_RAN
    return 0


if __name__ == "__main__":
    sys.exit(main())
