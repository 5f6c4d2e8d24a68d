"""Shared fixtures, command-line options and hypothesis profiles for the spec suite.

Model fixtures are session-scoped and built from config with seeded weights, so
every run sees the same models; building them takes well under a second.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from spec import build_gpt_neox, runner
from spec.models import SHIPPED_PAIR, TINY_TOKENIZER_SIZE, perturbed_copy, truncated_copy

# --- hypothesis profiles: `pytest --hypothesis-profile=NAME` ---------------------------
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=40, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=15, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The fixture models are tiny: one thread runs them fastest and keeps runs steady when
# other work shares the machine. The perf suite sets its own thread count.
torch.set_num_threads(1)


# pytester: tests/test_markers.py, tests/test_leakguard.py and tests/test_xdist.py run pytest on a
# scratch project. leakguard (tests/leakguard.py): a test that leaves torch's flags or spec's
# loaders changed fails. serial_timing (tests/serial_timing.py): under pytest-xdist, perf and gate
# cases run with no other test beside them. The conformance kit's plugin (--impl, --conform-budget,
# the impl fixture) is also registered by the pytest11 entry point of an installed spec, under this
# same name, so it is never loaded twice.
pytest_plugins = ["pytester", "leakguard", "serial_timing", "spec.conformance.plugin"]

# --- markers that compose ----------------------------------------------------------------
# An opt-in marker keeps its tests out of every run that does not ask for them: asked for by
# its option (--thorough) or by an -m expression that selects the test only because it carries
# the marker (-m thorough, -m "perf and thorough"). Whatever else -m, -k or a path selects
# ("not perf", "perf", -k name), they stay out. Add a marker here (and in pytest.ini) to make
# it opt-in the same way.
OPT_IN_MARKERS = {"thorough": "long statistical or exhaustive runs"}


def _asked_by_expression(expr: str, names: set[str], marker: str) -> bool:
    """True when -m `expr` selects a test with markers `names` but not the same test without `marker`."""
    from _pytest.mark.expression import Expression

    compiled = Expression.compile(expr)
    return (compiled.evaluate(lambda name, **kwargs: name in names)
            and not compiled.evaluate(lambda name, **kwargs: name in names - {marker}))


def _opt_in_left_out(item, config) -> bool:
    names = {m.name for m in item.iter_markers()}
    expr = config.getoption("markexpr") or ""
    return any(marker in names and not config.getoption(marker)
               and not (expr and _asked_by_expression(expr, names, marker))
               for marker in OPT_IN_MARKERS)


def pytest_sessionstart(session):
    """Each session builds its models afresh. The test helpers memoise models (functools caches)
    and spec memoises its probe's verdict on each model, so a process that runs pytest more than
    once (mutmut's fork server does, once per mutant) would otherwise hand a session the models,
    and the verdicts, of an earlier one, and a broken probe would never run."""
    root = Path(str(session.config.rootpath))
    for folder in (root / "tests", root / "spec" / "conformance"):
        _clear_test_caches(folder)


@pytest.fixture(autouse=True)
def _fresh_models_while_mutmut_maps_tests(request):
    """mutmut first runs the suite once to map each function to the tests that call it
    (MUTANT_UNDER_TEST=stats), then runs only those tests against each mutant. A model built once
    and probed once would map the probe's code to the first test that used it alone. While it
    maps, every test gets fresh models from the helpers' caches, and the session fixtures' models
    forget their probe verdicts."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        for folder in (Path(__file__).parent / "tests", Path(__file__).parent / "spec" / "conformance"):
            _clear_test_caches(folder)
        for name in request.fixturenames:
            if name == request.fixturename:
                continue
            try:
                value = request.getfixturevalue(name)
            except Exception:  # noqa: BLE001 - a parameter, not a fixture: nothing to forget
                continue
            for model in (value, getattr(value, "target", None), getattr(value, "draft", None)):
                if isinstance(model, torch.nn.Module):
                    runner.forget(model)
    yield


def _clear_test_caches(tests: Path) -> None:
    # A prefix test on the path as imported, not Path.resolve() of every module torch and
    # transformers load: that took 0.9 s a session, most of what a mutmut run spends per mutant.
    folders = tuple({str(tests) + os.sep, str(tests.resolve()) + os.sep})
    for module in list(sys.modules.values()):
        if not (getattr(module, "__file__", None) or "/").startswith(folders):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                value.cache_clear()


def pytest_collection_modifyitems(config, items):
    left_out = [item for item in items if _opt_in_left_out(item, config)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(left_out)
        items[:] = [item for item in items if item not in dropped]
    if not torch.cuda.is_available():
        no_cuda = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(no_cuda)


def pytest_addoption(parser):
    markers = parser.getgroup("spec markers", "opt-in test groups (see conftest.OPT_IN_MARKERS)")
    for marker, what in OPT_IN_MARKERS.items():
        markers.addoption(f"--{marker}", action="store_true", default=False, dest=marker,
                          help=f"also run the tests marked {marker} ({what}); -m {marker} runs only those")
    group = parser.getgroup("spec", "spec: real checkpoints for the GPU cases")
    group.addoption("--target", default=os.environ.get("SPEC_TARGET", "EleutherAI/pythia-12b"),
                    help="target model: local folder or cached hub id (env SPEC_TARGET)")
    group.addoption("--draft", default=os.environ.get("SPEC_DRAFT", "EleutherAI/pythia-410m"),
                    help="draft model: local folder or cached hub id (env SPEC_DRAFT)")


# --- the GPU cases and their rehearsal on CPU ---------------------------------------------
# No GPU has run these cases yet, and GPU time comes in minutes: a typo in a fixture or a wrong
# key in a report would spend it. So every GPU case takes `gpu_device` and runs twice: on CUDA
# (marked gpu: `pytest -m gpu`, skipped where there is no CUDA) and as a rehearsal on CPU in the
# default run: the same test body and fixtures with tiny shapes and a few tokens, thresholds and
# Theorem 3.8's band computed and reported but not asserted. What a rehearsal cannot run is the
# CUDA calls themselves (docs/log/benchmarks.md, "What the rehearsal does not run", lists those lines).

@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu, id="gpu"), pytest.param("cpu", id="rehearsal")])
def gpu_device(request) -> torch.device:
    """cuda for the real run, cpu for its rehearsal."""
    return torch.device(request.param)


@pytest.fixture
def rehearsal(gpu_device) -> bool:
    """True on the CPU rehearsal of a GPU case: shapes tiny, timing thresholds reported, not asserted."""
    return gpu_device.type != "cuda"


# --- model pairs ------------------------------------------------------------------------
# The target runs in fp64 on CPU: logit noise between a one-token step and a block
# verify is ~1e-15 there (docs/FACTS.md), so any divergence from greedy is a bug, not a tie.

@pytest.fixture(scope="session")
def target():
    """Random tiny GPT-NeoX target in fp64, logits 640 wide (the wider, pythia-12b-like head)."""
    return build_gpt_neox("tiny-target", seed=1, dtype=torch.float64)


@pytest.fixture(scope="session")
def target_fp32(target):
    return build_gpt_neox("tiny-target", seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def self_draft(target):
    """draft = target: every draft token is accepted."""
    return target


@pytest.fixture(scope="session")
def random_draft():
    """An unrelated random draft, 512 wide (the narrower, pythia-410m-like head): accepts almost nothing."""
    return build_gpt_neox("tiny-draft", seed=2)


@pytest.fixture(scope="session")
def partial_draft(target):
    """The target with 10% weight noise, in fp32: agrees on most tokens, not all."""
    return perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)


@pytest.fixture(scope="session")
def shallow_draft(target):
    """The target's first two layers, in bf16: partial acceptance from a cheaper model."""
    return truncated_copy(target, num_layers=2, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def drafts(self_draft, random_draft, partial_draft, shallow_draft):
    return {"self": self_draft, "random": random_draft, "partial": partial_draft, "shallow": shallow_draft}


@pytest.fixture(scope="session")
def tokenizer_size():
    return TINY_TOKENIZER_SIZE


@pytest.fixture
def one_thread():
    """Tiny models on a shared CPU run many times faster on one thread (no OpenMP spinning beside another
    process); a module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def saved_pair(tmp_path_factory) -> tuple[str, str]:
    """(target folder, draft folder): a tiny GPT-NeoX target and a draft made of its first layer (some drafts
    accepted), saved with save_pretrained; no tokenizer, so the command line feeds prompt bytes as ids, with no
    chat template and no EOS."""
    from spec.models import build_gpt_neox, truncated_copy
    root = tmp_path_factory.mktemp("pair")
    target = build_gpt_neox("tiny-target", seed=0)
    truncated_copy(target, num_layers=1).save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="session")
def shipped_pair():
    """The small trained pair shipped in spec/assets/pair, target in fp64 and draft in fp32."""
    from spec import load_pair
    if not (SHIPPED_PAIR / "target" / "config.json").exists():
        pytest.skip(f"no shipped pair at {SHIPPED_PAIR} (python recipes/train_pair.py makes it)")
    return load_pair(target_dtype=torch.float64, draft_dtype=torch.float32)


@pytest.fixture(scope="session")
def draft_run():
    """draft_run(model, max_len, impl="auto"): the Runner a draft model gets from spec.choose for a
    sequence of up to max_len positions (a one-token prompt), as speculative_generate runs it."""
    from spec import choose

    def make(model, max_len: int, impl: str = "auto"):
        return choose.runs({"draft": model}, [1], room=max_len - 1, draft_impl=impl).runs[0]
    return make


@pytest.fixture(scope="session")
def endpoint_server():
    """endpoint_server(speculative, bug=None, pair="llama"): an in-process OpenAI-compatible server over spec
    (tests/endpoint_server.py) on 127.0.0.1, one per (speculative, bug, pair), stopped at the session's end."""
    from endpoint_server import Server
    servers: dict = {}

    def make(speculative: bool, bug: str | None = None, pair: str = "llama") -> Server:
        if (speculative, bug, pair) not in servers:
            servers[speculative, bug, pair] = Server(speculative, bug, pair)
        return servers[speculative, bug, pair]
    yield make
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def vllm_setup(tmp_path_factory):
    """(SPEC_VLLM_PYTHON, the SmolLM2 folder vLLM loads, a folder for the logs); skipped with the reason without
    the venv or the model (python -m spec.realmodel)."""
    from servers import model_folder, vllm_python

    from spec import realmodel
    python, why = vllm_python()
    if why:
        pytest.skip(why)
    fp32 = realmodel.fp32_dir()
    if not realmodel.converted():
        pytest.skip(f"no SmolLM2 fp32 folder at {fp32} (python -m spec.realmodel)")
    return python, model_folder(fp32, tmp_path_factory.mktemp("vllm-model")), tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def vllm_servers(vllm_setup):
    """vllm_servers(kind): vLLM on SmolLM2-135M-Instruct fp32, kind None (plain), "ngram" or "draft_model"
    (tests/servers.py), started once from the venv SPEC_VLLM_PYTHON names; skipped with the reason without
    it or without the model (python -m spec.realmodel); all stopped at the session's end."""
    from servers import VllmServer
    python, folder, logs = vllm_setup
    yield from _server_pool(lambda kind: VllmServer(python, folder, kind, logs / f"{kind or 'plain'}.log").wait())


@pytest.fixture
def vllm_fresh_server(vllm_setup):
    """vllm_fresh_server(kind): a vLLM server of its own for one test (one a request may kill), started now and
    stopped at the test's end; skipped as vllm_servers is."""
    from servers import VllmServer
    python, folder, logs = vllm_setup
    started = []

    def start(kind: str | None):
        started.append(VllmServer(python, folder, kind, logs / f"fresh-{kind or 'plain'}-{len(started)}.log"))
        return started[-1].wait()
    yield start
    for server in started:
        server.stop()


def _server_pool(start):
    """A session's servers by kind, each started (`start(kind)`) on first use, all stopped at the end:
    what the server fixtures yield."""
    servers: dict = {}

    def server(kind: str | None):
        if kind not in servers:
            servers[kind] = start(kind)
        return servers[kind]
    try:
        yield server
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="session")
def llama_servers(tmp_path_factory):
    """llama_servers(kind): llama.cpp's own llama-server (SPEC_LLAMA_SERVER, tests/servers.py) on
    SmolLM2-135M-Instruct as an f32 GGUF (dequantized from the Q4_1 one), kind None (plain) or a key of
    servers.LLAMA_SPECULATIVE ("draft": the Q4_1 GGUF drafts); skipped with the reason without the binary
    or the GGUF (python -m spec.realmodel); all stopped at the session's end."""
    from servers import LlamaServer, llama_server_binary

    from spec import realmodel
    from spec.conformance import llamacpp
    binary, why = llama_server_binary()
    if why:
        pytest.skip(why)
    q4 = realmodel.gguf_path()
    if not q4.is_file():
        pytest.skip(f"no SmolLM2 GGUF at {q4} (python -m spec.realmodel)")
    f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
    if not f32.exists():
        llamacpp.dequantized_gguf(q4, f32, "f32")
    logs = tmp_path_factory.mktemp("llama-server-logs")
    yield from _server_pool(lambda kind: LlamaServer(binary, f32, kind, logs / f"{kind or 'plain'}.log",
                                                     draft=q4).wait(120))


@pytest.fixture(scope="session")
def llamacpp_servers(tmp_path_factory):
    """(prompt-lookup server, plain server) of llama-cpp-python on the SmolLM2 Q4_1 GGUF (tests/servers.py);
    skipped with the reason without the server's dependencies or the GGUF (python -m spec.realmodel)."""
    from servers import LlamaCppServer, llamacpp_server_missing

    from spec import realmodel
    why = llamacpp_server_missing()
    if why:
        pytest.skip(why)
    gguf = realmodel.gguf_path()
    if not gguf.is_file():
        pytest.skip(f"no SmolLM2 GGUF at {gguf} (python -m spec.realmodel)")
    logs = tmp_path_factory.mktemp("llamacpp-logs")
    servers = [LlamaCppServer(gguf, lookup, logs / f"{'lookup' if lookup else 'plain'}.log") for lookup in (True, False)]
    try:
        yield tuple(s.wait(120) for s in servers)
    finally:
        for s in servers:
            s.stop()
