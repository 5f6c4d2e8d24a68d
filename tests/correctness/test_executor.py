"""spec.cpu.executor: an fp32 CPU target's passes run by an object the runner calls, on packed weights it owns:
its logits within the probe's tolerance of the model's own on every path (1, 9 and many rows; cached and
cache-free; hidden states), two Python threads decoding at once on one model each get their own output, a
pass replaces no module's forward and leaves torch's threads as they were, calls it does not follow run the
model's own forward, and the report names the path that produced the logits and why."""

from __future__ import annotations

import threading

import pytest
import torch
from oracles import assert_logits_close

from spec import greedy_generate, hf, probe, runner
from spec.cpu import executor, gemv, prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def llama(layers=2, hidden=64, vocab=128, seed=0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, **extra)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():                       # norms of their own (a fresh model's are all ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture
def packed(monkeypatch):
    """The tiny models count as large (MIN_BYTES 0): spec's runners run them on an Executor."""
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    made = []

    def make(*args, kind="llama", **kwargs):
        model = llama(*args, **kwargs) if kind == "llama" else other(*args, **kwargs)
        probe.forget(model)
        made.append(model)
        return model
    yield make
    for model in made:
        probe.forget(model)


def other(seed=0):
    """A model of another architecture (Qwen2: not a plain Llama), run on executor.Linears when large."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).float().eval()


@pytest.fixture
def threads():
    """torch's threads set by the test, given back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2))
KERNEL = pytest.param(1, id="kernel", marks=pytest.mark.skipif(prepack.kernel_rows() == 0,
                                                                reason="no kernel on this CPU or build"))


def forced(ex, threads):
    """`ex` as the model's forward with its products on `threads` (0 oneDNN, n the kernel over n threads)."""
    return lambda **kwargs: ex.forward(kwargs, threads)


@pytest.mark.parametrize("threads", [0, KERNEL, pytest.param(2, id="kernel-split", marks=KERNEL.marks)])
@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_executors_logits_are_the_models_own(packed, rows, threads, kind):
    """Cache-free, and cached (a prefix, then `rows` more on top of it), on oneDNN, the kernel and the kernel
    split over 2 threads (rows above the kernel's run on oneDNN), within the probe's tolerance; and the hidden
    states a drafter reads (the last one after the final norm, as transformers gives them). A plain Llama on an
    Executor, a Qwen2 on Linears (its own forward, its products packed)."""
    model = packed(kind=kind)
    ex = (executor.Executor if kind == "llama" else executor.Linears)(model, kernel=threads > 0)
    fn, tol = forced(ex, threads), probe.tolerance(model)
    with torch.inference_mode():
        want = hf.authors_forward(model, IDS)
        got = hf.authors_forward(model, IDS[:rows], fn)
        assert_logits_close(got, want[:rows], torch.float32, what=f"{rows} rows, cache-free")
        assert probe.close(got, want[:rows], tol)
        cache = hf.new_cache(model)
        start = 40 - rows if rows < 40 else 0
        if start:
            hf.step(model, IDS[:start], cache, position_ids=torch.arange(start)[None], fn=fn)
        mine, own = [], []
        got, back = hf.step(model, IDS[start:], cache, position_ids=torch.arange(start, 40)[None], fn=fn, hidden=mine,
                            layers=(0, 1, -1))
        assert back is cache and hf.cache_len(cache) == 40
        assert_logits_close(got, want[start:], torch.float32, what=f"{rows} rows after {start} cached")
        hf.step(model, IDS, None, hidden=own, layers=(0, 1, -1))
        assert_logits_close(mine[0], own[0][start:], torch.float32, what="hidden states")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_threads_decoding_at_once_each_get_their_own_output(packed, threads, kind):
    """Two Python threads decode two prompts at once on the same target, each several times: every
    pass's logits are bit for bit those of the same prompt decoded alone, and greedy's tokens too. (A pass's
    state lives in its call; the kernel's threads are named per call; Linears' mode is thread-local.)"""
    model = packed(layers=3) if kind == "llama" else packed(kind=kind)
    prompts = [[5, 9, 14, 3], list(range(20, 36))]          # the second's prefill runs on oneDNN (16 rows)

    def decode(prompt, n=20):
        run = runner.KVRunner(model)
        logits = [run(torch.tensor(prompt))]
        for _ in range(n):
            logits.append(run(logits[-1][-1:].argmax(-1)))
        return torch.cat(logits), greedy_generate(model, prompt, max_new_tokens=n).tokens

    set_threads = torch.set_num_threads
    before = torch.get_num_threads()
    try:
        set_threads(threads)
        with torch.inference_mode():
            alone = [decode(p) for p in prompts]
        assert executor.executor_for(model) is not None
        assert executor.passes(model).get("kernel", 0) > 0 or not prepack.kernel_rows()
        got: dict = {0: [], 1: [], "error": []}
        start = threading.Barrier(2)

        def worker(i):
            try:
                start.wait()
                with torch.inference_mode():
                    for _ in range(3):
                        got[i].append(decode(prompts[i]))
            except BaseException as e:        # noqa: BLE001 - reported below
                got["error"].append(e)
        workers = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        set_threads(before)
    assert not got["error"], got["error"]
    for i in (0, 1):
        for logits, tokens in got[i]:
            assert tokens == alone[i][1]
            assert torch.equal(logits, alone[i][0]), f"prompt {i}: a pass's logits differ from the prompt's alone"


def test_a_pass_replaces_no_forward_and_leaves_torchs_threads(packed, threads, monkeypatch):
    """While a pass runs (seen from inside its products), no module of the model has a forward of its own
    and torch's thread count is the caller's: the kernel's threads are named per call."""
    model = packed()
    threads(2)
    runner.verdict(model)                       # (the probes' passes, their threads forced, come before)
    seen = []
    real = prepack.Packed.__call__

    def watched(self, x, threads=0):
        seen.append((torch.get_num_threads(), threads, any("forward" in vars(m) for m in model.modules())))
        return real(self, x, threads)
    monkeypatch.setattr(prepack.Packed, "__call__", watched)
    with torch.inference_mode():
        greedy_generate(model, [5, 9, 14, 3], max_new_tokens=6)
    assert seen and all(t == 2 and not patched for t, _, patched in seen), seen
    if prepack.kernel_rows():
        assert {n for _, n, _ in seen} == {2}              # few rows: the kernel over the caller's 2 threads


def test_calls_it_does_not_follow_run_the_models_own_forward(packed):
    """A hook on any module (fired), the model in training mode, attention weights asked for, a padded batch:
    the model's own forward, with the reason counted; transformers' own output recorders (installed once
    hidden states are asked of the model's forward) do not count as hooks."""
    model = packed()
    ex = executor.executor_for(model)
    assert ex is not None
    with torch.inference_mode():
        want = hf.authors_forward(model, IDS[:6])
        model(input_ids=IDS[None, :6], output_hidden_states=True)       # transformers installs its recorders
        before = dict(ex.passes)
        assert_logits_close(hf.authors_forward(model, IDS[:6], ex), want, torch.float32)
        assert ex.passes[executor.TRANSFORMERS] == before.get(executor.TRANSFORMERS, 0)
        fired = []
        handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: fired.append(1))
        assert_logits_close(hf.authors_forward(model, IDS[:6], ex), want, torch.float32)
        handle.remove()
        assert fired == [1] and ex.declined["hooks on a Linear"] == 1
        handle = model.register_forward_pre_hook(lambda *a: fired.append(2))
        hf.authors_forward(model, IDS[:6], ex)
        handle.remove()
        assert fired == [1, 2]
        ex(input_ids=IDS[None, :6], output_attentions=True)
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, :2] = 0
        ex(input_ids=IDS[:12].view(2, 6), attention_mask=mask)
        model.train()
        ex(input_ids=IDS[None, :6])
        model.eval()
    assert set(ex.declined) == {"hooks on a Linear", "hooks on a LlamaForCausalLM", "the call passes output_attentions",
                                "not one sequence of ids", "the model is in training mode"}, ex.declined
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_path_is_named_with_its_reason(threads, monkeypatch):
    """executor.describe: the kernel with its ISA and threads for few rows and oneDNN above; oneDNN alone,
    with why; or transformers, with why."""
    small = llama()
    probe.forget(small)
    assert executor.describe(small).startswith("transformers (the model's own forward): its linears are 0.")
    assert "under the 64 MB" in executor.describe(small)
    wide = llama().double()
    assert executor.describe(wide) == "transformers (the model's own forward): not fp32 on a CPU with oneDNN"
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    model = llama()
    if prepack.kernel_rows():
        isa = prepack.ISA_NAMES[gemv.isa()]
        threads(1)
        assert executor.describe(model) == (f"kernel (spec.cpu.gemv, {isa}, one thread) for passes of "
                                            f"1-{prepack.kernel_rows()} rows, oneDNN above (spec.cpu.executor: plain "
                                            "Llama layers on packed weights)")
        threads(2)
        assert f"kernel (spec.cpu.gemv, {isa}, panels over 2 threads)" in executor.describe(model)
        threads(3)
        assert executor.describe(model).startswith("oneDNN for every pass (no kernel: 3 torch threads, above the "
                                                   "kernel's 2)")
    monkeypatch.setenv("SPEC_GEMV", "0")
    probe.forget(model)
    assert executor.describe(model).startswith("oneDNN for every pass (no kernel: SPEC_GEMV=0)")
    assert executor.describe(model).endswith("(spec.cpu.executor: plain Llama layers on packed weights)")
    monkeypatch.setenv("SPEC_PLAIN_LAYERS", "0")
    probe.forget(model)
    assert executor.describe(model).endswith("(spec.cpu.executor: the model's own forward, its linears on packed "
                                             "weights; not plain layers: SPEC_PLAIN_LAYERS=0)")
    monkeypatch.setenv("SPEC_PREPACK", "0")
    probe.forget(model)
    assert executor.describe(model) == "transformers (the model's own forward): switched off (SPEC_PREPACK=0)"
    monkeypatch.delenv("SPEC_PREPACK")
    monkeypatch.delenv("SPEC_PLAIN_LAYERS")
    monkeypatch.delenv("SPEC_GEMV")
    qwen = other()
    threads(2)
    text = executor.describe(qwen)
    assert "(spec.cpu.executor: the model's own forward, its linears on packed weights; not plain layers: " \
           "Qwen2ForCausalLM's decoder layers are not transformers' LlamaDecoderLayer)" in text
    if prepack.kernel_rows():                       # (Linears: the kernel unsplit, at 2 torch threads too)
        assert text.startswith(f"kernel (spec.cpu.gemv, {prepack.ISA_NAMES[gemv.isa()]}, one thread) for passes")
    probe.forget(model)
    probe.forget(qwen)


@pytest.mark.parametrize("shed", ["1", "0"])
def test_the_runners_count_each_pass_by_path(packed, threads, monkeypatch, shed):
    """A greedy decode at one thread: each step on the kernel (where there is one), the prefill of 16 rows too
    where the model's weights gave their memory to the kernel's panels (prepack.shed), else on oneDNN; nothing
    on the model's own forward; the report's summary prints the counts."""
    from spec.experiment import report
    monkeypatch.setenv("SPEC_SHED", shed)
    model = packed()
    threads(1)
    runner.verdict(model)                       # (the runner probe's own passes counted before)
    before = executor.passes(model)
    greedy_generate(model, list(range(3, 19)), max_new_tokens=5)
    counts = {k: v - before.get(k, 0) for k, v in executor.passes(model).items() if v != before.get(k, 0)}
    if prepack.kernel_rows():
        assert counts == ({"kernel": 5} if shed == "1" else {"oneDNN": 1, "kernel": 4}), counts
    else:
        assert counts == {"oneDNN": 5}, counts
    s = type("S", (), {"target_passes": counts})()
    assert report._passes_lines(s)[0].startswith("target's passes by path: ")


def test_an_append_in_place_is_the_caches_own_update():
    """hf.cache_update leaves a DynamicCache's layer holding what DynamicCache.update leaves, append after
    append (strided new keys, as a layer has them; one row and nine; past a buffer's room and within it;
    after a crop), while appending within a buffer's room copies nothing already held (the same memory)."""
    g = torch.Generator().manual_seed(5)
    ours, theirs = hf.new_cache(None), hf.new_cache(None)
    k0, v0 = torch.randn(1, 2, 600, 64, generator=g), torch.randn(1, 2, 600, 64, generator=g)
    hf.cache_update(ours, k0, v0, 0)
    theirs.update(k0.clone(), v0.clone(), 0)
    moved = 0
    for step, new in enumerate([1, 9, 1, 3] * 40):
        qkv = torch.randn(1, new, 8, 64, generator=g).transpose(1, 2)      # strided views, as a layer has them
        k, v = qkv[:, 2:4], qkv[:, 4:6]
        before = ours.layers[0].keys.data_ptr()
        got = hf.cache_update(ours, k, v, 0)
        want = theirs.update(k, v, 0)
        for a, b in zip(got, want):
            assert torch.equal(a, b), step
        assert got[0] is ours.layers[0].keys and got[1] is ours.layers[0].values
        assert hf.cache_len(ours) == hf.cache_len(theirs)
        moved += ours.layers[0].keys.data_ptr() != before
        if step == 70:
            hf.crop(ours, 620), hf.crop(theirs, 620)
    assert 0 < moved <= (160 * 14 // 4) // hf.ROOM + 2, moved       # a copy per ROOM positions, not per append
    big = torch.randn(1, 2, 700, 64, generator=g)                      # keys that are another tensor's middle:
    kept = big.clone()                                                 # what lies past them is not the cache's
    cache = hf.new_cache(None)
    cache.update(k0, v0, 0)
    cache.layers[0].keys = cache.layers[0].values = big[:, :, 10:610]
    got = hf.cache_update(cache, k0[:, :, :1], v0[:, :, :1], 0)
    assert torch.equal(big, kept) and torch.equal(got[0], torch.cat([kept[:, :, 10:610], k0[:, :, :1]], 2))


def test_a_long_pass_gives_the_heap_back_only_where_it_keeps_growing(packed, monkeypatch):
    """spec.cpu.heap.release trims where the heap grew by more than the limit past its mark, and the mark then
    stays where the heap grew to (a trim shrinks a heap whose top is free: a mark taken after it made every
    layer of a 2,000-token prefill trim, 23% slower); an Executor's pass of LONG_ROWS rows or more asks
    after each layer, a shorter pass never; one of TRIM_ROWS or more trims at its end."""
    from spec.cpu import heap
    sizes, trims = iter([120, 140, 141, 175]), []
    with monkeypatch.context() as m:
        m.setattr(heap, "size", lambda: next(sizes))
        m.setattr(heap, "trim", lambda: trims.append(1))
        marks = [100]
        for _ in range(4):
            marks.append(heap.release(marks[-1], 30))
    assert marks == [100, 100, 140, 140, 175] and len(trims) == 2
    model = packed(layers=2, vocab=64)
    ex = executor.Executor(model, kernel=False)
    asked: list = []
    monkeypatch.setattr(executor, "LONG_ROWS", 8)
    monkeypatch.setattr(executor, "TRIM_ROWS", 6)
    monkeypatch.setattr(heap, "release", lambda mark, limit: asked.append(limit) or mark)
    monkeypatch.setattr(heap, "trim", lambda: asked.append("trim"))
    with torch.inference_mode():
        for rows in (5, 7, 8):
            hf.authors_forward(model, torch.arange(rows), ex)
            asked.append(rows)
    # (a pass of TRIM_ROWS or more, a prefill, gives its own freed memory back at its end; a verify pass never)
    assert asked == [5, "trim", 7, executor.HEAP_GROWTH, executor.HEAP_GROWTH, "trim", 8]


def test_a_glibc_without_mallinfo2_still_trims(monkeypatch):
    """On a glibc older than 2.33 (no mallinfo2) spec.cpu.heap still gives freed memory back where it is asked
    to (prepack's weights moved to their files, a long pass's end); only the growth watch is off (size 0)."""
    from spec.cpu import heap
    trims: list = []

    class OldGlibc:
        def malloc_trim(self, pad):
            trims.append(pad)
    monkeypatch.setattr(heap, "_LIBC", [OldGlibc()])
    assert heap.size() == 0 and heap.release(0, 1) == 0 and not trims
    heap.trim()
    assert trims == [0]


def test_positions_past_the_first_rotary_tables(packed):
    """The rotary tables are the model's own rows, made for the first 256 positions and again past them: a
    sequence of 300 fed in pieces on the kernel and on oneDNN is the model's own."""
    model = packed(layers=1, vocab=64)
    ex = executor.Executor(model, kernel=prepack.kernel_rows() > 0)
    ids = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = hf.authors_forward(model, ids)
        cache = hf.new_cache(model)
        for start, stop, threads in ((0, 100, 0), (100, 250, 0), (250, 259, 1), (259, 260, 2), (260, 300, 0)):
            got = hf.step(model, ids[start:stop], cache, position_ids=torch.arange(start, stop)[None],
                          fn=forced(ex, threads if ex.most else 0))[0]
            assert_logits_close(got, want[start:stop], torch.float32, what=f"positions {start}..{stop - 1}")


def test_linears_intercept_the_calling_threads_products_only(packed, monkeypatch):
    """Linears' torch function mode is the calling thread's: while one thread's pass waits inside the model
    (in a hook of its own, which Linears honour), another thread's call of one of the model's linears runs
    nn.Linear's own F.linear, and the pass's products all ran packed in its own thread."""
    model = packed(kind="qwen2")
    ex = executor.executor_for(model)
    assert type(ex) is executor.Linears
    inside, done, packed_in = threading.Event(), threading.Event(), []
    real = prepack.Packed.__call__
    monkeypatch.setattr(prepack.Packed, "__call__", lambda self, x, threads=0: packed_in.append(
        threading.current_thread().name) or real(self, x, threads))

    def wait(module, args):
        inside.set()
        done.wait(10)
    handle = model.model.layers[1].register_forward_pre_hook(wait)
    out: dict = {}

    def pass_():
        with torch.inference_mode():
            out["pass"] = hf.authors_forward(model, IDS[:5], ex)
    worker = threading.Thread(target=pass_, name="pass")
    worker.start()
    assert inside.wait(10)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        other_thread = model.lm_head(x)
    done.set()
    worker.join()
    handle.remove()
    assert torch.equal(other_thread, torch.nn.functional.linear(x, model.lm_head.weight))
    assert packed_in and set(packed_in) == {"pass"}
    with torch.inference_mode():
        assert_logits_close(out["pass"], hf.authors_forward(model, IDS[:5]), torch.float32)


def test_linears_honour_what_the_model_does(packed):
    """A hook that changes a module's output changes Linears' logits as it changes the model's own."""
    model = packed(kind="qwen2")
    ex = executor.executor_for(model)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: o * 0)
    with torch.inference_mode():
        assert_logits_close(hf.authors_forward(model, IDS[:7], ex), hf.authors_forward(model, IDS[:7]), torch.float32)
    handle.remove()
    assert not ex.passes[executor.TRANSFORMERS]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_an_executor_does_not_keep_its_model_alive(monkeypatch, kind):
    """The executors are kept weakly by model (spec.cpu.executor._MADE) and hold the model weakly: a model
    decoded once and dropped is freed, its executor with it."""
    import gc
    import weakref
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    model = llama() if kind == "llama" else other()
    greedy_generate(model, [5, 9, 14, 3], max_new_tokens=3)
    made = weakref.ref(executor.executor_for(model))
    assert made() is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and made() is None


def _run_ns() -> dict[int, int]:
    """Each thread of this process but the calling one: the nanoseconds it has run (schedstat)."""
    import os
    me, out = threading.get_native_id(), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:                       # (a thread that ended meanwhile)
            pass
    out.pop(me, None)
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/schedstat"), reason="Linux only (schedstat)")
def test_a_round_at_two_threads_leaves_torchs_thread_team_asleep(packed, threads, tmp_path, monkeypatch):
    """At 2 torch threads a pass's products and attention are split with the kernel's own worker. An op of the
    pass that torch splits over its threads (a gather of several rows by [] indexing: the tied embedding read
    from the head's panels, a prefill's rotary rows) wakes torch's thread team, which then spins beside that
    worker, and one of them waits for a core (SmolLM2, 2 threads: a 9-row round 1.69 -> 1.32 greedy steps).
    A speculative decode's passes, its prefill and 9-row rounds, run no part on torch's team."""
    import time

    from spec import PromptLookup, speculative_generate
    if not prepack.kernel_rows():
        pytest.skip("no kernel on this CPU: the passes run on oneDNN, at torch's threads")
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path))
    model = packed(vocab=4100, hidden=256, tie_word_embeddings=True)
    threads(2)
    ids = [(97 * i) % 4100 for i in range(72)]
    with torch.inference_mode():
        full = ids + greedy_generate(model, ids, max_new_tokens=40).tokens

    class Oracle(PromptLookup):                   # every proposal accepted: rounds of 9 rows
        def propose(self, history, limit):
            return full[len(history):len(history) + limit]
    ex = executor.executor_for(model)
    assert isinstance(ex, executor.Executor) and ex.head.shed, executor.describe(model)

    def ran(work) -> set[int]:
        time.sleep(0.05)
        before = _run_ns()
        work()
        time.sleep(0.05)
        return {t for t, ns in _run_ns().items() if ns > before.get(t, ns)}
    # torch's team: the threads that run a part of an add over 4M floats each time and nothing while idle
    # (a thread of another test that wakes now and then is not taken for it)
    team = set.intersection(*(ran(lambda: torch.ones(1 << 22).add_(1)) for _ in range(3)))
    team -= set.union(*(ran(lambda: None) for _ in range(3)))
    assert team, "torch's add over 4M floats at 2 threads ran on no other thread"
    before = _run_ns()
    with torch.inference_mode():
        out = speculative_generate(model, Oracle(), ids, gamma=8, max_new_tokens=40)
    time.sleep(0.05)
    after = _run_ns()
    assert out.tokens == full[len(ids):] and len(out.rounds) <= 6
    busy = {t: after[t] - before.get(t, 0) for t in after if after[t] > before.get(t, 0)}
    assert set(busy) - team, "no other thread ran a part of the passes: they were not split"
    assert not set(busy) & team, f"torch's team ran {sum(busy[t] for t in set(busy) & team) / 1e6:.2f} ms in the decode"
