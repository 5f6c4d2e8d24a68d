"""spec.runner's parts, pinned one at a time on six tiny fp64 models built once a module.

test_architectures.py checks whole decodes over 78 families; this module checks what they rest
on, where a fault would be named: each runner fed in blocks and cropped as the loop does, against
the model's own cache-free forward, with the tokens each pass feeds counted; the probe's verdict
on each kind of model, its memo, and every refusal word for word; the helpers that size the
probe and compare logits. It is also the test selection of mutmut's run over spec/runner.py
(docs/MUTATION.md), so it stays fast: a few seconds.

Models (tests/correctness/architectures.py): Llama (kv-cache), Mamba2 (state-snapshot: a block
pass continues the state), Mamba (state-stepwise: a block pass on a state drops it), OpenAI-GPT
(recompute: no cache), RoBERTa (kv-cache, positions counted from padding_idx + 1), XLNet (refused:
not causal).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import architectures as archs
import pytest
import torch
from oracles import relative_tolerance

from spec import hf, probe, runner
from spec.positions import counted_pad
from spec.runner import UnsupportedModelError

# How far a runner's logits may stray from the forward's, relative to 1 + the largest logit. The
# models are fp64, but go through fp32 (Llama computes its rotary table in fp32, HF's eager attention
# its softmax): 3e-7 measured (a forward over 6 ids against one over 16), 2.5 fp32 eps; the bound is
# fp32's (oracles.relative_tolerance, 3e-5). The faults caught here move logits by 1e-3 and more.
TOL = relative_tolerance(torch.float32)


def _near(got, want):
    return bool((got - want).abs().max() <= TOL * (1 + want.abs().max()))


def _model(name):
    return archs.BY_NAME[name].build(0)


def _module_model(fixture: str, family: str):
    """A module-scoped fixture named `fixture`: the registry's tiny `family`, built once for this module."""
    return pytest.fixture(scope="module", name=fixture)(lambda: _model(family))


llama, mamba2, mamba, gpt, roberta, xlnet = (_module_model(*names) for names in (
    ("llama", "llama"), ("mamba2", "mamba2"), ("mamba", "mamba"), ("gpt", "openai-gpt"), ("roberta", "roberta"),
    ("xlnet", "xlnet")))


@pytest.fixture
def fed(monkeypatch):
    """Every hf.step call the runners make: (tokens fed, rows kept, use_cache)."""
    calls = []
    real = hf.step

    def spy(model, ids, cache=None, **kwargs):
        calls.append((ids.numel(), kwargs.get("keep", 0), kwargs.get("use_cache", True)))
        return real(model, ids, cache, **kwargs)
    monkeypatch.setattr(hf, "step", spy)
    return calls


def _ids(n, seed=3, pad=None):
    ids = torch.randint(3, archs.VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    if pad is not None:
        ids[n // 2] = pad
    return ids


def _drive(run, ids, full, schedule):
    """Feeds and crops; every pass's rows checked against `full`, every crop's length."""
    for op, at, keep in schedule:
        if op == "crop":
            before = len(run)
            run.crop(at)
            assert len(run) == min(at, before), f"crop({at}) from {before} left {len(run)}"
            continue
        start = len(run)
        got = run(ids[start:at], keep=keep)
        rows = keep or at - start
        assert got.shape == (rows, full.shape[-1]), f"feed {start}..{at - 1} keep={keep}: {tuple(got.shape)}"
        assert _near(got, full[at - rows:at]), f"feed {start}..{at - 1} keep={keep}"
        assert len(run) == at


# The loop's moves and more: blocks, all rows or the last few, crops into the last block, to its
# end (nothing to drop), behind an earlier block, to 0.
SCHEDULE = [("feed", 6, 0), ("feed", 10, 4), ("crop", 8, None), ("feed", 12, 4), ("crop", 12, None),
            ("feed", 14, 1), ("crop", 5, None), ("feed", 9, 0), ("crop", 0, None), ("feed", 1, 0), ("feed", 4, 2),
            ("feed", 16, 3)]


# (fixture, runner class): a model for each runner path
EVERY_PATH = [("llama", runner.KVRunner), ("mamba2", runner.SnapshotRunner), ("mamba", runner.StepwiseSnapshotRunner),
              ("gpt", runner.RecomputeRunner)]


@pytest.mark.parametrize(("name", "cls"), EVERY_PATH)
@torch.inference_mode()
def test_each_runner_fed_in_blocks_and_cropped_matches_the_cache_free_forward(name, cls, request):
    model = request.getfixturevalue(name)
    ids = _ids(16)
    full = hf.authors_forward(model, ids)
    positions = "own" if name.startswith("mamba") else "explicit"
    _drive(cls(model, positions), ids, full, SCHEDULE)


@pytest.mark.parametrize(("name", "cls"), EVERY_PATH)
@torch.inference_mode()
def test_a_runner_returns_every_row_fed_unless_asked_for_fewer(name, cls, request):
    model = request.getfixturevalue(name)
    ids = _ids(9)
    full = hf.authors_forward(model, ids)
    run = cls(model) if name == "llama" else cls(model, "own" if name.startswith("mamba") else "explicit")
    assert _near(run(ids[:4]), full[:4])
    assert _near(run(ids[4:9]), full[4:9])
    assert cls(model).positions == "explicit"          # the default: 0-based, as most models count


@pytest.mark.parametrize("cls", [runner.KVRunner, runner.SnapshotRunner, runner.RecomputeRunner])
@torch.inference_mode()
def test_counted_positions_stay_exact_across_a_pad_and_a_crop(roberta, cls):
    """RoBERTa counts positions from padding_idx + 1 over the whole sequence and gives a pad its
    own; the runner recounts over every id it holds, the ones before a crop included, and passes
    an attention mask (positions that step back at the pad read as a new packed sequence without)."""
    pad = counted_pad(roberta)
    ids = _ids(16, pad=pad)
    full = hf.authors_forward(roberta, ids)
    _drive(cls(roberta, "counted"), ids, full, SCHEDULE + [("crop", 0, None), ("feed", 16, 0)])  # the pad in a first pass
    # 0-based positions are off by padding_idx + 1 everywhere: the check above would see it.
    wrong = runner.KVRunner(roberta, "explicit")
    assert not _near(wrong(ids), full)


@torch.inference_mode()
def test_snapshot_runner_copies_where_the_verify_rows_start_and_refeeds_only_what_a_crop_keeps(mamba2, fed):
    ids = _ids(16)
    full = hf.authors_forward(mamba2, ids)
    run = runner.SnapshotRunner(mamba2, "own")
    # A first pass asking for its last 4 rows: the prompt before them is fed alone (its last row
    # kept), and the state is copied there, where a crop may take the rows back to.
    _drive(run, ids, full, [("feed", 10, 4)])
    assert fed == [(6, 1, True), (4, 4, True)] and run.saved[0] == 6
    fed.clear()
    _drive(run, ids, full, [("crop", 8, None)])          # back to the copy, 6 and 7 re-fed
    assert fed == [(2, 1, True)] and run.saved is None and len(run) == 8
    fed.clear()
    _drive(run, ids, full, [("feed", 12, 4), ("crop", 12, None), ("feed", 14, 0)])   # nothing to drop
    assert fed == [(4, 4, True), (2, 0, True)] and run.saved[0] == 12
    fed.clear()
    _drive(run, ids, full, [("crop", 5, None)])          # behind the copy: from nothing
    assert fed == [(5, 1, True)]
    fed.clear()
    _drive(run, ids, full, [("feed", 9, 0), ("crop", 9, None), ("crop", 20, None), ("feed", 11, 2)])
    assert fed == [(4, 0, True), (2, 2, True)]
    fed.clear()
    _drive(run, ids, full, [("crop", 11, None), ("feed", 14, 3), ("crop", 11, None)])  # to the copy: nothing re-fed
    assert fed == [(3, 3, True)] and len(run) == 11
    fed.clear()
    _drive(run, ids, full, [("feed", 15, 4), ("crop", 13, None), ("crop", 12, None), ("feed", 16, 0)])
    assert fed == [(4, 4, True), (2, 1, True), (12, 1, True), (4, 0, True)]   # two crops in a row: the second from 0
    fresh = runner.SnapshotRunner(mamba2, "own")
    assert len(fresh) == 0 and fresh.saved is None
    fresh.crop(3)                                        # nothing held: nothing to do
    fed.clear()
    _drive(fresh, ids, full, [("feed", 5, 5)])           # all rows asked for: no split
    assert fresh.saved[0] == 0 and fed == [(5, 5, True)]
    fresh = runner.SnapshotRunner(mamba2, "own")
    fed.clear()
    _drive(fresh, ids, full, [("feed", 5, 1)])           # the last row only: the copy goes before it
    assert fresh.saved[0] == 4 and fed == [(4, 1, True), (1, 1, True)]


@torch.inference_mode()
def test_stepwise_runner_feeds_one_token_at_a_time_once_it_holds_a_state(mamba, fed):
    ids = _ids(12)
    full = hf.authors_forward(mamba, ids)
    run = runner.StepwiseSnapshotRunner(mamba, "own")
    _drive(run, ids, full, [("feed", 5, 0)])             # no state yet: one block pass
    assert fed == [(5, 0, True)]
    fed.clear()
    # A crop (nothing to drop) commits: the state is copied at 5, and the crop to 9 re-feeds 5..8.
    _drive(run, ids, full, [("crop", 5, None), ("feed", 8, 0), ("feed", 11, 2), ("crop", 9, None), ("feed", 10, 1)])
    assert fed == [(1, 1, True)] * (3 + 3 + 4 + 1) and run.saved[0] == 9
    fed.clear()
    _drive(run, ids, full, [("crop", 3, None)])          # behind the copy: from nothing, one block
    assert fed == [(3, 1, True)]
    assert runner.SnapshotRunner.stepwise is False and runner.StepwiseSnapshotRunner.stepwise is True


@torch.inference_mode()
def test_recompute_runner_runs_the_whole_sequence_each_pass(gpt, fed):
    ids = _ids(12)
    full = hf.authors_forward(gpt, ids)
    run = runner.RecomputeRunner(gpt, "explicit")
    assert len(run) == 0
    run.crop(4)                                          # nothing held: nothing to do
    _drive(run, ids, full, [("feed", 5, 0), ("feed", 9, 2), ("crop", 7, None), ("feed", 12, 0)])
    assert fed == [(5, 5, False), (9, 2, False), (12, 5, False)]


# --- the probe's verdicts -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [("llama", ("kv-cache", "explicit")),
                                                ("mamba2", ("state-snapshot", "own")),
                                                ("mamba", ("state-stepwise", "own")),
                                                ("gpt", ("recompute", "explicit")),
                                                ("roberta", ("kv-cache", "counted"))])
def test_the_probe_finds_each_models_runner_and_positions(name, expected, request):
    model = request.getfixturevalue(name)
    probe.forget(model)
    assert runner.verdict(model) == expected
    assert runner.probe(model) == expected[0] == runner.path_of(model)


def test_a_verdict_is_memoised_per_model_and_dtype_and_forgotten_on_request(llama, monkeypatch):
    probes = []
    real = runner._probe
    monkeypatch.setattr(runner, "_probe", lambda model: probes.append(model) or real(model))
    probe.forget(llama)
    assert runner.verdict(llama) == ("kv-cache", "explicit") and len(probes) == 1
    assert runner.verdict(llama) == ("kv-cache", "explicit") and len(probes) == 1
    probe.forget(llama)
    probe.forget(llama)                                 # forgetting twice is harmless
    assert runner.verdict(llama) == ("kv-cache", "explicit") and len(probes) == 2
    other = _model("llama")                              # an equal model is another model
    assert runner.verdict(other) == ("kv-cache", "explicit") and len(probes) == 3
    other.to(torch.float32)                              # another dtype: probed again
    assert runner.verdict(other) == ("kv-cache", "explicit") and len(probes) == 4
    assert probe.memo(other, "path")[0] == ("torch.float32", "cpu")
    assert runner.verdict(other) == ("kv-cache", "explicit") and len(probes) == 4
    assert probe.memo(llama, "path") == (("torch.float64", "cpu"), ("kv-cache", "explicit"))


def test_a_refusal_is_memoised_and_raised_again(xlnet, monkeypatch):
    probe.forget(xlnet)
    with pytest.raises(UnsupportedModelError) as first:
        runner.verdict(xlnet)
    assert str(first.value) == ("XLNetLMHeadModel cannot be decoded exactly by spec: its forward is not causal: "
                                "logits of a position change with later tokens")
    assert first.value.runs_uncached is True
    monkeypatch.setattr(runner, "_probe", lambda model: pytest.fail("probed again"))
    with pytest.raises(UnsupportedModelError) as again:
        runner.probe(xlnet)
    assert again.value is first.value
    assert probe.memo(xlnet, "path") == (("torch.float64", "cpu"), first.value)


def test_refusals_word_for_word(llama, monkeypatch):
    prefix = "LlamaForCausalLM cannot be decoded exactly by spec: "

    def refusal():
        probe.forget(llama)
        with pytest.raises(UnsupportedModelError) as info:
            runner.verdict(llama)
        probe.forget(llama)
        return str(info.value), info.value.runs_uncached

    def fails(*args, **kwargs):
        raise RuntimeError("no forward today")
    with monkeypatch.context() as m:
        m.setattr(hf, "authors_forward", fails)
        assert refusal() == (prefix + "its cache-free forward fails (RuntimeError: no forward today)", False)

    real = hf.step

    def strays(model, ids, cache=None, **kwargs):       # every pass spec makes off by 1e-4 of the scale
        logits, cache = real(model, ids, cache, **kwargs)
        return logits + 1e-4 * (1 + logits.abs().max()), cache
    with monkeypatch.context() as m:
        m.setattr(hf, "step", strays)
        m.setattr(hf, "cache_kwarg", lambda model: "cache_params")
        message, uncached = refusal()
    differ = "logits of positions 0..3 differ from the cache-free forward's"
    assert (message, uncached) == (
        prefix + "no way of running it reproduces its own cache-free forward (kv-cache: the forward takes no "
        f"attention cache; state-snapshot: {differ}; state-stepwise: {differ}; recompute: {differ})", True)

    def raises(model, ids, cache=None, **kwargs):
        raise ValueError("x" * 300 + "\nsecond line")

    def raises_nothing_said(model, ids, cache=None, **kwargs):
        raise KeyError()
    with monkeypatch.context() as m:
        m.setattr(hf, "step", raises)
        message, _ = refusal()
    assert message.startswith(prefix + "no way of running it reproduces its own cache-free forward (kv-cache: "
                              "ValueError: " + "x" * 200 + "; state-snapshot: ValueError: ")
    with monkeypatch.context() as m:
        m.setattr(hf, "step", raises_nothing_said)
        message, _ = refusal()
    assert message.endswith("(kv-cache: KeyError: ; state-snapshot: KeyError: ; state-stepwise: KeyError: ; "
                            "recompute: KeyError: )")


def test_the_probe_tolerance_lies_between_rounding_and_the_smallest_fault(llama, monkeypatch):
    """A cached pass off by 1e-4 of the scale is refused above (a Mamba that drops its state is
    off by 3e-4); off by 1e-7 it is rounding (fp64's is ~1e-15, fp32's 3e-7) and passes."""
    real = hf.step

    def strays(model, ids, cache=None, **kwargs):
        logits, cache = real(model, ids, cache, **kwargs)
        return logits + 1e-7 * (1 + logits.abs().max()), cache
    monkeypatch.setattr(hf, "step", strays)
    probe.forget(llama)
    assert runner.verdict(llama) == ("kv-cache", "explicit")
    probe.forget(llama)
    for dtype in (torch.float64, torch.float32):
        assert 3e-7 < probe.PROBE_TOLERANCE[dtype] < 1e-4
    assert probe.PROBE_TOLERANCE[torch.bfloat16] > 1e-2 and probe.PROBE_TOLERANCE[torch.float16] > 2e-3


def test_a_sparse_attention_model_is_refused_before_any_forward(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "index_topk", 16, raising=False)
    monkeypatch.setattr(hf, "authors_forward", lambda *a: pytest.fail("the model was run"))
    probe.forget(llama)
    try:
        with pytest.raises(UnsupportedModelError) as info:
            runner.verdict(llama)
    finally:
        probe.forget(llama)
    assert str(info.value) == (
        "LlamaForCausalLM cannot be decoded exactly by spec: its attention selects keys per pass (index_topk=16): "
        "a verify pass may select other keys than one-token steps once the sequence passes 16, so the output is "
        "not guaranteed to be greedy's")
    assert info.value.runs_uncached is True


def test_a_model_with_several_heads_or_none_is_refused_before_any_forward(llama, monkeypatch):
    monkeypatch.setattr(hf, "authors_forward", lambda *a: pytest.fail("the model was run"))
    heads = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)])
    for head, why in [(heads, "its LM head is 3 heads (one per codebook, as in MusicGen): spec decodes a single "
                              "stream of tokens"),
                      (None, "it has no single LM head (get_output_embeddings() gives no [vocab, hidden] weight)")]:
        monkeypatch.setattr(llama, "get_output_embeddings", lambda head=head: head)
        probe.forget(llama)
        try:
            with pytest.raises(UnsupportedModelError) as info:
                runner.verdict(llama)
        finally:
            probe.forget(llama)
        assert str(info.value) == "LlamaForCausalLM cannot be decoded exactly by spec: " + why
        assert info.value.runs_uncached is False


def test_unsupported_head_on_its_own():
    linear = torch.nn.Linear(4, 8)
    assert runner.unsupported_head(NS(get_output_embeddings=lambda: linear)) is None
    no_head = "it has no single LM head (get_output_embeddings() gives no [vocab, hidden] weight)"
    assert runner.unsupported_head(NS()) == no_head                      # no get_output_embeddings at all
    assert runner.unsupported_head(NS(get_output_embeddings=lambda: NS(weight=torch.zeros(8)))) == no_head
    assert runner.unsupported_head(NS(get_output_embeddings=lambda: NS(weight=None))) == no_head
    assert runner.unsupported_head(NS(get_output_embeddings=lambda: NS(weight=[[1.0]]))) == no_head   # no ndim


def test_unembeddable_head():
    def model(head_rows, emb):
        return NS(get_output_embeddings=lambda: torch.nn.Linear(4, head_rows), get_input_embeddings=lambda: emb)
    assert runner.unembeddable_head(model(300, torch.nn.Embedding(256, 4))) == (
        "its LM head scores 300 ids but its input embedding has 256 rows: a token it emits could not be fed back to it")
    assert runner.unembeddable_head(model(256, torch.nn.Embedding(256, 4))) is None
    assert runner.unembeddable_head(model(200, torch.nn.Embedding(256, 4))) is None     # a narrower head is fine
    assert runner.unembeddable_head(model(300, NS(num_embeddings=None))) is None        # rows unknown: not judged
    assert runner.unembeddable_head(NS(get_output_embeddings=lambda: torch.nn.Linear(4, 300))) is None


def test_path_of_names_what_is_not_a_hugging_face_model(llama):
    assert runner.path_of(object()) == "custom"
    assert runner.path_of(torch.nn.Linear(2, 2)) == "custom"
    assert runner.path_of(llama) == "kv-cache"
    assert UnsupportedModelError("why").runs_uncached is False and str(UnsupportedModelError("why")) == "why"
    assert isinstance(UnsupportedModelError("why"), ValueError)
    assert set(runner.RUNNERS) == {"kv-cache", "state-snapshot", "state-stepwise", "recompute"}
    assert list(runner.RUNNERS)[0] == "kv-cache" and list(runner.RUNNERS)[-1] == "recompute"  # cheapest first


# --- what sizes the probe and compares its logits ------------------------------------------


class _TextConfig(NS):
    """A multimodal config: its decoder's text config is another object (only with decoder=True)."""

    def get_text_config(self, decoder=False):
        return self.text if decoder else self


def _with(**fields):
    return NS(config=NS(**fields))


@pytest.mark.parametrize(("fields", "length"), [
    ({}, 12),                                                   # no window: 12
    ({"sliding_window": 8}, 14),                                # past the window by 6
    ({"sliding_window": 58}, 64),                               # PROBE_MAX exactly
    ({"sliding_window": 59}, 12),                               # beyond PROBE_MAX: 12 (the window is never crossed)
    ({"sliding_window": 4, "attention_window_size": 20}, 26),   # the widest reach
    ({"SLIDING_WINDOW": 30}, 36),                               # field names of any case
    ({"sliding_window": 0, "use_sliding_window": True, "window": "8", "other_window": -3}, 12),  # not reaches
    ({"num_experts_topk": 40, "moe_topk": 40, "topk_group": 40, "norm_topk_prob": 40, "n_group_topk": 40},
     12),                                                       # expert routing
    ({"index_topk": 20}, 26),                                   # a sparse-attention key budget
    ({"sliding_window": 20, "max_position_embeddings": 16}, 16),  # never past the model's positions
    ({"sliding_window": 20, "n_positions": 10}, 10),
    ({"sliding_window": 20, "max_position_embeddings": None, "n_positions": 10}, 10),
    ({"sliding_window": 20, "max_position_embeddings": 3}, 26),   # a limit under 4 is not taken
    ({"sliding_window": 20, "max_position_embeddings": 4}, 4),
    ({"max_position_embeddings": 20.0}, 12),                      # nor one that is not an int
])
def test_probe_length(fields, length):
    assert probe.probe_length(_with(**fields)) == length


def test_probe_length_and_reach_read_the_decoders_text_config():
    config = _TextConfig(sliding_window=50, text=NS(sliding_window=8, index_topk=10))
    assert probe.probe_length(NS(config=config)) == 16
    assert "(index_topk=10)" in runner.unprobed_reach(NS(config=config))
    assert runner.unprobed_reach(NS(config=_TextConfig(index_topk=10, text=NS()))) is None


def test_unprobed_reach_names_the_first_key_budget():
    assert runner.unprobed_reach(_with(sliding_window=8)) is None
    assert runner.unprobed_reach(_with(moe_topk=2, num_experts_per_tok=2)) is None
    assert runner.unprobed_reach(_with(index_topk=0)) is None                     # 0: no budget, not sparse
    assert "(index_topk=1)" in runner.unprobed_reach(_with(index_topk=1))
    assert runner.unprobed_reach(_with(sliding_window=8, Index_TopK=7, other_topk=9)) == (
        "its attention selects keys per pass (Index_TopK=7): a verify pass may select other keys than one-token "
        "steps once the sequence passes 7, so the output is not guaranteed to be greedy's")


def test_probe_ids_are_seeded_and_put_a_pad_mid_sequence_for_counted_positions(llama, roberta):
    ids = probe.ids(llama, 14, "cpu")
    assert ids.dtype == torch.long and ids.shape == (14,) and torch.equal(ids, probe.ids(llama, 14, "cpu"))
    assert int(ids.min()) >= 0 and int(ids.max()) < archs.VOCAB and len(set(ids.tolist())) > 7
    counted = probe.ids(roberta, 14, "cpu")
    pad = counted_pad(roberta)
    assert pad is not None and int(counted[7]) == pad and (counted == pad).sum() >= 1
    assert torch.equal(counted[:7], torch.randint(0, archs.VOCAB, (14,),
                                                  generator=torch.Generator().manual_seed(1234))[:7])
    assert torch.equal(ids, torch.randint(0, archs.VOCAB, (14,), generator=torch.Generator().manual_seed(1234)))


def test_a_pad_outside_the_vocabulary_is_not_placed(roberta, monkeypatch):
    plain = torch.randint(0, archs.VOCAB, (12,), generator=torch.Generator().manual_seed(1234))
    for pad in (archs.VOCAB, -1, archs.VOCAB - 1):
        monkeypatch.setattr(probe, "counted_pad", lambda model, pad=pad: pad)
        expected = plain.clone()
        if pad == archs.VOCAB - 1:
            expected[6] = pad                           # the last id the model embeds is placed
        assert torch.equal(probe.ids(roberta, 12, "cpu"), expected)


def test_close():
    t = torch.tensor
    inf = float("inf")
    assert probe.close(t([[1.0, 3.0]]), t([[1.0, 3.0]]), 0.0)
    assert not probe.close(t([[1.0, 3.0]]), t([1.0, 3.0]), 0.5)                    # another shape
    assert probe.close(t([[1.0, 5.0]]), t([[1.0, 3.0]]), 0.5)      # |5 - 3| = 2 = 0.5 * (1 + 3): at the bound
    assert not probe.close(t([[1.0, 5.5]]), t([[1.0, 3.0]]), 0.5)
    assert probe.close(t([[1.0, 3.0]]), t([[1.0, 5.5]]), 0.4)       # the scale is b's (the reference's)
    assert not probe.close(t([[1.0, 5.5]]), t([[1.0, 3.0]]), 0.4)
    assert probe.close(t([[-inf, 2.0]]), t([[-inf, 2.0]]), 0.0)                      # equal infinities agree
    assert not probe.close(t([[0.0, 2.0]]), t([[-inf, 2.0]]), 0.5)                  # a masked logit is not small
    assert probe.close(t([[-inf, inf]]), t([[-inf, inf]]), 0.0)                     # nothing finite: scale 0
    assert not probe.close(t([[-inf, 0.0]]), t([[-inf, inf]]), 0.5)
    assert probe.close(t([[0.25]]), t([[-4.0]]), 1.0)                               # the scale is |b|'s largest
    assert not probe.close(t([[0.25]]), t([[-4.0]]), 0.8)
    assert probe.close(t([[0.1, 0.0]], dtype=torch.float32), t([[0.1, 0.0]], dtype=torch.float64), 1e-7)


class _Replayer:
    """A runner that returns the reference's rows (off by `error` once `broken` crops were made),
    and records what it was asked."""

    def __init__(self, full, broken=None, error=1.0):
        self.full, self.len, self.crops, self.broken, self.error, self.asked = full, 0, 0, broken, error, []

    def __call__(self, ids, keep=0):
        start, self.len = self.len, self.len + ids.numel()
        self.asked.append((start, self.len, keep))
        off = self.error if self.broken is not None and self.crops >= self.broken else 0.0
        return self.full[self.len - keep:self.len] + off

    def crop(self, keep):
        self.crops += 1
        self.len = min(self.len, keep)

    def __len__(self):
        return self.len


def test_replay_feeds_and_crops_like_the_loop_and_names_the_first_disagreement():
    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.arange(12)
    good = _Replayer(full)
    assert runner._replay(good, ids, full, 1e-9) is None
    # blocks of a third, crops into the last block (one, three and four positions back), re-feeds
    assert good.asked == [(0, 4, 4), (4, 8, 4), (5, 10, 5), (9, 11, 2), (11, 12, 1), (8, 12, 4)]
    assert runner._replay(_Replayer(full, broken=1), ids, full, 1e-9) == \
        "logits of positions 5..9 differ from the cache-free forward's"
    assert runner._replay(_Replayer(full, broken=3), ids, full, 1e-9) == \
        "logits of positions 8..11 differ from the cache-free forward's"
    assert runner._replay(_Replayer(full, broken=0, error=1e-12), ids, full, 1e-9) is None   # within tolerance


def test_causal_check(llama, xlnet):
    for model, verdict in ((llama, None), (xlnet, "its forward is not causal: logits of a position change with "
                                                  "later tokens")):
        ids = _ids(12)
        with torch.inference_mode():
            assert runner.causal_check(model, ids, hf.authors_forward(model, ids), 1e-9) == verdict


class _PeeksAhead(torch.nn.Module):
    """A forward whose logits at position i read token i + `ahead`: not causal, by `ahead` tokens."""

    def __init__(self, ahead):
        super().__init__()
        self.ahead, self.emb = ahead, torch.nn.Embedding(archs.VOCAB, 4)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, attention_mask=None):
        ids = input_ids[0]
        seen = torch.cat([ids[self.ahead:], ids[-1:].repeat(self.ahead)])
        return NS(logits=torch.nn.functional.one_hot(seen, archs.VOCAB).double()[None])


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_causal_check_sees_a_forward_that_reads_a_few_tokens_ahead(ahead):
    model = _PeeksAhead(ahead)
    ids = torch.arange(10, 22)
    assert runner.causal_check(model, ids, hf.authors_forward(model, ids), 1e-9) is not None
    for last in (archs.VOCAB - 1, 0):                    # changed to 0 (wrapping around the vocabulary), from 0
        ids = torch.cat([torch.arange(10, 19), torch.full((3,), last)])
        assert runner.causal_check(model, ids, hf.authors_forward(model, ids), 1e-9) is not None


def test_a_dtype_the_table_lacks_gets_the_loosest_tolerance(llama, monkeypatch):
    """5e-2 of the scale, as bf16: off by 1e-2 passes, off by 1e-1 is refused."""
    monkeypatch.setattr(probe, "PROBE_TOLERANCE", {})
    real = hf.step
    for off, accepted in ((1e-2, True), (1e-1, False)):
        def strays(model, ids, cache=None, off=off, **kwargs):
            logits, cache = real(model, ids, cache, **kwargs)
            return logits + off * (1 + logits.abs().max()), cache
        monkeypatch.setattr(hf, "step", strays)
        probe.forget(llama)
        try:
            if accepted:
                assert runner.verdict(llama)[0] == "kv-cache"
            else:
                with pytest.raises(UnsupportedModelError, match="no way of running it reproduces"):
                    runner.verdict(llama)
        finally:
            probe.forget(llama)
