"""spec.cpu.gemv: the hand-written few-row kernel computes nn.Linear's function within fp32 rounding for
every block size, layout and ISA this CPU has; a library that cannot be built, crashes or computes
wrong is never used (a debug-level reason, oneDNN kept); the probe refuses a wrong kernel; and spec's
runners use it (through spec.cpu.executor) on up to KERNEL_THREADS torch threads (1 to KERNEL_ROWS rows) with
speculative output still equal to greedy's."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import nativecheck
from oracles import assert_logits_close

from spec import hf, probe
from spec.cpu import executor, gemv, plainllama, prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A library decided afresh, built into an empty cache; the real one decided again afterwards."""
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path))
    gemv.forget()
    yield tmp_path
    gemv.forget()


@pytest.fixture(scope="module")
def lib():
    """The library; skipped only where there is no C compiler (a build or self-test failure fails)."""
    return nativecheck.require_library()


def llama(bias=True):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=bias, mlp_bias=bias)
    return LlamaForCausalLM(cfg).float().eval()


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, what: str) -> None:
    """got equals F.linear within fp32 rounding, and each element the fp64 product within 1e-5 of
    sum |x_k w_k| (+|b|): far below what a wrong index, a lost tail or a dropped bias costs."""
    assert_logits_close(got, F.linear(x, w, b), torch.float32, what=what)
    x64, w64 = x.double(), w.double()
    want = F.linear(x64, w64, None if b is None else b.double())
    scale = F.linear(x64.abs(), w64.abs(), None if b is None else b.double().abs())
    worst = ((got.double() - want).abs() / scale).max().item() if want.numel() else 0.0
    assert worst <= 1e-5, f"{what}: off the fp64 product by {worst:.3g} of sum |x w|"


@pytest.mark.parametrize("prefetch,far,huge", [(None, None, True), (64, 512, True), (0, 0, False)])
@pytest.mark.parametrize("layout", ["panel", "rows"])
@pytest.mark.parametrize("N,K", [(96, 64), (17, 71), (33, 16), (1, 1), (16, 15), (40, 600)])
def test_the_kernel_is_the_linear(lib, layout, N, K, prefetch, far, huge):
    """Every row count 1-13 (every block of both layouts and a second turn), N and K off the 16 of the
    blocks (K's masked tail, the last panel's padding), with and without bias, on every ISA; with the
    kernel's own prefetches, explicit ones (near and far, past the weight's end too) and none, the panels
    on huge pages or torch's memory."""
    g = torch.Generator().manual_seed(N * 1000 + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    for variant in [-1] + list(range(gemv.isa() + 1)):     # -1: the kernel's own choice per call
        for bias in (b, None):
            f = gemv.product(w, bias, layout, variant=variant, prefetch=prefetch, far=far, huge=huge)
            for M in range(1, 14):
                x = torch.randn(M, K, generator=g)
                check(f(x), x, w, bias, f"{layout} isa {variant} M={M} N={N} K={K} bias={bias is not None} "
                                        f"prefetch={prefetch} far={far} huge={huge}")


@pytest.mark.parametrize("N,K", [(96, 64), (17, 71), (1, 1), (2000, 600)])
def test_panels_are_the_reordered_weight_on_huge_pages(lib, N, K):
    """The panel copy is W padded to 16 rows and interleaved k by k, the same on huge pages and in
    torch's memory; copies share the arena without overlapping, 4 KB-aligned (torch's: 64 bytes); where Linux has
    MADV_HUGEPAGE, a copy's mapping is marked for huge pages (VmFlags 'hg')."""
    w = torch.randn(N, K)
    P = -(-N // 16)
    padded = torch.cat([w, w.new_zeros(P * 16 - N, K)])
    want = padded.view(P, 16, K).transpose(1, 2)
    copies = [gemv.panels(w), gemv.panels(w), gemv.panels(w, huge=False)]
    for c in copies:
        assert torch.equal(c, want) and c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % 4096 == 0 == copies[1].data_ptr() % 4096 or not hasattr(gemv.mmap, "MADV_HUGEPAGE")
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * 4) for c in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    import mmap
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    at, flags = copies[0].data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= at < hi
            elif head == "VmFlags:" and inside:
                flags = line.split()[1:]
    assert flags is not None and "hg" in flags, flags


def test_no_huge_pages_falls_back_to_torch_memory(lib, monkeypatch):
    """A mapping that fails (or a platform without MADV_HUGEPAGE) leaves the panels in torch's memory."""
    w = torch.randn(40, 24)
    want = gemv.panels(w, huge=False)

    def fails(nbytes):
        raise OSError("no mapping")
    monkeypatch.setattr(gemv, "_mapping", fails)
    monkeypatch.setitem(gemv._ARENA, "map", None)
    assert torch.equal(gemv.panels(w), want)
    monkeypatch.delattr(gemv.mmap, "MADV_HUGEPAGE", raising=False)
    assert torch.equal(gemv.panels(w), want)
    x = torch.randn(3, 24)
    check(gemv.product(w)(x), x, w, None, "torch's memory")


def test_batched_empty_and_strided_inputs(lib):
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    f = gemv.product(w, b)
    for x in (torch.randn(2, 3, 40, generator=g), torch.randn(0, 40), torch.randn(40, 5, generator=g).t()):
        check(f(x), x, w, b, f"shape {tuple(x.shape)}")


def test_bad_input_names_the_argument(lib):
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="weight"):
        gemv.product(w.double())
    with pytest.raises(ValueError, match="weight"):
        gemv.product(w.t())
    with pytest.raises(ValueError, match="bias"):
        gemv.product(w, torch.randn(7))
    with pytest.raises(ValueError, match="layout"):
        gemv.product(w, layout="columns")
    with pytest.raises(ValueError, match="x:"):
        gemv.product(w)(torch.randn(2, 15))
    with pytest.raises(ValueError, match="x:"):
        gemv.product(w)(torch.randn(2, 16, dtype=torch.float64))


def test_no_compiler_leaves_onednn_with_a_debug_reason(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.DEBUG, logger="spec.cpu.native"):
        assert gemv.library() is None
    assert "/bin/false" in gemv.reason() and any("not used" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]
    gemv.forget()
    monkeypatch.setenv("CC", "/no/such/compiler")
    assert gemv.library() is None and "could not run" in gemv.reason()
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    ex = executor.executor_for(model)
    assert ex is not None and not ex.most and not any(f.kernel for f in ex.linears.values())
    assert "no kernel: spec.cpu.gemv's library is not available" in executor.describe(model)
    probe.forget(model)


@pytest.mark.parametrize("file,old,new,found", [
    ("gemv.c", "    int automatic = isa < 0;\n", "    *(volatile int *)0 = 0;\n    int automatic = isa < 0;\n",
     "return code -"),                                                                      # the panel entry crashes
    ("gemv.c", "y[m * N + n] += b[n];", "y[m * N + n] += 2 * b[n];", "fp64"),              # the bias added twice
])
def test_a_crashing_or_wrong_library_is_refused_in_a_subprocess(fresh, monkeypatch, tmp_path, file, old, new, found):
    """The self-test runs the library in a subprocess: a segfault there is a return code here and a
    wrong product a refusal; this process carries on with library() None."""
    nativecheck.plant(monkeypatch, tmp_path, file, old, new)
    assert gemv.library() is None
    assert "self-test" in gemv.reason() and found in gemv.reason(), gemv.reason()


def test_a_wrong_kernel_is_refused_by_the_probe(lib, monkeypatch):
    """A kernel 0.1% off the model's own linears: the probe says no, the model stays on oneDNN."""
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    real = gemv.product
    monkeypatch.setattr(gemv, "product", lambda *a, **k: (lambda x, threads=1, f=real(*a, **k): f(x, threads=threads)
                                                          * 1.001))
    ex = executor.executor_for(model)
    assert ex is not None and not ex.most and not any(f.kernel for f in ex.linears.values())
    assert "no kernel: the kernel's logits were off the model's own" in executor.describe(model)
    monkeypatch.setattr(gemv, "product", real)
    probe.forget(model)
    assert executor.executor_for(model).most == prepack.kernel_rows() > 0      # the control: the real kernel passes
    probe.forget(model)


def test_spec_runs_the_kernel_on_few_threads_and_stays_exact(lib, monkeypatch):
    """At one thread the runners' passes of 1 to KERNEL_ROWS[ISA] rows run the kernel (prefill above that on
    oneDNN), speculative output equals greedy's; at KERNEL_THREADS (2) still, the kernel's panels split over the
    2 threads named per call while torch's own setting stays 2 (never changed); above it the kernel is not
    called."""
    from spec import greedy_generate, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_SHED", "0")   # (the weights kept: longer passes on oneDNN; with them shed, the kernel
    #                                        runs every pass, test_executor's counts)
    calls = []                  # (rows, N, threads named, torch's threads) of each kernel product
    real = gemv.product

    def counted(*a, **k):
        f = real(*a, **k)
        return lambda x, threads=1: calls.append((x.numel() // x.shape[-1], f.N, threads, torch.get_num_threads())) \
            or f(x, threads=threads)
    monkeypatch.setattr(gemv, "product", counted)
    draft = perturbed_copy(model, noise=0.05, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert executor.executor_for(model).most and executor.executor_for(draft).most   # (probes: the kernel unsplit)
        calls.clear()
        prompt = list(range(3, 3 + 14))               # a 14-token prefill: above KERNEL_ROWS, oneDNN's
        for p in (prompt, [7, 7, 1, 2, 8]):
            out = speculative_generate(model, draft, p, gamma=3, max_new_tokens=16)
            assert out.tokens == greedy_generate(model, p, max_new_tokens=16).tokens and out.accepted > 0
        rows = {r for r, *_ in calls}
        assert rows and max(rows) <= prepack.KERNEL_ROWS[gemv.isa()] and 1 in rows and max(rows) > 1, sorted(rows)
        assert {(t, tt) for *_, t, tt in calls} == {(1, 1)}
        torch.set_num_threads(prepack.KERNEL_THREADS)
        calls.clear()
        before = gemv.worked()
        for p in (prompt, [7, 7, 1, 2, 8]):       # the kernel's panels split over the pool, still exact
            out = speculative_generate(model, draft, p, gamma=3, max_new_tokens=16)
            assert out.tokens == greedy_generate(model, p, max_new_tokens=16).tokens and out.accepted > 0
        assert calls and gemv.worked() > before
        assert {tt for *_, tt in calls} == {prepack.KERNEL_THREADS}           # torch's threads as they were set
        # few-row passes: the kernel over KERNEL_THREADS threads; the head's kept rows of a pass above
        # KERNEL_ROWS (the prefill, on oneDNN): the kernel on one
        assert {t for *_, t, _ in calls} == {1, 2} and {n for _, n, t, _ in calls if t == 1} == {model.config.vocab_size}
        torch.set_num_threads(prepack.KERNEL_THREADS + 1)
        calls.clear()
        greedy_generate(model, [5, 9, 14, 3], max_new_tokens=4)
        assert calls == []
    finally:
        torch.set_num_threads(threads)
        probe.forget(model)


@pytest.mark.parametrize("isa,most", [(0, 0), (1, 6), (2, 12)])
def test_the_rows_the_kernel_takes_follow_the_isa(lib, monkeypatch, isa, most):
    """AVX-512F: 1-12 rows (one turn of its panel kernel), AVX2+FMA: 1-6; the plain-C variant (no AVX2)
    is not used at all: the model stays on oneDNN."""
    if isa > gemv.isa():
        pytest.skip(f"this CPU runs ISA {gemv.isa()}")
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setattr(gemv, "isa", lambda: isa)
    assert executor.executor_for(model).most == most
    lin = model.model.layers[0].mlp.up_proj
    calls = []
    real = gemv.product
    monkeypatch.setattr(gemv, "product", lambda *a, **k: (lambda x, threads=1, f=real(*a, variant=isa, **k): calls.append(
        x.numel() // x.shape[-1]) or f(x, threads=threads)))
    f = prepack.packed_forward(lin, kernel=True)
    with torch.inference_mode():
        for M in range(1, 15):
            x = torch.randn(M, lin.in_features)
            assert_logits_close(f(x, 1), F.linear(x, lin.weight, lin.bias), torch.float32, what=f"M={M}")
    assert calls == list(range(1, most + 1))
    probe.forget(model)


@pytest.mark.parametrize("N,K", [(17, 71), (33, 16), (96, 64), (2000, 600), (1, 1)])
def test_the_split_over_threads_is_the_one_thread_product_bit_for_bit(lib, N, K):
    """The panels split over 2, 3 or 5 threads (more threads than panels too): each column's sums run in
    the same order, so the product equals the one-thread product exactly, bias and masked tails included;
    and the workers did run parts (the split happened)."""
    g = torch.Generator().manual_seed(N + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    f = gemv.product(w, b)
    xs = [torch.randn(M, K, generator=g) for M in (1, 2, 7, 9, 12, 13)]
    try:
        gemv.set_threads(1)
        want = [f(x) for x in xs]
        for threads in (2, 3, 5):
            assert gemv.set_threads(threads) == threads
            before = gemv.worked()
            for x, y in zip(xs, want):
                got = f(x)
                assert torch.equal(got, y), f"threads {threads} M={x.shape[0]} N={N} K={K}"
            check(got, xs[-1], w, b, f"threads {threads}")
            assert (gemv.worked() > before) is (N > 16), (threads, N)   # one panel: nothing to split
    finally:
        gemv.set_threads(1)


def test_products_from_two_caller_threads_at_once_stay_right(lib):
    """Two Python threads calling split products at the same time (ctypes lets go of the GIL): a call that
    finds the pool taken runs alone, so every product still equals the one-thread one."""
    import threading
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4096, 256, generator=g)
    f = gemv.product(w)
    xs = [torch.randn(m, 256, generator=g) for m in (1, 3, 9, 12) * 5]
    gemv.set_threads(1)
    want = [f(x) for x in xs]
    bad: list = []

    def caller(order):
        for i in order * 200:
            if not torch.equal(f(xs[i]), want[i]):
                bad.append(i)
    try:
        gemv.set_threads(2)
        threads = [threading.Thread(target=caller, args=(list(range(len(xs)))[::s],)) for s in (1, -1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gemv.set_threads(1)
    assert not bad, f"{len(bad)} products differ"


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 12])
@pytest.mark.parametrize("outs,bias", [((64, 32, 32), True), ((96, 96), False), ((48, 16, 40), True)])
def test_a_grouped_product_is_its_members_side_by_side(lib, rows, outs, bias):
    """gemv.grouped: the whole product's columns are bit-identical to each member's own product (made by
    `product`), the members read the whole's panels, and each is the linear within fp32 rounding; the
    last member may end in a partial panel (40 rows)."""
    torch.manual_seed(rows)
    ws = [torch.randn(n, 64) for n in outs]
    bs = [torch.randn(n) if bias and i != 1 else None for i, n in enumerate(outs)]   # a member without bias
    whole, parts = gemv.grouped(ws, bs)
    x = torch.randn(rows, 64)
    got = whole(x)
    alone = torch.cat([gemv.product(w, b)(x) for w, b in zip(ws, bs)], dim=-1)
    assert torch.equal(got, alone)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), alone)
    start = whole.keep[0].data_ptr()
    assert [p.keep[0].data_ptr() - start for p in parts] == [4 * 64 * sum(outs[:i]) for i in range(len(outs))]
    for i, (w, b) in enumerate(zip(ws, bs)):
        check(parts[i](x), x, w, b, f"member {i}, {rows} rows")


def test_a_group_that_cannot_share_panels_is_refused(lib):
    """A member other than the last whose rows are not a multiple of 16 (its last panel would hold the
    next one's rows), or members of different K: None, and spec.cpu.prepack.group makes each its own."""
    assert gemv.grouped([torch.randn(40, 64), torch.randn(16, 64)], [None, None]) is None
    assert gemv.grouped([torch.randn(16, 64), torch.randn(16, 32)], [None, None]) is None
    lins = (torch.nn.Linear(64, 40), torch.nn.Linear(64, 16))
    g = prepack.group(lins, kernel=True)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert g.whole is None and all(m.kernel for m in g.members)
        check(g(x, 1), x, torch.cat([m.weight for m in lins]).detach(), torch.cat([m.bias for m in lins]).detach(),
              "own")


def test_plain_layers_on_the_kernel_compute_the_models_layers(lib):
    """spec.cpu.plainllama on the kernel's grouped products (q/k/v and gate/up each one product): the model's
    own logits within fp32 rounding, cache-free and cached (1 and several rows)."""
    model = llama()
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4))
    ex = executor.Executor(model, kernel=True)
    assert len(ex.layers) == 2 and ex.most and all(f.kernel for f in ex.linears.values())
    fn = lambda **kwargs: ex.forward(kwargs, 1)        # noqa: E731 - the kernel wherever it runs, unsplit
    with torch.inference_mode():
        want = hf.authors_forward(model, ids)
        assert_logits_close(hf.authors_forward(model, ids[:9], fn), want[:9], torch.float32, what="9 ids")
        cache = hf.new_cache(model)
        hf.step(model, ids[:8], cache, fn=fn)
        assert_logits_close(hf.step(model, ids[8:9], cache, fn=fn)[0], want[8:9], torch.float32, what="1 row after 8")
        assert_logits_close(hf.step(model, ids[9:20], cache, fn=fn)[0], want[9:], torch.float32, what="11 rows after 9")


@pytest.mark.parametrize("T,L,H,KV,masked", [(1, 70, 9, 3, False), (9, 73, 9, 3, True), (5, 5, 4, 4, False),
                                             (3, 40, 4, 1, True), (9, 730, 9, 3, False), (40, 40, 9, 3, False),
                                             (70, 75, 4, 4, False)])
def test_attention_on_the_library_is_sdpa(lib, T, L, H, KV, masked):
    """gemv.attend: SDPA's output within fp32 rounding, for one row, a verify pass under the model's
    mask or after a long cache, a causal prefill and grouped heads, with more rows than one block of the
    library's attention takes (its keys packed as later rows reach them), its key heads split over threads or
    not; q a strided view as a plain layer hands it over; None (the caller's own attention) where a row may attend to nothing, for a batch, or off
    AVX-512F."""
    if gemv.isa() != 2:
        q = torch.randn(1, H, T, 16)
        assert gemv.attend(q, torch.randn(1, KV, L, 16), torch.randn(1, KV, L, 16), None, 0.25) is None
        pytest.skip("spec_attend covers AVX-512F CPUs; elsewhere the plain layers run SDPA")
    torch.manual_seed(T + L)
    D = 64
    q = torch.randn(1, T, H + 2 * KV, D).transpose(1, 2)[:, :H]
    k, v = torch.randn(1, KV, L, D), torch.randn(1, KV, L, D)
    mask = (torch.rand(T, L) < 0.7).logical_or(torch.eye(T, L, dtype=torch.bool))[None, None] if masked else None
    causal = mask is None and T == L > 1           # (SDPA's is_causal is top-left: after a cache, the mask)
    sees = plainllama.causal_mask(T, L) if mask is None and 1 < T < L else mask
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=0.125, is_causal=causal,
                                          enable_gqa=True).transpose(1, 2).reshape(1, T, -1)
    got = gemv.attend(q, k, v, mask, 0.125)
    assert_logits_close(got, want, torch.float32, what=f"T={T} L={L}")
    assert torch.equal(gemv.attend(q, k, v, mask, 0.125, threads=2), got)      # key heads split: the same sums
    if masked:
        blind = mask.clone()
        blind[0, 0, T - 1] = False
        assert gemv.attend(q, k, v, blind, 0.125) is None
    assert gemv.attend(torch.randn(2, H, T, D), torch.randn(2, KV, L, D), torch.randn(2, KV, L, D), None, 0.1) is None
