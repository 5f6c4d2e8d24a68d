"""What a user reads first is current and traceable: docs/BENCHMARKS.md's tables and docs/CONFORMANCE.md's
engine matrix are what `python recipes/docs.py` renders from results/, every results file says when, where,
at which commit and with what it was measured (or which log section its figures were copied from), the links
and section names other files point at exist, and the user docs carry no issue numbers and no superseded
gamma default. Standard library only; a second or so."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = ("docs/BENCHMARKS.md", "docs/CONFORMANCE.md")


def _load(path: Path, name: str):
    loader = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


docs = _load(ROOT / "recipes" / "docs.py", "recipes_docs")
provenance = _load(ROOT / "spec" / "conformance" / "provenance.py", "docs_provenance")
RESULTS = sorted((ROOT / "results").rglob("*.json"))


def headings(path: Path) -> list[str]:
    """A Markdown file's headings (outside code fences), as written."""
    out, fence = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def test_the_generated_parts_are_what_the_results_files_give(tmp_path):
    """recipes/docs.py run on a copy of docs/ and results/ leaves the committed docs as they are (their dates come
    from the results files, so a rerun changes nothing at all); a stale part is caught."""
    for folder in ("docs", "results"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    assert docs.main(["--root", str(tmp_path)]) == 0
    for doc in USER_DOCS:
        assert (tmp_path / doc).read_text() == (ROOT / doc).read_text(), \
            f"{doc} is not what python recipes/docs.py renders from results/: run it and commit the result"
    stale = tmp_path / "docs" / "BENCHMARKS.md"
    stale.write_text(stale.read_text().replace("| greedy tok/s |", "| greedy tokens/s |", 1))
    assert docs.main(["--root", str(tmp_path), "--check"]) == 1
    assert docs.main(["--root", str(tmp_path)]) == 0 and docs.main(["--root", str(tmp_path), "--check"]) == 0


def test_every_part_has_its_markers_once():
    for doc, parts in docs.PARTS.items():
        text = (ROOT / doc).read_text()
        for name in parts:
            assert text.count(docs.BEGIN.format(name)) == 1 and text.count(docs.END.format(name)) == 1, (doc, name)


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_says_when_where_and_with_what(path):
    meta = json.loads(path.read_text()).get("meta")
    assert isinstance(meta, dict), f"{path.name}: no meta block (spec.conformance.provenance.meta)"
    missing = [k for k in provenance.REQUIRED if k not in meta]
    assert not missing, f"{path.name}: meta lacks {missing}"
    assert meta["date"] and meta["command"] and meta["machine"] and meta["versions"], path.name
    if meta["source"] == "measured":
        assert meta["commit"], f"{path.name}: a measured file names its commit"
        assert {"cpu", "cores", "flags"} <= set(meta["machine"]), path.name
        assert "torch" in meta["versions"] or "python" in meta["versions"], path.name
    else:   # figures copied from the dated log: which section, and why they were not measured again
        assert meta["source"] == "transcribed" and meta["not_remeasured"], path.name
        log = meta["log"]
        assert log["section"] in headings(ROOT / log["file"]), f"{path.name}: no section {log['section']!r}"


def test_a_measured_meta_block_describes_this_machine():
    meta = provenance.meta("python recipes/x.py")
    assert set(provenance.REQUIRED) <= set(meta) and meta["source"] == "measured"
    assert meta["machine"]["cores"] >= 1 and meta["versions"]["python"]


def _anchors(path: Path) -> set[str]:
    return {docs.slug(h) for h in headings(path)}


def test_links_between_the_docs_resolve():
    """Every relative Markdown link in README.md and docs/ names a file that exists and, with #anchor, a heading
    of it."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        prose = re.sub(r"`[^`\n]*`", "", page.read_text())      # inline code is not a link
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            where = (page.parent / file).resolve() if file else page
            if not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


SECTION_REFERENCE = re.compile(r"(docs/[\w/]+\.md)(?:,| \(|, the log's) \"([^\"]+)\"")


def test_the_sections_code_and_docs_name_exist():
    """`docs/X.md, "Section"` in the code, the tests, the recipes and the docs names a heading of X that starts
    so (as spec/llamaguard.py's refusal names "llama.cpp on AMX CPUs")."""
    missing = []
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "spec").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "recipes").glob("*"), *(ROOT / "requirements").glob("*")]
    for path in files:
        if not path.is_file() or path.suffix not in ("", ".py", ".md", ".sh") or path == Path(__file__):
            continue
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text(errors="replace"))
        for doc, name in SECTION_REFERENCE.findall(text):
            if not (ROOT / doc).exists():
                missing.append(f"{path.relative_to(ROOT)}: {doc} does not exist")
            elif not any(h.replace("`", "").startswith(name.replace("`", "")) for h in headings(ROOT / doc)):
                missing.append(f"{path.relative_to(ROOT)}: {doc} has no section {name!r}")
    assert not missing, "\n".join(missing)


def test_the_user_docs_carry_no_issue_numbers_and_no_dated_headings():
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        assert not re.findall(r"\b[Ii]ssue \d+|\(issue\b", text), doc
        dated = [h for h in headings(ROOT / doc) if re.search(r"\b20\d\d-\d\d-\d\d\b", h)]
        assert not dated, (doc, dated)


def test_benchmarks_states_only_the_current_gamma_defaults():
    """A sentence of docs/BENCHMARKS.md that speaks of a default gamma names spec.defaults' values only."""
    defaults = _load(ROOT / "spec" / "defaults.py", "docs_defaults")
    allowed = {defaults.DEFAULT_GAMMA, *defaults.REAL_GAMMA.values()}
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    for sentence in re.split(r"(?<=[.;])\s", text.replace("\n", " ")):
        if "default" in sentence and "gamma" in sentence:
            said = {int(n) for n in re.findall(r"gamma (\d+)", sentence)}
            assert said <= allowed, sentence
