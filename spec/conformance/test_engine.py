"""Engine properties: a decoder under test that brings its own models and its own reference
(`--impl llama-cpp`; spec/llamacpp.py). The reference is the engine's own plain greedy decoding,
the evidence the engine's own logits.

  engine_greedy_exact      speculative greedy output (prompt lookup, or a draft model) equals the
                           engine's own plain greedy output, token for token, on the seed prompts;
                           each divergence diagnosed from the engine's logits
  engine_greedy_exact_tiny the same, under hypothesis (prompts, gamma 1..8, 1..24 tokens), on the
                           kit's seeded 640-wide Llama written as an f32 GGUF (spec.llamacpp.llama_gguf;
                           the draft model is its 10%-noise copy): fast enough to search
  engine_divergences_are_ties  every divergence is a numerical tie: the greedy top-2 gap at the
                           divergent position is within the engine's measured noise (the largest
                           difference between a one-token and a multi-token pass, for this model
                           file), not a logic bug

Models: the real SmolLM2-135M-Instruct Q4_1 GGUF (spec.realmodel fetches it) and the same weights
dequantized to an f32 GGUF (spec.llamacpp.dequantized_gguf), or the file given with --model
(python -m spec conform --impl llama-cpp --model path/to/model.gguf).
"""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.conformance import kit
from spec.prompts import SEED_PROMPTS

DRAFTERS = {"prompt-lookup": 8, "draft-model": 4}   # drafter -> gamma (prompt lookup: 3-gram matches)
THREADS = 1


def pytest_generate_tests(metafunc):
    if "variant" in metafunc.fixturenames:
        variants = ["model"] if metafunc.config.getoption("--conform-model") else ["q4_1", "f32"]
        metafunc.parametrize("variant", variants)


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    """llama.cpp's models are freed here, while llama_cpp is still importable (not at exit)."""
    yield
    for e in list(_engines.values()):
        e.close()
    _engines.clear()
    outcome.cache_clear()


@functools.cache
def model_file(variant: str, given: str | None):
    from spec import llamacpp, realmodel

    if variant == "model":
        return given
    q4 = realmodel.fetch(say=lambda *a: None)
    if variant == "q4_1":
        return str(q4)
    f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
    if not f32.exists():
        llamacpp.dequantized_gguf(q4, f32, "f32")
    return str(f32)


_engines: dict = {}


def engine(path: str):
    from spec import llamacpp
    if path not in _engines:
        _engines[path] = llamacpp.Engine(path, threads=THREADS)
    return _engines[path]


@functools.cache
def outcome(path: str, drafter: str, draft_path: str, n: int):
    """Per seed prompt: (prompt ids, greedy, speculative, greedy s, speculative s); and the noise."""
    e = engine(path)
    rows = []
    for text in SEED_PROMPTS:
        ids = e.tokenize(text)
        greedy, t_greedy = e.greedy(ids, n)
        spec, t_spec = e.speculative(ids, n, draft=drafter, gamma=DRAFTERS[drafter], draft_path=draft_path)
        rows.append((ids, greedy, spec, t_greedy, t_spec))
    widths = (2, DRAFTERS[drafter] + 1)
    noise = e.noise([ids + greedy for ids, greedy, *_ in rows[:2]], widths=widths)
    return rows, noise


def _run(impl, budget, variant, drafter):
    if impl.engine != "llama-cpp":
        pytest.skip(f"{impl.name} is not an engine adapter (engine properties run for --impl llama-cpp)")
    from spec import llamacpp
    missing = llamacpp.available()
    if missing:
        pytest.skip(missing)
    path = model_file(variant, impl.model)
    draft_path = path if variant == "model" else model_file("q4_1", None)
    n = max(16, round(64 * budget))
    rows, noise = outcome(path, drafter, draft_path, n)
    e = engine(path)
    diagnoses = [e.diagnose(ids, greedy, spec, noise, gamma=DRAFTERS[drafter]) for ids, greedy, spec, *_ in rows]
    same = sum(d is None for d in diagnoses)
    speed = sum(r[3] for r in rows) / sum(r[4] for r in rows)
    head = (f"{variant} ({path.rsplit('/', 1)[-1]}), {drafter} (gamma {DRAFTERS[drafter]}), {n} tokens x "
            f"{len(rows)} prompts, {THREADS} thread: {same} of {len(rows)} identical to the engine's greedy; "
            f"noise {noise:.3g}; speculative {speed:.2f}x the speed of plain")
    lines = [f"  prompt {i}: " + ("identical" if d is None else str(d)) for i, d in enumerate(diagnoses)]
    return head, "\n".join(lines), diagnoses


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_engine_greedy_exact(impl, budget, variant, drafter, record_property):
    head, lines, diagnoses = _run(impl, budget, variant, drafter)
    record_property("evidence", head)
    if any(d is not None for d in diagnoses):
        pytest.fail(f"property engine_greedy_exact violated by {impl.name}: {head}\n{lines}", pytrace=False)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_engine_divergences_are_ties(impl, budget, variant, drafter, record_property):
    head, lines, diagnoses = _run(impl, budget, variant, drafter)
    record_property("evidence", f"{head}; " + "; ".join(f"gap {d.gap:.3g}" for d in diagnoses if d))
    if any(d is not None and d.verdict != "tie" for d in diagnoses):
        pytest.fail(f"property engine_divergences_are_ties violated by {impl.name}: {head}\n{lines}", pytrace=False)


@functools.cache
def tiny_file(which: str) -> str:
    """kit.zoo's Llama ("target", or the "partial" draft) as an f32 GGUF in a scratch folder."""
    from spec import llamacpp
    model = copy.deepcopy(kit.zoo("llama")[which]).float()
    folder = Path(tempfile.mkdtemp(prefix="spec-kit-gguf-"))
    return str(llamacpp.llama_gguf(model, folder / f"llama-{which}.gguf"))


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_engine_greedy_exact_tiny(impl, budget, drafter):
    if impl.engine != "llama-cpp":
        pytest.skip(f"{impl.name} is not an engine adapter (engine properties run for --impl llama-cpp)")
    from spec import llamacpp
    missing = llamacpp.available()
    if missing:
        pytest.skip(missing)
    e, draft_path = engine(tiny_file("target")), tiny_file("partial")

    @kit.kit_settings(budget, 6)
    @given(prompt=kit.prompts(), gamma=st.integers(1, 8), n=st.integers(1, 24))
    def prop(prompt, gamma, n):
        greedy, _ = e.greedy(prompt, n)
        spec, _ = e.speculative(prompt, n, draft=drafter, gamma=gamma, draft_path=draft_path)
        if spec != greedy:
            d = e.diagnose(prompt, greedy, spec, e.noise([list(prompt) + greedy], widths=(2, gamma + 1)), gamma=gamma)
            pytest.fail(f"property engine_greedy_exact_tiny violated by {impl.name}: kit's Llama as f32 GGUF, "
                        f"{drafter} gamma={gamma} n={n}\n  prompt={prompt}\n  {d}\n  expected {greedy}\n"
                        f"  actual   {spec}", pytrace=False)
    prop()
