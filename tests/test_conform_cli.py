"""`python -m spec conform`: option errors (exit 2) and runs in which no property ran (exit 3)
in-process, the same rule for plain pytest runs of the kit (exit 5), and end to end in a subprocess
(thorough: a fresh interpreter costs tens of seconds here) against spec and a broken decoder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import spec.__main__ as cli
from spec.conformance import conform

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv", [["conform", "--budget", "0"], ["conform", "--impl", "no-such-decoder"],
                                  ["conform", "--impl", "/no/such/file.py:generate"],
                                  ["conform", "--impl", "spec.decode:no_such_function"],
                                  ["conform", "--junitxml", "/"], ["conform", "--summary", "."]])
def test_conform_bad_options_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_conform_row_names():
    assert conform._split("test_greedy.py::test_greedy_exact[llama-partial]") == ("greedy_exact", "llama-partial")
    assert conform._split("test_greedy.py::test_greedy_exact[hf-assisted-llama-partial]", "hf-assisted") == \
        ("greedy_exact", "llama-partial")
    assert conform._split("test_sampling_law.py::test_determinism[hf-assisted]", "hf-assisted") == ("determinism", "")
    assert conform._split("test_sampling_law.py::test_sampling_power[correct]", "spec") == ("sampling_power", "correct")
    assert conform._split("test_engine.py::test_engine_greedy_exact[q4_1-llama-cpp-prompt-lookup]", "llama-cpp") == \
        ("engine_greedy_exact", "q4_1-prompt-lookup")


SKIPS_EVERYTHING = '''
def generate(target, draft, input_ids, **options):
    raise NotImplementedError("this decoder supports nothing")

generate.conformance_draft = "any"
'''


def test_conform_exit_3_when_no_property_ran(tmp_path, capsys):
    """A -k that matches no property, and a decoder that skips every property, are errors with
    their own exit status, never a pass."""
    out = tmp_path / "conformance.json"
    assert cli.main(["conform", "-k", "no_such_property", "--out", str(out)]) == conform.NOTHING_RAN
    assert "no property matched -k" in capsys.readouterr().err
    (tmp_path / "skipper.py").write_text(SKIPS_EVERYTHING)
    code = cli.main(["conform", "--impl", f"{tmp_path / 'skipper.py'}:generate", "--out", str(out),
                     "-k", "greedy_exact or determinism or sampling_law"])
    assert code == conform.NOTHING_RAN
    assert "every property of the decoder was skipped" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["counts"]["skipped"] > 0  # (the decoder-independent negative controls still pass)


def test_pytest_run_of_the_kit_fails_when_a_decoder_ran_nothing(pytester, tmp_path):
    """The same rule in plain pytest: a decoder none of whose properties ran turns an otherwise
    green run into exit 5 (no tests), naming the decoder; a decoder that ran keeps exit 0."""
    (tmp_path / "skipper.py").write_text(SKIPS_EVERYTHING)
    skipper = f"{tmp_path / 'skipper.py'}:generate"
    args = ["--pyargs", "spec.conformance.test_sampling_law", "-k", "determinism", "-p", "no:cacheprovider",
            "-p", "spec.conformance.plugin"]  # (an installed spec registers it by its entry point, same name)
    result = pytester.runpytest(*args, f"--impl=spec,{skipper}")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines([f"*no property ran for {skipper}*"])
    assert pytester.runpytest(*args, "--impl=spec").ret == pytest.ExitCode.OK


TOKEN_CHANGED = '''
from spec.conformance.impls import spec_generate
from spec import greedy_generate

def generate(target, draft, input_ids, *, gamma, max_new_tokens, **options):
    """Wrong on purpose: the token after the greedy continuation's first 3 is replaced."""
    tokens = spec_generate(target, draft, input_ids, gamma=gamma, max_new_tokens=max_new_tokens, **options)
    if len(tokens) > 3:
        tokens[3] = (tokens[3] + 1) % 500
    return tokens
'''


@pytest.mark.thorough
@pytest.mark.slow
@pytest.mark.parametrize("impl, expected_exit", [("spec", 0), ("BROKEN", 1)])
def test_conform_end_to_end(tmp_path, impl, expected_exit):
    if impl == "BROKEN":
        (tmp_path / "broken.py").write_text(textwrap.dedent(TOKEN_CHANGED))
        impl = f"{tmp_path / 'broken.py'}:generate"
    out = tmp_path / "conformance.json"
    run = subprocess.run([sys.executable, "-m", "spec", "conform", "--impl", impl, "--out", str(out),
                          "-k", "greedy_exact and gpt-neox-partial"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    # (run from tmp_path, outside the source tree: the kit comes from the package, not from tests/)
    assert run.returncode == expected_exit, run.stdout + run.stderr
    report = json.loads(out.read_text())
    (row,) = [r for r in report["results"] if r["property"] == "greedy_exact"]
    assert row["outcome"] == ("passed" if expected_exit == 0 else "failed")
    if expected_exit:
        assert "property greedy_exact violated" in row["evidence"] and "BUG" in row["evidence"]
        assert "FAIL" in run.stdout


def _a_run(tmp_path, capsys, impl: str, keyword: str, env_summary: Path | None, monkeypatch) -> tuple[int, Path, Path]:
    if env_summary is not None:
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(env_summary))
    else:
        monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    xml, md = tmp_path / "ci" / "junit.xml", tmp_path / "summary.md"
    code = cli.main(["conform", "--impl", impl, "--budget", "0.25", "-k", keyword, "--out",
                     str(tmp_path / "c.json"), "--junitxml", str(xml), "--summary", str(md)])
    capsys.readouterr()
    return code, xml, md


def test_conform_writes_junit_xml_and_a_summary_ci_can_read(tmp_path, capsys, monkeypatch):
    """--junitxml: valid JUnit XML with one test case per property and case of the report (its counts the
    report's), a failure carrying the diagnosis; --summary (and $GITHUB_STEP_SUMMARY, appended): Markdown
    naming each failed property. Against a broken decoder, so the failure path is exercised."""
    import xml.etree.ElementTree as ET
    (tmp_path / "broken.py").write_text(textwrap.dedent(TOKEN_CHANGED))
    step = tmp_path / "step.md"
    step.write_text("earlier step\n")
    code, xml, md = _a_run(tmp_path, capsys, f"{tmp_path / 'broken.py'}:generate",
                           "(greedy_exact and gpt-neox-partial) or determinism", step, monkeypatch)
    assert code == 1
    report = json.loads((tmp_path / "c.json").read_text())
    root = ET.parse(xml).getroot()
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(report["results"]) == int(suite.get("tests")) == int(root.get("tests")) > 1
    failed = [c for c in cases if c.find("failure") is not None]
    want = [r for r in report["results"] if r["outcome"] == "failed"]
    assert len(failed) == len(want) == int(suite.get("failures")) >= 1
    assert {c.get("name") for c in failed} == {f"{r['property']}[{r['case']}]" if r["case"] else r["property"]
                                               for r in want}
    assert all("property greedy_exact violated" in c.find("failure").text for c in failed
               if c.get("classname") == "spec.conformance.greedy_exact")
    text = md.read_text()
    assert text.startswith("## spec conform") and ": FAIL" in text.splitlines()[0]
    for r in want:
        assert f"<b>{r['property']}" in text
    assert step.read_text() == "earlier step\n" + text


def test_conform_ci_outputs_on_a_pass(tmp_path, capsys, monkeypatch):
    code, xml, md = _a_run(tmp_path, capsys, "spec", "determinism", None, monkeypatch)
    assert code == 0
    import xml.etree.ElementTree as ET
    suite = ET.parse(xml).getroot().find("testsuite")
    assert int(suite.get("failures")) == 0 and int(suite.get("tests")) >= 1
    assert md.read_text().splitlines()[0].endswith(": pass") and "Failed properties" not in md.read_text()


def test_conform_help_names_every_exit_status(capsys):
    with pytest.raises(SystemExit):
        conform.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for code in range(5):
        assert f"{code}:" in out, code
