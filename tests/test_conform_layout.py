"""The conformance kit's structure, checked mechanically:

- a served-model run (`spec conform --impl openai:URL --reference openai:URL`) imports neither torch nor
  transformers: checking a server needs only the kit, pytest, hypothesis and an HTTP client (issue 41);
- no test module imports another (tests/test_*.py and the kit's property modules spec/conformance/test_*.py):
  what two of them share is a library module (spec/conformance/laws.py, onesided_laws.py, levels.py, ...),
  so a property module is only ever collected, and renaming or splitting one breaks no other test.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from endpoint_proxy import Proxy

ROOT = Path(__file__).resolve().parents[1]

# The child runs `spec conform` as `python -m spec conform` does, then names the heavy modules it holds.
SERVED_RUN = textwrap.dedent("""
    import json, sys
    from spec.conformance import conform
    code = conform.main(sys.argv[1:])
    print("IMPORTED " + json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
    sys.exit(code)
""")


@pytest.mark.parametrize("bug, keyword, expected", [
    (None, "endpoint and not sampling_options", 0),           # every served property but the slow option laws
    ("block-token-wrong", "endpoint_greedy_exact", 1),        # a failure, its diagnosis and its --repro script
])
def test_a_served_model_run_imports_neither_torch_nor_transformers(endpoint_server, tmp_path, bug, keyword,
                                                                   expected):
    """The in-process servers (tests/endpoint_server.py) hold torch in this process; the run is a child that
    speaks to them over HTTP. Not vacuous: the child's properties must have run (passed, or failed with a
    script written), not been skipped."""
    server, reference = endpoint_server(True), endpoint_server(False)
    proxy = Proxy(server.url, bug) if bug else None
    try:
        out, folder = tmp_path / "conformance.json", tmp_path / "repro"
        argv = ["--impl", f"openai:{(proxy or server).url}", "--reference", f"openai:{reference.url}",
                "--budget", "0.25", "-k", keyword, "--out", str(out), "--repro", str(folder)]
        done = subprocess.run([sys.executable, "-c", SERVED_RUN, *argv], capture_output=True, text=True,
                              cwd=tmp_path, timeout=600, env={**_env(), "PYTHONPATH": str(ROOT)})
    finally:
        if proxy:
            proxy.stop()
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == expected, tail
    imported = [line for line in done.stdout.splitlines() if line.startswith("IMPORTED ")]
    assert imported == ["IMPORTED []"], tail
    rows = json.loads(out.read_text())["results"]
    passed = {r["property"] for r in rows if r["outcome"] == "passed"}
    if expected == 0:   # the statistics too: the first token's law at T = 1 is a chi-square
        assert {"endpoint_greedy_exact", "endpoint_stops", "endpoint_sampling_law", "endpoint_seeded"} <= passed, rows
    else:
        assert [(r["property"], r["outcome"]) for r in rows] == [(keyword, "failed")], rows
        assert len(list(folder.glob("*.py"))) == 1, tail


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# --- no test module imports another ------------------------------------------------------------------------

def _test_modules() -> dict[str, Path]:
    """Importable name -> file of every test module: tests/test_*.py (on sys.path as top-level names, with
    tests/ itself) and the kit's property modules."""
    found = {p.stem: p for p in sorted((ROOT / "tests").rglob("test_*.py"))}
    found.update({f"spec.conformance.{p.stem}": p for p in sorted((ROOT / "spec" / "conformance").glob("test_*.py"))})
    return found


def imported_test_modules(source: str) -> set[str]:
    """The test modules (named test_*) a module's source imports, at the top or inside a function, in any
    spelling: `import test_x`, `from pkg import test_x`, `from pkg.test_x import name`, `import pkg.test_x`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.rsplit(".", 1)[-1].startswith("test_")}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.rsplit(".", 1)[-1].startswith("test_"):
                out.add(module)
            out |= {f"{module}.{a.name}".lstrip(".") for a in node.names if a.name.startswith("test_")}
    return out


def test_no_test_module_imports_another():
    modules = _test_modules()
    assert len(modules) > 40 and "spec.conformance.test_sampling_law" in modules   # the walk finds them
    offenders = {str(path.relative_to(ROOT)): sorted(found) for path in modules.values()
                 if (found := imported_test_modules(path.read_text(encoding="utf-8")))}
    assert not offenders, f"test modules importing test modules (move what they share into a library module): " \
                          f"{offenders}"


@pytest.mark.parametrize("source", [
    "from spec.conformance import test_sampling_law as law",
    "from spec.conformance.test_one_sided import UNDERPOWERED",
    "import spec.conformance.test_endpoint",
    "import test_endpoint",
    "from . import test_greedy",
    "def f():\n    from spec.conformance import kit, test_trees\n",
])
def test_the_finder_finds_a_test_module_import(source):
    assert imported_test_modules(source), source


def test_the_finder_leaves_library_imports_alone():
    assert not imported_test_modules("from spec.conformance import laws, onesided_laws, kit\nimport endpoint_proxy\n"
                                     "from spec.conformance.laws import sample_size\nimport pytest_timeout\n")
