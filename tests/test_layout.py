"""The layout rules of issue 19, checked mechanically: no import cycle inside spec/, no
function over 60 lines in spec/ except the decode loop (Algorithm 1 kept in one piece),
and one clock (spec/clock.py) for every timing in spec/ and tests/perf/. And those of issue 25:
the Runner and Drafter protocols exist and every runner and drafter keeps them, one function
makes runners and model drafts (spec.choose.runs), nothing is stored on a user's model as a
`_spec_*` attribute, spec/ imports nothing from tests/, and only the command lines read parsed
options (library functions take explicit arguments)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"
MAX_FUNCTION_LINES = 60
LONG_ALLOWED = {"speculative_generate"}  # the decode loop: Algorithm 1 on one screen


# The package by audience: the runtime (spec/*.py), the experiment (spec/experiment/) and the kit's
# modules (spec/conformance/, its property modules test_*.py aside). Names are dotted below spec.
PACKAGES = ("experiment", "conformance", "cpu", "bench")
AUDIENCES = ("experiment", "conformance", "bench")   # what the runtime (spec/*.py and spec/cpu/) never imports
COMMAND_LINES = {"__main__"}      # runtime-level files that drive the experiment (realmodel only fetches:
                                  # `--real` is a preset of spec.experiment.load, not a pipeline of its own)


def _name(path: Path) -> str:
    parts = path.relative_to(SPEC).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    paths = sorted(SPEC.glob("*.py")) + [p for pkg in PACKAGES for p in sorted((SPEC / pkg).glob("*.py"))
                                         if not p.name.startswith("test_")]
    return {_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in paths
            if _name(p) != "conformance"}


def _spec_imports(tree: ast.Module) -> set[str]:
    """spec modules a module imports, at the top or inside a function (dotted below spec, as
    `_modules` names them: `from spec.experiment import report` is experiment.report)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name[len("spec."):] for a in node.names if a.name.startswith("spec.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "spec":
                out |= {a.name for a in node.names}
            elif node.module.startswith("spec."):
                base = node.module[len("spec."):]
                subs = {f"{base}.{a.name}" for a in node.names}
                found = subs & _MODULE_NAMES
                out |= found or {base}
    return {m if m in _MODULE_NAMES else m.split(".")[0] for m in out}


_MODULE_NAMES = set(_modules())


def test_the_runtime_imports_neither_the_experiment_nor_the_kit():
    """Layout by audience: spec/*.py (the command lines aside) import nothing from spec/experiment/
    or spec/conformance/; the experiment imports nothing from the kit."""
    modules = _modules()
    for name, tree in modules.items():
        reached = {m.split(".")[0] for m in _spec_imports(tree)}
        if ("." not in name or name.startswith("cpu.")) and name not in PACKAGES and name not in COMMAND_LINES:
            assert not reached & set(AUDIENCES), f"spec/{name}.py imports {sorted(reached & set(AUDIENCES))}"
        if name.split(".")[0] == "experiment":
            assert "conformance" not in reached, f"{name} imports the conformance kit"


def test_the_real_model_is_a_preset_of_the_experiment():
    """Issue 42: `python -m spec --real` runs the one pipeline. spec/realmodel.py only fetches and
    loads SmolLM2 (it imports nothing of the experiment: the test above), spec.experiment's load
    step is what reaches it, and the command line does not, so no second path writes results.json."""
    modules = _modules()
    assert "realmodel" in _spec_imports(modules["experiment"])
    assert "realmodel" not in _spec_imports(modules["__main__"])


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
    long = [f"spec/{name.replace('.', '/')}.py:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and node.name not in LONG_ALLOWED]
    assert not long, "functions over 60 lines (split them into steps):\n" + "\n".join(long)


def test_one_clock():
    """Only spec/clock.py reads the clock; everything else times through it (device sync included)."""
    files = [p for p in sorted(SPEC.glob("*.py")) + sorted((SPEC / "cpu").glob("*.py"))
             + sorted((ROOT / "tests" / "perf").glob("*.py"))
             if p.name != "clock.py"]
    readers = [f"{p.relative_to(ROOT)}:{i}" for p in files
               for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
               if "perf_counter" in line or "time.monotonic" in line]
    assert not readers, "timing outside spec.clock: " + ", ".join(readers)


# --- issue 25: one loop over two small protocols, chosen in one place --------------------------

RUNNER_METHODS = {"__call__", "crop", "__len__"}
DRAFTER_METHODS = {"begin", "draft", "observe", "__len__"}


def _classes_with(methods: set[str]) -> dict[str, str]:
    """Classes in spec/ (outside the protocols themselves) defining every one of `methods`, or
    inheriting them from such a class in the same module: name -> module."""
    found = {}
    for module, tree in _modules().items():
        if module == "protocols":
            continue
        local = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                own = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                local[node.name] = own | set().union(*(local.get(b, set()) for b in bases))
                if methods <= local[node.name]:
                    found[node.name] = module
    return found


def test_the_protocols_exist_and_every_runner_and_drafter_keeps_them():
    import typing

    import torch

    from spec import batch, choose, draft, gguf_draft, hf, lookup, neox, protocols, runner, seq2seq
    from spec.cpu import qdraft
    for proto, methods in ((protocols.Runner, RUNNER_METHODS), (protocols.Drafter, DRAFTER_METHODS)):
        assert typing.Protocol in proto.__mro__ and proto.__doc__ and len(proto.__doc__) > 200
        assert methods <= set(vars(proto))
    runners = _classes_with(RUNNER_METHODS)
    assert {"KVRunner", "SnapshotRunner", "StepwiseSnapshotRunner", "RecomputeRunner", "NeoXDraft", "Cached",
            "Decoder"} <= set(runners)
    modules = dict(runner=runner, neox=neox, hf=hf, seq2seq=seq2seq, draft=draft, lookup=lookup, choose=choose,
                   batch=batch, gguf_draft=gguf_draft, **{"cpu.qdraft": qdraft})
    for name, module in runners.items():
        assert RUNNER_METHODS <= set(dir(getattr(modules[module], name))), name
    # keep means one thing: every runner's keep defaults to 0 (every row fed)
    import inspect
    for name, module in runners.items():
        keep = inspect.signature(getattr(modules[module], name).__call__).parameters["keep"]
        assert keep.default == 0, f"{name}: keep defaults to {keep.default!r}, not 0 (all rows)"
    # every drafter keeps the protocol, the built-in ones and any added as docs/DEVELOPING.md says (a new
    # spec/lastseen.py must not break this test): each is found, and its class has the protocol's methods
    import importlib
    # (a class with a `draft` method; the rest may come from a base such as spec.protocols.DraftSource)
    drafters = _classes_with({"draft"})
    assert {"ModelDraft", "ModelSource", "PromptLookup", "EachRow", "NoDraft", "TreeDraft", "LookupTree"} <= set(drafters)
    assert issubclass(gguf_draft.GGUFDraft, draft.ModelSource)     # its draft is the base's
    for name, module in drafters.items():
        cls = getattr(importlib.import_module(f"spec.{module}"), name)
        assert DRAFTER_METHODS <= set(dir(cls)), name
        if name not in ("ModelDraft", "EachRow", "NoDraft"):        # the single-row protocol declares its needs
            assert isinstance(getattr(cls, "needs", None), frozenset) and \
                all(isinstance(need, protocols.Need) for need in cls.needs), name
    # the loop's forms keep the batched protocols: one loop runs every prompt count
    for proto, classes in ((protocols.BatchRunner, (batch.Rows, batch.EachRunner)),
                           (protocols.BatchDrafter, (draft.ModelDraft, batch.EachRow, draft.NoDraft))):
        assert proto.__doc__ and len(proto.__doc__) > 200
        for cls in classes:
            assert {m for m in vars(proto) if not m.startswith("_") or m in ("__call__", "__len__")} - {"lengths"} \
                <= set(dir(cls)), cls.__name__
    assert isinstance(lookup.PromptLookup(), protocols.Drafter)
    assert isinstance(draft.ModelDraft(batch.EachRunner([runner.RecomputeRunner(torch.nn.Linear(1, 1))]), [draft.Pick()],
                                       [1], width=1, rows=1, clamp=False), protocols.BatchDrafter)


def _constructions() -> list[tuple[str, str, str]]:
    """(module, enclosing function, what) for every call in spec/ that builds a runner or a model
    draft: a call of a runner class by name, a call through the RUNNERS table, or ModelDraft(...)."""
    made = set(_classes_with(RUNNER_METHODS)) | {"ModelDraft"}
    out = []
    for module, tree in _modules().items():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                table = isinstance(f, ast.Subscript) and getattr(f.value, "attr", getattr(f.value, "id", None)) == "RUNNERS"
                if name in made or table:
                    out.append((module, func.name, name or "RUNNERS[...]"))
    return out


def test_one_function_makes_runners_and_model_drafts():
    """spec.choose is the one place a model becomes a Runner or a Drafter: `runs` for one sequence's
    Runners, `rows` (with its helper `_rows`) for what the loop runs on. (The probe in
    spec.runner builds each candidate path's class from a loop variable to test it against the
    model's own forward: a trial, not a choice, and not a call this check matches by name. A
    spec.gguf_draft.GGUFDraft is a Drafter its caller makes from a GGUF file, not from a model, like
    spec.PromptLookup; spec.choose uses it as it is, and its llama.cpp context is its own; spec.TreeDraft
    likewise makes the one engine, a ModelDraft, over the runner spec.choose.runs gives its model. The
    tree probe, spec.runner._tree_probe, builds a KVRunner to try a tree mask on: a trial again.)"""
    places = {(module, function) for module, function, _ in _constructions()}
    assert places == {("choose", "runs"), ("choose", "rows"), ("choose", "_rows"), ("gguf_draft", "__init__"),
                      ("treedraft", "_start"), ("runner", "_tree_probe")}, \
        f"runners or drafts built outside spec.choose: {sorted(places)}"


def test_the_construction_finder_finds_a_construction():
    tree = ast.parse("def elsewhere(model):\n    return KVRunner(model)\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert calls and calls[0].func.id in _classes_with(RUNNER_METHODS)
    assert ("choose", "rows", "ModelDraft") in _constructions()
    assert ("choose", "runs", "RUNNERS[...]") in _constructions()


def test_nothing_is_stored_on_a_users_model():
    """Memo tables are keyed weakly (spec.probe._MEMO, hf.COMPILED_STEPS): no `_spec_*`
    attribute is written, by assignment or setattr, anywhere in spec/."""
    writes = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"spec/{module}.py:{node.lineno}" for t in targets
                       if isinstance(t, ast.Attribute) and t.attr.startswith("_spec_")]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1 \
                    and "_spec_" in ast.unparse(node.args[1]):   # a name, or an f-string building one
                writes.append(f"spec/{module}.py:{node.lineno} (setattr)")
    assert not writes, "attributes written on objects spec does not own: " + ", ".join(writes)


def test_spec_imports_nothing_from_tests():
    helpers = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "conftest"}
    found = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            found += [f"spec/{module}.py:{node.lineno} imports {n}" for n in names if n.split(".")[0] in helpers]
    assert not found, "\n".join(found)


CLI_MODULES = {"__main__", "conformance.conform", "bench.cli"}   # the command lines: they parse options and pass
                                                                # values on


def _namespace_readers(module: str, tree: ast.Module) -> list[str]:
    """Functions that take a parsed command line (a parameter named `args`) or read one
    (`args.x`, `vars(args)`) without parsing it themselves."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        nodes = list(ast.walk(fn))
        parses = any(isinstance(n, ast.Attribute) and n.attr == "parse_args" for n in nodes)
        reads = any(isinstance(n, ast.Name) and n.id == "args" and isinstance(n.ctx, ast.Load) for n in nodes)
        if "args" in params or (reads and not parses):
            out.append(f"spec/{module}.py:{fn.lineno} {fn.name}")
    return out


def test_only_the_command_lines_read_parsed_options():
    """Library functions take explicit arguments, not argparse namespaces: spec/__main__.py and
    spec/conformance/conform.py parse options and pass their values on; a module's own `main(argv)` that
    parses its options may read them."""
    found = [f for module, tree in _modules().items() if module not in CLI_MODULES
             for f in _namespace_readers(module, tree)]
    assert not found, "functions that read a parsed command line:\n" + "\n".join(found)


def test_the_namespace_finder_finds_a_reader():
    tree = ast.parse("def step(args, say):\n    return args.gamma\n"
                     "def later(x):\n    return vars(args)\n"
                     "def main(argv):\n    args = parser.parse_args(argv)\n    return args.gamma\n")
    assert _namespace_readers("m", tree) == ["spec/m.py:1 step", "spec/m.py:3 later"]
    assert _namespace_readers("__main__", _modules()["__main__"])   # the command line itself reads them


def test_one_acceptance_path_one_probe_memo_and_no_capability_flags():
    """The structure issue 42 asked for, held: spec.accept has one entry per rule (greedy, sampled)
    over every proposal, the loop never asks a proposal's shape, the probes' verdicts live in one
    memo (spec.probe), and no capability is read as an optional attribute (getattr/hasattr with a
    default): needs are declared (spec.Need), runners are asked by type."""
    import spec.accept as accept
    public = sorted(n for n, v in vars(accept).items()
                    if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == accept.__name__)
    assert public == ["greedy", "sampled"], public
    sources = {name: ast.unparse(tree) for name, tree in _modules().items()}
    # (spec.batch: the shared pass takes chains under its 2-D mask, a fast path; a drafter in a batch that
    # branches must say so)
    assert "is_chain" not in sources["decode"] and "is_chain" not in \
        sources["batch"].replace("tree.is_chain for", "").replace("(not made.is_chain) and (Need.TREES", "")
    memos = [name for name, text in sources.items() if "WeakKeyDictionary()" in text]
    assert "probe" in memos and "runner" not in memos and "batch" not in memos, memos
    # one model-drafting path: only the engine (spec.draft.ModelDraft) picks tokens from a draft model's
    # runner; TreeDraft and GGUFDraft are its configurations (spec.draft.ModelSource), and one resync
    from spec import draft, gguf_draft, treedraft
    assert all(issubclass(cls, draft.ModelSource) for cls in (treedraft.TreeDraft, gguf_draft.GGUFDraft))
    scorers = sorted(name for name, text in sources.items()         # (the kit's decoders under test aside)
                     if "score_tree(" in text and not name.startswith("conformance"))
    assert scorers == ["batch", "runner"], scorers
    resyncs = sorted(name for name, text in sources.items() if re.search(r"\bresync\(", text))
    assert resyncs == ["draft"], resyncs
    flags = ("makes_trees", "needs_hidden", "takes_trees", "collect_hidden", "hidden", "needs")
    found = [f"spec/{name}.py: {m.group(0)}" for name, text in sources.items() if not name.startswith("conformance")
             for m in re.finditer(r"\b(?:getattr|hasattr)\([^'\n]*?'(\w+)'", text) if m.group(1) in flags]
    assert not found, found


# --- issue 43: an executor, not patches ------------------------------------------------------------

def _patches(module: str, tree: ast.Module) -> list[str]:
    """Lines of `module` that replace a module's `forward` (object.__setattr__ / setattr(m, "forward", ...),
    an assignment to `x.forward`, `vars(m).pop("forward")` or `m.__dict__.pop("forward")`), read torch's
    private global hook dicts (`torch.nn.modules.module._global_*`), or, in spec.runner and spec/cpu/, set
    torch's thread count (`torch.set_num_threads`)."""
    out = []

    def forward_named(arg) -> bool:
        return isinstance(arg, ast.Constant) and arg.value == "forward"
    for node in ast.walk(tree):
        where = f"spec/{module.replace('.', '/')}.py:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            f, args = node.func, node.args
            name = ast.unparse(f)
            if name.endswith("__setattr__") or name == "setattr":
                if len(args) > 1 and forward_named(args[1]):
                    out.append(f"{where} sets a forward ({name})")
            if isinstance(f, ast.Attribute) and f.attr in ("pop", "__delitem__") and args and forward_named(args[0]):
                holder = ast.unparse(f.value)
                if holder.startswith("vars(") or holder.endswith("__dict__"):
                    out.append(f"{where} pops a forward ({holder}.pop)")
            if name.split(".")[-1] == "set_num_threads" and (module == "runner" or module.startswith("cpu.")):
                out.append(f"{where} sets torch's threads")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [f"{where} assigns a forward" for t in targets if isinstance(t, ast.Attribute) and t.attr == "forward"]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_global_"):
            out.append(f"{where} reads torch's private {node.attr}")
    return out


def test_passes_run_on_an_executor_not_on_patches():
    """Issue 43: spec runs a pass by calling an object (spec.cpu.executor), so no module's `forward` is
    replaced anywhere in spec/, no torch thread count is set in spec.runner or spec/cpu/ (a pass's threads are
    named per call), and torch's private global hook dicts are read nowhere."""
    found = [line for module, tree in _modules().items() for line in _patches(module, tree)]
    assert not found, "patches instead of an executor:\n" + "\n".join(found)


def test_the_patch_finder_finds_patches():
    tree = ast.parse("def swap(m, f):\n    object.__setattr__(m, 'forward', f)\n    vars(m).pop('forward', None)\n"
                     "    m.__dict__.pop('forward')\n    setattr(m, 'forward', f)\n    m.forward = f\n"
                     "    torch.set_num_threads(1)\n    return torch.nn.modules.module._global_forward_hooks\n")
    assert len(_patches("cpu.prepack", tree)) == 7
    assert len(_patches("experiment", tree)) == 6           # (the experiment's setup sets the run's threads)
    assert not _patches("cpu.prepack", ast.parse("vars(m).pop('other')\nobject.__setattr__(m, 'x', 1)\n"))


# --- the native library: C in source files, one build, one Llama layer -------------------------------

NATIVE = SPEC / "cpu" / "native"


def test_no_c_source_lives_in_a_python_string():
    """C is in spec/cpu/native/*.c where editors, linters and sanitizers see it: no Python file in spec/
    holds a string with a C include or a C function body."""
    found = []
    for path in sorted(SPEC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    "#include" in node.value or re.search(r"\b(?:static|void|int64_t)\b[^\n]*\)\s*\{", node.value)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "C source in Python strings: " + ", ".join(found)
    assert sorted(p.name for p in NATIVE.glob("*.c")) == ["gemv.c", "isa.c", "layer.c", "pool.c", "qdraft.c",
                                                           "selftest.c", "selftest_main.c"]


def test_one_build_and_one_dispatch():
    """One module compiles C (spec.cpu.native: the only caller of a compiler), and the variant is chosen
    in one place (isa.c's spec_native_isa: the only __builtin_cpu_supports; no CPU flags read from
    /proc/cpuinfo in Python: the report's CPU name aside, and spec.conformance.provenance, which copies them
    into a report's "meta" block and which the runtime never imports: it chooses nothing)."""
    compilers = [str(p.relative_to(ROOT)) for p in SPEC.rglob("*.py")
                 if re.search(r"\bcompiler\(\)|\"-shared\"|'-shared'", p.read_text(encoding="utf-8"))]
    assert compilers == ["spec/cpu/native.py"], compilers
    readers = [str(p.relative_to(ROOT)) for p in SPEC.rglob("*.py")
               if re.search(r"avx|vnni|startswith\(\"flags", p.read_text(encoding="utf-8"), re.I)
               and "/proc/cpuinfo" in p.read_text(encoding="utf-8")]
    assert readers == ["spec/conformance/provenance.py"], readers
    dispatch = [p.name for p in NATIVE.glob("*.c") if "__builtin_cpu_supports" in p.read_text()]
    assert dispatch == ["isa.c"], dispatch


def test_one_llama_layer_for_target_and_draft():
    """RMSNorm, rotary, attention and the SiLU gate are written once (layer.c; attention over the draft's
    cache of keys in blocks, spec_attend_blocked, beside the target's) and the draft's forward calls them: qdraft.c computes no square root, exponential, sine or cosine table of its own but the
    rotary angles, and defines no norm, rope, softmax or attention of its own. The runtime reads a GGUF's
    header in one place."""
    qd = (NATIVE / "qdraft.c").read_text()
    for op in ("spec_rms(", "spec_rotary(", "spec_attend_blocked(", "spec_silu_mul("):
        assert op in qd, f"the draft's forward does not call {op}"
    own = re.findall(r"^static[^\n(]*\b(\w*(?:norm|rope|rms|attend|softmax|silu|exp)\w*)\(", qd, re.M)
    assert not own, f"qdraft.c defines layer ops of its own: {own}"
    assert "expf(" not in qd and "sqrtf(" not in qd.replace("1.f / sqrtf((float)hd)", "")
    layer = (NATIVE / "layer.c").read_text()
    for entry in ("void spec_rms(", "void spec_rotary(", "int64_t spec_attend(", "void spec_attend_blocked(",
                  "void spec_silu_mul("):
        assert sum(p.read_text().count(entry) for p in NATIVE.glob("*.c")) == 1 and entry in layer, entry
    # the runtime reads a GGUF's header with qdraft.GGUF alone (measured: the gguf package's reader took ~120 MB
    # and 2 s for SmolLM2's 49k-token vocabulary, qdraft.GGUF 6 MB and 0.16 s); the package writes GGUFs,
    # and converts one whole in the kit (spec.conformance.llamacpp.dequantized_gguf: every field rewritten with
    # its type, every tensor type dequantized)
    readers = {p.relative_to(SPEC).as_posix() for p in SPEC.rglob("*.py") if "GGUFReader(" in p.read_text()}
    assert readers == {"conformance/llamacpp.py"}, readers
    assert sum(p.read_text().count("class GGUF:") for p in SPEC.rglob("*.py")) == 1
    assert "gguf" not in re.findall(r"^\s*(?:import|from) (\w+)", (SPEC / "cpu" / "qdraft.py").read_text(), re.M)


# --- the kit: each property once, capabilities declared, one class per name, gamma's default once ---------

def _every_module() -> dict[str, ast.Module]:
    """Every Python file under spec/ (the kit's property modules included), by its dotted name below spec."""
    return {_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SPEC.rglob("*.py"))}


def _callers(trees: dict[str, ast.Module], called: str) -> set[str]:
    """'module.function' (or 'module.Class.method', 'module' at the top level) for every call of a function
    named `called` (`called(...)` or `x.called(...)`)."""
    found = set()

    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, f"{where}.{child.name}")
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) == called:
                    found.add(where)
            walk(child, where)
    for module, tree in trees.items():
        walk(tree, module)
    return found


def _classes(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names.setdefault(node.name, []).append(f"spec/{module}:{node.lineno}")
    return names


def _gamma_defaults(trees: dict[str, ast.Module]) -> list[str]:
    """A number written as gamma's default: a parameter named gamma with a numeric default, an argparse
    --gamma with a numeric default=, or a DEFAULT_GAMMA-like constant assigned a number outside
    spec/defaults.py."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults)) + \
                    [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                found += [f"spec/{module}:{node.lineno} {k.arg}={ast.unparse(d)}" for k, d in pairs
                          if k.arg == "gamma" and isinstance(d, ast.Constant) and isinstance(d.value, (int, float))]
            elif isinstance(node, ast.Call) and any(isinstance(x, ast.Constant) and x.value == "--gamma"
                                                    for x in node.args):
                found += [f"spec/{module}:{node.lineno} --gamma default={ast.unparse(k.value)}" for k in node.keywords
                          if k.arg == "default" and isinstance(k.value, ast.Constant)
                          and isinstance(k.value.value, (int, float))]
            elif isinstance(node, ast.Assign) and module != "defaults" and isinstance(node.value, ast.Constant):
                found += [f"spec/{module}:{node.lineno} {t.id}" for t in node.targets
                          if isinstance(t, ast.Name) and "DEFAULT" in t.id and "GAMMA" in t.id]
    return found


def test_one_class_per_name():
    """Two classes under one name (the runtime's ModelDraft and a kit module's, say) make tracebacks and
    imports ambiguous: every class name in spec/ is defined once."""
    twice = {name: where for name, where in _classes(_every_module()).items() if len(where) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def test_gammas_default_is_written_once():
    """gamma's default lives in spec.defaults (DEFAULT_GAMMA, REAL_GAMMA): no other number is gamma's
    default anywhere in spec/."""
    assert not _gamma_defaults(_every_module())
    from spec import decode, defaults
    import inspect
    assert inspect.signature(decode.speculative_generate).parameters["gamma"].default == defaults.DEFAULT_GAMMA


def test_the_kit_checks_each_property_once():
    """Greedy exactness and the sampling law are each one function (spec.conformance.checks) over the
    Subject protocol, whatever the subject (a server, llama.cpp in process, an in-process decoder): the
    tie-or-bug judgement (spec.diagnose.judge) is reached only through Subject.judge, a subject's outputs
    are judged by checks.greedy_exact (and endpoints.diagnose, the served properties' other comparisons),
    and a chi-square of samples against a law (stats.goodness_of_fit) is built only by stats.law_fit, which
    only checks.sampling_law and the negative controls' fits (kit.joint_fit, laws.wide_fit) call."""
    trees = _every_module()
    assert _callers(trees, "judge") == {"diagnose.diagnose", "conformance.subject.Subject.judge",
                                        "conformance.checks.greedy_exact", "conformance.endpoints.diagnose"}
    assert _callers(trees, "greedy_exact") == {"conformance.endpoints.greedy_exact",
                                               "conformance.endpoints.greedy_options",
                                               "conformance.kit.greedy_property",
                                               "conformance.test_engine.outcome"}
    assert _callers(trees, "goodness_of_fit") == {"conformance.stats.law_fit"}
    assert _callers(trees, "law_fit") == {"conformance.checks.sampling_law", "conformance.kit.joint_fit",
                                          "conformance.laws.wide_fit"}
    from spec.conformance import subject
    assert issubclass(subject.DecoderSubject, subject.Subject)


def test_capabilities_are_declared_not_looked_up():
    """A subject's capabilities are its Capabilities, fixed where it is made; a user's callable declares
    its conformance_* attributes, read by one function (subject.declared). No getattr/hasattr of a
    conformance_* name anywhere in spec/."""
    lookups = []
    for module, tree in _every_module().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                    and len(node.args) > 1 and "conformance_" in ast.unparse(node.args[1]):
                lookups.append(f"spec/{module}:{node.lineno}")
    assert not lookups, lookups
    readers = {m for m, tree in _every_module().items()
               for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "DECLARED"}
    assert readers == {"conformance.subject"}, readers


def test_the_kit_finders_find_what_they_look_for():
    """Not vacuous: each finder above finds a planted instance."""
    planted = {"a": ast.parse("class Draft: pass\ndef f(gamma=4):\n    return judge(1, 2)\n"),
               "b": ast.parse("class Draft: pass\nDEFAULT_GAMMA = 3\np.add_argument('--gamma', default=6)\n"
                              "class C:\n    def m(self, *, gamma: int = 2):\n        return x.judge(1)\n")}
    assert _classes(planted)["Draft"] == ["spec/a:1", "spec/b:1"]
    assert len(_gamma_defaults(planted)) == 4
    assert _callers(planted, "judge") == {"a.f", "b.C.m"}
