"""The layout rules of issue 19, checked mechanically: no import cycle inside spec/, no
function over 60 lines in spec/ except the decode loop (Algorithm 1 kept in one piece),
and one clock (spec/clock.py) for every timing in spec/ and tests/perf/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
MAX_FUNCTION_LINES = 60
LONG_ALLOWED = {"speculative_generate"}  # the decode loop: Algorithm 1 on one screen


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SPEC.glob("*.py"))}


def _spec_imports(tree: ast.Module) -> set[str]:
    """spec modules a module imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("spec.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "spec":
                out |= {a.name for a in node.names}
            elif node.module.startswith("spec."):
                out.add(node.module.split(".")[1])
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_in_spec():
    modules = _modules()
    graph = {name: _spec_imports(tree) & set(modules) for name, tree in modules.items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"decode": {"measure"}, "measure": {"decode"}}) in (["decode", "measure", "decode"],
                                                                         ["measure", "decode", "measure"])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_long_functions_in_spec():
    long = [f"spec/{name}.py:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and node.name not in LONG_ALLOWED]
    assert not long, "functions over 60 lines (split them into steps):\n" + "\n".join(long)


def test_one_clock():
    """Only spec/clock.py reads the clock; everything else times through it (device sync included)."""
    files = [p for p in sorted(SPEC.glob("*.py")) + sorted((ROOT / "tests" / "perf").glob("*.py"))
             if p.name != "clock.py"]
    readers = [f"{p.relative_to(ROOT)}:{i}" for p in files
               for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
               if "perf_counter" in line or "time.monotonic" in line]
    assert not readers, "timing outside spec.clock: " + ", ".join(readers)
