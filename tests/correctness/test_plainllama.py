"""spec.cpu.plainllama: Llama decoder layers in plain tensors compute the model's own layers (cache-free,
cached, under a tree's mask, padded batches, hidden states), run where spec.cpu.prepack says so, fall back to
the layer's own forward where they cannot follow it, and refuse the models they do not cover."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_logits_close

from spec import hf, probe, runner
from spec.cpu import plainllama, prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def llama(bias=False, kv_heads=2, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, attention_bias=bias, mlp_bias=bias, **extra)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():                       # norms of their own (a fresh model's are all ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def plain(model):
    """The model's linears packed (oneDNN) and its layers plain, as a pass runs them."""
    return prepack.swapped(prepack.forwards(model, kernel=False, layers=True))


def unpacked(model):
    return prepack.swapped(prepack.forwards(model, kernel=False, layers=False))


@pytest.fixture
def own_forward_forbidden(monkeypatch):
    """Any call of LlamaDecoderLayer's own forward fails the test: the plain path must not fall back."""
    from transformers.models.llama import modeling_llama as ml

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the layer's own forward ran")
    monkeypatch.setattr(ml.LlamaDecoderLayer, "forward", forbidden)


IDS = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(params=["native", "torch"])
def small_ops(request, monkeypatch):
    """RMSNorm and rotary on spec.cpu.gemv's library where it is there ("native"), or as torch ops."""
    from spec.cpu import gemv
    if request.param == "native":
        import nativecheck
        nativecheck.require_library()
    if request.param == "torch":
        monkeypatch.setattr(plainllama.gemv, "library", lambda: None)
    return request.param


@pytest.mark.parametrize("bias,kv_heads", [(False, 2), (True, 4), (False, 1)])
def test_plain_layers_compute_the_models_layers(bias, kv_heads, small_ops):
    model = llama(bias, kv_heads)
    with torch.inference_mode():
        want = {n: hf.authors_forward(model, IDS[:n]) for n in (1, 5, 24)}
        with plain(model):
            for n, w in want.items():
                assert_logits_close(hf.authors_forward(model, IDS[:n]), w, torch.float32, what=f"{n} ids, cache-free")
            assert runner._replay(runner.KVRunner(model), IDS, want[24], 1e-5) is None      # cached, 1 and more rows
            # a 9-row pass on a 15-position cache (a verify pass: the model builds a mask)
            run = runner.KVRunner(model)
            run(IDS[:15])
            assert_logits_close(run(IDS[15:24]), want[24][15:], torch.float32, what="9 rows after 15 cached")


def test_the_plain_path_runs_and_is_not_the_layers_own(own_forward_forbidden):
    """Not vacuous: with the layer's own forward made to fail, a packed pass still runs (plain), and
    outside the swap the model's own forward is what runs."""
    model = llama()
    with torch.inference_mode():
        with plain(model):
            hf.authors_forward(model, IDS[:7])
            run = runner.KVRunner(model)
            run(IDS[:4])
            run(IDS[4:9])
        with pytest.raises(AssertionError, match="own forward ran"):
            hf.authors_forward(model, IDS[:7])


def test_a_tree_pass_sees_each_nodes_path():
    """Under a tree's mask (spec.tree.layout) the plain layers give the model's own layers' logits."""
    from spec.tree import Tree
    model = llama()
    tree = Tree(torch.tensor([5, 9, 17, 3, 40, 41]), (-1, -1, 0, 0, 2, 1))
    with torch.inference_mode():
        logits = {}
        for name, context in (("own", unpacked), ("plain", plain)):
            run = runner.KVRunner(model)
            with context(model):
                run(IDS[:10])
                logits[name] = run.feed_tree(IDS[10:12], tree)
        assert_logits_close(logits["plain"], logits["own"], torch.float32, what="tree pass")


def test_a_padded_batch_and_hidden_states_match():
    """A left-padded batch of two rows (a 4-D padding mask) and the hidden states a drafter reads."""
    model = llama()
    ids = torch.stack([IDS[:8], torch.cat([torch.zeros(3, dtype=torch.long), IDS[8:13]])])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.inference_mode():
        out = {}
        for name, context in (("own", unpacked), ("plain", plain)):
            with context(model):
                o = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            out[name] = (o.logits, o.hidden_states[-1])
        assert_logits_close(out["plain"][0][0], out["own"][0][0], torch.float32, what="row 0")
        assert_logits_close(out["plain"][0][1, 3:], out["own"][0][1, 3:], torch.float32, what="row 1, unpadded")
        assert_logits_close(out["plain"][1][1, 3:], out["own"][1][1, 3:], torch.float32, what="hidden states")


def test_what_the_plain_code_does_not_follow_runs_the_layers_own_forward():
    """A hook on a layer's part, or attention weights asked for: the layer's own forward, hook fired."""
    model = llama()
    fired = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: fired.append(1))
    with torch.inference_mode(), plain(model):
        want = hf.authors_forward(model, IDS[:6])
        assert fired == [1]
        handle.remove()
        o = model(input_ids=IDS[None, :6], output_attentions=True)
    assert_logits_close(o.logits[0], want, torch.float32)


@pytest.mark.parametrize("change,reason", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_implementation": "eager"}, "attention 'eager'"),
])
def test_models_it_does_not_cover_are_named(change, reason):
    assert plainllama.supports(llama()) is None
    assert reason in plainllama.supports(llama(**change))


def test_other_architectures_are_not_taken():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    for model in (qwen, gpt2):
        assert "LlamaDecoderLayer" in plainllama.supports(model)


def test_spec_uses_the_plain_layers_where_they_agree(monkeypatch):
    """With the model's linears packed, the runners run its layers plain (probed once); switched off
    (SPEC_PLAIN_LAYERS=0), or when the plain forward is off by 0.1%, they run the model's own."""
    from spec import greedy_generate, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)      # as if it were large
    probe.forget(model)
    assert prepack.layers_used(model) and probe.memo(model, "plain layers")[1] is True
    calls = []
    real = prepack.swapped

    def counted(packed, rows=None):
        if rows is not None:                         # a runner's pass (a probe's swap gives no rows)
            calls.append(sum(type(m).__name__ == "LlamaDecoderLayer" for m in packed))
        return real(packed, rows)
    monkeypatch.setattr(prepack, "swapped", counted)
    draft = perturbed_copy(model, noise=0.05, seed=3)
    out = speculative_generate(model, draft, [5, 9, 14, 3], gamma=3, max_new_tokens=16)
    assert out.tokens == greedy_generate(model, [5, 9, 14, 3], max_new_tokens=16).tokens and out.accepted > 0
    assert calls and all(c == 2 for c in calls), calls       # both layers plain, every pass
    monkeypatch.setenv("SPEC_PLAIN_LAYERS", "0")
    assert not prepack.layers_used(model)
    monkeypatch.delenv("SPEC_PLAIN_LAYERS")
    probe.forget(model)
    real_layer = plainllama.layer_forward
    monkeypatch.setattr(plainllama, "layer_forward", lambda *a, **k: (
        lambda *x, f=real_layer(*a, **k), **y: f(*x, **y) * 1.001))
    prepack._PACKED.pop(model, None)
    assert not prepack.layers_used(model)
    probe.forget(model)
    prepack._PACKED.pop(model, None)


def test_plain_layers_that_fail_leave_the_models_own_with_a_debug_reason(monkeypatch, caplog):
    """A plain forward that raises in the probe (a transformers release whose layers take other arguments)
    is a no: the runners run the model's own layers, and the output stays exact."""
    import logging
    from spec import greedy_generate, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    probe.forget(model)

    def broken(*args, **kwargs):
        def forward(*a, **k):
            raise TypeError("unexpected keyword argument 'cache'")
        return forward
    monkeypatch.setattr(plainllama, "layer_forward", broken)
    with caplog.at_level(logging.DEBUG, logger="spec.cpu.prepack"):
        assert not prepack.layers_used(model)
    assert any("plain layers failed (TypeError" in r.getMessage() for r in caplog.records)
    assert not any(type(m).__name__ == "LlamaDecoderLayer" for m in prepack.forwards(model))
    draft = perturbed_copy(model, noise=0.05, seed=3)
    out = speculative_generate(model, draft, [5, 9, 14, 3], gamma=3, max_new_tokens=12)
    assert out.tokens == greedy_generate(model, [5, 9, 14, 3], max_new_tokens=12).tokens
    probe.forget(model)
    prepack._PACKED.pop(model, None)
