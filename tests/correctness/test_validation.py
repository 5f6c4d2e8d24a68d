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
    (dict(sequence_bias={(640,): 1.0}), r"sequence_bias / bad_words_ids name id 640, outside the vocabulary \[0, 640\)"),
    (dict(bad_words_ids=[[5, 640]]), r"sequence_bias / bad_words_ids name id 640, outside the vocabulary \[0, 640\)"),
])
def test_bad_options(target, partial_draft, kwargs, match):
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, partial_draft, [1, 2, 3], **kwargs)


@pytest.mark.parametrize("input_ids, error, match", [
    ([], ValueError, "input_ids is empty"),
    (torch.tensor([], dtype=torch.long), ValueError, "input_ids is empty"),
    (torch.tensor([[1, 2], [3, 640]]), ValueError, r"input_ids row 1: input_ids holds token id 640, outside the "
                                                   r"target's vocabulary \[0, 640\)"),
    ([[1, 2], []], ValueError, "input_ids row 1: input_ids is empty"),
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


# --- every message word for word, at the boundaries of each argument (spec.validate) ---------

def _message(fn, *args, **kwargs):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kwargs)
    return type(info.value).__name__, str(info.value)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer >= 1, got 2.0"),
    (dict(max_new_tokens=1, gamma=0), "gamma must be an integer >= 1 or 'auto', got 0"),
    (dict(max_new_tokens=1, gamma=False), "gamma must be an integer >= 1 or 'auto', got False"),
    (dict(max_new_tokens=1, gamma="Auto"), "gamma must be an integer >= 1 or 'auto', got 'Auto'"),
    (dict(max_new_tokens=1, gamma=2.0), "gamma must be an integer >= 1 or 'auto', got 2.0"),
    (dict(max_new_tokens=1, temperature=0), "temperature must be a number > 0, got 0"),
    (dict(max_new_tokens=1, temperature="1"), "temperature must be a number > 0, got '1'"),
    (dict(max_new_tokens=1, top_k=0), "top_k must be None or an integer >= 1, got 0"),
    (dict(max_new_tokens=1, top_k=1.0), "top_k must be None or an integer >= 1, got 1.0"),
    (dict(max_new_tokens=1, top_p=0), "top_p must be None or a number in (0, 1], got 0"),
    (dict(max_new_tokens=1, top_p=1.0000001), "top_p must be None or a number in (0, 1], got 1.0000001"),
    (dict(max_new_tokens=1, top_p="0.5"), "top_p must be None or a number in (0, 1], got '0.5'"),
])
def test_option_messages(kwargs, expected):
    from spec.validate import check_options
    assert _message(check_options, **kwargs) == ("ValueError", expected)


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=1), dict(max_new_tokens=1, gamma=1),
                                    dict(max_new_tokens=1, gamma="auto", temperature=1e-9, top_k=1, top_p=1),
                                    dict(max_new_tokens=1, top_p=1e-9, temperature=2)])
def test_options_at_their_boundaries_pass(kwargs):
    from spec.validate import check_options
    assert check_options(**kwargs) is None


def test_prompt_messages(target, random_draft):
    from spec.validate import as_prompt
    models = {"target": target, "draft": random_draft}   # vocabularies 640 and 512 rows
    cpu = torch.device("cpu")
    assert _message(as_prompt, torch.tensor([1.0]), cpu, models) == \
        ("TypeError", "input_ids must hold integer token ids, got dtype torch.float32")
    assert _message(as_prompt, torch.tensor([True]), cpu, models) == \
        ("TypeError", "input_ids must hold integer token ids, got dtype torch.bool")
    assert _message(as_prompt, torch.tensor([1j]), cpu, models) == \
        ("TypeError", "input_ids must hold integer token ids, got dtype torch.complex64")
    assert _message(as_prompt, torch.ones(2, 3, dtype=torch.long), cpu, models) == \
        ("ValueError", "input_ids must be 1-D or (1, n): batch size 2 is not supported")
    assert _message(as_prompt, torch.ones(1, 1, 3, dtype=torch.long), cpu, models) == \
        ("ValueError", "input_ids must be 1-D or (1, n), got shape (1, 1, 3)")
    assert _message(as_prompt, [1, True], cpu, models) == ("TypeError", "input_ids as a list must hold ints only")
    assert _message(as_prompt, "1 2", cpu, models) == \
        ("TypeError", "input_ids must be a LongTensor or a list of ints, got str")
    assert _message(as_prompt, [], cpu, models) == \
        ("ValueError", "input_ids is empty: the prompt needs at least one token")
    assert _message(as_prompt, [3, -1], cpu, models) == \
        ("ValueError", "input_ids holds token id -1, outside the target's vocabulary [0, 640)")
    assert _message(as_prompt, [600, 3], cpu, models) == \
        ("ValueError", "input_ids holds token id 600, outside the draft's vocabulary [0, 512)")
    assert _message(as_prompt, [0, 600], cpu, models) == \
        ("ValueError", "input_ids holds token id 600, outside the draft's vocabulary [0, 512)")
    for ok in ([0, 511], (0, 511), torch.tensor([0, 511]), torch.tensor([[0, 511]], dtype=torch.int32)):
        out = as_prompt(ok, cpu, models)
        assert out.dtype == torch.long and out.tolist() == [0, 511] and out.device == cpu


def test_eos_messages(target, random_draft):
    from spec.validate import stop_ids
    models = {"target": target, "draft": random_draft}   # logit widths 640 and 512
    assert stop_ids(None, models) == frozenset()
    assert stop_ids(0, models) == frozenset({0}) and stop_ids(511, models) == frozenset({511})
    assert stop_ids([3, 7], models) == stop_ids((7, 3), models) == stop_ids({3, 7}, models) == frozenset({3, 7})
    assert _message(stop_ids, 512, models) == ("ValueError", "eos_token_id 512 is outside the vocabulary [0, 512)")
    assert _message(stop_ids, [1, -1], models) == ("ValueError", "eos_token_id -1 is outside the vocabulary [0, 512)")
    for bad in ("2", [1, "2"], [True], 2.0):
        assert _message(stop_ids, bad, models) == \
            ("TypeError", f"eos_token_id must be None, an int or a list of ints, got {bad!r}")


def test_model_and_pair_messages(target, random_draft):
    from spec.validate import check_model, check_pair
    assert _message(check_model, object(), "draft") == \
        ("TypeError", "draft must be a Hugging Face causal LM (a torch.nn.Module with a config), got object")
    assert _message(check_model, GPTNeoXModel(target.config), "target") == \
        ("TypeError", "target must have a causal-LM head (e.g. AutoModelForCausalLM); GPTNeoXModel has no output "
                      "embeddings")
    bare = torch.nn.Linear(2, 2)
    bare.config = target.config       # a module with a config but no LM-head accessor at all
    assert _message(check_model, bare, "draft") == \
        ("TypeError", "draft must have a causal-LM head (e.g. AutoModelForCausalLM); Linear has no output embeddings")
    import copy
    other = copy.deepcopy(random_draft)
    other.config.eos_token_id = 7
    assert _message(check_pair, target, other) == \
        ("ValueError", "target and draft cannot share a tokenizer: config.eos_token_id is 0 for the target and 7 "
                       "for the draft")
    other.config.eos_token_id, other.config.bos_token_id = 0, 9
    assert _message(check_pair, target, other)[1].startswith("target and draft cannot share a tokenizer: "
                                                             "config.bos_token_id is 0")
    other.config.bos_token_id = None  # unknown on one side: nothing to compare
    assert check_pair(target, other) is None
    wide = build_gpt_neox("tiny-draft", vocab_size=512 + 640 + 1024 + 1)
    assert _message(check_pair, target, wide) == \
        ("ValueError", "target and draft cannot share a tokenizer: logit widths 640 and 2177 differ by more than "
                       "embedding padding (1024)")
    assert check_pair(target, build_gpt_neox("tiny-draft", vocab_size=640 + 1024)) is None   # a gap of exactly 1024


def test_position_limit_messages(target):
    from spec.validate import check_positions, position_limit
    assert position_limit(target) == 2048
    assert position_limit(object()) is None
    assert position_limit(type("M", (), {"config": type("C", (), {"max_position_embeddings": 1})()})()) == 1
    for bad in (0, -1, True, 2048.0, None):
        fake = type("M", (), {"config": type("C", (), {"max_position_embeddings": bad})()})()
        assert position_limit(fake) is None
    assert check_positions(2000, 48, {"target": target}) is None   # exactly at the limit
    assert _message(check_positions, 2000, 49, {"draft": target}) == \
        ("ValueError", "prompt (2000 tokens) + max_new_tokens (49) = 2049 positions exceeds the draft's limit of 2048 "
                       "(config.max_position_embeddings); shorten the prompt or lower max_new_tokens")


def test_a_target_whose_head_is_wider_than_its_embedding_is_refused_up_front(target):
    """It could emit an id it cannot be fed back (found on a tiny Inkling2 whose head kept its
    full width); greedy and speculative refuse it before any forward, a draft may have one."""
    import copy

    from spec.runner import UnsupportedModelError
    wide = copy.deepcopy(target)
    head = wide.get_output_embeddings()
    wide.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features + 8, bias=False,
                                               dtype=head.weight.dtype))
    calls = []
    wide.register_forward_pre_hook(lambda *a: calls.append(1))
    message = (f"GPTNeoXForCausalLM cannot be decoded exactly by spec: its LM head scores {head.out_features + 8} "
               f"ids but its input embedding has {head.out_features} rows: a token it emits could not be fed back to it")
    with pytest.raises(UnsupportedModelError) as info:
        greedy_generate(wide, [1, 2, 3], max_new_tokens=4)
    assert str(info.value) == "model: " + message
    with pytest.raises(UnsupportedModelError) as info:
        speculative_generate(wide, target, [1, 2, 3], max_new_tokens=4)
    assert str(info.value) == "target: " + message and calls == []


@pytest.mark.parametrize("input_ids, attention_mask, match", [
    (torch.ones(1, 2, 3, dtype=torch.long), torch.ones(1, 2, 3, dtype=torch.long), r"input_ids with an attention_mask must be \(B, n\), got shape \(1, 2, 3\)"),
    (torch.ones(2, 3, dtype=torch.long), [[1, 1, 1], [1, 1, 1]],
     r"attention_mask must be a tensor of input_ids' shape \(2, 3\), got \[\[1, 1, 1\], \[1, 1, 1\]\]"),
    (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 2, 1], [1, 1, 1]]),
     r"^attention_mask must hold only 0 \(padding\) and 1 \(token\)$"),
    (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]),
     r"^attention_mask must be left padding \(0s before 1s in each row, HF's padding_side='left'\)"),
    (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [0, 1, 0]]),     # a hole after the first token
     r"^attention_mask must be left padding"),
])
def test_bad_batch_masks_name_what_is_wrong(target, input_ids, attention_mask, match):
    with pytest.raises(ValueError, match=match):
        greedy_generate(target, input_ids, attention_mask=attention_mask, max_new_tokens=2)


def test_option_names_are_enums_that_equal_the_words_users_type():
    """spec.options: each member equals its string (so callers and results.json keep the words), and
    carries what the code branches on."""
    import json

    from spec.options import DraftImpl, GammaMode, RunnerPath, Verdict
    assert RunnerPath.KV_CACHE == "kv-cache" and json.dumps([RunnerPath.SNAPSHOT, Verdict.TIE]) == '["state-snapshot", "tie"]'
    assert [p for p in RunnerPath if p.restores_state] == [RunnerPath.SNAPSHOT, RunnerPath.STEPWISE]
    assert [p for p in RunnerPath if not p.has_cache] == [RunnerPath.RECOMPUTE]
    assert [d for d in DraftImpl if d.batches] == ["auto", "hf"]
    assert GammaMode("auto").in_the_loop and not GammaMode("calibrated").in_the_loop
    with pytest.raises(ValueError):
        DraftImpl("fast")
