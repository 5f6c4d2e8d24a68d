"""The conformance kit's pytest plugin: the decoders under test (`--impl`), the budget, known findings,
and the rule that a run in which no property ran is an error.

Registered through the `pytest11` entry point (pyproject.toml), so an installed `spec` gives every
pytest run these options; the kit itself only runs where its tests are collected
(`pytest --pyargs spec.conformance`, `python -m spec conform`, or this project's own suite).
Nothing heavy is imported until a test asks for `impl`.

`--impl A,B,...`: spec, hf-assisted, hf-prompt-lookup, llama-cpp, openai:URL (with --conform-reference
openai:URL), module:function or
path/to/file.py:function (see spec/conformance/impls.py for the interface); every property that takes `impl`
runs once per decoder named. `--conform-budget B` scales every example count and sample size by B
(default 1: the kit against spec fits in about a minute of a CPU).
"""

from __future__ import annotations

import os

import pytest

IMPLS = pytest.StashKey()     # name -> spec.conformance.impls.Impl, loaded on first use
ITEM_IMPL = pytest.StashKey()  # nodeid -> impl name, for the items that take one
RAN = pytest.StashKey()        # impl name -> whether any of its properties ran (passed, failed or xfailed)
OURS = pytest.StashKey()       # node ids (without parameters) of the tests this plugin parametrized

# (impl, test name without the impl's id) -> why it fails. Every entry is a confirmed non-exactness
# written up in docs/CONFORMANCE.md; it runs as xfail(strict=True, raises=kit.TiesOnly), so an upstream fix
# shows up as XPASS, and any other failure there (a crash, a refused build, a divergence that is a bug)
# fails as usual.
_Q4_TIES = ("llama.cpp {0} on the SmolLM2-135M-Instruct Q4_1 GGUF: 4 of 5 seed prompts diverge from the engine's own "
            "greedy output (llama-cpp-python 0.3.36, 64 tokens, 1 thread); every divergence is a tie, a greedy top-2 "
            "gap of 0.007 to 0.17 against a measured one-token vs block noise of 1.24 on Q4_1 weights (kernel "
            "non-invariance, not a rollback bug); the same weights in f32 are exact (docs/CONFORMANCE.md)")
KNOWN_FINDINGS: dict[tuple[str, str], str] = {
    ("llama-cpp", "test_engine_greedy_exact[q4_1-prompt-lookup]"): _Q4_TIES.format("prompt lookup (gamma 8)"),
    ("llama-cpp", "test_engine_greedy_exact[q4_1-draft-model]"): _Q4_TIES.format("with a draft model (gamma 4)"),
}


def pytest_addoption(parser):
    kit = parser.getgroup("conformance", "spec: the conformance kit (spec/conformance)")
    kit.addoption("--impl", default=os.environ.get("SPEC_IMPL", "spec"),
                  help="decoders under test, comma-separated: spec, hf-assisted, hf-prompt-lookup, llama-cpp, "
                       "module:function or path/to/file.py:function (env SPEC_IMPL; default spec)")
    kit.addoption("--conform-budget", type=float, default=1.0,
                  help="scale the kit's example counts and sample sizes (default 1)")
    kit.addoption("--conform-no-shrink", action="store_true",
                  help="report the first counterexample hypothesis finds, without shrinking it (faster)")
    kit.addoption("--conform-model", default=None,
                  help="a model file for the engine adapters that take one (llama-cpp: a .gguf); "
                       "default: the adapter's own models; openai:URL: the served model's name")
    kit.addoption("--conform-reference", default=os.environ.get("SPEC_REFERENCE"),
                  help="for --impl openai:URL: openai:URL of the same model served without speculation "
                       "(env SPEC_REFERENCE)")
    kit.addoption("--conform-control", default=os.environ.get("SPEC_CONTROL"),
                  help="for --impl openai:URL: openai:URL of the same speculative engine in its deterministic / "
                       "batch-invariant mode; a failed crowd property replays its crowd there (env SPEC_CONTROL)")


def impl_names(config) -> list[str]:
    names = [n.strip() for n in str(config.getoption("--impl")).split(",") if n.strip()]
    if not names:
        raise pytest.UsageError("--impl names no decoder")
    return names


def loaded(config, name: str):
    """The Impl named `name`, loaded once per session; a bad name is a usage error."""
    cache = config.stash.setdefault(IMPLS, {})
    if name not in cache:
        from spec.conformance import impls
        try:
            cache[name] = impls.load(name, model=config.getoption("--conform-model"),
                                     reference=config.getoption("--conform-reference"),
                                     control=config.getoption("--conform-control"))
        except Exception as err:  # a bad --impl is a usage error, not 60 failing tests
            raise pytest.UsageError(f"--impl {name!r}: {type(err).__name__}: {err}") from None
    return cache[name]


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance: a property of the conformance kit (spec/conformance)")


def _parametrizes_impl_itself(metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        if "impl" in ([n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)):
            return True
    return False


def pytest_generate_tests(metafunc):
    """Every test that takes the `impl` fixture runs once per decoder named by --impl (a test that
    parametrizes a parameter of that name itself is left alone)."""
    if "impl" in metafunc.fixturenames and not _parametrizes_impl_itself(metafunc):
        names = impl_names(metafunc.config)
        metafunc.config.stash.setdefault(OURS, set()).add(metafunc.definition.nodeid)
        for name in names:
            loaded(metafunc.config, name)
        metafunc.parametrize("impl", names, indirect=True, ids=names, scope="session")


@pytest.fixture(scope="session")
def impl(request):
    """The decoder under test (spec.conformance.impls.Impl)."""
    return loaded(request.config, request.param)


@pytest.fixture(scope="session")
def budget(pytestconfig) -> float:
    value = pytestconfig.getoption("--conform-budget")
    if not value > 0:
        raise pytest.UsageError(f"--conform-budget must be a number > 0, got {value}")
    return value


def property_name(item, impl: str) -> str:
    """The test's name as it would be with no impl parameter: test_greedy_exact[llama-partial]."""
    base, _, case = item.name.partition("[")
    parts = case.removesuffix("]").replace(f"-{impl}-", "-")
    for cut in (f"{impl}-", f"-{impl}"):
        if parts.startswith(cut) or parts.endswith(cut):
            parts = parts.removeprefix(cut) if parts.startswith(cut) else parts.removesuffix(cut)
            break
    else:
        parts = "" if parts == impl else parts
    return f"{base}[{parts}]" if parts else base


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    owners = config.stash.setdefault(ITEM_IMPL, {})
    ours = config.stash.get(OURS, set())
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "impl" not in callspec.params or item.nodeid.partition("[")[0] not in ours:
            continue
        name = callspec.params["impl"]
        owners[item.nodeid] = name
        reason = KNOWN_FINDINGS.get((name, property_name(item, name)))
        if reason:
            from spec.conformance.kit import TiesOnly
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason, raises=TiesOnly))
    if owners:
        from spec.conformance import hypo
        hypo.SHRINK[0] = not config.getoption("--conform-no-shrink")
    config.stash[RAN] = {name: False for name in owners.values()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    owner = item.config.stash.get(ITEM_IMPL, {}).get(item.nodeid)
    if owner is None:
        return
    ran = (report.when == "call" and not (report.skipped and not hasattr(report, "wasxfail"))) or report.failed
    if ran:
        item.config.stash[RAN][owner] = True


def pytest_sessionfinish(session, exitstatus):
    """A decoder none of whose properties ran (all skipped: it takes no draft, raises
    NotImplementedError for everything, or the extra it needs is missing) is not a pass."""
    ran = session.config.stash.get(RAN, {})
    idle = [name for name, did in ran.items() if not did]
    if idle and exitstatus == pytest.ExitCode.OK and not session.config.option.collectonly:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"conformance: no property ran for {', '.join(idle)} (every one was skipped): "
                                f"exit {int(pytest.ExitCode.NO_TESTS_COLLECTED)}, not a pass", red=True)
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
