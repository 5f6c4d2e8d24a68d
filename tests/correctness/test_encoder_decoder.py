"""Encoder-decoder targets are exact: T5, BART, Whisper, Marian, Pegasus, mBART, M2M100, BlenderbotSmall.

The same properties as the decoder-only suite, over tiny seeded fp64 models of each family
(seq2seq_models.py): greedy_generate equals a cache-free reference (the full decoder over the
whole decoder sequence at every step, the model's own encoder output) and HF generate;
speculative_generate equals it; every round's drafted / accepted / emitted counts equal
Algorithm 1 replayed without caches, with the draft reading ITS OWN encoder output (or the
target's, with share_encoder=True); the caches hold exactly the final tokens after each round.

The replay is what catches a decoder cache that is not rolled back, and a draft fed the wrong
encoder output: the target decides every token, so the output stays exact, but the draft's
proposals, hence the accepted counts, change.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace as NS

import pytest
import torch
import transformers as T
from hypothesis import given, settings
from hypothesis import strategies as st
from seq2seq_models import (CORE, FAMILIES, VOCAB, build, cache_free_greedy, decoder_start, distil_whisper_draft,
                            draft_for, encoder_inputs, encoder_output, hf_generate, token_mask)

from oracles import replay_rounds as replay

from spec import greedy_generate, speculative_generate
from spec.diagnose import diagnose
from spec.runner import UnsupportedModelError
from spec.seq2seq import decoder_prompt, encode, prepare, refuse_inputs

# A sixth of the profile's examples per family (ci: 6, thorough: 333): eight families share the budget.
EXAMPLES = settings(max_examples=max(4, settings().max_examples // 6))


def encoder_token_ids():
    """Encoder inputs for text families: 1 to 24 ids, special ids (0-2) included."""
    return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)


def feature_seeds():
    """Whisper: seeds for the log-mel features drawn by encoder_inputs."""
    return st.integers(0, 2**16)


def _inputs(family, tokens, seed):
    return encoder_inputs(family, tokens, seed)


def _eos(data, free: list[int], use_eos: bool):
    return free[data.draw(st.integers(0, len(free) - 1), label="eos position")] if use_eos and free else None


def replay_rounds(target, draft, draft_encoder_out, prompt, expected, gamma, max_new_tokens):
    """Algorithm 1 without caches: per round (drafted, accepted, emitted). The draft's proposals
    are its cache-free greedy continuation over `draft_encoder_out`, under the target's token
    masks (spec applies the target's to both); `expected` is the target's greedy output."""
    mask = token_mask(target, len(prompt), max_new_tokens)
    return replay(expected, gamma, max_new_tokens,
                  lambda n, g: cache_free_greedy(draft, draft_encoder_out, prompt + expected[:n], g, mask=mask))


def check_trace(run, prompt_len: int):
    """After each round's rollback the target's cache holds all final tokens but the newest, the
    draft's at most that and at least one fewer (it lags by one after a fully accepted round)."""
    n = prompt_len
    for i, r in enumerate(run.trace):
        n += r.emitted
        assert r.target_cache == n - 1, f"round {i}: target decoder cache {r.target_cache}, sequence {n}"
        assert r.draft_cache <= n - 1, f"round {i}: draft decoder cache {r.draft_cache} holds rejected tokens"
        if r.drafted:
            assert r.draft_cache >= n - 2, f"round {i}: draft decoder cache {r.draft_cache} lags sequence {n}"


@pytest.mark.parametrize("family", list(FAMILIES))
@EXAMPLES
@given(tokens=encoder_token_ids(), seed=feature_seeds(), max_new_tokens=st.integers(1, 24), use_eos=st.booleans(),
       data=st.data())
def test_greedy_equals_cache_free_reference_and_hf_generate(family, tokens, seed, max_new_tokens, use_eos, data):
    model = build(family)
    inputs = _inputs(family, tokens, seed)
    prompt = decoder_start(model, family)
    mask = token_mask(model, len(prompt), max_new_tokens)
    free = cache_free_greedy(model, encoder_output(model, inputs), prompt, max_new_tokens, mask=mask)
    eos = _eos(data, free, use_eos)
    reference = cache_free_greedy(model, encoder_output(model, inputs), prompt, max_new_tokens, eos, mask=mask)
    ours = greedy_generate(model, max_new_tokens=max_new_tokens, eos_token_id=eos, trace=True, **inputs)
    assert ours.tokens == reference, f"{family}: greedy_generate differs from the cache-free reference"
    assert ours.tokens == hf_generate(model, inputs, max_new_tokens, eos), f"{family}: differs from HF generate"
    assert [r.target_cache for r in ours.trace] == list(range(len(prompt), len(prompt) + len(ours.tokens)))
    assert ours.stop_reason == ("eos" if eos is not None else "max_new_tokens")


@pytest.mark.parametrize("family", list(FAMILIES))
@EXAMPLES
@given(tokens=encoder_token_ids(), seed=feature_seeds(), gamma=st.integers(1, 8),
       max_new_tokens=st.integers(1, 24), use_eos=st.booleans(), data=st.data())
def test_speculative_equals_greedy_round_for_round(family, tokens, seed, gamma, max_new_tokens, use_eos, data):
    """Target and draft each with its own encoder (the paper's T5 pairs)."""
    target, draft = build(family), draft_for(family)
    inputs = _inputs(family, tokens, seed)
    prompt = decoder_start(target, family)
    mask = token_mask(target, len(prompt), max_new_tokens)
    target_out = encoder_output(target, inputs)
    free = cache_free_greedy(target, target_out, prompt, max_new_tokens, mask=mask)
    eos = _eos(data, free, use_eos)
    expected = cache_free_greedy(target, target_out, prompt, max_new_tokens, eos, mask=mask)
    run = speculative_generate(target, draft, gamma=gamma, max_new_tokens=max_new_tokens, eos_token_id=eos,
                               trace=True, **inputs)
    if run.tokens != expected:
        d = diagnose(target, inputs["input_ids"], expected, run.tokens,
                     input_features=inputs.get("input_features"))
        pytest.fail(f"{family}: {d}")
    replay = replay_rounds(target, draft, encoder_output(draft, inputs), prompt, expected, gamma, max_new_tokens)
    assert list(zip(run.drafted_per_round, run.accepted_per_round, run.tokens_per_round)) == replay, \
        f"{family}: per-round counts differ from Algorithm 1 replayed without caches (draft on its own encoder)"
    check_trace(run, len(prompt))


@EXAMPLES
@given(seed=feature_seeds(), gamma=st.integers(1, 8), max_new_tokens=st.integers(1, 24))
def test_whisper_draft_sharing_the_target_encoder(seed, gamma, max_new_tokens):
    """distil-Whisper style: the draft's one-layer decoder attends to the TARGET's encoder output."""
    target, draft = build("whisper"), distil_whisper_draft()
    inputs = _inputs("whisper", None, seed)
    prompt = decoder_start(target, "whisper")
    target_out = encoder_output(target, inputs)
    expected = cache_free_greedy(target, target_out, prompt, max_new_tokens,
                                 mask=token_mask(target, len(prompt), max_new_tokens))
    run = speculative_generate(target, draft, gamma=gamma, max_new_tokens=max_new_tokens, trace=True,
                               share_encoder=True, **inputs)
    assert run.tokens == expected
    replay = replay_rounds(target, draft, target_out, prompt, expected, gamma, max_new_tokens)
    assert list(zip(run.drafted_per_round, run.accepted_per_round, run.tokens_per_round)) == replay
    check_trace(run, len(prompt))


def test_draft_fed_another_encoder_output_changes_the_rounds():
    """The replay can tell the encoder outputs apart: with the target's encoder output instead of
    its own, the T5 draft's rounds differ on this input (so a runner that mixed them up fails)."""
    target, draft = build("t5"), draft_for("t5")
    inputs = _inputs("t5", list(range(3, 23)), 0)
    prompt = decoder_start(target, "t5")
    expected = cache_free_greedy(target, encoder_output(target, inputs), prompt, 24,
                                 mask=token_mask(target, 1, 24))
    own = replay_rounds(target, draft, encoder_output(draft, inputs), prompt, expected, 4, 24)
    other = replay_rounds(target, draft, encoder_output(target, inputs), prompt, expected, 4, 24)
    assert own != other
    run = speculative_generate(target, draft, gamma=4, max_new_tokens=24, **inputs)
    assert list(zip(run.drafted_per_round, run.accepted_per_round, run.tokens_per_round)) == own


def test_self_draft_accepts_everything_and_t5_decoder_depth_may_differ():
    """draft = target: gamma + 1 tokens a round. A T5 whose decoder is deeper than its encoder
    (num_decoder_layers != num_layers; HF generate 5.24 itself fails on it) runs too."""
    target = build("bart")
    run = speculative_generate(target, target, list(range(3, 15)), gamma=4, max_new_tokens=23)
    assert run.tokens_per_round == [5, 5, 5, 5, 3] and run.accepted == run.drafted
    import transformers as T
    from seq2seq_models import sharpen
    torch.manual_seed(0)
    deep = sharpen(T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                           num_decoder_layers=3, num_heads=4, vocab_size=VOCAB,
                                                           decoder_start_token_id=0)), 0).double().eval()
    inputs = {"input_ids": list(range(3, 15))}
    expected = cache_free_greedy(deep, encoder_output(deep, inputs), [0], 16)
    assert greedy_generate(deep, max_new_tokens=16, **inputs).tokens == expected
    assert speculative_generate(deep, draft_for("t5"), gamma=3, max_new_tokens=16, **inputs).tokens == expected


@pytest.mark.parametrize("family", [*CORE, "m2m_100"])
def test_decoder_input_ids_continue_a_given_decoder_prompt(family):
    """A longer decoder prompt: Whisper's begin suppression acts at the first NEW token; M2M100's
    forced BOS only at decoder position 1 (inside this prompt, so not at all), as in HF generate."""
    model, draft = build(family), draft_for(family)
    inputs = _inputs(family, list(range(5, 17)), 3)
    dec = decoder_start(model, family) + [30, 31]
    expected = cache_free_greedy(model, encoder_output(model, inputs), dec, 12, mask=token_mask(model, len(dec), 12))
    assert greedy_generate(model, max_new_tokens=12, decoder_input_ids=dec, **inputs).tokens == expected
    assert speculative_generate(model, draft, gamma=3, max_new_tokens=12, decoder_input_ids=dec,
                                **inputs).tokens == expected
    assert hf_generate(model, inputs, 12, decoder_input_ids=dec) == expected


def test_whisper_features_are_cast_to_the_model_dtype():
    """fp64 features (or any float) into an fp32 Whisper: cast as HF's feature extractor output would be."""
    whisper = copy.deepcopy(build("whisper")).float()
    inputs = _inputs("whisper", None, 5)
    assert inputs["input_features"].dtype == torch.float64
    expected = cache_free_greedy(whisper, encoder_output(whisper, inputs), [3], 6, mask=token_mask(whisper, 1, 6))
    assert greedy_generate(whisper, max_new_tokens=6, **inputs).tokens == expected
    assert hf_generate(whisper, inputs, 6) == expected


@pytest.mark.parametrize("draft_impl", ["auto", "hf"])
def test_draft_impl_auto_and_hf_both_run_the_decoder_runner(draft_impl):
    """The two draft_impl values an encoder-decoder draft accepts: the same runner, the same rounds."""
    target, draft = build("bart"), draft_for("bart")
    inputs = _inputs("bart", list(range(4, 18)), 0)
    expected = cache_free_greedy(target, encoder_output(target, inputs), [2], 10, mask=token_mask(target, 1, 10))
    run = speculative_generate(target, draft, gamma=3, max_new_tokens=10, draft_impl=draft_impl, **inputs)
    assert run.tokens == expected
    assert list(zip(run.drafted_per_round, run.accepted_per_round, run.tokens_per_round)) == \
        replay_rounds(target, draft, encoder_output(draft, inputs), [2], expected, 3, 10)


def test_token_masks_read_from_the_generation_config():
    """TokenMasks.of: suppress_tokens and one-token bad_words_ids everywhere, begin suppression at the
    prompt's length, forced BOS / EOS, the last new token's position (prompt_len + max_new_tokens - 1)."""
    from spec.seq2seq import TokenMasks
    gen = NS(suppress_tokens=[5, 6], bad_words_ids=[[9], [12]], begin_suppress_tokens=[7, 2],
             forced_bos_token_id=4, forced_eos_token_id=3)
    assert TokenMasks.of(NS(generation_config=gen), 3, 5) == TokenMasks((5, 6, 9, 12), (7, 2), 4, 3, 3, 7)
    assert TokenMasks.of(NS(generation_config=gen), 1, 1) == TokenMasks((5, 6, 9, 12), (7, 2), 4, 3, 1, 1)
    assert TokenMasks.of(NS(generation_config=gen), 2) == TokenMasks((5, 6, 9, 12), (7, 2), 4, 3, 2, None)
    gen.bad_words_ids = [[9], [10, 11]]   # a multi-token entry: refused (HF would ban the sequence)
    with pytest.raises(ValueError, match=r"^SimpleNamespace: generation_config.bad_words_ids holds multi-token"):
        TokenMasks.of(NS(generation_config=gen), 3, 5)
    empty = NS(suppress_tokens=None, bad_words_ids=None, begin_suppress_tokens=None, forced_bos_token_id=None,
               forced_eos_token_id=None)
    assert TokenMasks.of(NS(generation_config=empty), 4, 6) == TokenMasks((), (), None, None, 4, 9)
    assert TokenMasks.of(NS(generation_config=NS()), 4, 6) == TokenMasks((), (), None, None, 4, 9)
    assert TokenMasks.of(NS(), 4, 6) == TokenMasks(begin_at=4)  # no generation_config: nothing masked
    assert TokenMasks.of(build("whisper"), 1, 8) == TokenMasks((5, 6), (7, 2), None, None, 1, 8)
    assert TokenMasks.of(build("m2m_100"), 1, 8) == TokenMasks((), (), 9, None, 1, 8)
    assert TokenMasks.of(build("bart"), 2, 8) == TokenMasks((), (), None, 2, 2, 9)


def _masked(rows, width, masked=(), only=None):
    """Expected logits: row r of `rows` is 10 * r + column, -inf where masked, or all but `only`."""
    out = torch.arange(rows * width, dtype=torch.float64).reshape(rows, width)
    for r, cols in masked:
        out[r, list(cols)] = -float("inf")
    for r, token in only or ():
        keep = out[r, token].clone()
        out[r] = -float("inf")
        out[r, token] = keep
    return out


@pytest.mark.parametrize("first_pos, masked, only", [
    # rows predict positions first_pos + 1, ...: 1 (forced BOS), 2 (begin suppression), 3, 4 (forced EOS)
    (0, [(1, (5, 7)), (2, (5,))], [(0, 4), (3, 2)]),
    (1, [(0, (5, 7)), (1, (5,)), (3, (5,))], [(2, 2)]),  # positions 2..5: no BOS row
    (4, [(r, (5,)) for r in range(4)], []),  # positions 5..8: suppression only
])
def test_token_masks_act_on_the_rows_predicting_their_positions(first_pos, masked, only):
    from spec.seq2seq import TokenMasks
    masks = TokenMasks(suppress=(5, 12, 40), begin_suppress=(7, 12), forced_bos=4, forced_eos=2, begin_at=2, end_at=4)
    logits = torch.arange(48, dtype=torch.float64).reshape(4, 12)
    out = masks.apply(logits, first_pos)
    assert torch.equal(out, _masked(4, 12, masked, only))
    assert torch.equal(logits, torch.arange(48, dtype=torch.float64).reshape(4, 12))  # the input is left as is
    if first_pos == 0:  # one row at a time, as a decoding step feeds them
        for i in range(4):
            assert torch.equal(masks.apply(logits[i:i + 1], i), out[i:i + 1])
    nothing = TokenMasks(begin_at=2, end_at=4)
    assert nothing.apply(logits, first_pos) is logits
    for only_one in (TokenMasks(forced_bos=4), TokenMasks(forced_eos=2, end_at=4), TokenMasks(suppress=(5,)),
                     TokenMasks(begin_suppress=(7,), begin_at=4)):
        assert not torch.equal(only_one.apply(logits, 0), logits)


def test_ids_may_be_any_integer_tensor_or_a_list():
    """input_ids and decoder_input_ids: a list, a tuple, a 1-D or (1, n) tensor of any integer dtype
    (uint8 and int16 ids are cast: the embedding takes int64 ones)."""
    t5 = build("t5")
    ids, dec = list(range(3, 15)), [0, 30]
    expected = cache_free_greedy(t5, encoder_output(t5, {"input_ids": ids}), dec, 5)
    for dtype, shape in ((torch.uint8, (-1,)), (torch.int16, (1, -1))):
        run = greedy_generate(t5, torch.tensor(ids, dtype=dtype).reshape(shape), max_new_tokens=5,
                              decoder_input_ids=torch.tensor(dec, dtype=dtype).reshape(shape))
        assert run.tokens == expected, (dtype, shape)
    assert greedy_generate(t5, tuple(ids), max_new_tokens=5, decoder_input_ids=tuple(dec)).tokens == expected


def test_decoder_starts_from_the_generation_config_then_the_config():
    """decoder_start_token_id: generation_config's first (as HF generate reads it), else the model config's."""
    t5 = _with(build("t5"))
    t5.generation_config.decoder_start_token_id = 7
    inputs = {"input_ids": list(range(3, 15))}
    assert decoder_prompt(t5) == [7]
    expected = cache_free_greedy(t5, encoder_output(t5, inputs), [7], 4)
    assert greedy_generate(t5, max_new_tokens=4, **inputs).tokens == expected == hf_generate(t5, inputs, 4)
    t5.generation_config.decoder_start_token_id = None
    t5.config.decoder_start_token_id = 5
    assert decoder_prompt(t5) == [5]
    assert decoder_prompt(NS(config=NS(decoder_start_token_id=6, model_type="bart"))) == [6]  # no generation_config


def test_diagnose_names_the_first_divergence_of_an_encoder_decoder_target():
    target = build("t5")
    inputs = {"input_ids": list(range(3, 20))}
    tokens = greedy_generate(target, max_new_tokens=10, **inputs).tokens
    assert diagnose(target, inputs["input_ids"], tokens, list(tokens)) is None
    wrong = tokens[:4] + [(tokens[4] + 1) % VOCAB] + tokens[5:]
    d = diagnose(target, inputs["input_ids"], tokens, wrong)
    assert (d.position, d.expected, d.actual, d.verdict) == (4, tokens[4], wrong[4], "bug")
    assert d.noise < 1e-9 < d.gap_step  # fp64: the decoder's step and block logits agree to rounding
    whisper = build("whisper")
    w_inputs = _inputs("whisper", None, 1)
    tokens = greedy_generate(whisper, max_new_tokens=6, **w_inputs).tokens
    d = diagnose(whisper, None, tokens, tokens[:2] + [(tokens[2] + 1) % VOCAB],
                 input_features=w_inputs["input_features"])
    assert d.position == 2 and d.verdict == "bug"
    # Whisper's masks set some logits to -inf in both passes: the noise is measured over the others
    assert 0 <= d.noise < 1e-9 < d.gap_step
    import transformers as T
    with pytest.raises(ValueError, match=r"^target: encoder-decoder family 'prophetnet'"):
        diagnose(UNSUPPORTED["prophetnet"](T).eval(), [3, 4, 5], [1, 2], [1, 3])


# --- refused up front, with the argument named ------------------------------------------------

def _raises(match, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args, **kwargs)


def test_bad_inputs_are_refused_clearly(target):
    t5, whisper = build("t5"), build("whisper")
    feats = _inputs("whisper", None, 0)["input_features"]
    _raises("pass input_features=", greedy_generate, whisper, None)
    _raises("input_ids is not used", greedy_generate, whisper, [1, 2], input_features=feats)
    _raises(r"input_features must be \[8, 32\]", greedy_generate, whisper, None, input_features=feats[:, :10])
    _raises("input_features must be a floating-point", greedy_generate, whisper, None,
            input_features=torch.ones(8, 32, dtype=torch.long))
    _raises("not input_features=", greedy_generate, t5, [1, 2], input_features=feats)
    _raises("needs input_ids", greedy_generate, t5, None)
    _raises("input_ids holds token id 500", greedy_generate, t5, [1, 500])
    _raises("decoder_input_ids holds token id 999", speculative_generate, t5, draft_for("t5"), [1, 2],
            decoder_input_ids=[0, 999])
    _raises("decoder_input_ids is empty", greedy_generate, t5, [1, 2], decoder_input_ids=[])
    _raises("input_features is for encoder-decoder", greedy_generate, target, [1, 2], input_features=feats)
    _raises("decoder_input_ids is for encoder-decoder", speculative_generate, target, target, [1, 2],
            decoder_input_ids=[0])
    _raises("share_encoder=True is for encoder-decoder", speculative_generate, target, target, [1, 2],
            share_encoder=True)
    _raises("draft_impl='plain' is for decoder-only", speculative_generate, t5, t5, [1, 2], draft_impl="plain")


def test_mismatched_pairs_are_refused(target):
    t5, bart, whisper = build("t5"), build("bart"), build("whisper")
    from spec import build_gpt_neox
    causal = build_gpt_neox("tiny-draft", eos_token_id=1, vocab_size=VOCAB)  # T5's EOS: only the kind differs
    _raises("decoder-only model but the target is encoder-decoder", speculative_generate, t5, causal, [1, 2])
    _raises("target is a decoder-only model", speculative_generate, causal, t5, [1, 2])
    import copy
    restart = copy.deepcopy(t5)
    restart.config.decoder_start_token_id = restart.generation_config.decoder_start_token_id = 2
    _raises("decoder_start_token_id is 0 for the target and 2 for the draft", speculative_generate, t5, restart, [1])
    wide = copy.deepcopy(bart)
    wide.resize_token_embeddings(VOCAB + 8)
    _raises("vocabularies differ", speculative_generate, bart, wide, [1, 2])
    _raises("share_encoder=True: the target's encoder output is 32 wide", speculative_generate, whisper,
            _narrow_whisper(), None, input_features=_inputs("whisper", None, 0)["input_features"], share_encoder=True)
    _raises("share_encoder=True needs one family", speculative_generate, bart, build("mbart"), [3, 4],
            share_encoder=True)


def _like_bart(model):
    """`model` with BART's special ids (config and generation_config), so only its family differs."""
    for key in ("bos_token_id", "pad_token_id", "eos_token_id", "decoder_start_token_id"):
        setattr(model.config, key, getattr(build("bart").config, key))
        setattr(model.generation_config, key, getattr(build("bart").generation_config, key))
    return model


def _with(model, **generation):
    model = copy.deepcopy(model)
    for key, value in generation.items():
        setattr(model.config, key, value)
        setattr(model.generation_config, key, value)
    return model


def _features_of(shape, dtype=torch.float64):
    return torch.zeros(shape, dtype=dtype)


_UNSUPPORTED_MSG = ("{}: encoder-decoder family 'prophetnet' (ProphetNetForConditionalGeneration) is not supported; "
                    "spec runs t5, bart, mbart, marian, pegasus, m2m_100, blenderbot-small, whisper (each checked "
                    "exact against HF generate)")
_NOT_A_LIST = "input_ids as a list must hold ints only"   # spec.validate.as_prompt, as for decoder-only models
_FEATURES_TYPE = ("input_features must be a floating-point tensor [num_mel_bins, frames] or [1, num_mel_bins, frames], "
                  "got {}")
_FEATURES_BATCH = ("input_features must be [num_mel_bins, frames] or [1, num_mel_bins, frames] (batch 1), "
                   "got shape {}")
_FEATURES_SIZE = ("input_features must be [8, 32] for this model (num_mel_bins, 2 x max_source_positions), got {}; "
                  "longer audio is not supported")
_S = speculative_generate
REFUSALS = {  # case: (call, exception, message word for word)
    "draft decoder-only": (lambda: _S(build("t5"), _causal(), [1, 2]), ValueError,
                           "draft is a decoder-only model but the target is encoder-decoder: "
                           "both must be encoder-decoder models"),
    "target decoder-only": (lambda: _S(_causal(), build("t5"), [1, 2]), ValueError,
                            "target is a decoder-only model but the draft is encoder-decoder: "
                            "both must be encoder-decoder models"),
    "draft unsupported": (lambda: _S(build("bart"), _like_bart(UNSUPPORTED["prophetnet"](T).eval()), [3, 4]),
                          ValueError, _UNSUPPORTED_MSG.format("draft")),
    "target unsupported": (lambda: _S(_like_bart(UNSUPPORTED["prophetnet"](T).eval()), build("bart"), [3, 4]),
                           ValueError, _UNSUPPORTED_MSG.format("target")),
    "no LM head": (lambda: prepare({"target": T.T5Model(T.T5Config(d_model=16, d_kv=4, d_ff=16, num_layers=1,
                                                                    num_heads=4, vocab_size=VOCAB)).eval()}, [3]),
                   TypeError, "target must be an encoder-decoder model with an LM head (e.g. AutoModelForSeq2SeqLM); "
                              "T5Model has none"),
    "draft timestamps": (lambda: _S(build("whisper"), _with(build("whisper"), return_timestamps=True), None,
                                    input_features=_features_of((8, 32))), ValueError,
                         "draft: generation_config.return_timestamps is set; Whisper timestamp decoding is not "
                         "supported (set it to False)"),
    "start tokens differ": (lambda: _S(build("t5"), _with(build("t5"), decoder_start_token_id=2), [1]), ValueError,
                            "target and draft decoders start from different tokens: decoder_start_token_id is 0 "
                            "for the target and 2 for the draft"),
    "vocabularies differ": (lambda: _S(build("bart"), _wide_bart(), [1, 2]), ValueError,
                            "target and draft vocabularies differ: logit widths 96 and 104 (encoder-decoder pairs "
                            "must share one vocabulary)"),
    "no start token": (lambda: greedy_generate(_with(build("t5"), decoder_start_token_id=None), [3]), ValueError,
                       "model has no decoder_start_token_id in its config or generation_config: "
                       "pass decoder_input_ids="),
    "empty list": (lambda: greedy_generate(build("t5"), []), ValueError,
                   "input_ids is empty: the prompt needs at least one token"),
    "bool in list": (lambda: greedy_generate(build("t5"), [3, True]), TypeError, _NOT_A_LIST),
    "float in list": (lambda: greedy_generate(build("t5"), (3, 4.0)), TypeError, _NOT_A_LIST),
    "str": (lambda: greedy_generate(build("t5"), "abc"), TypeError,
            "input_ids must be a LongTensor or a list of ints, got str"),
    "float tensor": (lambda: greedy_generate(build("t5"), torch.tensor([3., 4.])), TypeError,
                     "input_ids must hold integer token ids, got dtype torch.float32"),
    "bool tensor": (lambda: greedy_generate(build("t5"), torch.tensor([True])), TypeError,
                    "input_ids must hold integer token ids, got dtype torch.bool"),
    "complex tensor": (lambda: greedy_generate(build("t5"), torch.tensor([3, 4], dtype=torch.complex64)), TypeError,
                       "input_ids must hold integer token ids, got dtype torch.complex64"),
    "batch of 2": (lambda: greedy_generate(build("t5"), torch.tensor([[3, 4, 5], [6, 7, 8]])), UnsupportedModelError,
                   "model: T5ForConditionalGeneration is an encoder-decoder model; spec decodes those one prompt at "
                   "a time (batches are decoder-only)"),
    "3-D ids": (lambda: greedy_generate(build("t5"), torch.tensor([[[3, 4]]])), ValueError,
                "input_ids must be 1-D or (1, n), got shape (1, 1, 2)"),
    "0-D ids": (lambda: greedy_generate(build("t5"), torch.tensor(3)), ValueError,
                "input_ids must be 1-D or (1, n), got shape ()"),
    "no ids": (lambda: greedy_generate(build("t5"), torch.zeros(1, 0, dtype=torch.long)), ValueError,
               "input_ids is empty: the prompt needs at least one token"),
    "negative id": (lambda: greedy_generate(build("t5"), [3, -1]), ValueError,
                    "input_ids holds token id -1, outside the model's vocabulary [0, 96)"),
    "id past the vocabulary": (lambda: _S(build("t5"), draft_for("t5"), [96, 3]), ValueError,
                               "input_ids holds token id 96, outside the target's vocabulary [0, 96)"),
    "decoder id past it": (lambda: _S(build("t5"), draft_for("t5"), [3], decoder_input_ids=[0, 96]), ValueError,
                           "decoder_input_ids holds token id 96, outside the target's vocabulary [0, 96)"),
    "whisper given ids": (lambda: greedy_generate(build("whisper"), None), ValueError,
                          "model (WhisperForConditionalGeneration) takes input_features (log-mel spectrogram), not "
                          "input_ids, as its encoder input: pass input_features="),
    "whisper given ids only": (lambda: greedy_generate(build("whisper"), [1, 2]), ValueError,
                               "model (WhisperForConditionalGeneration) takes input_features (log-mel spectrogram), "
                               "not input_ids, as its encoder input: pass input_features="),
    "whisper given both": (lambda: _S(build("whisper"), draft_for("whisper"), [1, 2],
                                      input_features=_features_of((8, 32))), ValueError,
                           "target (WhisperForConditionalGeneration) encodes input_features; input_ids is not used "
                           "(give the decoder prompt as decoder_input_ids=)"),
    "t5 given features": (lambda: greedy_generate(build("t5"), [1, 2], input_features=_features_of((8, 32))),
                          ValueError, "model (T5ForConditionalGeneration) encodes token ids: pass input_ids=, "
                                      "not input_features="),
    "t5 given nothing": (lambda: _S(build("t5"), draft_for("t5"), None), ValueError,
                         "target (T5ForConditionalGeneration) needs input_ids (the encoder input)"),
    "features a list": (lambda: greedy_generate(build("whisper"), None, input_features=[[0.5] * 32] * 8), TypeError,
                        _FEATURES_TYPE.format("list")),
    "features long": (lambda: greedy_generate(build("whisper"), None,
                                              input_features=_features_of((8, 32), torch.long)),
                      TypeError, _FEATURES_TYPE.format("torch.int64")),
    "features 1-D": (lambda: greedy_generate(build("whisper"), None, input_features=_features_of(256)), ValueError,
                     _FEATURES_BATCH.format("(256,)")),
    "features batch 2": (lambda: greedy_generate(build("whisper"), None, input_features=_features_of((2, 8, 32))),
                         ValueError, _FEATURES_BATCH.format("(2, 8, 32)")),
    "features short": (lambda: greedy_generate(build("whisper"), None, input_features=_features_of((1, 8, 10))),
                       ValueError, _FEATURES_SIZE.format("[8, 10]")),
    "features few bins": (lambda: greedy_generate(build("whisper"), None, input_features=_features_of((4, 32))),
                          ValueError, _FEATURES_SIZE.format("[4, 32]")),
    "no model_type": (lambda: prepare({"target": NS(config=NS(is_encoder_decoder=True))}, [3]), ValueError,
                      "target: encoder-decoder family '?' (SimpleNamespace) is not supported; spec runs t5, bart, "
                      "mbart, marian, pegasus, m2m_100, blenderbot-small, whisper (each checked exact against HF "
                      "generate)"),
    "no output embeddings": (lambda: prepare({"target": NS(config=NS(model_type="t5", is_encoder_decoder=True),
                                                           get_encoder=lambda: None)}, [3]), TypeError,
                             "target must be an encoder-decoder model with an LM head (e.g. AutoModelForSeq2SeqLM); "
                             "SimpleNamespace has none"),
    "decoder ids float": (lambda: greedy_generate(build("t5"), [3], decoder_input_ids=torch.tensor([0., 1.])),
                          TypeError, "decoder_input_ids must hold integer token ids, got dtype torch.float32"),
    "default name: start": (lambda: decoder_prompt(NS(config=NS(decoder_start_token_id=None, model_type="bart"))),
                            ValueError, "model has no decoder_start_token_id in its config or generation_config: "
                                        "pass decoder_input_ids="),
    "default name: encode": (lambda: encode(build("t5")), ValueError,
                             "model (T5ForConditionalGeneration) needs input_ids (the encoder input)"),
    "share without draft": (lambda: prepare({"target": build("t5")}, [3], share_encoder=True), ValueError,
                            "share_encoder=True needs a draft"),
    "share not a bool": (lambda: _S(build("t5"), draft_for("t5"), [3], share_encoder=1), TypeError,
                         "share_encoder must be True or False, got 1"),
    "draft_impl": (lambda: _S(build("t5"), draft_for("t5"), [3], draft_impl="compiled"), ValueError,
                   "draft_impl='compiled' is for decoder-only drafts; an encoder-decoder draft runs its own forward: "
                   "use 'auto' or 'hf'"),
    "features decoder-only": (lambda: refuse_inputs(input_features=_features_of((8, 32))), ValueError,
                              "input_features is for encoder-decoder models; this model is decoder-only (pass its "
                              "prompt as input_ids)"),
    "decoder ids decoder-only": (lambda: refuse_inputs(decoder_input_ids=[0]), ValueError,
                                 "decoder_input_ids is for encoder-decoder models; this model is decoder-only (pass "
                                 "its prompt as input_ids)"),
    "share decoder-only": (lambda: refuse_inputs(share_encoder=True), ValueError,
                           "share_encoder=True is for encoder-decoder pairs; these models are decoder-only"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_word_for_word(case):
    """Each refusal of spec.seq2seq names the argument (or model) and what was expected, exactly."""
    call, error, message = REFUSALS[case]
    with pytest.raises(error) as err:
        call()
    assert str(err.value) == message


def test_a_model_without_generation_config_passes_the_family_check():
    from spec.seq2seq import check_supported
    duck = NS(config=NS(model_type="t5"), get_encoder=lambda: None, get_output_embeddings=lambda: object())
    assert check_supported(duck, "target") is None


def _causal():
    from spec import build_gpt_neox
    return build_gpt_neox("tiny-draft", eos_token_id=1, vocab_size=VOCAB)


def _wide_bart():
    wide = copy.deepcopy(build("bart"))
    wide.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    return wide


def _narrow_whisper():
    import transformers as T
    kwargs = dict(FAMILIES["whisper"][1], d_model=16)
    return T.WhisperForConditionalGeneration(T.WhisperConfig(**kwargs)).double().eval()


UNSUPPORTED = {  # families spec has not checked: refused before anything runs
    "prophetnet": lambda T: T.ProphetNetForConditionalGeneration(T.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=16, num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, ngram=2)),
    "led": lambda T: T.LEDForConditionalGeneration(T.LEDConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, attention_window=[4])),
}


@pytest.mark.parametrize("family", list(UNSUPPORTED))
def test_unsupported_families_are_refused(family):
    import transformers as T
    model = UNSUPPORTED[family](T).eval()
    _raises(f"encoder-decoder family '{family}'.*is not supported", greedy_generate, model, [3, 4, 5])
    _raises(f"encoder-decoder family '{family}'.*is not supported", speculative_generate, model, model, [3, 4, 5])


def test_multilingual_whisper_without_language_is_refused():
    import copy
    whisper = copy.deepcopy(build("whisper"))
    whisper.generation_config.lang_to_id = {"<|en|>": 50}
    feats = _inputs("whisper", None, 0)["input_features"]
    _raises("multilingual Whisper without a language", greedy_generate, whisper, None, input_features=feats)
    whisper.generation_config.forced_decoder_ids = [[1, None], [2, 51]]  # language open: HF would detect it
    _raises("multilingual Whisper without a language", greedy_generate, whisper, None, input_features=feats)
    whisper.generation_config.forced_decoder_ids = [[1, 50], [2, 51]]
    run = greedy_generate(whisper, None, input_features=feats, max_new_tokens=4, trace=True)
    assert run.trace[0].target_cache == 3  # start token, then the two forced ones: a 3-token prompt
    whisper.generation_config.return_timestamps = True
    _raises("return_timestamps", greedy_generate, whisper, None, input_features=feats)


_TASK_REFUSAL = ("whisper: generation_config.task / language are set; spec does not build Whisper's language and "
                 "task tokens: pass the whole decoder prompt as decoder_input_ids= "
                 "(e.g. [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>])")
_NO_LANGUAGE = ("whisper: a multilingual Whisper without a language: HF generate would detect it with an extra pass; "
                "pass the decoder prompt as decoder_input_ids= "
                "(e.g. [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>])")


@pytest.mark.parametrize("config, generation, expected", [
    # the start token (3), forced_decoder_ids' run from index 1, then <|notimestamps|> where the config has one
    # (WhisperGenerationMixin._retrieve_init_tokens' rules, written out by hand)
    ({}, {}, [3]),
    ({"forced_decoder_ids": [[1, 50], [2, 51]]}, {}, [3, 50, 51]),  # the model config's, as HF falls back to
    ({}, {"forced_decoder_ids": [[2, 51], [1, 50]]}, [3, 50, 51]),  # in index order
    ({"forced_decoder_ids": [[1, 40]]}, {"forced_decoder_ids": [[1, 50]]}, [3, 50]),  # generation_config's first
    ({}, {"no_timestamps_token_id": 60}, [3, 60]),
    ({}, {"forced_decoder_ids": [[1, 50], [2, 60]], "no_timestamps_token_id": 60}, [3, 50, 60]),  # not twice
    ({}, {"lang_to_id": {"<|en|>": 50}, "forced_decoder_ids": [[1, 50]]}, [3, 50]),  # multilingual, language given
    ({}, {"task": "transcribe"}, _TASK_REFUSAL),
    ({}, {"language": "en"}, _TASK_REFUSAL),
    ({}, {"task": "transcribe", "language": "en", "forced_decoder_ids": [[1, 50]]}, _TASK_REFUSAL),
    ({}, {"lang_to_id": {"<|en|>": 50}}, _NO_LANGUAGE),
    ({}, {"lang_to_id": {"<|en|>": 50}, "forced_decoder_ids": [[1, None], [2, 51]]}, _NO_LANGUAGE),
    ({}, {"forced_decoder_ids": [[2, 51]]}, "whisper: forced_decoder_ids [(2, 51)] do not follow Whisper's prompt "
                                            "pattern (one token for each index 1, 2, ...): pass decoder_input_ids="),
    ({}, {"forced_decoder_ids": [[1, None]]}, "whisper: forced_decoder_ids [(1, None)] do not follow Whisper's "
                                              "prompt pattern (one token for each index 1, 2, ...): pass "
                                              "decoder_input_ids="),
])
def test_whisper_decoder_prompt_from_its_configs(config, generation, expected):
    """spec.seq2seq.decoder_prompt for Whisper: what HF generate starts the decoder from, or why spec
    refuses to guess it (word for word)."""
    whisper = copy.deepcopy(build("whisper"))
    for key, value in config.items():
        setattr(whisper.config, key, value)
    for key, value in generation.items():
        setattr(whisper.generation_config, key, value)
    if isinstance(expected, str):
        with pytest.raises(ValueError) as err:
            decoder_prompt(whisper, name="whisper")
        assert str(err.value) == expected
    else:
        assert decoder_prompt(whisper, name="whisper") == expected
        assert decoder_prompt(whisper, [3, 70], name="whisper") == [3, 70]  # decoder_input_ids win


# --- what sharing the encoder saves (docs/log/benchmarks.md): `pytest -m thorough -s -k share_encoder` ----

@pytest.mark.thorough
def test_share_encoder_same_rounds_and_its_time():
    """The distil draft's own encoder equals the target's, so sharing changes no round, only the time
    (printed: per call, best of 5 interleaved repeats of 20 calls; a timing is never asserted)."""
    target, draft = build("whisper"), distil_whisper_draft()
    inputs = _inputs("whisper", None, 0)
    for max_new_tokens in (4, 16):
        runs = {share: speculative_generate(target, draft, gamma=4, max_new_tokens=max_new_tokens,
                                            share_encoder=share, **inputs) for share in (False, True)}
        assert runs[True].tokens == runs[False].tokens
        assert runs[True].accepted_per_round == runs[False].accepted_per_round
        times = {False: [], True: []}
        for _ in range(5):
            for share in (False, True):
                t0 = time.perf_counter()
                for _ in range(20):
                    speculative_generate(target, draft, gamma=4, max_new_tokens=max_new_tokens,
                                         share_encoder=share, **inputs)
                times[share].append((time.perf_counter() - t0) / 20)
        own, shared = min(times[False]), min(times[True])
        print(f"max_new_tokens={max_new_tokens}: own encoder {own * 1e3:.2f} ms, shared {shared * 1e3:.2f} ms "
              f"per call ({(own - shared) * 1e3:.2f} ms saved)")


# --- python -m spec on a saved encoder-decoder pair ---------------------------------------------

def test_cli_runs_a_saved_t5_pair_and_refuses_what_it_cannot_run(tmp_path, capsys):
    """Prompts become the encoder's input (bytes as ids: the pair has no tokenizer); the table and
    results.json are the decoder-only ones. Whisper (features) and the HF peer exit 2 with a reason."""
    import json

    import spec.__main__ as cli
    for name, model in (("target", build("t5")), ("draft", draft_for("t5")), ("whisper", build("whisper"))):
        model.save_pretrained(tmp_path / name)
    base = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--max-new-tokens", "6",
            "--gamma", "2", "--quiet", "--threads", "1", "--no-plots", "--target-dtype", "fp64",
            "--draft-dtype", "fp64"]
    rc = cli.main([*base, "--out", str(tmp_path / "out")])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert any(line.startswith("#  prompt") for line in stdout.splitlines())
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["summary"]["all_identical"] and len(results["prompts"]) == 5
    record = results["prompts"][0]
    inputs = {"input_ids": [b % VOCAB for b in record["prompt"].encode("utf-8")]}
    assert record["spec_tokens"] == greedy_generate(build("t5"), max_new_tokens=6, **inputs).tokens
    assert cli.main([*base, "--out", str(tmp_path / "peer"), "--peer", "hf"]) == 2
    assert "--peer hf" in capsys.readouterr().err
    whisper = ["--target", str(tmp_path / "whisper"), "--draft", str(tmp_path / "whisper"), "--quiet",
               "--out", str(tmp_path / "w")]
    assert cli.main(whisper) == 2
    assert "encodes audio features" in capsys.readouterr().err
    # Whisper: one features file a prompt (.pt and .npy), the distil-style draft with its own encoder copy.
    import numpy as np
    distil_whisper_draft().save_pretrained(tmp_path / "distil")
    feats = [_inputs("whisper", None, seed)["input_features"] for seed in (0, 1)]
    torch.save(feats[0], tmp_path / "a.pt")
    np.save(tmp_path / "b.npy", feats[1].numpy())
    rc = cli.main(["--target", str(tmp_path / "whisper"), "--draft", str(tmp_path / "distil"), "--quiet",
                   "--features", str(tmp_path / "a.pt"), "--features", str(tmp_path / "b.npy"), "--no-plots",
                   "--max-new-tokens", "6", "--threads", "1", "--target-dtype", "fp64", "--draft-dtype", "fp64",
                   "--out", str(tmp_path / "w2")])
    assert rc == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "w2" / "results.json").read_text())
    assert results["summary"]["all_identical"] and len(results["prompts"]) == 2
    expected = greedy_generate(build("whisper"), None, input_features=feats[1], max_new_tokens=6).tokens
    assert results["prompts"][1]["spec_tokens"] == expected
    (tmp_path / "bad.pt").write_text("not a tensor")
    assert cli.main([*base, "--out", str(tmp_path / "x"), "--features", str(tmp_path / "a.pt")]) == 2
    assert "--features: T5ForConditionalGeneration encodes token ids" in capsys.readouterr().err
    assert cli.main([*whisper, "--features", str(tmp_path / "bad.pt")]) == 2
    assert "--features: cannot read" in capsys.readouterr().err


def test_cli_refusals_say_what_to_give_instead(target):
    """What `python -m spec` refuses before loading prompts, word for word (spec.experiment.refusal)."""
    from spec.experiment import refusal as cli_refusal
    t5, whisper = build("t5"), build("whisper")
    assert cli_refusal(target, None) is None and cli_refusal(t5, None) is None
    assert cli_refusal(target, "hf", features=["a.pt"]) == \
        "--features: the target is decoder-only; its prompts are text (--prompts)"
    assert cli_refusal(whisper, None) == ("WhisperForConditionalGeneration encodes audio features: give a features "
                                          "file per prompt, --features FILE.pt or FILE.npy ([num_mel_bins, frames])")
    assert cli_refusal(t5, None, features=["a.pt"]) == \
        "--features: T5ForConditionalGeneration encodes token ids; give text prompts (--prompts)"
    assert cli_refusal(t5, "hf") == cli_refusal(whisper, "hf", features=["a.pt"]) == \
        "--peer hf: the HF assisted-generation peer is run for decoder-only pairs only"
    assert cli_refusal(whisper, None, features=["a.pt"]) is None


def test_decoder_runner_names_its_model_in_refusals():
    import transformers as T

    from spec import choose
    model = UNSUPPORTED["prophetnet"](T).eval()
    with pytest.raises(ValueError, match=r"^model: encoder-decoder family 'prophetnet'"):
        choose.runs({"model": model}, torch.tensor([3, 4, 5]))


def test_multi_token_bad_words_are_refused_one_token_ones_applied():
    model = copy.deepcopy(build("t5"))
    inputs = {"input_ids": list(range(3, 12))}
    free = greedy_generate(model, max_new_tokens=6, **inputs).tokens
    model.generation_config.bad_words_ids = [[free[1]]]
    banned = greedy_generate(model, max_new_tokens=6, **inputs).tokens
    assert free[1] not in banned[:2] and banned == hf_generate(model, inputs, 6)
    model.generation_config.bad_words_ids = [[free[1]], [5, 6]]
    with pytest.raises(ValueError) as info:
        greedy_generate(model, max_new_tokens=6, **inputs)
    assert str(info.value) == ("T5ForConditionalGeneration: generation_config.bad_words_ids holds multi-token entries "
                               "([[5, 6]]); HF generate bans those sequences and spec does not, so the outputs could "
                               "differ: keep one-token entries only")
