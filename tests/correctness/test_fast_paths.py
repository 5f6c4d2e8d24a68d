"""spec's own fast paths against Hugging Face's forward on the same inputs, at the edges the
decode-loop tests do not reach: the plain-tensor draft (spec.neox) over long sequences (past
256 positions) with rollbacks deep into its buffer, and the adapter (spec.hf): cropping
dynamic and static caches, partial logits, the widened assistant, HF's greedy reference with
one EOS id or a list."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_logits_close

from spec import build_gpt_neox, greedy_generate, hf, hfref, neox

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=512)


def with_random_biases_and_norms(model, seed: int = 0):
    """HF initialises every bias to 0 and every LayerNorm to (1, 0): a fast path that dropped one
    would still match. A trained model has none of that; give each 1-D parameter random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2).to(p.dtype))
    return model


def full_forward_logits(model, ids) -> torch.Tensor:
    """HF's forward over the whole sequence, no cache: the logits of its last position."""
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0, -1].double()


def ids_of(n: int, salt: int = 0) -> list[int]:
    return [(i * 97 + salt * 31 + 5) % 512 for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_plain_draft_past_256_positions_with_deep_rollbacks(dtype):
    """Prefill 150, step one token at a time to 300, roll back to 40 (deep into the buffer),
    re-feed a block, cross 256 again in blocks of 2 and 5, roll back exactly to 255 and 256.
    Every step's logits are held to HF's uncached forward over the whole sequence."""
    model = with_random_biases_and_norms(build_gpt_neox(SMALL, seed=4, dtype=dtype))
    plain = neox.NeoXDraft(model, 400)
    seq = ids_of(330)
    checks = 0

    def check(n):
        nonlocal checks
        want = full_forward_logits(model, seq[:n])
        got = plain_logits.double()
        assert_logits_close(got, want, dtype, f"{dtype} at {n} positions")
        if dtype == torch.float64:
            assert int(got.argmax()) == int(want.argmax())
        assert len(plain) == n
        checks += 1

    plain_logits = plain(torch.tensor(seq[:150]))[-1]
    check(150)
    for n in range(151, 301):
        plain_logits = plain(torch.tensor(seq[n - 1:n]))[-1]
        if n % 10 == 0 or 254 <= n <= 258:
            check(n)
    plain.crop(40)
    assert len(plain) == 40
    plain_logits = plain(torch.tensor(seq[40:43]))[-1]
    check(43)
    seq[43:60] = ids_of(17, salt=3)  # after a rollback the sequence continues differently
    n = 43
    for width in (2, 5, 1) * 3:
        plain_logits = plain(torch.tensor(seq[n:n + width]))[-1]
        n += width
        check(n)
    plain_logits = plain(torch.tensor(seq[n:250]))[-1]
    check(250)
    for n in range(252, 263, 2):
        plain_logits = plain(torch.tensor(seq[n - 2:n]))[-1]
        check(n)
    for keep in (256, 255):
        plain.crop(keep)
        plain_logits = plain(torch.tensor(seq[keep:keep + 1]))[-1]
        check(keep + 1)
        plain_logits = plain(torch.tensor(seq[keep + 1:keep + 4]))[-1]
        check(keep + 4)
    assert checks > 40


@pytest.mark.parametrize("overrides", [dict(use_parallel_residual=False), dict(rotary_pct=1.0),
                                       dict(hidden_act="gelu_new"), dict(attention_bias=False)],
                         ids=["sequential", "full-rotary", "tanh-gelu", "no-attention-bias"])
def test_plain_draft_variants_with_trained_like_parameters(overrides):
    """Every variant supports() accepts, with non-zero biases and norms, against HF's forward."""
    model = with_random_biases_and_norms(build_gpt_neox(SMALL, seed=5, dtype=torch.float64, **overrides), seed=1)
    plain = neox.NeoXDraft(model, 64)
    seq = ids_of(40, salt=2)
    got = plain(torch.tensor(seq[:30]))[-1].double()
    assert_logits_close(got, full_forward_logits(model, seq[:30]))
    for n in (32, 33, 38):
        got = plain(torch.tensor(seq[len(plain):n]))[-1].double()
        assert_logits_close(got, full_forward_logits(model, seq[:n]), what=f"{n} positions")


def test_plain_draft_crop_past_its_length_changes_nothing():
    model = build_gpt_neox(SMALL, seed=4, dtype=torch.float64)
    plain = neox.NeoXDraft(model, 32)
    assert plain(torch.tensor([1, 2, 3, 4]), keep=1).shape == (1, 512)   # the last position, as asked
    plain.crop(10)
    assert len(plain) == 4
    got = plain(torch.tensor([5]))[-1].double()
    assert_logits_close(got, full_forward_logits(model, [1, 2, 3, 4, 5]))


def test_plain_draft_keep_means_what_every_runner_means():
    """keep: the last `keep` rows fed; 0 (the default, as for every Runner): all of them."""
    model = build_gpt_neox(SMALL, seed=4, dtype=torch.float64)
    ids = torch.tensor([1, 2, 3, 4, 5])
    full = neox.NeoXDraft(model, 16)(ids)
    assert full.shape == (5, hf.logit_width(model))
    with torch.no_grad():
        assert_logits_close(full, model(ids[None]).logits[0])   # HF's own forward
    for keep in (1, 3, 5):
        plain = neox.NeoXDraft(model, 16)
        got = plain(ids, keep=keep)
        assert got.shape == (keep, hf.logit_width(model)) and len(plain) == 5
        assert_logits_close(got, full[-keep:])  # other row counts round otherwise


def test_plain_draft_fills_its_buffer_exactly():
    model = build_gpt_neox(SMALL, seed=4, dtype=torch.float64)
    plain = neox.NeoXDraft(model, 6)
    plain(torch.tensor([1, 2, 3, 4, 5]))
    got = plain(torch.tensor([6]))[-1].double()   # position 6 of 6: fits
    assert len(plain) == 6
    assert_logits_close(got, full_forward_logits(model, [1, 2, 3, 4, 5, 6]))


@pytest.mark.parametrize("overrides,supported", [
    (dict(), True), (dict(hidden_act="gelu_new"), True), (dict(hidden_act="relu"), False),
    (dict(hidden_act="gelu_fast"), False), (dict(rope_parameters=dict(rope_type="linear", factor=2.0)), False)])
def test_supports_exactly_what_it_implements(overrides, supported):
    model = build_gpt_neox(SMALL, seed=4, **overrides)
    assert neox.supports(model) is supported
    if not supported:
        with pytest.raises(ValueError, match="draft: plain-tensor step needs a GPT-NeoX model, got GPTNeoXForCausalLM"):
            neox.NeoXDraft(model, 8)


def test_supports_refuses_other_families():
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    assert neox.supports(llama) is False


# --- spec.hf: the adapter ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small64():
    return build_gpt_neox(SMALL, seed=4, dtype=torch.float64)


def test_crop_dynamic_cache(small64):
    cache = hf.new_cache(small64)
    hf.forward(small64, torch.tensor(ids_of(10)), cache)
    assert hf.cache_len(cache) == 10
    hf.crop(cache, 12)                      # past the end: nothing to drop, and no error
    assert hf.cache_len(cache) == 10
    hf.crop(cache, 10)
    assert hf.cache_len(cache) == 10
    hf.crop(cache, 7)
    assert hf.cache_len(cache) == 7
    seq = ids_of(10)[:7] + [400]
    got = hf.forward(small64, torch.tensor([400]), cache, keep=1)[-1]
    assert_logits_close(got, full_forward_logits(small64, seq))
    hf.crop(cache, 0)
    assert hf.cache_len(cache) == 0


def test_forward_keep_returns_the_last_rows(small64):
    ids = torch.tensor(ids_of(9))
    with torch.no_grad():
        full = small64(ids[None]).logits[0]
    assert_logits_close(hf.forward(small64, ids, hf.new_cache(small64), keep=0), full)
    last3 = hf.forward(small64, ids, hf.new_cache(small64), keep=3)
    assert last3.shape == (3, 512)
    assert_logits_close(last3, full[-3:])


def test_static_cache_crop_and_refeed(small64):
    """The compiled draft's cache, without the compile: crop moves the write position back,
    and the positions fed after it see only what was kept."""
    run = hf.Cached(small64)
    run.cache = hf.new_static_cache(small64, 64)
    seq = ids_of(20)
    run(torch.tensor(seq[:12]))
    assert len(run) == 12
    run.crop(15)
    assert len(run) == 12
    run.crop(5)
    assert len(run) == 5
    seq[5:8] = [11, 22, 33]
    got = run(torch.tensor(seq[5:8]), keep=1)[-1]
    assert len(run) == 8
    assert_logits_close(got, full_forward_logits(small64, seq[:8]))
    got = run(torch.tensor(seq[8:9]))[-1]
    assert_logits_close(got, full_forward_logits(small64, seq[:9]))


def test_cached_static_len_rounds_to_a_power_of_two(small64, monkeypatch):
    monkeypatch.setattr(hf, "compile_step", lambda model: "compiled")
    monkeypatch.delitem(hf.COMPILED_STEPS, small64, raising=False)
    for asked, size in ((10, 256), (256, 256), (257, 512), (600, 1024)):
        run = hf.Cached(small64, static_len=asked)
        assert run.cache.layers[0].max_cache_len == size and run.step == "compiled"
    monkeypatch.delitem(hf.COMPILED_STEPS, small64, raising=False)


def test_cache_keyword_follows_the_forward_signature():
    class New:
        def forward(self, input_ids=None, cache=None): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None): ...

    class Mamba517:
        def forward(self, input_ids=None, cache_params=None): ...

    class NoCache:
        def forward(self, input_ids=None, position_ids=None): ...

    assert hf.cache_kwarg(New()) == "cache" and hf.cache_kwarg(Old()) == "past_key_values"
    assert hf.cache_kwarg(Mamba517()) == "cache_params" and hf.cache_kwarg(NoCache()) is None


def test_widths(target, random_draft):
    assert (hf.vocab_rows(target), hf.logit_width(target)) == (640, 640)
    assert (hf.vocab_rows(random_draft), hf.logit_width(random_draft)) == (512, 512)


def test_assistant_for_widens_a_copy_with_zero_rows(target, random_draft):
    assert hfref.assistant_for(target, target) is target
    before = random_draft.get_output_embeddings().weight.clone()
    wide = hfref.assistant_for(target, random_draft)
    assert wide is not random_draft
    assert (hf.logit_width(wide), hf.vocab_rows(wide)) == (640, 640)
    assert torch.equal(wide.get_output_embeddings().weight[:512], before)
    assert torch.count_nonzero(wide.get_output_embeddings().weight[512:]) == 0
    assert torch.count_nonzero(wide.get_input_embeddings().weight[512:]) == 0
    assert torch.equal(random_draft.get_output_embeddings().weight, before) and hf.logit_width(random_draft) == 512
    with pytest.raises(ValueError, match="draft: logit width 640 exceeds the target's 512"):
        hfref.assistant_for(random_draft, target)


PROMPT = [3, 141, 59, 26]


def test_hf_greedy_with_no_eos_and_one_eos(target):
    free = hfref.hf_greedy(target, torch.tensor(PROMPT), 24)
    assert free == greedy_generate(target, PROMPT, max_new_tokens=24).tokens and len(free) == 24
    a = free[9]
    assert hfref.hf_greedy(target, torch.tensor([PROMPT]), 24, eos_token_id=a) == free[:free.index(a) + 1]
    assert hfref.hf_greedy(target, torch.tensor(PROMPT), 24, eos_token_id=999) == free


def test_hf_greedy_with_an_eos_list(target):
    free = hfref.hf_greedy(target, torch.tensor(PROMPT), 24)
    a, b = free[9], free[15]
    both = hfref.hf_greedy(target, torch.tensor(PROMPT), 24, eos_token_id=[b, a])
    assert both == free[:min(free.index(a), free.index(b)) + 1]


def test_greedy_config_means_no_eos_when_none(target):
    cfg = hfref._greedy_config(7, None)
    assert (cfg.do_sample, cfg.max_new_tokens, cfg.eos_token_id, cfg.num_beams, cfg.pad_token_id) == \
        (False, 7, None, 1, 0)
    cfg = hfref._greedy_config(3, 5)
    assert cfg.eos_token_id == 5 and cfg.pad_token_id == 5
    cfg = hfref._greedy_config(3, [9, 4])  # a list: its first id pads
    assert cfg.eos_token_id == [9, 4] and cfg.pad_token_id == 9


def test_hf_assisted_sets_gamma_for_the_call_and_matches_greedy(target, partial_draft, monkeypatch):
    """HF reads gamma from the assistant's generation_config: set there while generate() runs,
    put back after it (hfref.hf_generate)."""
    free = greedy_generate(target, PROMPT, max_new_tokens=20).tokens
    assistant = hfref.assistant_for(target, partial_draft)
    before, seen, generate = assistant.generation_config.to_dict(), [], target.generate

    def watched(*args, **kwargs):
        gc = kwargs["assistant_model"].generation_config
        seen.append((gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold))
        return generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", watched)
    out = hfref.hf_assisted(target, assistant, torch.tensor(PROMPT), gamma=3, max_new_tokens=20)
    assert seen == [(3, "constant", 0.0)] and assistant.generation_config.to_dict() == before
    assert out == free
    stop = free[12]
    assert hfref.hf_assisted(target, assistant, torch.tensor(PROMPT), gamma=2, max_new_tokens=20,
                          eos_token_id=stop) == free[:free.index(stop) + 1]


def test_draft_runner_picks_the_runner_each_impl_names(monkeypatch, partial_draft, draft_run):
    """auto: the plain-tensor path for a GPT-NeoX draft it supports, else the probed HF path;
    compiled: a static cache of at least 256 positions (a power of two) and the compiled step."""
    from spec import neox, runner
    draft_runner = draft_run
    assert isinstance(draft_runner(partial_draft, 40), neox.NeoXDraft)
    assert isinstance(draft_runner(partial_draft, 40, "plain"), neox.NeoXDraft)
    assert isinstance(draft_runner(partial_draft, 40, "hf"), runner.KVRunner)
    monkeypatch.setattr(neox, "supports", lambda model: False)
    assert isinstance(draft_runner(partial_draft, 40, "auto"), runner.KVRunner)
    monkeypatch.setattr(hf, "compile_step", lambda model: "compiled step")
    monkeypatch.delitem(hf.COMPILED_STEPS, partial_draft, raising=False)
    run = draft_runner(partial_draft, 300, "compiled")
    assert type(run) is hf.Cached and run.step == "compiled step" and run.cache.get_max_length() == 512
    monkeypatch.delitem(hf.COMPILED_STEPS, partial_draft)
    with pytest.raises(ValueError) as info:
        draft_runner(partial_draft, 40, "fast")
    assert str(info.value) == "draft_impl must be one of 'auto', 'plain', 'hf', 'compiled', got 'fast'"


def test_cached_returns_the_last_row_and_runs_the_compiled_step_once_a_model(monkeypatch, partial_draft):
    """hf.Cached: every row by default (keep=0, as for every Runner); with static_len, every pass goes through the compiled step,
    which is compiled once a model and kept (weakly keyed, not on the model)."""
    compiled = []

    def fake_compile(model):
        calls = []
        compiled.append(calls)
        return lambda **kwargs: calls.append(kwargs["input_ids"].shape[-1]) or model.forward(**kwargs)
    monkeypatch.setattr(hf, "compile_step", fake_compile)
    monkeypatch.delitem(hf.COMPILED_STEPS, partial_draft, raising=False)
    ids = torch.tensor([3, 141, 59, 26, 5])
    eager = hf.Cached(partial_draft)
    assert eager(ids).shape == (5, hf.logit_width(partial_draft)) and compiled == []
    run, ref = hf.Cached(partial_draft, static_len=16), hf.Cached(partial_draft)
    assert_logits_close(run(ids[:4]), ref(ids[:4]))      # a prefill runs eagerly
    assert_logits_close(run(ids[4:]), ref(ids[4:]))      # a one-token step, compiled
    again = hf.Cached(partial_draft, static_len=16)
    again(ids[:4]), again(ids[4:])
    assert compiled == [[1, 1]]   # compiled once, used by both runners, for one-token steps only
    monkeypatch.delitem(hf.COMPILED_STEPS, partial_draft)
