"""`python -m spec conform --impl NAME [--budget B]`: the conformance kit as a report.

Runs the property tests in tests/conformance (pytest, in-process) against the decoder named by
--impl (spec/impls.py: spec, hf-assisted, hf-prompt-lookup, module:function or
path/to/file.py:function), prints one row per property and case (pass / FAIL / skipped / xfail,
with the evidence: hypothesis's smallest counterexample and the diagnosis, or the p-value and the
observed-vs-expected table) and writes conformance.json. Exit status 0 when nothing failed,
1 when a property failed, 2 for bad options or a missing test tree.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from spec import clock

KIT = Path(__file__).resolve().parent.parent / "tests" / "conformance"


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


def _split(nodeid: str) -> tuple[str, str]:
    name = nodeid.split("::")[-1]
    base, _, case = name.partition("[")
    return base.removeprefix("test_"), case.rstrip("]")


def _summary(evidence: str, width: int) -> str:
    lines = [ln.strip() for ln in evidence.splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].startswith("property "):
        lines = lines[1:]  # the row already names the property: show the case and the verdict
    text = " | ".join(lines[:3])
    return text if len(text) <= width else text[:width - 3] + "..."


def parse_args(argv):
    p = argparse.ArgumentParser(prog="spec conform", description=(
        "Run the conformance kit (greedy exactness, length and EOS rules, sampling laws by chi-square, "
        "determinism, stateful processors) against a speculative decoder and report each property."))
    p.add_argument("--impl", default="spec",
                   help="decoder under test: spec, hf-assisted, hf-prompt-lookup, module:function or "
                        "path/to/file.py:function (default: %(default)s)")
    p.add_argument("--budget", type=float, default=1.0,
                   help="scale example counts and sample sizes (default 1: about a minute for spec on a CPU)")
    p.add_argument("--out", type=Path, default=Path("conformance.json"), help="JSON report (default: %(default)s)")
    p.add_argument("--no-shrink", action="store_true",
                   help="report hypothesis's first counterexample unshrunk (faster when many properties fail)")
    p.add_argument("-k", dest="keyword", help="only the properties matching this pytest -k expression")
    return p.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if not args.budget > 0:
        print(f"spec conform: error: --budget must be a number > 0, got {args.budget}", file=sys.stderr)
        return 2
    if not KIT.is_dir():
        print(f"spec conform: error: no conformance tests at {KIT}: run from a source checkout of spec",
              file=sys.stderr)
        return 2
    import pytest
    import torch
    import transformers

    from spec import impls
    try:
        impls.load(args.impl)
    except Exception as err:
        print(f"spec conform: error: --impl {args.impl!r}: {err}", file=sys.stderr)
        return 2

    collector = Collector()
    pytest_args = [str(KIT), f"--impl={args.impl}", f"--conform-budget={args.budget}", "-q", "-p", "no:cacheprovider",
                   "--no-header", "-rN"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    if args.no_shrink:
        pytest_args.append("--conform-no-shrink")
    code, wall = clock.timed(lambda: pytest.main(pytest_args, plugins=[collector]))
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.NO_TESTS_COLLECTED):
        print(f"spec conform: error: pytest exited with {code!r}", file=sys.stderr)
        return 2

    rows = []
    for nodeid, row in collector.rows.items():
        prop, case = _split(nodeid)
        rows.append(dict(property=prop, case=case, **row))
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped", "xfail")}
    print(f"\nconformance of {args.impl!r} (budget {args.budget:g}; transformers {transformers.__version__}, "
          f"torch {torch.__version__}; {wall:.0f} s)")
    print(f"{'property':<22} {'case':<44} {'result':<8} evidence")
    for r in rows:
        result = {"passed": "pass", "failed": "FAIL", "error": "ERROR"}.get(r["outcome"], r["outcome"])
        print(f"{r['property']:<22} {r['case'][:44]:<44} {result:<8} {_summary(r['evidence'], 160)}")
    print("  ".join(f"{k} {v}" for k, v in counts.items() if v))
    report = {"impl": args.impl, "budget": args.budget, "transformers": transformers.__version__,
              "torch": torch.__version__, "python": platform.python_version(), "seconds": round(wall, 1),
              "counts": counts, "results": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if counts["failed"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
