"""Engine-only properties of llama.cpp (`--impl llama-cpp`; spec/conformance/llamacpp.py): what only an engine
that brings its own models, its own reference and its own logits can be asked. Every property a served
model has (greedy_exact, greedy_search, stops, seeded, sampling_law, ...) runs on llama.cpp too, from
spec/conformance/test_endpoint.py on the engine's Subject (spec/conformance/subject.py); they are not
repeated here.

  engine_greedy_exact      on the real SmolLM2 GGUFs (Q4_1 and the same weights in f32, or --model), both
                           drafters (prompt lookup gamma 8, a draft model gamma 4): speculative greedy output
                           == the engine's own plain greedy output, token for token, on the seed prompts; any
                           divergence fails, each diagnosed from the engine's logits (spec.diagnose.judge: its
                           top-2 gap against its one-token vs block noise, and the pass shapes that emit it).
                           The Q4_1 files' kernel-noise ties are known findings (plugin.KNOWN_FINDINGS: a strict
                           xfail that a bug, or a fix upstream, breaks)
  engine_sampling_law      speculative sampling (prompt lookup, or the draft model; gamma 2): the joint
                           law of the first 3 new tokens equals the law of llama.cpp's own sampler chain
                           (spec.conformance.llamacpp.sampler_law: top-k, top-p and min-p at temperature 1, then the
                           temperature) on the engine's own logits, on the kit's tiny Llama GGUF; so
                           neither PyTorch's kernels nor HF's order of the filters count. With its
                           negative controls (engine_sampling_power): the law the samples are tested
                           against must reject HF's order of the same filters at the same n.

The engine runs in a child process (spec.conformance.llamacpp.Engine): a native crash of llama.cpp fails
the property it happened in with the verdict (the signal, the batch, the model file, the build's
system info) and the path of a standalone reproduction script, and the run goes on.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from spec.conformance import kit
from spec.conformance.laws import ALPHA, sample_size
from spec.prompts import SEED_PROMPTS

DRAFTERS = {"prompt-lookup": 8, "draft-model": 4}   # drafter -> gamma (prompt lookup: 3-gram matches)
THREADS = 1   # as spec.conformance.llamacpp.THREADS


def pytest_generate_tests(metafunc):
    if "variant" in metafunc.fixturenames:
        variants = ["model"] if metafunc.config.getoption("--conform-model") else ["q4_1", "f32"]
        metafunc.parametrize("variant", variants)


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    """llama.cpp's models are freed here, while llama_cpp is still importable (not at exit)."""
    from spec.conformance import llamacpp
    yield
    llamacpp.close_engines()
    outcome.cache_clear()


@functools.cache
def model_file(variant: str, given: str | None):
    from spec import realmodel
    from spec.conformance import llamacpp

    if variant == "model":
        return given
    q4 = realmodel.fetch(say=lambda *a: None)
    if variant == "q4_1":
        return str(q4)
    f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
    if not f32.exists():
        llamacpp.dequantized_gguf(q4, f32, "f32")
    return str(f32)


@functools.cache
def outcome(path: str, drafter: str, draft_path: str, n: int):
    """The one greedy-exactness check (checks.greedy_exact) on the engine's Subject (its speculative decoding
    with `drafter` against its own plain decoding, judged by its own logits) over the seed prompts; and the
    noise (one-token vs block logits over the first two prompts' greedy continuations)."""
    from spec.conformance import checks, llamacpp
    from spec.conformance.subject import engine_subject
    e = llamacpp.shared_engine(path)
    subject = engine_subject(e, "llama-cpp", drafter=drafter, gamma=DRAFTERS[drafter], draft_path=draft_path,
                             called="greedy")
    prompts = [e.tokenize(text) for text in SEED_PROMPTS]
    noise = subject.noise(prompts[:2], n)
    return checks.greedy_exact(subject, prompts, n, noise), noise


def crash_is_a_verdict(test):
    """The property fails with the engine's crash verdict (EngineCrashed: its child died, e.g. SIGSEGV
    inside llama_decode) instead of an error; the next call starts a new child."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        from spec.conformance import llamacpp
        try:
            return test(*args, **kwargs)
        except llamacpp.EngineCrashed as crash:
            impl = inspect.signature(test).bind(*args, **kwargs).arguments.get("impl")
            by = f" by {impl.name}" if impl is not None else ""
            pytest.fail(f"property {test.__name__.removeprefix('test_')} violated{by}: {crash}", pytrace=False)
    return run


def _needs_llama_cpp():
    from spec.conformance import llamacpp
    missing = llamacpp.available()
    if missing:
        pytest.skip(missing)


def _needs_engine(impl):
    if impl.engine != "llama-cpp":
        pytest.skip(f"{impl.name} is not an engine adapter (engine properties run for --impl llama-cpp)")
    _needs_llama_cpp()


def _run(impl, budget, variant, drafter):
    _needs_engine(impl)
    path = model_file(variant, impl.model)
    draft_path = path if variant == "model" else model_file("q4_1", None)
    n = max(16, round(64 * budget))
    found, noise = outcome(path, drafter, draft_path, n)
    rows = found.rows
    speed = sum(r.expected.seconds for r in rows) / sum(r.actual.seconds for r in rows)
    head = (f"{variant} ({path.rsplit('/', 1)[-1]}), {drafter} (gamma {DRAFTERS[drafter]}), {n} tokens x "
            f"{len(rows)} prompts, {THREADS} thread: {found.identical} of {len(rows)} identical to the engine's "
            f"greedy; "
            f"noise {noise:.3g}; speculative {speed:.2f}x the speed of plain")
    lines = [f"  prompt {r.index}: " + ("identical" if r.divergence is None else str(r.divergence)) for r in rows]
    return head, "\n".join(lines), found


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@crash_is_a_verdict
def test_engine_greedy_exact(impl, budget, variant, drafter, record_property, request):
    head, lines, found = _run(impl, budget, variant, drafter)
    record_property("evidence", head)
    if found.identical < len(found.rows):
        message = f"property engine_greedy_exact violated by {impl.name}: {head}\n{lines}"
        if request.node.get_closest_marker("xfail") and not found.bugs:
            raise kit.TiesOnly(message)        # what a known tie finding expects (plugin.KNOWN_FINDINGS)
        pytest.fail(message, pytrace=False)


# --- sampling laws from the engine's own logits ------------------------------------------------------

@pytest.mark.parametrize("sampler", ["temp=0.7,top_k=3", "temp=0.6,top_k=8,top_p=0.6,min_p=0.2"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@crash_is_a_verdict
def test_engine_sampling_law(impl, budget, drafter, sampler, record_property):
    from spec.conformance import llamacpp
    _needs_engine(impl)
    e, draft_path = llamacpp.shared_engine(llamacpp.tiny_gguf("target")), llamacpp.tiny_gguf("partial")
    n = sample_size(budget)
    fit, table, same = llamacpp.sampling_law_fit(e, n, sampler, drafter, draft_path)
    # evidence only (exactness asks for the law, not this): llama-cpp-python draws once per emitted
    # token, so with the same seed its speculative samples are its plain ones
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, level {ALPHA}); "
                                f"{same} of {n} equal to the engine's plain samples with the same seed")
    if fit.rejects(ALPHA):
        why = "outcomes of exact probability 0 were sampled" if fit.impossible else f"p = {fit.pvalue:.3g} < {ALPHA}"
        pytest.fail(f"property engine_sampling_law violated by {impl.name} ({sampler}, {drafter}, "
                    f"gamma={llamacpp.LAW_GAMMA}, kit's Llama as f32 GGUF; law from the engine's own logits): "
                    f"{why}\n  {fit}\n{table}", pytrace=False)


@pytest.mark.parametrize("control", ["correct", "temperature-first"])
@crash_is_a_verdict
def test_engine_sampling_power(budget, control, record_property):
    """Negative control for engine_sampling_law at its sample size, independent of --impl: samples
    drawn from the engine's law pass; samples drawn with HF's order of the same filters (temperature
    first) are rejected. It needs llama.cpp for the engine's logits."""
    _needs_llama_cpp()
    from spec.conformance.llamacpp import LAW_JOINT, tiny_law
    sampler = "temp=0.6,top_k=8,top_p=0.6,min_p=0.2"
    law = tiny_law(sampler, temperature_first=control == "temperature-first")
    cells = list(law)
    drawn = torch.multinomial(torch.tensor([law[c] for c in cells], dtype=torch.float64), sample_size(budget),
                              replacement=True, generator=torch.Generator().manual_seed(55))
    fit, table = kit.joint_fit(f"joint law of the first {LAW_JOINT} tokens", [cells[i] for i in drawn.tolist()],
                               tiny_law(sampler))
    record_property("evidence", f"p = {fit.pvalue:.3g} (chi2 {fit.stat:.1f}, df {fit.df}, n {fit.n}, "
                                f"impossible {len(fit.impossible)})")
    if control == "correct":
        assert not fit.rejects(ALPHA), f"samples from the engine's law were rejected (false alarm): {fit}\n{table}"
    else:
        assert fit.rejects(ALPHA), f"HF's order of the filters was not rejected at n = {fit.n}: {fit}\n{table}"
