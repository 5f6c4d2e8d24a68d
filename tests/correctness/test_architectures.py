"""Every decoder family in the registry: exact against a cache-free reference, or refused up front.

The models are tiny seeded ones of ~77 transformers families (tests/correctness/architectures.py):
full attention, sliding windows of 8 tokens (every generation here is longer, so some verify pass
crosses the window), mixtures of experts, latent attention, recurrent, linear-attention and hybrid
models, and forwards with no usable cache. The reference decodes with NO cache at all (the full
forward over the whole sequence at each step), so it shares no code path with the cache, rollback
or position handling under test.

Drafts: the target itself (everything accepted: no rollback but the bonus token), the target with
weight noise (partial acceptance) and a model of a DIFFERENT family sharing the vocabulary and
special ids (almost nothing accepted: a rollback every round).

Default run: one family per cache kind (`architectures.FAST`); all families: `pytest -m thorough`.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import architectures as archs
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from oracles import assert_logits_close, cache_free_greedy
from strategies import gammas, max_new_tokens_crossing_window, short_prompts_for_tiny_vocab

import spec
from spec import greedy_generate, speculative_generate

SPEC_DIR = Path(spec.__file__).resolve().parent
EXAMPLES = 3          # hypothesis examples per family and test (each decodes up to 20 tokens a few times)
# No shrinking: a failing family reports its first failing example at once (shrinking one of these
# takes minutes, and the families in KNOWN_FAILING_ON_BASE fail on purpose).
NO_SHRINK = dict(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.reuse, Phase.generate])
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)

PROMPTS = short_prompts_for_tiny_vocab(archs.VOCAB)
LENGTHS = max_new_tokens_crossing_window(archs.SLIDING_WINDOW)


def _params(check: str, expects: tuple[str, ...]):
    out = []
    for arch in archs.REGISTRY:
        if arch.expect not in expects:
            continue
        marks = [] if arch.name in archs.FAST else [pytest.mark.thorough]
        if (arch.name, check) in archs.KNOWN_FAILING_ON_BASE:
            marks.append(pytest.mark.xfail(strict=True, reason=f"{arch.name}/{check} fails on the base "
                                           "code (architectures.KNOWN_FAILING_ON_BASE; empty it as fixes land)"))
        out.append(pytest.param(arch.name, marks=marks, id=arch.name))
    return out


def _other_family(name: str) -> str:
    """A draft family other than the target's, of plain full attention (so that the draft
    itself is never the thing under test)."""
    return "gpt2" if name != "gpt2" else "llama"


def _drafts(name: str) -> dict:
    return {"self": archs.cached_model(name), "perturbed": archs.draft_model(name),
            "other family": archs.draft_model(name, _other_family(name))}


def _decode_or_refusal(fn):
    """(tokens, None) or (None, exception) when spec refuses with one of REFUSAL_TYPES."""
    try:
        return fn(), None
    except REFUSAL_TYPES as err:
        return None, err


def assert_clear_refusal(err: BaseException, model, forwards_on_prompt: int) -> None:
    """A refusal spec raised itself, before any forward on the prompt, saying which model and why."""
    top = traceback.extract_tb(err.__traceback__)[-1]
    assert Path(top.filename).resolve().is_relative_to(SPEC_DIR), \
        f"raised from {top.filename}:{top.lineno}, not by spec: {type(err).__name__}: {err}"
    assert forwards_on_prompt == 0, f"refused only after {forwards_on_prompt} forward passes on the prompt: {err}"
    message = str(err)
    assert type(model).__name__ in message or "target" in message or "model" in message, message
    assert len(message) > 40, f"a refusal must say why, got {message!r}"


class PromptForwards:
    """Counts forward passes whose input starts with the prompt: decoding work. A check of the
    model on other ids before decoding (a probe) is not counted."""

    def __init__(self, prompt, *models):
        self.prompt, self.n = torch.tensor(prompt), 0
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                        for m in {id(m): m for m in models}.values()]

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1)
            k = min(ids.numel(), self.prompt.numel())
            self.n += bool(k) and torch.equal(ids[:k].cpu(), self.prompt[:k])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _check_exact_or_refused(name, expect, prompt, expected, run, models):
    with PromptForwards(prompt, *models) as counter:
        tokens, refusal = _decode_or_refusal(run)
    if refusal is None:
        assert tokens == expected, f"{name}: spec {tokens} != cache-free reference {expected}"
        return
    if expect == "exact":
        raise refusal
    assert_clear_refusal(refusal, models[0], counter.n)


@pytest.mark.parametrize("name", _params("greedy", ("exact", "exact_or_refused")))
@settings(**NO_SHRINK)
@given(prompt=PROMPTS, max_new_tokens=LENGTHS)
def test_greedy_equals_cache_free_reference(name, prompt, max_new_tokens):
    model = archs.cached_model(name)
    expected = cache_free_greedy(model, prompt, max_new_tokens)
    _check_exact_or_refused(name, archs.BY_NAME[name].expect, prompt, expected,
                            lambda: greedy_generate(model, prompt, max_new_tokens=max_new_tokens).tokens, [model])


@pytest.mark.parametrize("name", _params("speculative", ("exact", "exact_or_refused")))
@settings(**NO_SHRINK)
@given(prompt=PROMPTS, max_new_tokens=LENGTHS, gamma=gammas(6))
def test_speculative_equals_cache_free_reference(name, prompt, max_new_tokens, gamma):
    """Every draft kind on every example: the self draft never rolls back, the other two do,
    in particular across the sliding window."""
    target = archs.cached_model(name)
    expected = cache_free_greedy(target, prompt, max_new_tokens)
    for kind, draft in _drafts(name).items():
        _check_exact_or_refused(
            f"{name} ({kind} draft, gamma {gamma})", archs.BY_NAME[name].expect, prompt, expected,
            lambda: speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=max_new_tokens).tokens,
            [target, draft])


@pytest.mark.parametrize("name", _params("path", ("exact", "refused", "exact_or_refused")))
def test_each_family_takes_its_runner_path(name):
    """The probe's choice is pinned: a rollback broken for one cache kind makes the probe fall
    through to a slower path that is still exact, which only this check notices."""
    from spec.runner import UnsupportedModelError, path_of
    try:
        path = path_of(archs.cached_model(name))
    except UnsupportedModelError:
        path = "refused"
    assert path == archs.EXPECTED_PATH.get(name, "kv-cache"), f"{name}: runs on {path}"


@pytest.mark.parametrize("name", _params("positions", ("exact", "exact_or_refused")))
def test_each_family_gets_positions_the_way_it_counts_them(name):
    """spec passes positions only as the model counts them (spec/positions.py): 0-based where the
    forward given them equals the forward given none, RoBERTa's count (from padding_idx + 1,
    skipping pad tokens) for that family, none where the forward takes none."""
    from spec.runner import verdict
    assert verdict(archs.cached_model(name))[1] == archs.EXPECTED_POSITIONS.get(name, "explicit")


@pytest.mark.parametrize("name", _params("pad", ("exact", "exact_or_refused")))
def test_a_pad_token_inside_the_sequence_keeps_positions_exact(name):
    """RoBERTa's family gives a pad token the position padding_idx and counts on after it: a
    runner that counted positions from its cache length alone would drift from there on."""
    target = archs.cached_model(name)
    prompt = [5, 17, archs.PAD, 99, archs.PAD, 3, 250]
    expected = cache_free_greedy(target, prompt, 14)
    _check_exact_or_refused(name, archs.BY_NAME[name].expect, prompt, expected,
                            lambda: greedy_generate(target, prompt, max_new_tokens=14).tokens, [target])
    draft = archs.draft_model(name)
    _check_exact_or_refused(name, archs.BY_NAME[name].expect, prompt, expected,
                            lambda: speculative_generate(target, draft, prompt, gamma=3, max_new_tokens=14).tokens,
                            [target, draft])


@pytest.mark.parametrize("name", _params("refused", ("refused",)))
@pytest.mark.parametrize("decoder", ["greedy", "speculative"])
def test_refused_up_front_with_a_reason(name, decoder):
    model = archs.cached_model(name)
    prompt = [5, 17, 99, 3, 250]
    with PromptForwards(prompt, model) as counter:
        with pytest.raises(REFUSAL_TYPES) as info:
            if decoder == "greedy":
                greedy_generate(model, prompt, max_new_tokens=12)
            else:
                speculative_generate(model, archs.draft_model(name, "gpt2"), prompt, gamma=3, max_new_tokens=12)
    assert_clear_refusal(info.value, model, counter.n)


def test_a_refusal_says_which_model_and_is_remembered():
    """The refusal names the model's class, says whether the model still runs cache-free (a
    non-causal forward does: such a model may still draft, by recompute), and is memoised on the
    model: asking again raises the same error without running the model."""
    from spec import choose
    from spec.runner import UnsupportedModelError, path_of, probe
    model = archs.BY_NAME["xlnet"].build(0)
    with pytest.raises(UnsupportedModelError) as first:
        probe(model)
    assert str(first.value) == (f"{type(model).__name__} cannot be decoded exactly by spec: its forward is not "
                                "causal: logits of a position change with later tokens")
    assert first.value.runs_uncached is True
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(UnsupportedModelError) as again:
            path_of(model)
    finally:
        hook.remove()
    assert again.value is first.value and forwards == []
    with pytest.raises(UnsupportedModelError, match=r"^target: XLNet"):
        choose.runs({"target": model}, [1, 2, 3])
    assert type(choose.runs({"draft": model}, [1, 2, 3], draft_impl="hf").runs[0]).__name__ == "RecomputeRunner"
    assert UnsupportedModelError("why").runs_uncached is False
    assert path_of(object()) == "custom"


def test_recompute_runner_feeds_the_whole_sequence_and_crops_it():
    """RecomputeRunner against the model's own cache-free forward: all new rows by default, the
    last `keep` when asked, and a crop that forgets exactly the positions from `keep` on."""
    from spec import hf
    from spec.runner import RecomputeRunner
    model = archs.cached_model("openai-gpt")
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 8])
    full = hf.authors_forward(model, ids)
    run = RecomputeRunner(model)
    assert len(run) == 0
    assert_logits_close(run(ids[:5]), full[:5])
    assert len(run) == 5
    run.crop(3)
    assert len(run) == 3
    other = torch.tensor([1, 2])
    expected = hf.authors_forward(model, torch.cat([ids[:3], other]))
    assert_logits_close(run(other, keep=1), expected[-1:])
    assert len(run) == 5


# Target and draft of different families (tokenizer contract: same vocabulary size and special
# ids). The first two run by default.
CROSS_FAMILY = [("mistral", "llama"), ("qwen3_next", "mamba2"), ("gemma2", "gpt2"), ("mamba", "llama"),
                ("llama", "rwkv"), ("mixtral", "qwen3_next"), ("falcon_h1", "gemma3_text"), ("gpt_oss", "bloom"),
                ("recurrent_gemma", "mistral"), ("deepseek_v3", "falcon_mamba")]


@pytest.mark.parametrize("target_name,draft_name", [
    pytest.param(t, d, id=f"{t}<-{d}", marks=[] if i < 2 else [pytest.mark.thorough])
    for i, (t, d) in enumerate(CROSS_FAMILY) if t in archs.BY_NAME and d in archs.BY_NAME])
@settings(**NO_SHRINK)
@given(prompt=PROMPTS, max_new_tokens=LENGTHS, gamma=gammas(6), data=st.data())
def test_cross_family_draft(target_name, draft_name, prompt, max_new_tokens, gamma, data):
    """A draft of another family: its guesses differ, the output must not."""
    if (target_name, "speculative") in archs.KNOWN_FAILING_ON_BASE or \
            (draft_name, "speculative") in archs.KNOWN_FAILING_ON_BASE:
        pytest.xfail(f"{target_name} or {draft_name} is in KNOWN_FAILING_ON_BASE")
    target, draft = archs.cached_model(target_name), archs.draft_model(target_name, draft_name)
    expected = cache_free_greedy(target, prompt, max_new_tokens)
    _check_exact_or_refused(f"{target_name} <- {draft_name}", archs.BY_NAME[target_name].expect, prompt, expected,
                            lambda: speculative_generate(target, draft, prompt, gamma=gamma,
                                                         max_new_tokens=max_new_tokens).tokens, [target, draft])


def test_registry_covers_issue_13():
    """At least 60 families, every family issue 13 names, windows smaller than the generations,
    hybrids with a layer of each kind."""
    named = {"gpt2", "gptj", "llama", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
             "gemma", "gemma2", "gemma3_text", "phi", "phi3", "phimoe", "starcoder2", "cohere2", "olmo", "olmo3",
             "exaone4", "gpt_oss", "vaultgemma", "granite", "opt", "bloom", "mpt", "falcon", "deepseek_v3", "glm",
             "mamba", "mamba2", "falcon_mamba", "jamba", "falcon_h1", "zamba", "zamba2", "granitemoehybrid",
             "qwen3_next", "xlstm", "lfm2", "nemotron_h", "kimi_linear", "rwkv", "bamba", "recurrent_gemma", "trocr",
             "openai-gpt", "reformer", "xlnet"}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    available = named & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert available <= set(archs.BY_NAME), sorted(available - set(archs.BY_NAME))
    assert len(archs.REGISTRY) >= 60
    assert set(archs.FAST) <= set(archs.BY_NAME)
    for name in ("mistral", "gemma2", "qwen3", "gpt_oss", "phi3", "starcoder2"):
        cfg = archs.cached_model(name).config
        assert cfg.sliding_window == archs.SLIDING_WINDOW < archs.SLIDING_WINDOW + 1
    assert sorted(set(archs.cached_model("jamba").config.layer_types)) == ["full_attention", "linear_attention"]
    assert {"hybrid", "linear_attention"} <= set(archs.cached_model("zamba2").config.layers_block_type)
