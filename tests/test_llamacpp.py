"""llama.cpp through the conformance kit (spec/conformance/llamacpp.py, its Subject for the served properties,
spec/conformance/test_engine.py for its own), kept
short: skipped with the reason without the `llama` extra (and the real-model cases without the real
model in the cache)."""

from __future__ import annotations

import copy
import signal

import numpy as np
import pytest
import torch

from spec import realmodel
from spec.conformance import impls, llamacpp
from spec.conformance import kit

pytestmark = pytest.mark.skipif(llamacpp.available() is not None, reason=str(llamacpp.available()))

from llamafaults import AMX_LIKE_CRASH  # noqa: E402  (the engines' children build these: tests/llamafaults.py)

FAULTS = "llamafaults"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = copy.deepcopy(kit.zoo("llama")["target"]).float()
    return llamacpp.llama_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_kits_llama_written_as_gguf_is_the_same_model(tmp_path):
    """spec.conformance.llamacpp.llama_gguf: llama.cpp runs the kit's seeded 640-wide Llama with PyTorch's logits
    (to fp32 rounding; q/k permuted to llama.cpp's rope layout) and its greedy output."""
    from spec import greedy_generate
    model = copy.deepcopy(kit.zoo("llama")["target"]).float()
    engine = llamacpp.Engine(llamacpp.llama_gguf(model, tmp_path / "tiny.gguf"))
    try:
        ids = [5, 9, 5, 9, 300, 12, 7, 7, 100]
        ours = engine.logits(ids)
        greedy, _ = engine.greedy(ids, 20)
    finally:
        engine.close()
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    assert float(np.abs(ours - theirs).max()) < 5e-3
    assert greedy == greedy_generate(model, ids, max_new_tokens=20).tokens


def test_the_served_properties_reject_a_broken_engine(monkeypatch):
    """Negative control for the served properties on llama.cpp's Subject (spec/conformance/subject.py): an
    engine whose speculative run changes its third token fails endpoint_greedy_exact with a BUG verdict from
    the engine's own logits; the honest engine passes it, with what its drafter proposed counted."""
    from spec.conformance import endpoints
    subject = llamacpp.kit_subject(impls.load("llama-cpp"))
    try:
        noise = subject.noise(llamacpp.TINY_PROMPTS[:2], 16)
        before = subject.counters()
        assert "5 of 5 identical" in endpoints.greedy_exact(subject, llamacpp.TINY_PROMPTS, 16, noise)
        done = subject.counters().since(before)
        assert done.draft_tokens > 0 and 0 < done.accepted <= done.draft_tokens, done
        real = llamacpp.Engine.speculative

        def broken(self, prompt, n, **kw):
            tokens, seconds = real(self, prompt, n, **kw)
            return tokens[:2] + [(t + 1) % 640 for t in tokens[2:3]] + tokens[3:], seconds
        monkeypatch.setattr(llamacpp.Engine, "speculative", broken)
        with pytest.raises(endpoints.Violation, match=r"first divergence at new token 2: reference \d+, got \d+; "
                                                      r"reference top-2 logit gap .*BUG"):
            endpoints.greedy_exact(subject, llamacpp.TINY_PROMPTS, 16, noise)
    finally:   # free llama.cpp's models while llama_cpp is importable
        subject.close()


def test_the_engine_sampling_law_rejects_a_broken_engine(monkeypatch):
    """Negative control for engine_sampling_law: an engine whose speculative run takes the second
    token greedily (the target's top token, not a draw) is rejected at the kit's sample size."""
    from spec.conformance.laws import ALPHA

    real = llamacpp.Engine.sample

    def broken(self, prompt, n, **kw):
        tokens = real(self, prompt, n, **kw)
        if kw.get("draft") is not None:
            tokens[1] = int(np.argmax(self.logits(list(prompt) + tokens[:1])[-1]))
        return tokens
    monkeypatch.setattr(llamacpp.Engine, "sample", broken)
    try:
        engine = llamacpp.shared_engine(llamacpp.tiny_gguf("target"))
        fit, _, _ = llamacpp.sampling_law_fit(engine, 400, "temp=0.7,top_k=3", "prompt-lookup", None)
        assert fit.rejects(ALPHA), fit
    finally:   # free llama.cpp's models while llama_cpp is importable
        llamacpp.close_engines()


def test_a_native_crash_is_a_verdict_and_the_run_goes_on(tiny_gguf, tmp_path, monkeypatch):
    """The engine runs in a child: when llama.cpp segfaults there, a property on its Subject fails with the
    signal, the batch, the model and the build's system info (spec.conformance.subject.Crashed, which the
    kit's properties turn into their failure), a reproduction script is written (and reproduces the crash
    under the same fault), and this process, and the engine after a restart, live on."""
    import subprocess
    import sys

    from spec.conformance import endpoints, subject

    crashing = llamacpp.Engine(tiny_gguf, make=f"{FAULTS}:amx_like", crash_dir=tmp_path)
    prompt = list(llamacpp.LAW_PROMPT)
    try:
        with pytest.raises(subject.Crashed) as failed:
            endpoints.seeded(subject.engine_subject(crashing, "llama-cpp", gamma=4), [prompt], 3)
        assert crashing.greedy([5], 3)[0] == crashing.greedy([5], 3)[0]   # a new child; one token runs
    finally:
        crashing.close()
    verdict = str(failed.value)
    n = len(prompt)
    assert (f"engine crashed (SIGSEGV) on a {n}-token batch after 0 cached positions, tiny.gguf, "
            f"llama-cpp-python ") in verdict, verdict
    import llama_cpp

    from spec import llamaguard
    features = " ".join(k for k, v in llamaguard.features(llama_cpp.llama_print_system_info()).items() if v == "1")
    assert f"system info: {features} (in Engine.sample)" in verdict, verdict
    scripts = list(tmp_path.glob("crash-tiny-*.py"))
    assert len(scripts) == 1 and f"reproduction: python {scripts[0]}" in verdict
    source = scripts[0].read_text()
    assert f"BATCH = {prompt!r}" in source and str(tiny_gguf) in source
    code = f"{AMX_LIKE_CRASH}\nimport runpy\nrunpy.run_path({str(scripts[0])!r})"   # the script, with the fault
    replay = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert replay.returncode == -signal.SIGSEGV and f"evaluating {n} tokens after 0" in replay.stdout, replay


def test_an_engine_that_exits_in_a_call_is_named(tiny_gguf, tmp_path):
    """Not only signals: a child that exits mid-call is a verdict too, naming the call (no batch was fed,
    so no reproduction script); the next call starts a new child."""
    engine = llamacpp.Engine(tiny_gguf, make=f"{FAULTS}:ExitsOnTokenize", crash_dir=tmp_path)
    try:
        with pytest.raises(llamacpp.EngineCrashed, match=r"engine crashed \(exit status 3\) in Engine.tokenize, tiny"):
            engine.tokenize("x")
        assert engine.greedy([5, 9, 5], 3)[0] == engine.greedy([5, 9, 5], 3)[0]
    finally:
        engine.close()
    assert not list(tmp_path.iterdir())


def test_the_engine_refuses_a_build_known_to_crash(tiny_gguf, tmp_path):
    """spec.llamaguard runs in the engine's child before any model loads; its refusal (with the fix)
    reaches the caller as itself."""
    from spec.llamaguard import UnsafeLlamaBuild
    with pytest.raises(UnsafeLlamaBuild, match=r"llama-cpp-python 0\.3\.36 was built with AMX_INT8.*build-llama"):
        llamacpp.Engine(tiny_gguf, make=f"{FAULTS}:amx_reported", crash_dir=tmp_path)


# --- llama.cpp's sampler chain: top-k before top-p ----------------------------------------------------

def test_top_k_cuts_before_top_p():
    """sampler_law keeps llama.cpp's order: top-p's mass is counted over what top-k kept. Probabilities
    0.4, 0.3, 0.2, 0.1 with top-k 2 and top-p 0.5: after top-k the first token has 4/7 >= 0.5, so it
    alone is kept; top-p first (over all four: 0.4 < 0.5) would keep two, 4/7 and 3/7."""
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    assert np.allclose(llamacpp.sampler_law(logits, 1.0, top_k=2, top_p=0.5), [1, 0, 0, 0])
    assert np.allclose(llamacpp.sampler_law(logits, 1.0, top_k=0, top_p=0.5), [4 / 7, 3 / 7, 0, 0])


def test_the_engine_cuts_top_k_before_top_p(tiny_gguf):
    """The same order, from llama.cpp itself: on the tiny engine's next-token row after LAW_PROMPT, top-k 2
    and a top-p between the top token's probability and its share of the top two: sampler_law says the
    top token always, top-p first would draw the runner-up over 30% of the time (at most 0.7^30 = 2e-5
    for 30 draws to miss it); 30 seeded draws of the engine are all the top token."""
    engine = llamacpp.Engine(tiny_gguf)
    try:
        row = engine.logits(list(llamacpp.LAW_PROMPT))[-1]
        p = np.sort(np.exp(row - row.max()) / np.exp(row - row.max()).sum())[::-1]
        top_p = float((p[0] + p[0] / (p[0] + p[1])) / 2)
        law = llamacpp.sampler_law(row, 1.0, top_k=2, top_p=top_p)
        runner_up = float(p[1] / (p[0] + p[1]))   # its probability with top-p first (it keeps >= 2, top-k 2)
        assert law.max() == 1.0 and p[0] < top_p and runner_up > 0.3, (p[:3], top_p)
        sampler = dict(temp=1.0, top_k=2, top_p=top_p, min_p=0.0)
        draws = [engine.sample(llamacpp.LAW_PROMPT, 1, seed=s, sampler=sampler)[0] for s in range(30)]
    finally:
        engine.close()
    assert set(draws) == {int(law.argmax())}, (draws, top_p, p[:3])


def test_callers_in_several_threads_get_their_own_answers(tiny_gguf):
    """The engine is one child on two pipes: callers in 8 threads at once (the served properties send
    requests together) each get their own answer, the one they get alone, and nothing hangs."""
    from concurrent.futures import ThreadPoolExecutor
    engine = llamacpp.Engine(tiny_gguf)
    sampler = dict(temp=0.9, top_k=0, top_p=1.0, min_p=0.0)
    alone = [engine.sample(llamacpp.LAW_PROMPT, 3, seed=s, sampler=sampler) for s in range(8)]
    pool = ThreadPoolExecutor(8)
    futures = [pool.submit(engine.sample, llamacpp.LAW_PROMPT, 3, seed=s, sampler=sampler) for s in range(8)]
    try:
        together = [f.result(timeout=60) for f in futures]
    finally:
        if not all(f.done() for f in futures):
            engine._proc.kill()       # a hang: the blocked callers get EOF and end, the test fails
        pool.shutdown(wait=True)
        engine.close()
    assert together == alone and len(set(map(tuple, alone))) > 1


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    return llamacpp.dequantized_gguf(realmodel.gguf_path(), tmp_path_factory.mktemp("gguf") / "smollm2.f32.gguf")


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.skipif(not realmodel.converted(), reason="SmolLM2 not in the cache (python -m spec.realmodel)")
def test_the_f32_gguf_holds_the_weights_spec_runs(f32_gguf):
    """llama.cpp on the dequantized f32 GGUF and PyTorch on spec.realmodel's fp32 folder (both
    dequantized from the same Q4_1 file) give the same next-token logits, to fp32 summation order."""
    engine = llamacpp.Engine(f32_gguf)
    try:
        ids = engine.tokenize("The key difference between supervised and unsupervised learning is")
        ours = engine.logits(ids)
    finally:
        engine.close()
    model, _ = realmodel.load()
    with torch.inference_mode():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    diff = float(np.abs(ours - theirs).max())
    print(f"llama.cpp f32 GGUF vs PyTorch fp32: max |logit difference| {diff:.3g} over {len(ids)} positions")
    assert diff < 0.05, f"llama.cpp f32 vs PyTorch fp32 logits differ by {diff}"
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.9


@pytest.mark.thorough   # about two minutes here: 5 prompts x 2 models x plain, speculative and diagnosis
@pytest.mark.realmodel
@pytest.mark.skipif(not realmodel.converted(), reason="SmolLM2 not in the cache (python -m spec.realmodel)")
def test_conform_llama_cpp_exits_0_with_the_documented_xfails(pytester):
    """The kit's engine property at budget 0.25 (16 tokens): Q4_1 diverges (a strict xfail, ties),
    the f32 GGUF of the same weights is exact."""
    result = pytester.runpytest("--pyargs", "spec.conformance.test_engine", "-p", "spec.conformance.plugin",
                                "-p", "no:cacheprovider", "--impl=llama-cpp", "--conform-budget=0.25",
                                "-k", "engine_greedy_exact and not tiny and prompt-lookup", "-rxX")
    outcomes = result.parseoutcomes()
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert outcomes.get("xfailed") == 1 and outcomes.get("passed") == 1, outcomes


def test_a_served_property_the_engine_cannot_be_asked_is_untested_not_failed(tmp_path, capsys):
    """llama-cpp-python's speculative generate reports no logprobs: the logprob properties raise
    UnsupportedRequest (an EndpointError, nothing sent), which the kit reports as untested (a skip), never
    as a failure of the engine; with nothing else selected the run is exit 3, not a pass."""
    import json
    import spec.__main__ as cli
    out = tmp_path / "c.json"
    assert cli.main(["conform", "--impl", "llama-cpp", "--budget", "0.25", "-k", "endpoint_logprobs",
                     "--out", str(out)]) == 3
    capsys.readouterr()
    (row,) = json.loads(out.read_text())["results"]
    assert row["outcome"] == "skipped" and "untested: llama-cpp-python's speculative generate reports no logprobs" \
        in row["evidence"], row
