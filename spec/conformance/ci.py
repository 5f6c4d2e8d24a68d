"""The kit's report in the two forms CI systems read: JUnit XML (`spec conform --junitxml PATH`) and a
Markdown job summary (`--summary PATH`, and $GITHUB_STEP_SUMMARY where it is set). Both are written from the
rows of the run's report (conform._report: one per property and case, after --repro and the
not-speculating verdict), so they say what conformance.json says. Standard library only: a served-model
run imports no torch."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

# a row's outcome -> the JUnit element a test case carries (None: a pass)
JUNIT = {"passed": None, "failed": "failure", "not-speculating": "failure", "error": "error", "skipped": "skipped",
         "xfail": "skipped"}
STEP_SUMMARY = "GITHUB_STEP_SUMMARY"


def _first_line(text: str) -> str:
    """The evidence's first line that says something the row does not: a "property X violated by Y"
    header is skipped for the diagnosis under it; a verdict line (BUG, tie) is preferred where there is one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].startswith("property "):
        lines = lines[1:]
    return next((ln for ln in lines if "BUG" in ln), lines[0] if lines else "")


def junit(report: dict) -> ET.ElementTree:
    """One <testsuite> named for the decoder, one <testcase> per property and case (classname: the
    property, name: property[case]); a failure carries the diagnosis (message: its first line, text: all of
    it), a skip its reason, an xfail the recorded finding; the run's versions as <properties>."""
    rows, counts = report["results"], report["counts"]
    suite = ET.Element("testsuite", name=f"spec conform {report['impl']}", tests=str(len(rows)),
                       failures=str(counts["failed"] + counts["not-speculating"]), errors=str(counts["error"]),
                       skipped=str(counts["skipped"] + counts["xfail"]), time=f"{report['seconds']:.1f}")
    props = ET.SubElement(suite, "properties")
    for key in ("impl", "model", "reference", "control", "budget", "transformers", "torch", "python"):
        if report.get(key) is not None:
            ET.SubElement(props, "property", name=key, value=str(report[key]))
    for r in rows:
        name = f"{r['property']}[{r['case']}]" if r["case"] else r["property"]
        case = ET.SubElement(suite, "testcase", classname=f"spec.conformance.{r['property']}", name=name,
                             time=f"{r['seconds']:.3f}")
        kind = JUNIT[r["outcome"]]
        if kind is None:
            if r["evidence"]:
                ET.SubElement(case, "system-out").text = r["evidence"]
            continue
        message = _first_line(r["evidence"])
        if r["outcome"] == "xfail":
            message = f"known finding: {message}"
        element = ET.SubElement(case, kind, message=message, type=r["outcome"])
        if kind != "skipped":
            element.text = r["evidence"]
    root = ET.Element("testsuites", name="spec conform", tests=suite.get("tests"), failures=suite.get("failures"),
                      errors=suite.get("errors"), skipped=suite.get("skipped"), time=suite.get("time"))
    root.append(suite)
    ET.indent(root)
    return ET.ElementTree(root)


def write_junit(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    junit(report).write(path, encoding="utf-8", xml_declaration=True)


def _cell(text: str, width: int = 200) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def summary(report: dict, code: int) -> str:
    """The job summary: the verdict and counts, then each property that failed with its diagnosis (in a
    collapsed block), then one table of every property and case."""
    rows, counts = report["results"], report["counts"]
    bad = [r for r in rows if r["outcome"] in ("failed", "error", "not-speculating")]
    verdict = ("pass" if code == 0 else "FAIL" if code == 1 else "not speculating" if code == 4 else
               "nothing ran" if code == 3 else f"exit {code}")
    out = [f"## spec conform `{report['impl']}`: {verdict}", "",
           f"{', '.join(f'{v} {k}' for k, v in counts.items() if v)}; budget {report['budget']:g}; "
           f"transformers {report['transformers']}, torch {report['torch']}; {report['seconds']:.0f} s", ""]
    if bad:
        out += ["### Failed properties", ""]
        for r in bad:
            label = f"{r['property']} [{r['case']}]" if r["case"] else r["property"]
            out += [f"<details><summary><b>{label}</b>: {_cell(_first_line(r['evidence']), 160)}</summary>", "",
                    "```", r["evidence"].strip(), "```", "</details>", ""]
    out += ["### Every property", "", "| property | case | result | evidence |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['property']} | {_cell(r['case'], 60)} | {r['outcome']} | {_cell(r['evidence'])} |")
    return "\n".join(out) + "\n"


def write_summary(report: dict, code: int, path: Path | None) -> list[Path]:
    """The summary written to `path` (replaced) and appended to $GITHUB_STEP_SUMMARY where set: where it went."""
    text, went = summary(report, code), []
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        went.append(path)
    step = os.environ.get(STEP_SUMMARY)
    if step:
        with open(step, "a", encoding="utf-8") as f:
            f.write(text)
        went.append(Path(step))
    return went
