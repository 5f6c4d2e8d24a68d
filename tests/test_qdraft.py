"""spec.cpu.qdraft: a GGUF Llama (Q4_1 matrices, Q8_0 embedding and output) drafting on spec's own
block-quantized kernel. On a tiny seeded Llama written by spec.conformance.llamacpp.llama_gguf:
the forward against a NumPy forward of the same arithmetic (weights dequantized by the gguf package,
not by spec's record packing; activations quantized per block of 32 as the kernel does), prefill in
blocks and one at a time, the cache cut back and fed again; greedy speculative decoding with it
equals greedy and rejects some proposals; its sampled law is the target's; the refusals and the
self-test. Skipped with the reason where the kernel cannot run (no AVX-512 VNNI, no compiler); failed
where it should run and does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spec import greedy_generate, speculative_generate
from spec.cpu import native, qdraft
from spec.conformance import kit, llamacpp
from spec.conformance.stats import goodness_of_fit, reference_probabilities
from spec.draft import Pick
from spec.models import perturbed_copy

import nativecheck
from skewedq import SkewedQ



@pytest.fixture(autouse=True)
def kernel():
    """Skipped where the kernel cannot run (no AVX-512 VNNI, no compiler); failed where it should and does not."""
    return nativecheck.require_qdraft()

PROMPTS = [[5, 9, 5, 9, 300, 12, 7, 7, 100], [3, 141, 59, 26, 53, 58, 97], [11, 400, 22]]


@pytest.fixture(scope="module")
def target():
    return kit.zoo("llama")["target"]   # fp64, 64 wide, 4 heads over 2 KV heads, vocabulary 640


@pytest.fixture(scope="module")
def q4_gguf(target, tmp_path_factory):
    """The target plus 10% weight noise, quantized as llama.cpp's Q4_1 export: many proposals
    accepted, some rejected."""
    pytest.importorskip("gguf")
    draft = perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)
    return llamacpp.llama_gguf(draft, tmp_path_factory.mktemp("qgguf") / "partial.q4_1.gguf", quantized=True)


# ----------------------------------------------------------------------------- the NumPy forward

def _quantized(x: np.ndarray) -> np.ndarray:
    """x [R, K] float32 as the kernel sees it: per block of 32, amax / 127 times rint(x * 127 / amax)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    iscale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * iscale), -127, 127)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def reference_logits(path, ids: list[int], inputs: list | None = None) -> np.ndarray:
    """Every position's logits [len(ids), vocab] from the GGUF at `path`, in NumPy (keys and values rounded to
    IEEE halves, as the kernel's cache holds them); each layer's input
    [len(ids), dim] appended to `inputs` where given."""
    import gguf

    r = gguf.GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("llama.")}
    W = lambda n: gguf.quants.dequantize(t[n].data, t[n].tensor_type).astype(np.float64)
    V = lambda n: np.asarray(t[n].data, dtype=np.float32)
    D, H, KV = f["llama.embedding_length"], f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
    hd, eps, theta = D // H, np.float32(f["llama.attention.layer_norm_rms_epsilon"]), f["llama.rope.freq_base"]
    lin = lambda w, x: (_quantized(x.astype(np.float32)) @ w.T).astype(np.float32)
    norm = lambda x, w: (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32) * w
    T = len(ids)
    pos = np.arange(T)[:, None] * theta ** (-2 * np.arange(hd // 2) / hd)
    cos, sin = np.cos(pos), np.sin(pos)

    def rope(v, heads):                                    # adjacent pairs, llama.cpp's layout
        v = v.reshape(T, heads, hd // 2, 2)
        a, b = v[..., 0], v[..., 1]
        c, s = cos[:, None], sin[:, None]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(T, heads * hd)

    x = W("token_embd.weight")[ids].astype(np.float32)
    for i in range(f["llama.block_count"]):
        p = f"blk.{i}."
        if inputs is not None:
            inputs.append(x.copy())
        h = norm(x, V(p + "attn_norm.weight"))
        q, k, v = (lin(W(p + n + ".weight"), h) for n in ("attn_q", "attn_k", "attn_v"))
        q, k = rope(q, H), rope(k, KV)
        k, v = (c.astype(np.float32).astype(np.float16).astype(np.float32) for c in (k, v))   # its cache: halves
        out = np.zeros((T, D), np.float32)
        for hh in range(H):
            kh = hh // (H // KV)
            s = q[:, hh * hd:(hh + 1) * hd] @ k[:, kh * hd:(kh + 1) * hd].T / np.sqrt(hd)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh * hd:(hh + 1) * hd] = (a / a.sum(-1, keepdims=True)) @ v[:, kh * hd:(kh + 1) * hd]
        x = x + lin(W(p + "attn_output.weight"), out)
        h = norm(x, V(p + "ffn_norm.weight"))
        g, u = lin(W(p + "ffn_gate.weight"), h), lin(W(p + "ffn_up.weight"), h)
        x = x + lin(W(p + "ffn_down.weight"), g / (1 + np.exp(-g)) * u)
    out = "output.weight" if "output.weight" in t else "token_embd.weight"
    return lin(W(out), norm(x, V("output_norm.weight")))


def assert_close(got: torch.Tensor, want: np.ndarray, where: str) -> None:
    """Within 1e-3 of the logits' scale: float32 sums in another order, and where that moves an activation
    across a rounding boundary of its int8 block, one step of 1/127 of the block's largest value."""
    err = float(np.abs(got.numpy().astype(np.float64) - want).max())
    scale = float(np.abs(want).max())
    assert err <= 1e-3 * scale, f"{where}: largest difference {err:.3g} against logits up to {scale:.3g}"


def test_the_forward_is_the_arithmetic_it_claims(q4_gguf):
    """Prefill (blocks of 4 rows and a remainder), one token at a time, and a cache cut back and fed
    again all give the NumPy forward's logits at every position."""
    ids = PROMPTS[0] + PROMPTS[1]
    want = reference_logits(q4_gguf, ids)
    run = qdraft.QuantRun(q4_gguf, n_ctx=64)
    assert_close(run(torch.tensor(ids[:9]), keep=1)[0], want[8], "prefill of 9")
    for i in range(9, len(ids)):
        assert_close(run(torch.tensor(ids[i:i + 1]))[0], want[i], f"position {i}")
    run.crop(5)
    assert len(run) == 5 and run.held().tolist() == ids[:5]
    assert_close(run(torch.tensor(ids[5:12]), keep=1)[0], want[11], "fed again from 5")
    with pytest.raises(ValueError, match="context holds 64"):
        run(torch.tensor(ids * 4), keep=1)
    with pytest.raises(ValueError, match=r"ids: token ids in \[0, 640\)"):
        run(torch.tensor([640]))


def test_a_tied_models_gguf_holds_its_embedding_once(target, q4_gguf, tmp_path):
    """A model whose output layer is its embedding is written as llama.cpp's converter writes a tied
    checkpoint (no output.weight: llama.cpp and the kernel read token_embd for both, one copy in memory),
    and the kernel's logits over it are the arithmetic; an untied model keeps its own output."""
    tied = perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    path = llamacpp.llama_gguf(tied, tmp_path / "tied.q4_1.gguf", quantized=True)
    assert "output.weight" not in qdraft.read(path).tensors
    assert "output.weight" in qdraft.read(q4_gguf).tensors
    ids = PROMPTS[0]
    assert_close(qdraft.QuantRun(path, n_ctx=64)(torch.tensor(ids), keep=1)[0], reference_logits(path, ids)[-1],
                 "tied prefill")


def test_a_long_prefill_is_the_arithmetic_across_its_chunks(q4_gguf):
    """A prefill longer than the forward's chunk (64 rows a pass over the weights: spec_qd_forward's CHUNK)
    gives the NumPy forward's logits, at the end of each of 1, 2 and 3 chunks and a remainder; and the
    positions after it, one at a time, attend over the whole cache."""
    ids = [(7 * i + 3) % 640 for i in range(150)]
    want = reference_logits(q4_gguf, ids)
    for n in (64, 65, 128, 149):
        run = qdraft.QuantRun(q4_gguf, n_ctx=160)
        assert_close(run(torch.tensor(ids[:n]), keep=1)[0], want[n - 1], f"prefill of {n}")
        if n == 149:
            assert_close(run(torch.tensor(ids[149:150]))[0], want[149], "the step after it")


def test_a_cache_filled_from_layer_inputs_is_the_one_the_forward_makes(q4_gguf):
    """QuantRun.fill, given each layer's input at every prompt position (here the NumPy forward's own),
    makes the keys and values the forward would: the steps after it give the NumPy forward's logits,
    whether the states lie position-major or layer-major (read where they lie); a wrong shape or a fill
    past the cache is refused by name."""
    ids = [(5 * i + 1) % 640 for i in range(80)]
    inputs: list = []
    want = reference_logits(q4_gguf, ids, inputs)
    hidden = torch.from_numpy(np.stack(inputs, 1))                  # [ids, layers, dim]
    run = qdraft.QuantRun(q4_gguf, n_ctx=96)
    run.fill(torch.from_numpy(np.stack(inputs))[:, :40].transpose(0, 1), torch.tensor(ids[:40]))   # layer-major
    run.fill(hidden[40:70], torch.tensor(ids[40:70]))
    assert len(run) == 70 and run.held().tolist() == ids[:70]
    for i in range(70, 80):     # (the states are NumPy's: where one rounds across an int8 step, 1/127 of a block)
        got = run(torch.tensor(ids[i:i + 1]))[0].numpy().astype(np.float64)
        assert np.abs(got - want[i]).max() <= 1e-2 * np.abs(want[i]).max(), f"position {i} after a fill of 70"
        assert got.argmax() == want[i].argmax()
    with pytest.raises(ValueError, match=r"hidden: \[3, 2, 64\] expected"):
        run.fill(hidden[:3, :1], torch.tensor(ids[:3]))
    with pytest.raises(ValueError, match="context holds 96"):
        run.fill(hidden[:20], torch.tensor(ids[:20]))


def _own_then_taken(target, own, taken, ids):
    """Each draft's speculative run of `ids` (24 new tokens, gamma 4), its output checked against greedy's:
    the second run's output, and the proposals each accepted after its first round."""
    greedy = greedy_generate(target, ids, max_new_tokens=24).tokens
    accepted = []
    for drafter in (own, taken):
        out = speculative_generate(target, drafter, ids, gamma=4, max_new_tokens=24, trace=True)
        assert out.tokens == greedy
        accepted.append(sum(r.accepted for r in out.trace[1:]))
    return out, accepted


def test_a_long_prompt_takes_the_targets_prefill_and_stays_exact(target, q4_gguf):
    """A prompt of FILL_FROM ids or more: the draft proposes nothing on the first round, makes its cache from
    the target's own prefill (each layer's input, handed through Need.HIDDEN), then drafts; the output is
    greedy's, later rounds accept proposals, and the draft's cache holds the sequence. A shorter prompt, or
    prefill='own', prefills the draft itself."""
    from spec.gguf_draft import FILL_FROM, GGUFDraft
    ids = [(11 * i + 7) % 640 for i in range(FILL_FROM + 10)]
    own, taken = GGUFDraft(q4_gguf, target, engine="native", prefill="own"), GGUFDraft(q4_gguf, target, engine="native")
    assert not own.needs and own.why_own_prefill == "prefill='own'" and taken.why_own_prefill is None
    filled = []
    fill = taken.run.fill
    taken.run.fill = lambda hidden, got: (filled.append(len(got)), fill(hidden, got))
    out, accepted = _own_then_taken(target, own, taken, ids)
    print("accepted after the first round, own prefill and the target's:", accepted)
    assert accepted[1] >= 0.8 * accepted[0] > 0, accepted     # the target's states serve the draft as its own
    assert filled == [len(ids)]
    assert out.trace[0].drafted == 0 and out.trace[1].drafted > 0
    assert taken.run.held().tolist()[:len(ids)] == ids
    short = speculative_generate(target, taken, ids[:FILL_FROM - 1], gamma=4, max_new_tokens=8, trace=True)
    assert short.trace[0].drafted > 0 and filled == [len(ids)]


def test_a_draft_whose_prompt_states_do_not_come_prefills_itself(target, q4_gguf):
    """The draft waits one round for the target's prompt states; where they start after the prompt (it was
    first asked after the prefill: a FirstOf's second source), or where it is asked again with nothing
    handed, it prefills itself and proposes, rather than proposing nothing for the rest of the sequence."""
    from spec.gguf_draft import FILL_FROM, GGUFDraft
    from spec.protocols import Step
    ids = [(11 * i + 7) % 640 for i in range(FILL_FROM + 10)]
    n, seq = len(ids), torch.tensor(ids + [0] * 16)
    draft = GGUFDraft(q4_gguf, target, engine="native")
    layers, width = len(draft.layers), draft.run.dim
    for handed in (True, False):
        draft.begin(seq[:n])
        draft.run.crop(0)
        assert len(draft.draft(seq, n, 4)) == 0                    # waits for the prefill's states
        if handed:
            draft.process(Step(torch.arange(5, n), torch.zeros(n - 5, layers, width), draft.layers))
        assert len(draft.draft(seq, n, 4)) == 4 and draft.run.held().tolist()[:n] == ids, handed


def test_a_fill_layer_by_layer_makes_the_cache_a_whole_fill_makes(q4_gguf):
    """QuantRun.filler, handed each layer's input in turn (as a target's pass makes them), leaves the caches
    and positions bit for bit as fill given all layers at once; a wrong shape is refused by name."""
    ids = [(5 * i + 1) % 640 for i in range(80)]
    inputs: list = []
    reference_logits(q4_gguf, ids, inputs)
    hidden = torch.from_numpy(np.stack(inputs, 1))                  # [ids, layers, dim]
    whole, layered = qdraft.QuantRun(q4_gguf, n_ctx=96), qdraft.QuantRun(q4_gguf, n_ctx=96)
    for run in (whole, layered):
        run(torch.tensor(ids[:5]), keep=1)                           # after 5 positions of its own
    whole.fill(hidden[5:], torch.tensor(ids[5:]))
    take = layered.filler(torch.tensor(ids[5:]))
    for layer in range(hidden.shape[1]):
        assert len(layered) == 5                                     # held once the last layer is in
        take(layer, hidden[5:, layer].T.contiguous().T if layer % 2 else hidden[5:, layer])   # (a strided one too)
    assert len(layered) == len(whole) == 80 and layered.held().tolist() == ids
    assert np.array_equal(layered.kc, whole.kc) and np.array_equal(layered.vc, whole.vc)
    assert torch.equal(layered(torch.tensor([9])), whole(torch.tensor([9])))
    with pytest.raises(ValueError, match=r"x: \[3, 64\] expected"):
        layered.filler(torch.tensor(ids[:3]))(0, hidden[:2, 0])


@pytest.fixture
def target32(target, monkeypatch):
    """The target in fp32, counted large enough for spec's executor (its plain Llama layers on packed weights)."""
    import copy

    from spec.cpu import executor, prepack
    monkeypatch.setattr(prepack, "MIN_BYTES", 0)
    model = copy.deepcopy(target).float()
    assert isinstance(executor.executor_for(model), executor.Executor)
    return model


def test_a_target_on_spec_executor_hands_its_layer_inputs_as_its_pass_makes_them(target32, q4_gguf, monkeypatch):
    """Where the target runs on spec's executor, the draft asks for no hidden states (nothing holds every
    layer's states of a prompt at once): its first round proposes nothing, the target's prefill hands each
    layer's input to the draft's cache as it makes it, and from the second round it proposes; the output is
    greedy's, and the draft proposes as well as after its own prefill. A pass of other ids, or one after
    the prompt, takes no watch; a watch dropped is not taken."""
    from spec.cpu import executor
    from spec.gguf_draft import FILL_FROM, GGUFDraft
    ids = [(11 * i + 7) % 640 for i in range(FILL_FROM + 10)]
    own = GGUFDraft(q4_gguf, target32, engine="native", prefill="own")
    taken = GGUFDraft(q4_gguf, target32, engine="native")
    assert not taken.needs and taken.why_own_prefill is None
    layers, filled = [], []
    filler, fill = taken.run.filler, taken.run.fill
    taken.run.fill = lambda *a: pytest.fail("the states came all at once")
    taken.run.filler = lambda got: (filled.append(len(got)), (lambda take: lambda i, x: (layers.append(i), take(i, x)))(
        filler(got)))[1]
    ran = executor.Executor.run
    monkeypatch.setattr(executor.Executor, "run", lambda self, *a, **k: (
        pytest.fail("hidden states asked for") if a[5] else ran(self, *a, **k)))
    out, accepted = _own_then_taken(target32, own, taken, ids)
    assert filled == [len(ids)] and layers == list(range(taken.run.n_layer))
    assert out.trace[0].drafted == 0 and out.trace[1].drafted > 0
    assert accepted[1] >= 0.8 * accepted[0] > 0, accepted
    ex = executor.executor_for(target32)
    seen = []
    cancel = ex.watch(torch.tensor(ids), lambda T: seen.append(T))
    greedy_generate(target32, [1] + ids[1:], max_new_tokens=2)          # other ids: not taken
    assert seen == [] and len(ex._watches) == 1
    cancel()
    greedy_generate(target32, ids, max_new_tokens=2)                     # dropped: not taken
    assert seen == [] and ex._watches == []
    ex.watch(torch.tensor(ids), lambda T: seen.append(T))
    greedy_generate(target32, ids[:40], max_new_tokens=2)                # the first 40: taken, once
    greedy_generate(target32, ids, max_new_tokens=2)
    assert seen == [40] and ex._watches == []
    from spec import hf
    cache = hf.new_cache(target32)
    ex.watch(torch.tensor(ids[10:20]), lambda T: seen.append(T))
    for part in (ids[:10], ids[10:20]):                                   # the same ids after the prompt: not taken
        hf.step(target32, torch.tensor(part), cache, fn=ex)
    assert seen == [40] and len(ex._watches) == 1


def test_a_draft_whose_target_executor_was_refused_prefills_itself(target32, q4_gguf, monkeypatch):
    """A target expected to run on spec's executor whose probe then refuses it hands nothing: the draft
    prefills itself on the first round and proposes."""
    from spec import gguf_draft
    from spec.gguf_draft import FILL_FROM, GGUFDraft
    ids = [(11 * i + 7) % 640 for i in range(FILL_FROM + 10)]
    draft = GGUFDraft(q4_gguf, target32, engine="native")
    monkeypatch.setattr(gguf_draft, "_layer_inputs_from", lambda target: None)
    out = speculative_generate(target32, draft, ids, gamma=4, max_new_tokens=12, trace=True)
    assert out.tokens == greedy_generate(target32, ids, max_new_tokens=12).tokens
    assert out.trace[0].drafted > 0


def test_products_split_over_threads_give_the_same_logits(q4_gguf):
    """threads=2 splits each product's panels over the pool: logits equal one thread's bit for bit, a
    prefill and steps, and the pool's worker did run parts; a bad count is refused by name."""
    ids = PROMPTS[0] + PROMPTS[1]
    one, two = qdraft.QuantRun(q4_gguf, n_ctx=64), qdraft.QuantRun(q4_gguf, n_ctx=64, threads=2)
    before = qdraft.library().spec_pool_worked()
    assert torch.equal(one(torch.tensor(ids[:9]), keep=1), two(torch.tensor(ids[:9]), keep=1))
    for i in range(9, len(ids)):
        assert torch.equal(one(torch.tensor(ids[i:i + 1])), two(torch.tensor(ids[i:i + 1]))), i
    assert qdraft.library().spec_pool_worked() > before
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads: a positive int"):
            qdraft.QuantRun(q4_gguf, n_ctx=64, threads=bad)


def test_greedy_is_exact_and_proposals_are_rejected(target, q4_gguf):
    from spec.gguf_draft import GGUFDraft
    drafter = GGUFDraft(q4_gguf, target, engine="native")
    assert repr(drafter).endswith("native)") and drafter.why_not_native is None
    rejected = 0
    for ids in PROMPTS:
        for gamma in (2, 5):
            out = speculative_generate(target, drafter, ids, gamma=gamma, max_new_tokens=24, trace=True)
            assert out.tokens == greedy_generate(target, ids, max_new_tokens=24).tokens
            rejected += sum(r.accepted < r.drafted for r in out.trace)
            assert len(drafter.run) <= len(ids) + 24
    assert rejected > 0, "no round rejected anything: the cache's cut went untested"


def fresh_greedy(path, prefix: list[int], g: int) -> list[int]:
    """g greedy proposals of a fresh QuantRun fed `prefix` (nothing cached before)."""
    run = qdraft.QuantRun(path, n_ctx=128)
    out, feed = [], torch.tensor(prefix)
    for _ in range(g):
        out.append(int(run(feed, keep=1)[0].argmax()))
        feed = torch.tensor(out[-1:])
    return out


def check_proposals(target, drafter, path, monkeypatch) -> None:
    """Exact against greedy, and every round's proposals equal a fresh run's greedy continuation of that
    round's final prefix: the cache was cut back to what the sequence shares."""
    rounds = []
    inner = drafter.draft

    def draft(seq, n, g):
        chain = inner(seq, n, g)
        rounds.append((seq[:n].tolist(), chain.tokens.tolist()))
        return chain
    monkeypatch.setattr(drafter, "draft", draft)
    for ids in PROMPTS:
        out = speculative_generate(target, drafter, ids, gamma=4, max_new_tokens=24)
        assert out.tokens == greedy_generate(target, ids, max_new_tokens=24).tokens
    for prefix, proposed in rounds:
        assert proposed == fresh_greedy(path, prefix, len(proposed)), f"proposals after {prefix} from another context"


def test_proposals_follow_the_final_sequence(target, q4_gguf, monkeypatch):
    from spec.gguf_draft import GGUFDraft
    check_proposals(target, GGUFDraft(q4_gguf, target, engine="native"), q4_gguf, monkeypatch)


def _crop_one_short(run, keep):
    run.n = min(run.n, keep + 1)


def _crop_nothing(run, keep):
    pass


@pytest.mark.parametrize("fault", [_crop_one_short, _crop_nothing], ids=["crop-keeps-one-stale", "crop-nothing"])
def test_a_cache_not_cut_back_is_caught(target, q4_gguf, monkeypatch, fault):
    """Negative controls: a cache that keeps rejected positions is caught by the check above (stale
    proposals, or nothing left to feed)."""
    from spec.gguf_draft import GGUFDraft
    monkeypatch.setattr(qdraft.QuantRun, "crop", fault)
    drafter = GGUFDraft(q4_gguf, target, engine="native")
    with pytest.raises((AssertionError, ValueError)):
        check_proposals(target, drafter, q4_gguf, monkeypatch)


V, LAW_PROMPT, TEMPERATURE = 16, [1, 2, 3, 1], 0.8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 16-token one-layer Llama target (fp64, a sharp head) and, as a Q4_1 GGUF, the target with 100%
    weight noise (the smallest shape the kernel takes: 32 wide, 16 rows)."""
    pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model = model.double().eval()
    draft = perturbed_copy(model, noise=1.0, seed=5, dtype=torch.float32)
    return model, llamacpp.llama_gguf(draft, tmp_path_factory.mktemp("qgguf") / "small.q4_1.gguf", quantized=True)


def two_token_law(model) -> list[float]:
    def p(ctx):
        with torch.inference_mode():
            return reference_probabilities(model(torch.tensor([ctx])).logits[0, -1], TEMPERATURE)
    first = p(LAW_PROMPT)
    return [float(first[a]) * float(p(LAW_PROMPT + [a])[b]) for a in range(V) for b in range(V)]


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q-not-what-it-drew"])
def test_sampling_follows_the_targets_law(small, broken):
    """The joint law of the first two tokens (gamma 2: acceptance, residual and bonus all take part)
    against the target's exact law, chi-square at 0.001, 1500 draws; a q that is not what the draft drew
    from is rejected."""
    from spec.gguf_draft import GGUFDraft
    model, path = small
    gen = torch.Generator().manual_seed(11)
    drafter = GGUFDraft(path, model, engine="native", pick=Pick(do_sample=True, temperature=TEMPERATURE, generator=gen))
    counts = [0] * V * V
    for _ in range(1500):
        out = speculative_generate(model, SkewedQ(drafter) if broken else drafter, LAW_PROMPT, gamma=2,
                                   max_new_tokens=2, do_sample=True, temperature=TEMPERATURE, generator=gen).tokens
        counts[out[0] * V + out[1]] += 1
    fit = goodness_of_fit("joint law of the first 2 tokens, native Q4_1 draft", {"all": (counts, two_token_law(model))})
    assert fit.rejects(0.001) == broken, str(fit)


def test_what_it_cannot_run_is_refused_by_name(target, tmp_path):
    from spec.gguf_draft import GGUFDraft
    f32 = llamacpp.llama_gguf(perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32), tmp_path / "f32.gguf")
    assert "token_embd.weight is F32" in qdraft.unsupported(f32)
    with pytest.raises(ValueError, match="engine='native': f32.gguf: token_embd.weight is F32"):
        GGUFDraft(f32, target, engine="native")
    with pytest.raises(ValueError, match="engine: one of 'auto', 'native', 'llama.cpp' expected, got 'fast'"):
        GGUFDraft(f32, target, engine="fast")
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    assert "no GGUF magic" in qdraft.unsupported(tmp_path / "not.gguf")


def test_auto_takes_the_kernel_where_it_runs(target, q4_gguf):
    """Where the kernel runs (this test is skipped only on a CPU without it), engine="auto" is the kernel:
    a broken library cannot hide behind llama.cpp."""
    from spec.gguf_draft import GGUFDraft
    d = GGUFDraft(q4_gguf, target)
    assert d.engine_name == "native" and d.why_not_native is None, d.why_not_native


@pytest.mark.parametrize("isa", [0, 2])
def test_each_variant_of_the_forward_is_the_arithmetic(q4_gguf, monkeypatch, isa):
    """The plain-C products (and, at 2, the AVX-512F attention and SiLU around them), forced: the same
    NumPy forward's logits, prefill and steps."""
    if isa > native.isa():
        pytest.skip(f"this CPU runs variant {native.isa()} at most")
    monkeypatch.setenv("SPEC_NATIVE_ISA", str(isa))
    ids = PROMPTS[0] + PROMPTS[1][:3]
    want = reference_logits(q4_gguf, ids)
    run = qdraft.QuantRun(q4_gguf, n_ctx=32)
    assert run.model.isa == isa
    assert_close(run(torch.tensor(ids[:9]), keep=1)[0], want[8], f"variant {isa}, prefill of 9")
    for i in range(9, len(ids)):
        assert_close(run(torch.tensor(ids[i:i + 1]))[0], want[i], f"variant {isa}, position {i}")


def test_without_the_kernel_auto_runs_llama_cpp_and_says_why(target, q4_gguf, monkeypatch):
    if llamacpp.available() is not None:
        pytest.skip(str(llamacpp.available()))
    from spec.gguf_draft import GGUFDraft
    monkeypatch.setenv("SPEC_QDRAFT", "0")
    qdraft.forget()
    try:
        d = GGUFDraft(q4_gguf, target)
        assert repr(d).endswith("llama.cpp)") and "SPEC_QDRAFT=0" in d.why_not_native
        out = speculative_generate(target, d, PROMPTS[1], gamma=3, max_new_tokens=16)
        assert out.tokens == greedy_generate(target, PROMPTS[1], max_new_tokens=16).tokens
    finally:
        monkeypatch.delenv("SPEC_QDRAFT")
        qdraft.forget()
    assert qdraft.library() is not None


@pytest.mark.parametrize("old, new, says", [
    ("s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(xb[g]));", "s0 = _mm512_setzero_si512();",
     "qd_matvec"),
    ("    qmv_c(j->W, j->kind, N, K, j->xq, j->xd, j->xs, j->R, j->y, p0, p1);\n}",
     "    qmv_c(j->W, j->kind, N, K, j->xq, j->xd, j->xs, j->R, j->y, p0, p1);\n    if (j->R == 3) *(volatile int *)0 = 1;\n}",
     "return code"),
    ("    if (!qd_fits(m, n, pos0)) return -1;\n    const int64_t D = m->dim, F",
     "    if (!qd_fits(m, n, pos0)) return -1;\n    if (n == 5) *(volatile int *)0 = 1;\n    const int64_t D = m->dim, F",
     "return code"),
], ids=["vnni-sum-drops-half", "crash", "forward-crash"])
def test_a_broken_kernel_is_caught_by_the_self_test(monkeypatch, tmp_path, old, new, says):
    """The self-test runs the library in a subprocess: a wrong sum or a segfault (in a product or in the
    whole forward) becomes a reason, and library() None (spec.gguf_draft then runs llama.cpp)."""
    nativecheck.plant(monkeypatch, tmp_path, "qdraft.c", old, new)
    try:
        assert qdraft.library() is None
        assert "self-test of" in qdraft.reason() and says in qdraft.reason(), qdraft.reason()
    finally:
        monkeypatch.undo()
        qdraft.forget()
    assert qdraft.library() is not None


class Pieces:
    """A tokenizer stand-in for check_pieces: the tiny GGUF's own tokens ("<i>"), `renamed` spelled otherwise."""

    def __init__(self, n, bos=None, renamed=()):
        self.n, self.bos_token_id, self.eos_token_id, self.renamed = n, bos, None, set(renamed)

    def __len__(self):
        return self.n

    def convert_ids_to_tokens(self, ids):
        return [f"other{i}" if i in self.renamed else f"<{i}>" for i in ids]


def test_a_gguf_of_another_tokenizer_is_refused_without_llama_cpp(target, q4_gguf):
    """The native engine checks the GGUF's own token list against the target's tokenizer, every id."""
    from spec.gguf_draft import GGUFDraft
    GGUFDraft(q4_gguf, target, Pieces(640), engine="native")          # the same pieces: accepted
    with pytest.raises(ValueError, match=r"token 517 is '<517>' in the GGUF but 'other517' in the target's tokenizer "
                                         r"\(1 of 640 ids differ\)"):
        GGUFDraft(q4_gguf, target, Pieces(640, renamed=[517]), engine="native")
    with pytest.raises(ValueError, match="its BOS token is id 0, the target tokenizer's is 3"):
        GGUFDraft(q4_gguf, target, Pieces(640, bos=3), engine="native")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="Linux only")
def test_the_draft_holds_in_memory_only_what_it_has_written(q4_gguf):
    """A QuantRun's caches are resident only where positions were written, a page at a time (numpy asks for
    huge pages for large arrays: 2 MB a layer at the first position), and the GGUF's mapped pages, copied
    into its records, leave the process once it is made."""
    run = qdraft.QuantRun(q4_gguf, n_ctx=1 << 16)
    g = qdraft.read(q4_gguf)
    assert nativecheck.resident(g._map.ctypes.data, g._map.nbytes) < g._map.nbytes / 4
    run(torch.tensor(PROMPTS[0] + PROMPTS[1]), keep=1)
    caches = run.kc.nbytes + run.vc.nbytes
    assert caches > 8 << 20                                   # (large enough for numpy's huge pages)
    held = sum(nativecheck.resident(c.ctypes.data, c.nbytes) for c in (run.kc, run.vc))
    assert 0 < held <= 64 * 4096, f"{held} bytes of {caches} resident after {len(run)} positions"


def test_the_drafts_weights_are_read_at_its_first_use(target, q4_gguf):
    """A GGUFDraft reads no weight when it is made: its records are made at its first generate, after the
    target's probes, which read the target's own weights before they are packed (a draft made first was held
    beside them: SmolLM2's self-draft peaked at 1,083 MB there, against 1,052 after); it then decodes as
    greedy does. A closed run is not made again."""
    from spec.gguf_draft import GGUFDraft
    draft = GGUFDraft(q4_gguf, target, engine="native")
    assert draft.run._model is None and not draft.run._keep and draft.run.kc is None
    out = speculative_generate(target, draft, PROMPTS[0], gamma=4, max_new_tokens=8).tokens
    assert draft.run._model is not None and draft.run._keep
    assert out == greedy_generate(target, PROMPTS[0], max_new_tokens=8).tokens
    draft.close()
    with pytest.raises(RuntimeError, match="closed"):
        draft.run(torch.tensor([1]))


def test_the_header_reader_reads_what_the_gguf_package_reads(q4_gguf, tmp_path):
    """qdraft.GGUF reads the header itself (the gguf package's reader makes an object per token: ~120 MB
    for a 49k-token vocabulary): the package's fields (the merges aside), tensor types, shapes and bytes;
    a file cut inside its header is refused by name."""
    gguf = pytest.importorskip("gguf")
    r, g = gguf.GGUFReader(str(q4_gguf)), qdraft.GGUF(q4_gguf)
    assert g.fields == {k: v.contents() for k, v in r.fields.items()
                        if not k.startswith(("tokenizer.ggml.merges", "GGUF."))}
    assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in g.fields.values())     # (tokens)
    assert len(g.tensors) == len(r.tensors)
    for t in r.tensors:
        assert g.tensors[t.name] == (qdraft.GGUF_TYPES[int(t.tensor_type)], [int(s) for s in t.shape]), t.name
        raw = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8).reshape(1, -1)
        assert np.array_equal(g.data(t.name), raw), t.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(q4_gguf).read_bytes()[:300])
    with pytest.raises(qdraft.Unsupported, match="cut.gguf: its GGUF header cannot be read"):
        qdraft.GGUF(cut)
