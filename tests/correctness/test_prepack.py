"""spec.cpu.prepack: packed weights (oneDNN's reordered copies) compute nn.Linear's function within fp32
rounding; spec's runners run an fp32 CPU model on them (through spec.cpu.executor) where they pay and agree
with the model's own forward, pass the runner probe's replay, and leave the model as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_logits_close

from spec import hf, probe, runner
from spec.cpu import executor, prepack

import nativecheck

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def llama(dtype=torch.float32, bias=True):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=bias, mlp_bias=bias)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 64), (9, 64), (1, 2, 64), (2, 5, 64), (0, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_forward_is_the_linear(shape, bias):
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        got = prepack.packed_forward(lin)(x)
        assert_logits_close(got, F.linear(x, lin.weight, lin.bias), torch.float32, what=str(shape))


def test_the_runner_probe_accepts_the_packed_model():
    """The runner probe's replay (feeds and crops like the decode loop's) through the Executor on oneDNN."""
    model = llama()
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(2))
    ex = executor.Executor(model, kernel=False)
    with torch.inference_mode():
        full = hf.authors_forward(model, ids)
        run = runner.KVRunner(model)
        run.executor = ex
        assert runner._replay(run, ids, full, 1e-5) is None
        assert ex.passes[executor.ONEDNN] > 0 and not ex.passes[executor.TRANSFORMERS]
        assert_logits_close(hf.authors_forward(model, ids, ex), full, torch.float32)


def test_the_model_is_left_as_it_was_even_on_error(monkeypatch):
    """A pass that fails inside leaves every module as it was (nothing was replaced to put back), and the
    model's own forward gives what it gave before."""
    model = llama()
    ex = executor.Executor(model, kernel=False)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))

    def broken(self, x, threads=0):
        raise RuntimeError("inside")
    with torch.inference_mode():
        before = model(ids).logits
        monkeypatch.setattr(prepack.Packed, "__call__", broken)
        with pytest.raises(RuntimeError, match="inside"):
            ex(input_ids=ids)
        monkeypatch.undo()
        assert not any("forward" in vars(m) for m in model.modules())
        assert torch.equal(model(ids).logits, before)


def test_a_model_not_fp32_on_cpu_is_left_alone():
    model = llama(torch.float64)
    assert not prepack.available(model)
    assert executor.executor_for(model) is None
    assert "not fp32" in executor.describe(model)


def test_spec_runs_an_fp32_cpu_model_packed_and_stays_exact(monkeypatch):
    """The runners use the Executor where the model agrees with its own forward (probed once): greedy and
    speculative decoding then run packed, and speculative output equals greedy's."""
    from spec import greedy_generate, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    probe.forget(model)
    assert executor.executor_for(model) is None           # its 60 KB of linears fit in any cache: F.linear is faster
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)      # as if it were large
    ex = executor.executor_for(model)
    assert ex is not None and probe.memo(model, "executor")[1][1] is not None
    assert set(ex.linears) == {m for m in model.modules() if type(m) is torch.nn.Linear}       # all 15 packed
    draft = perturbed_copy(model, noise=0.05, seed=3)
    for prompt in ([5, 9, 14, 3], [7, 7, 1, 2, 8]):
        out = speculative_generate(model, draft, prompt, gamma=3, max_new_tokens=16)
        assert out.tokens == greedy_generate(model, prompt, max_new_tokens=16).tokens and out.accepted > 0
    assert sum(ex.passes.values()) > 0 and not ex.passes[executor.TRANSFORMERS]      # every pass on the Executor
    assert all("forward" not in vars(m) for m in model.modules())
    probe.forget(model)


def test_packing_is_off_when_asked_or_when_the_packed_forward_disagrees(monkeypatch):
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_PREPACK", "0")
    assert executor.executor_for(model) is None
    monkeypatch.delenv("SPEC_PREPACK")
    probe.forget(model)
    real = prepack.Packed.__call__
    monkeypatch.setattr(prepack.Packed, "__call__", lambda self, x, threads=0: real(self, x, threads) * 1.001)
    assert executor.executor_for(model) is None          # 0.1% off the model's own: not used, its own forward runs
    assert "off the model's own" in executor.describe(model)
    assert runner.verdict(model)[0] == "kv-cache"
    monkeypatch.undo()
    probe.forget(model)


def test_a_model_whose_copies_do_not_fit_in_memory_runs_its_own_forward(monkeypatch):
    """Packing costs the linears' bytes once more (the kernel's panels, or oneDNN's copy: never both where the
    kernel runs the short passes): a model whose copy would take more than half the memory available runs
    its own forward; unknown memory packs."""
    model = llama()
    size = prepack.linear_bytes(model)
    assert size == sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    for free, packs in ((2 * size - 1, False), (2 * size, True), (None, True)):
        monkeypatch.setattr(prepack, "memory_available", lambda free=free: free)
        probe.forget(model)
        assert (executor.executor_for(model) is not None) is packs, (free, size)
    probe.forget(model)
    assert prepack.memory_available() is None or prepack.memory_available() > 0


@pytest.mark.parametrize("kernel", [False, True])
def test_onednns_copy_is_made_only_where_it_pays_and_fits(monkeypatch, kernel):
    """A pass longer than REORDER_ROWS (a prompt's prefill) runs oneDNN on the model's own weight and makes
    no reordered copy; a short pass oneDNN runs (no kernel, or more rows than it takes) makes it, unless it
    would not fit in memory then; every answer is the linear's within fp32 rounding. With the kernel running
    the decode's short passes, the linear costs its own weight and the panels only."""
    if kernel and not prepack.kernel_rows():
        pytest.skip("spec.cpu.gemv's kernel does not run on this CPU (the test_gemv tests say why)")
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 96)
    monkeypatch.setattr(prepack, "memory_available", lambda: None)
    with torch.inference_mode():
        packed = prepack.packed_forward(lin, kernel=kernel)
        most = packed.most
        for rows in (prepack.REORDER_ROWS + 1, 200):
            x = torch.randn(rows, 64)
            assert_logits_close(packed(x, threads=1), F.linear(x, lin.weight, lin.bias), torch.float32, what=str(rows))
        assert packed.reordered is None
        if kernel:
            for rows in range(1, most + 1):      # the decode's passes: on the kernel, no copy either
                x = torch.randn(rows, 64)
                assert_logits_close(packed(x, threads=1), F.linear(x, lin.weight, lin.bias), torch.float32)
            assert packed.reordered is None
        short = torch.randn(most + 1, 64)
        if kernel:      # a short pass on oneDNN where the kernel runs the decode: a probe's, or gamma >= 12
            assert_logits_close(packed(short, threads=0), F.linear(short, lin.weight, lin.bias), torch.float32)
            assert packed.reordered is None
            monkeypatch.setattr(torch, "get_num_threads", lambda: prepack.KERNEL_THREADS + 1)  # oneDNN's own regime
        monkeypatch.setattr(prepack, "memory_available", lambda: 96 * 64 * 4 * 2 - 1)   # the copy would not fit
        assert_logits_close(packed(short, threads=1), F.linear(short, lin.weight, lin.bias), torch.float32)
        assert packed.reordered is None
        monkeypatch.setattr(prepack, "memory_available", lambda: None)
        assert_logits_close(packed(short, threads=1), F.linear(short, lin.weight, lin.bias), torch.float32)
        assert packed.reordered is not None
        assert lin.weight.data_ptr() == packed.weight.data_ptr()     # the plain path reads the model's own


# --- the model's own weights, where the kernel's panels run every pass (prepack.shed) ---------------------

def _mapping(t: torch.Tensor) -> str:
    """The /proc/self/maps line of the mapping that holds t's first byte."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.strip()
    raise AssertionError("no mapping holds the tensor")


def _resident(t: torch.Tensor) -> int:
    """Bytes of t's whole pages resident in this process."""
    return nativecheck.resident(t.data_ptr(), t.numel() * t.element_size())


# At a fault on a mapped file Linux maps up to 64 KB of its neighbouring pages already in the page cache
# (fault-around): reading one weight brings back at most that much of each neighbour's, 128 KB a weight.
FAULT_AROUND = 128 << 10
needs_linux = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="Linux only")


@needs_linux
def test_a_weight_in_the_process_memory_moves_to_a_file_with_its_values(tmp_path, monkeypatch):
    """shed: the same Parameter object, the same values, now a private mapping of an unlinked file in
    $SPEC_CACHE/weights, none of it resident until read; the module computes what it did."""
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path))
    lin = torch.nn.Linear(512, 1024)
    x = torch.randn(3, 512)
    want, before, param = lin(x).detach(), lin.weight.detach().clone(), lin.weight
    assert "weights" not in _mapping(lin.weight)
    assert prepack.shed(lin.weight)
    assert lin.weight is param and torch.equal(lin.weight.detach(), before) and torch.equal(lin(x).detach(), want)
    assert f"{tmp_path}/weights/" in _mapping(lin.weight) and "(deleted)" in _mapping(lin.weight)
    assert not list((tmp_path / "weights").iterdir())          # unlinked at once


@needs_linux
def test_a_weight_in_the_process_memory_is_moved_before_its_panels_are_made(tmp_path, monkeypatch):
    """A weight in the process's own memory (a model built, not mapped from a checkpoint) is moved to its file
    before its panels are made, so the panels are read from the file's mapping and each block's pages leave
    as it is copied: the weight and its panels are never both whole in memory (SmolLM2's 360M shape peaked
    116 MB higher with the biggest weight, the head, held beside its panels). Alone and in a group (q, k,
    v): read from the mapping, none of it resident after, the products the linears'."""
    from spec.cpu import gemv
    if not prepack.kernel_rows():
        pytest.skip("no kernel on this CPU: no panels")
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path))
    read, fill = [], gemv._fill_panels

    def spy(out, weight, done=None):
        read.append(_mapping(weight))
        return fill(out, weight, done)
    monkeypatch.setattr(gemv, "_fill_panels", spy)
    torch.manual_seed(0)
    linears = [torch.nn.Linear(512, n, bias=False) for n in (1024, 256, 256, 2048)]
    x = torch.randn(3, 512)
    want = [m(x).detach() for m in linears]
    group = prepack.group(tuple(linears[:3]), kernel=True, shed_weights=True)
    head = prepack.packed_forward(linears[3], kernel=True, shed_weight=True)
    assert len(read) == 4 and all(f"{tmp_path}/weights/" in m and "(deleted)" in m for m in read), read
    assert all(_resident(m.weight) == 0 for m in linears)
    assert all(m.shed for m in group.members) and head.shed
    assert_logits_close(group(x, threads=1), torch.cat(want[:3], -1), torch.float32)
    assert_logits_close(head(x, threads=1), want[3], torch.float32)


@needs_linux
def test_weights_given_back_stay_out_whoever_asks_first(tmp_path, monkeypatch, one_thread):
    """The runner's verdict runs the model's own forward, which reads every weight: asked for after the
    executor had given its weights back (`executor.describe` or `executor_for` called before any decode), it
    brought them all back beside their panels (SmolLM2: peak 1,454 MB against 994). The executor asked for
    first takes the verdict first; probed again (`probe.forget`: the verdict, then a new executor), the pages its
    own forward read back leave again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec import greedy_generate
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "ckpt")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = [3 + i % 500 for i in range(17)]
    read = []
    own = hf.authors_forward

    def spy(m, *args, **kwargs):
        read.append(executor._MADE.get(m) is not None and executor._MADE[m].shed)
        return own(m, *args, **kwargs)
    monkeypatch.setattr(hf, "authors_forward", spy)
    if not prepack.kernel_rows():
        pytest.skip("no kernel on this CPU: the weights are kept")
    assert "kernel" in executor.describe(model)
    assert probe.memo(model, "path") is not None              # the verdict first
    ex = executor.executor_for(model)
    assert ex is not None and ex.shed
    assert read and not any(read), "the model's own forward ran on weights already given back"
    weights = [m.weight for m in ex.linears]
    resident = lambda: sum(_resident(w) for w in weights)     # noqa: E731
    assert resident() <= FAULT_AROUND * len(weights)
    out = greedy_generate(model, ids, max_new_tokens=8).tokens
    assert resident() <= FAULT_AROUND * len(weights)
    probe.forget(model)                                        # probed again: its own forward reads them all
    assert greedy_generate(model, ids, max_new_tokens=8).tokens == out
    assert resident() <= FAULT_AROUND * len(weights), "a probe's reads stayed in the process"
    assert out == model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()


@needs_linux
def test_a_tied_embedding_given_back_is_read_from_the_head_panels(tmp_path, monkeypatch, one_thread):
    """SmolLM2's head is its embedding: once the head's panels are made its weight is given back, and the
    embedding's rows are read from the panels, the same values. Read from the weight's mapping instead, each
    token brought back a page cache folio of it (about 1 MB on Linux 6.x, ext4): 80 of its 113 MB after a
    64-token prompt on SmolLM2's 135M shape with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec import greedy_generate
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table
    rows = table.detach().clone()
    ids = [(97 * i) % 4100 for i in range(40)]
    want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert greedy_generate(model, ids, max_new_tokens=8).tokens == want
    ex = executor.executor_for(model)
    if not prepack.kernel_rows():
        pytest.skip("no kernel on this CPU: the head's weight is kept")
    assert isinstance(ex, executor.Executor) and ex.head.shed, executor.describe(model)
    assert "(deleted)" in _mapping(table)                      # given back: moved to spec's own file
    every = torch.arange(4100)[None]
    assert torch.equal(ex.embedded(every), rows[None])         # the panels' rows are the embedding's values
    assert _resident(table) <= table.numel(), "the embedding's pages came back"    # (a quarter: fault-around)
    for outside in (4100, -1):                                 # (4100: in the last panel's zero padding)
        with pytest.raises(IndexError):                        # (F.embedding's, reading the weight itself)
            ex.embedded(torch.tensor([[3, outside]]))
    assert greedy_generate(model, ids[::-1], max_new_tokens=8).tokens == \
        model.generate(torch.tensor([ids[::-1]]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()


@needs_linux
def test_a_mapped_checkpoint_gives_its_pages_back_and_keeps_its_values(tmp_path, monkeypatch, one_thread):
    """A model loaded from safetensors (transformers maps the file): once the executor's panels serve every
    pass, its linears' pages leave the process (the Parameters untouched, still mapped from the checkpoint),
    the decode stays exact; a weight changed in memory after loading keeps its change (its pages differ from
    the file's, so they are not dropped); SPEC_SHED=0 keeps every page."""
    from transformers import LlamaForCausalLM

    from spec import greedy_generate
    from transformers import LlamaConfig
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)        # (linears of 256 KB and more: Linux maps up to 64 KB of a file's neighbouring
    #                             pages at each fault, fault-around, which brings a few pages of a small one back)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "ckpt")
    for shed in ("1", "0"):
        monkeypatch.setenv("SPEC_SHED", shed)
        model = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
        up = model.model.layers[1].mlp.up_proj.weight
        ids = [3 + i % 500 for i in range(17)]
        assert "ckpt/model.safetensors" in _mapping(up), "transformers no longer maps the checkpoint"
        with torch.no_grad():
            up[0, 0] += 1.0                                   # a changed page: its values are the model's now
        changed = up.detach().clone()
        with torch.inference_mode():
            ref = hf.authors_forward(model, torch.tensor(ids))
        probe.forget(model)
        out = greedy_generate(model, ids, max_new_tokens=8).tokens   # (its probes first, then the executor's)
        ex = executor.executor_for(model)
        assert ex is not None and ex.most == prepack.kernel_rows() and ex.shed == (shed == "1" and ex.most > 0)
        assert not ex.linears[model.model.layers[1].mlp.up_proj].shed   # (the changed one: kept)
        weights = [m.weight for m in ex.linears if m is not model.model.layers[1].mlp.up_proj]
        assert all("ckpt/model.safetensors" in _mapping(w) for w in weights)    # the Parameters are not moved
        total = sum(w.numel() * 4 for w in weights)
        resident = lambda: sum(_resident(w) for w in weights)     # noqa: E731
        if ex.shed:
            assert resident() <= FAULT_AROUND * len(weights), "the checkpoint's pages stayed in the process"
        else:
            assert resident() > total * 3 / 4
        assert torch.equal(up.detach(), changed)                  # the changed weight kept its change
        assert greedy_generate(model, ids, max_new_tokens=8).tokens == out
        assert resident() <= FAULT_AROUND * len(weights) or not ex.shed   # (a decode reads none of them back)
        with torch.inference_mode():
            assert_logits_close(hf.authors_forward(model, torch.tensor(ids), ex), ref, torch.float32)
            assert torch.equal(hf.authors_forward(model, torch.tensor(ids)), ref)   # its own forward: as before
        assert out == model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        probe.forget(model)
