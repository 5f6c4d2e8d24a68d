"""Bad input gets a clear error naming the argument, before any work is done."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXModel

from spec import build_gpt_neox, greedy_generate, speculative_generate
from spec.models import load_pair


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=0), "gamma must be an integer >= 1"),
    (dict(gamma=-3), "gamma must be an integer >= 1"),
    (dict(gamma=2.5), "gamma must be an integer >= 1"),
    (dict(gamma="fast"), "gamma must be an integer >= 1 or 'auto'"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=None), "max_new_tokens must be an integer >= 1"),
    (dict(temperature=0.0), "temperature must be a number > 0"),
    (dict(top_k=0), "top_k must be None or an integer >= 1"),
    (dict(top_p=1.5), r"top_p must be None or a number in \(0, 1\]"),
    (dict(eos_token_id=10_000), "eos_token_id 10000 is outside the vocabulary"),
])
def test_bad_options(target, partial_draft, kwargs, match):
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, partial_draft, [1, 2, 3], **kwargs)


@pytest.mark.parametrize("input_ids, error, match", [
    ([], ValueError, "input_ids is empty"),
    (torch.tensor([], dtype=torch.long), ValueError, "input_ids is empty"),
    (torch.tensor([[1, 2], [3, 4]]), ValueError, "batch size 2 is not supported"),
    (torch.ones(1, 1, 3, dtype=torch.long), ValueError, r"input_ids must be 1-D or \(1, n\)"),
    (torch.tensor([1.0, 2.0]), TypeError, "input_ids must hold integer token ids"),
    ([1, "2"], TypeError, "input_ids as a list must hold ints only"),
    ("hello", TypeError, "input_ids must be a LongTensor or a list of ints"),
    ([1, -1], ValueError, "token id -1, outside the target's vocabulary"),
    ([1, 640], ValueError, r"token id 640, outside the target's vocabulary \[0, 640\)"),
    ([1, 600], ValueError, r"token id 600, outside the draft's vocabulary \[0, 512\)"),
])
def test_bad_input_ids(target, random_draft, input_ids, error, match):
    with pytest.raises(error, match=match):
        speculative_generate(target, random_draft, input_ids)


def test_greedy_names_its_argument(target):
    with pytest.raises(ValueError, match=r"outside the model's vocabulary"):
        greedy_generate(target, [700])
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(target, [1], max_new_tokens=-1)


def test_model_without_lm_head(target):
    body = GPTNeoXModel(target.config)
    with pytest.raises(TypeError, match="draft must have a causal-LM head"):
        speculative_generate(target, body, [1, 2])
    with pytest.raises(TypeError, match="target must be a Hugging Face causal LM"):
        speculative_generate("gpt2", target, [1, 2])


def test_models_on_different_devices(target, partial_draft):
    meta_draft = build_gpt_neox("tiny-draft", seed=2, device="meta")
    with pytest.raises(ValueError, match="same device, got target on cpu and draft on meta"):
        speculative_generate(target, meta_draft, [1, 2])


def test_models_that_cannot_share_a_tokenizer(target):
    other_eos = build_gpt_neox("tiny-draft", seed=2, eos_token_id=7)
    with pytest.raises(ValueError, match="cannot share a tokenizer: config.eos_token_id"):
        speculative_generate(target, other_eos, [1, 2])
    other_vocab = build_gpt_neox("tiny-draft", seed=2, vocab_size=4096)
    with pytest.raises(ValueError, match="cannot share a tokenizer: logit widths 640 and 4096"):
        speculative_generate(target, other_vocab, [1, 2])


def test_missing_weights_give_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights for .* on this machine"):
        load_pair(tmp_path / "nowhere", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="EleutherAI/pythia-does-not-exist"):
        load_pair("EleutherAI/pythia-does-not-exist", tmp_path)


def test_unknown_device(tmp_path):
    with pytest.raises(ValueError, match="device must be"):
        load_pair(tmp_path, tmp_path, device="tpu")


def test_no_state_leaks_between_calls(target, partial_draft):
    """Each call builds its own caches: an error midway or a previous run leaves nothing behind."""
    with pytest.raises(ValueError):
        speculative_generate(target, partial_draft, [1, 2, 3], gamma=0)
    a = speculative_generate(target, partial_draft, [1, 2, 3], gamma=3, max_new_tokens=10).tokens
    b = speculative_generate(target, partial_draft, [1, 2, 3], gamma=3, max_new_tokens=10).tokens
    assert a == b
