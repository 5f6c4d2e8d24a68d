"""spec.seq2seq's decoder runner, pinned directly: fed in blocks and cropped as the decode loop
does, against the model's own cache-free decoder pass over the same encoder output.

test_encoder_decoder.py checks whole decodes (greedy, speculative, rounds replayed); this module
checks the runner's parts one at a time, on the tiny fp64 models of seq2seq_models.py built once
a module, so that a fault is named where it is (and mutmut's runs of spec/seq2seq.py stay short).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from oracles import assert_logits_close
from seq2seq_models import CORE, VOCAB, build, encoder_inputs, encoder_output

from spec import seq2seq
from spec.seq2seq import Decoder, TokenMasks

# The loop's moves: a prompt block, verify blocks, crops to every depth (to 0 too), one-token steps.
SCHEDULE = [("feed", 5), ("feed", 9), ("crop", 7), ("feed", 8), ("feed", 13), ("crop", 13), ("crop", 10),
            ("feed", 14), ("crop", 0), ("feed", 3), ("feed", 16)]


@pytest.fixture(scope="module", params=CORE)
def family(request):
    return request.param


def _reference(model, encoded, ids):
    """The model's own decoder over the whole sequence, no cache, no spec code."""
    mask = torch.ones(encoded.last_hidden_state.shape[:2], dtype=torch.long)
    return model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=ids[None], use_cache=False).logits[0]


@torch.no_grad()  # not inference_mode: the models built here are shared (cached) with other modules
def test_decoder_fed_in_blocks_and_cropped_matches_the_cache_free_decoder(family):
    model = build(family)
    encoded = encoder_output(model, encoder_inputs(family, list(range(3, 17)), 0))
    ids = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    full = _reference(model, encoded, ids)
    run = Decoder(model, encoded)       # no masks: the model's own logits
    for op, at in SCHEDULE:
        if op == "crop":
            before = len(run)
            run.crop(at)
            assert len(run) == min(at, before)
            continue
        start = len(run)
        everything = run(ids[start:at])                             # keep=0: every row fed
        assert len(run) == at
        assert everything.shape == (at - start, full.shape[-1])
        assert_logits_close(everything, full[start:at], what=f"{family}: {start}..{at - 1}")
        run.crop(start)
        last = run(ids[start:at], keep=1)                           # keep=1: the last row only
        assert_logits_close(last, full[at - 1:at], what=f"{family}: {at - 1}")


@torch.no_grad()
def test_decoder_applies_its_masks_by_the_position_each_row_predicts():
    """A row predicting decoder position p gets the masks of p, whichever pass computes it."""
    model = build("t5")
    encoded = encoder_output(model, encoder_inputs("t5", list(range(3, 17)), 0))
    masks = TokenMasks(suppress=(5,), begin_suppress=(7,), forced_bos=4, forced_eos=9, begin_at=2, end_at=6)
    ids = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(6))
    full = masks.apply(_reference(model, encoded, ids), 0)
    run = Decoder(model, encoded, masks)
    assert_logits_close(run(ids[:3]), full[:3])
    assert_logits_close(run(ids[3:7], keep=2), full[5:7])
    run.crop(4)
    assert_logits_close(run(ids[4:8], keep=3), full[5:8])
    assert full[0].isfinite().sum() == 1 and full[5].isfinite().sum() == 1     # forced BOS, forced EOS rows
    assert full[1, 7] == -float("inf") and full[2, 7] != -float("inf")      # begin suppression: position 2 only
    assert (full[:, 5] == -float("inf")).all()


def test_t5_with_a_deeper_decoder_gets_config_free_caches():
    """num_decoder_layers != num_layers: the decoder's text config miscounts its layers, so the
    caches are built without it (they grow a layer per use); otherwise from the config."""
    import transformers as T
    deep = T.T5ForConditionalGeneration(T.T5Config(d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=3,
                                                   num_heads=4, vocab_size=VOCAB, decoder_start_token_id=0))
    cache = seq2seq.new_cache(deep)
    assert len(cache.self_attention_cache.layers) == 0 and len(cache.cross_attention_cache.layers) == 0
    cache = seq2seq.new_cache(build("bart"))
    assert len(cache.self_attention_cache.layers) == 2 and len(cache.cross_attention_cache.layers) == 2


@torch.no_grad()
def test_a_bart_with_a_deeper_decoder_gets_caches_of_its_decoders_depth():
    """BART's config counts the encoder's layers (num_hidden_layers); the caches are the decoder's."""
    import transformers as T
    from seq2seq_models import _BART_LIKE, sharpen
    torch.manual_seed(0)
    model = sharpen(T.BartForConditionalGeneration(T.BartConfig(**dict(_BART_LIKE, encoder_layers=1,
                                                                       decoder_layers=3))), 0).double().eval()
    cache = seq2seq.new_cache(model)
    assert len(cache.self_attention_cache.layers) == 3 and len(cache.cross_attention_cache.layers) == 3
    encoded = encoder_output(model, encoder_inputs("bart", list(range(3, 17)), 0))
    ids = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    full = _reference(model, encoded, ids)
    run = Decoder(model, encoded)
    assert_logits_close(run(ids[:9]), full[:9])
    run.crop(6)
    assert_logits_close(run(ids[6:16], keep=4), full[12:16])


@torch.no_grad()
def test_whisper_features_may_be_given_in_the_place_of_input_ids():
    """As the CLI passes them: a floating-point tensor as the first argument is Whisper's features."""
    model = build("whisper")
    features = encoder_inputs("whisper", None, 3)["input_features"]
    by_name = seq2seq.encode(model, input_features=features).last_hidden_state
    assert torch.equal(seq2seq.encode(model, features).last_hidden_state, by_name)
    assert torch.equal(seq2seq.encode(model, features[None]).last_hidden_state, by_name)


def test_a_shared_encoder_output_must_fit_the_drafts_width_and_family():
    """share_encoder=True: the draft attends to the target's encoder output, so its decoder must
    take states that wide (d_model, or hidden_size where a config names it so) and be the same family."""
    out = NS(last_hidden_state=torch.zeros(1, 5, 32))
    target = NS(config=NS(model_type="whisper", d_model=32))
    for config in (NS(model_type="whisper", d_model=32), NS(model_type="whisper", hidden_size=32),
                   NS(model_type="whisper", d_model=32, hidden_size=32)):
        assert seq2seq._check_shared(target, NS(config=config), out) is None
    for config in (NS(model_type="whisper", d_model=16), NS(model_type="whisper", hidden_size=16),
                   NS(model_type="whisper")):
        with pytest.raises(ValueError) as info:
            seq2seq._check_shared(target, NS(config=config), out)
        assert str(info.value) == (
            f"share_encoder=True: the target's encoder output is 32 wide but the draft's decoder attends to "
            f"{getattr(config, 'd_model', getattr(config, 'hidden_size', None))}-wide states; the draft cannot "
            f"reuse the target's encoder")
    with pytest.raises(ValueError) as info:
        seq2seq._check_shared(target, NS(config=NS(model_type="t5", d_model=32)), out)
    assert str(info.value) == "share_encoder=True needs one family: target is 'whisper', draft is 't5'"


def test_decoder_only_calls_refuse_encoder_decoder_inputs():
    assert seq2seq.refuse_inputs() is None
    assert seq2seq.refuse_inputs(None, None, False) is None
    with pytest.raises(ValueError, match=r"^share_encoder=True is for encoder-decoder pairs; these models are "
                                         r"decoder-only$"):
        seq2seq.refuse_inputs(share_encoder=True)


def test_features_files_are_read_from_pt_and_npy_and_refused_clearly(tmp_path):
    """The CLI's --features files (spec.experiment reads them; seq2seq is runtime only)."""
    import numpy as np

    from spec import experiment
    features = torch.randn(8, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.save(features, tmp_path / "a.pt")
    np.save(tmp_path / "b.npy", features.numpy())
    for name in ("a.pt", "b.npy"):
        got = experiment.load_features(tmp_path / name)
        assert got.dtype == torch.float64 and torch.equal(got, features)
    assert torch.equal(experiment.load_features(str(tmp_path / "a.pt")), features)     # a str path too
    names, label, tensors = experiment.feature_prompts([tmp_path / "a.pt", tmp_path / "b.npy"])
    assert names == [str(tmp_path / "a.pt"), str(tmp_path / "b.npy")] and label == "features files"
    assert len(tensors) == 2 and all(torch.equal(t, features) for t in tensors)

    (tmp_path / "bad.pt").write_text("not a tensor")
    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read '.*bad\.pt': "):
        experiment.load_features(tmp_path / "bad.pt")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))         # pickles: not allowed
    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read '.*objects\.npy': .*allow_pickle"):
        experiment.load_features(tmp_path / "objects.npy")
    from fractions import Fraction
    torch.save(Fraction(1, 2), tmp_path / "object.pt")                           # not weights: not unpickled
    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read '.*object\.pt': .*[Ww]eights only load failed"):
        experiment.load_features(tmp_path / "object.pt")
    np.save(tmp_path / "ints.npy", np.arange(6))
    torch.save({"features": features}, tmp_path / "dict.pt")
    for name in ("ints.npy", "dict.pt"):
        with pytest.raises(experiment.UsageError) as info:
            experiment.load_features(tmp_path / name)
        assert str(info.value) == (f"--features: {str(tmp_path / name)!r} must hold one floating-point tensor "
                                   "[num_mel_bins, frames]")

    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read"):
        experiment.feature_prompts([tmp_path / "a.pt", tmp_path / "bad.pt"])


def test_the_auto_class_and_the_draft_impls_an_encoder_decoder_draft_takes():
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    assert seq2seq.auto_class(build("whisper").config) is AutoModelForSpeechSeq2Seq
    assert seq2seq.auto_class(build("t5").config) is AutoModelForSeq2SeqLM
    for impl in ("auto", "hf"):
        assert seq2seq.check_draft_impl(impl) is None
    with pytest.raises(ValueError) as info:
        seq2seq.check_draft_impl("plain")
    assert str(info.value) == ("draft_impl='plain' is for decoder-only drafts; an encoder-decoder draft runs its own "
                               "forward: use 'auto' or 'hf'")


@torch.no_grad()
def test_prepare_gives_the_decoder_prompt_each_models_own_encoder_output_and_the_masks():
    from seq2seq_models import draft_for
    target, draft = build("bart"), draft_for("bart")
    inputs = encoder_inputs("bart", list(range(3, 17)), 0)
    prompt, outputs, masks = seq2seq.prepare({"target": target}, inputs["input_ids"], max_new_tokens=5)
    assert prompt.tolist() == [2] and prompt.dtype == torch.long and len(outputs) == 1
    assert masks == TokenMasks.of(target, 1, 5)
    prompt, outputs, _ = seq2seq.prepare({"target": target, "draft": draft}, inputs["input_ids"])   # own encoders
    assert torch.equal(outputs[0].last_hidden_state, encoder_output(target, inputs).last_hidden_state)
    assert torch.equal(outputs[1].last_hidden_state, encoder_output(draft, inputs).last_hidden_state)
    _, shared, _ = seq2seq.prepare({"target": target, "draft": draft}, inputs["input_ids"], share_encoder=True)
    assert torch.equal(shared[1].last_hidden_state, shared[0].last_hidden_state)
    import copy
    single = copy.deepcopy(draft).float()                  # a draft in another dtype reads the output cast to it
    _, cast, _ = seq2seq.prepare({"target": target, "draft": single}, inputs["input_ids"], share_encoder=True)
    assert cast[1].last_hidden_state.dtype == torch.float32 and cast[0].last_hidden_state.dtype == torch.float64
    assert torch.equal(cast[1].last_hidden_state, cast[0].last_hidden_state.float())


def test_prepare_names_the_target_and_the_decoder_prompt_in_its_refusals():
    import copy
    model = copy.deepcopy(build("t5"))
    model.generation_config.decoder_start_token_id = VOCAB + 4            # outside what the decoder embeds
    with pytest.raises(ValueError) as info:
        seq2seq.prepare({"target": model}, [5, 6])
    assert str(info.value) == f"the decoder prompt holds token id {VOCAB + 4}, outside the target's vocabulary [0, {VOCAB})"
    with pytest.raises(ValueError) as info:
        seq2seq.prepare({"target": model}, [5, 6], decoder_input_ids=[0, VOCAB])
    assert str(info.value) == f"decoder_input_ids holds token id {VOCAB}, outside the target's vocabulary [0, {VOCAB})"
    model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id = None
    with pytest.raises(ValueError) as info:
        seq2seq.prepare({"target": model}, [5, 6])
    assert str(info.value) == ("target has no decoder_start_token_id in its config or generation_config: "
                               "pass decoder_input_ids=")


@torch.no_grad()
def test_the_drafts_encoder_input_is_checked_against_its_own_vocabulary(monkeypatch):
    from seq2seq_models import draft_for
    from spec import hf
    target, draft = build("t5"), draft_for("t5")
    real = hf.vocab_rows
    monkeypatch.setattr(hf, "vocab_rows", lambda model: 50 if model is draft else real(model))
    with pytest.raises(ValueError) as info:
        seq2seq.prepare({"target": target, "draft": draft}, [3, 60])
    assert str(info.value) == "input_ids holds token id 60, outside the draft's vocabulary [0, 50)"


def test_is_encoder_decoder_and_the_start_token_read_whatever_configs_have():
    assert seq2seq.is_encoder_decoder(build("t5")) is True
    assert seq2seq.is_encoder_decoder(object()) is False                       # no config at all
    assert seq2seq.is_encoder_decoder(NS(config=NS())) is False                # a config without the field
    bart = NS(model_type="bart")
    assert seq2seq.decoder_prompt(NS(generation_config=NS(), config=NS(model_type="bart", decoder_start_token_id=6))) == [6]
    with pytest.raises(ValueError) as info:
        seq2seq.decoder_prompt(NS(generation_config=NS(), config=bart), name="target")
    assert str(info.value) == ("target has no decoder_start_token_id in its config or generation_config: "
                               "pass decoder_input_ids=")
