"""spec.cpu.prepack: oneDNN-prepacked linears compute nn.Linear's function within fp32 rounding, pass the
runner probe's replay, and leave the model as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_logits_close

from spec import hf, runner
from spec.cpu import prepack

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
    model = llama()
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = hf.authors_forward(model, ids)
        with prepack.packed_linears(model):
            assert runner._replay(runner.KVRunner(model), ids, full, 1e-5) is None
            assert_logits_close(hf.authors_forward(model, ids), full, torch.float32)


def test_the_model_is_put_back_even_on_error():
    model = llama()
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        before = model(ids).logits
        with pytest.raises(RuntimeError, match="inside"):
            with prepack.packed_linears(model):
                assert all("forward" in vars(m) for m in linears)
                raise RuntimeError("inside")
        assert not any("forward" in vars(m) for m in linears)
        assert torch.equal(model(ids).logits, before)


def test_a_model_not_fp32_on_cpu_is_left_alone():
    model = llama(torch.float64)
    assert not prepack.available(model)
    with prepack.packed_linears(model):
        assert not any("forward" in vars(m) for m in model.modules())


def test_spec_runs_an_fp32_cpu_model_packed_and_stays_exact(monkeypatch):
    """The runners use the packed linears where the model agrees with its own forward (probed once):
    greedy and speculative decoding then run packed, and speculative output equals greedy's."""
    from spec import greedy_generate, probe, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    probe.forget(model)
    assert not prepack.used(model)                    # its 60 KB of linears fit in any cache: F.linear is faster
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)      # as if it were large
    assert prepack.used(model) and probe.memo(model, "packed linears")[1] is True
    calls = []
    real = prepack.swapped
    monkeypatch.setattr(prepack, "swapped", lambda packed, rows=None: calls.append(
        sum(type(m) is torch.nn.Linear for m in packed)) or real(packed, rows))
    draft = perturbed_copy(model, noise=0.05, seed=3)
    for prompt in ([5, 9, 14, 3], [7, 7, 1, 2, 8]):
        out = speculative_generate(model, draft, prompt, gamma=3, max_new_tokens=16)
        assert out.tokens == greedy_generate(model, prompt, max_new_tokens=16).tokens and out.accepted > 0
    assert calls and all(count == 15 for count in calls), calls     # every pass, all 15 linears packed
    assert all("forward" not in vars(m) for m in model.modules())       # put back after every pass


def test_packing_is_off_when_asked_or_when_the_packed_forward_disagrees(monkeypatch):
    from spec import probe
    model = llama()
    probe.forget(model)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    monkeypatch.setenv("SPEC_PREPACK", "0")
    assert not prepack.used(model)
    monkeypatch.delenv("SPEC_PREPACK")
    real = prepack.packed_forward
    monkeypatch.setattr(prepack, "packed_forward", lambda lin, kernel=False: (lambda x, f=real(lin, kernel): f(x) * 1.001))
    prepack._PACKED.pop(model, None)
    assert not prepack.used(model)                   # 0.1% off the model's own: not used, the plain path runs
    assert runner.verdict(model)[0] == "kv-cache"
    probe.forget(model)
    prepack._PACKED.pop(model, None)


def test_a_model_whose_copies_do_not_fit_in_memory_runs_its_own_linears(monkeypatch):
    """Packing costs up to twice the linears' bytes more (the kernel's panels and oneDNN's copy): a model
    whose copies would take more than half the memory available runs unpacked; unknown memory packs."""
    from spec import probe
    model = llama()
    size = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    for free, packs in ((4 * size - 1, False), (4 * size, True), (None, True)):
        monkeypatch.setattr(prepack, "memory_available", lambda free=free: free)
        probe.forget(model)
        assert prepack.used(model) is packs, (free, size)
    probe.forget(model)
    assert prepack.memory_available() is None or prepack.memory_available() > 0
