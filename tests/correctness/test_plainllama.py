"""spec.cpu.plainllama: Llama decoder layers in plain tensors, as spec.cpu.executor runs them, compute the
model's own layers (cache-free, cached, under a tree's mask, hidden states), run where the executor's probe
says so, leave calls they cannot follow (hooks, attention weights, a padded batch) to the model's own
forward, and refuse the models they do not cover."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_logits_close

from spec import hf, probe, runner
from spec.cpu import executor, plainllama, prepack

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


def plain(model, native=None):
    """An Executor of the model on oneDNN's packed weights (its layers plain, as a pass runs them)."""
    return executor.Executor(model, kernel=False, native=native)


@pytest.fixture
def own_forward_forbidden(monkeypatch):
    """Any call of LlamaDecoderLayer's own forward fails the test: the plain path must not fall back."""
    from transformers.models.llama import modeling_llama as ml

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the layer's own forward ran")
    monkeypatch.setattr(ml.LlamaDecoderLayer, "forward", forbidden)


IDS = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(2))


@pytest.fixture(params=["native", "torch"])
def small_ops(request):
    """RMSNorm, rotary, attention and the SiLU gate on spec.cpu.gemv's library where it is there ("native":
    True), or as torch ops (False)."""
    from spec.cpu import gemv
    if request.param == "native":
        import nativecheck
        nativecheck.require_library()
    return request.param == "native"


@pytest.mark.parametrize("bias,kv_heads", [(False, 2), (True, 4), (False, 1)])
def test_plain_layers_compute_the_models_layers(bias, kv_heads, small_ops):
    model = llama(bias, kv_heads)
    ex = plain(model, small_ops)

    def on(run):
        run.executor = ex
        return run
    with torch.inference_mode():
        want = {n: hf.authors_forward(model, IDS[:n]) for n in (1, 5, 24)}
        for n, w in want.items():
            assert_logits_close(hf.authors_forward(model, IDS[:n], ex), w, torch.float32, what=f"{n} ids, cache-free")
        assert runner._replay(on(runner.KVRunner(model)), IDS, want[24], 1e-5) is None      # cached, 1 and more rows
        # a 9-row pass on a 15-position cache (a verify pass: the model builds a mask)
        run = on(runner.KVRunner(model))
        run(IDS[:15])
        assert_logits_close(run(IDS[15:24]), want[24][15:], torch.float32, what="9 rows after 15 cached")
    assert not ex.passes[executor.TRANSFORMERS]


def test_the_plain_path_runs_and_is_not_the_layers_own(own_forward_forbidden):
    """Not vacuous: with the layer's own forward made to fail, a pass on the Executor still runs (plain), and
    the model's own forward is what fails."""
    model = llama()
    ex = plain(model)
    with torch.inference_mode():
        hf.authors_forward(model, IDS[:7], ex)
        run = runner.KVRunner(model)
        run.executor = ex
        run(IDS[:4])
        run(IDS[4:9])
        with pytest.raises(AssertionError, match="own forward ran"):
            hf.authors_forward(model, IDS[:7])


def test_a_tree_pass_sees_each_nodes_path():
    """Under a tree's mask (spec.tree.layout) the plain layers give the model's own layers' logits."""
    from spec.tree import Tree
    model = llama()
    tree = Tree(torch.tensor([5, 9, 17, 3, 40, 41]), (-1, -1, 0, 0, 2, 1))
    ex = plain(model)
    with torch.inference_mode():
        logits = {}
        for name, fn in (("own", None), ("plain", ex)):
            run = runner.KVRunner(model)
            run.executor = fn
            run(IDS[:10])
            logits[name] = run.feed_tree(IDS[10:12], tree)
        assert_logits_close(logits["plain"], logits["own"], torch.float32, what="tree pass")
    assert ex.passes[executor.ONEDNN] == 2 and not ex.passes[executor.TRANSFORMERS]


def test_hidden_states_match_and_a_padded_batch_is_the_models_own():
    """The hidden states a drafter reads (every layer's, the last after the final norm) match the model's
    own; a left-padded batch of two rows is left to the model's own forward."""
    model = llama()
    ex = plain(model)
    ids = torch.stack([IDS[:8], torch.cat([torch.zeros(3, dtype=torch.long), IDS[8:13]])])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.inference_mode():
        own = model(input_ids=IDS[None, :8], output_hidden_states=True)
        mine = ex(input_ids=IDS[None, :8], output_hidden_states=True)
        assert len(mine.hidden_states) == len(own.hidden_states) == 3
        for i, (a, b) in enumerate(zip(mine.hidden_states, own.hidden_states)):
            assert_logits_close(a[0], b[0], torch.float32, what=f"hidden state {i}")
        batch = ex(input_ids=ids, attention_mask=mask)
        assert torch.equal(batch.logits, model(input_ids=ids, attention_mask=mask).logits)
    assert ex.declined == {"not one sequence of ids": 1}


def test_what_the_plain_code_does_not_follow_runs_the_models_own_forward():
    """A hook on a layer's part, or attention weights asked for: the model's own forward, hook fired."""
    model = llama()
    ex = plain(model)
    fired = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: fired.append(1))
    with torch.inference_mode():
        want = hf.authors_forward(model, IDS[:6], ex)
        assert fired == [1]
        handle.remove()
        o = ex(input_ids=IDS[None, :6], output_attentions=True)
    assert_logits_close(o.logits[0], want, torch.float32)
    assert ex.declined == {"hooks on a LlamaMLP": 1, "the call passes output_attentions": 1}


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
    """The runners run the model's layers plain on its Executor (probed once); switched off
    (SPEC_PLAIN_LAYERS=0), or when the plain layers are off by 0.1%, the model's own forward on its packed
    linears (executor.Linears)."""
    from spec import greedy_generate, speculative_generate
    from spec.models import perturbed_copy
    model = llama()
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)      # as if it were large
    probe.forget(model)
    ex = executor.executor_for(model)
    assert ex is not None and len(ex.layers) == 2
    draft = perturbed_copy(model, noise=0.05, seed=3)
    before = sum(ex.passes.values())
    out = speculative_generate(model, draft, [5, 9, 14, 3], gamma=3, max_new_tokens=16)
    assert out.tokens == greedy_generate(model, [5, 9, 14, 3], max_new_tokens=16).tokens and out.accepted > 0
    assert sum(ex.passes.values()) > before and not ex.passes[executor.TRANSFORMERS]     # every pass plain
    monkeypatch.setenv("SPEC_PLAIN_LAYERS", "0")
    probe.forget(model)
    assert type(executor.executor_for(model)) is executor.Linears
    assert "not plain layers: SPEC_PLAIN_LAYERS=0" in executor.describe(model)
    monkeypatch.delenv("SPEC_PLAIN_LAYERS")
    probe.forget(model)
    real_layer = plainllama.layer_forward
    monkeypatch.setattr(plainllama, "layer_forward", lambda *a, **k: (
        lambda *x, f=real_layer(*a, **k), **y: f(*x, **y) * 1.001))
    assert type(executor.executor_for(model)) is executor.Linears
    assert "not plain layers: its plain layers were off the model's own forward" in executor.describe(model)
    probe.forget(model)


def test_plain_layers_that_fail_leave_the_models_own_with_a_debug_reason(monkeypatch, caplog):
    """A plain layer that raises in the probe (a transformers release whose parts take other arguments) is a
    no: the runners run the model's own forward on its packed linears, and the output stays exact."""
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
    with caplog.at_level(logging.DEBUG, logger="spec.cpu.executor"):
        assert type(executor.executor_for(model)) is executor.Linears
    assert any("passes on Executor failed here (TypeError" in r.getMessage() for r in caplog.records)
    assert "its plain layers failed here (TypeError: unexpected keyword argument 'cache')" in executor.describe(model)
    draft = perturbed_copy(model, noise=0.05, seed=3)
    out = speculative_generate(model, draft, [5, 9, 14, 3], gamma=3, max_new_tokens=12)
    assert out.tokens == greedy_generate(model, [5, 9, 14, 3], max_new_tokens=12).tokens
    probe.forget(model)
