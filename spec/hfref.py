"""Hugging Face's own decoders, called the way spec compares itself with them: generate() for plain
greedy (one prompt and a left-padded batch), for sampling, assisted generation and prompt lookup.
The references of the suite, the kit and the CLI; the runtime never calls them.

`generate()` (5.17 and 5.24 alike) fills every unset field of the GenerationConfig it is given
from the model's own generation_config: every call here sets the model's aside for the call
(`as_only_config`), so that eos_token_id=None means no EOS stop. The transformers-version shims
the runtime needs are spec.hf's.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig

from spec.hf import logit_width, vocab_rows


def _greedy_config(max_new_tokens: int, eos_token_id) -> GenerationConfig:
    """Plain greedy decoding for exactly max_new_tokens, or to `eos_token_id` (None: no EOS).

    Every field left unset here would be filled by generate() from the model's own
    generation_config (5.17 and 5.24 alike: `_prepare_generation_config` updates the
    None fields from it), so this config is only half the fix: `as_only_config`
    puts it in place of the model's for the call."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                           num_beams=1)
    # generate() compares pad_token_id with single ids: the first of an EOS list stands in.
    first_eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    cfg.pad_token_id = first_eos if first_eos is not None else 0
    return cfg


@contextlib.contextmanager
def as_only_config(cfg: GenerationConfig, *models):
    """`cfg` as the generation config of each of `models` for the duration of a generate() call.

    generate() merges the model's generation_config into the config it is passed, None
    fields first: a model shipped with an EOS (every real checkpoint) would stop there
    although eos_token_id=None was asked for, and a shipped repetition_penalty or
    min_length would change the "greedy" reference. With the model's config replaced by
    `cfg` itself there is nothing left to merge in."""
    saved = [m.generation_config for m in models]
    try:
        for m in models:
            m.generation_config = copy.deepcopy(cfg)
        yield
    finally:
        for m, old in zip(models, saved):
            m.generation_config = old


@torch.inference_mode()
def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """New tokens of `model.generate(do_sample=False)`: the reference oracle.
    eos_token_id=None: exactly max_new_tokens tokens, whatever the model's own generation_config says."""
    ids = prompt.reshape(1, -1).to(model.device)
    cfg = _greedy_config(max_new_tokens, eos_token_id)
    with as_only_config(cfg, model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, ids.shape[1]:].tolist()


def assistant_for(target, draft):
    """The draft as HF assisted generation will take it.

    HF refuses a pair whose logit widths differ (pythia-12b 50688 vs pythia-410m
    50304). We widen a copy of the draft's head with zero rows: a zero logit never
    beats a trained model's top logit in practice, and HF's output is the target's
    greedy output whatever the draft proposes, so exactness does not depend on it."""
    width = logit_width(target)
    if logit_width(draft) == width:
        return draft
    if logit_width(draft) > width:
        raise ValueError(f"draft: logit width {logit_width(draft)} exceeds the target's {width}")
    wide = copy.deepcopy(draft)
    rows = vocab_rows(wide)
    # HF also feeds the draft every id the target emits, so the embedding grows too.
    wide.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        wide.get_output_embeddings().weight[rows:].zero_()
        wide.get_input_embeddings().weight[rows:].zero_()
    return wide


@contextlib.contextmanager
def _seeded_global_rng(generator, device):
    """HF generate() takes no generator and samples from torch's global RNG: seed that from
    `generator` for the call, and put the global state back afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if generator is not None:
            torch.manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=generator)))
        yield


def _generation_config(max_new_tokens, eos, do_sample, temperature, top_k, top_p, min_p, min_new_tokens,
                       repetition_penalty, no_repeat_ngram_size, sequence_bias, bad_words_ids,
                       top_k_as_given) -> GenerationConfig:
    """Every option hf_generate takes, set explicitly (see as_only_config)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or 0, num_beams=1,
                           do_sample=do_sample,
                           eos_token_id=eos, pad_token_id=(eos[0] if isinstance(eos, list) else eos) or 0,
                           repetition_penalty=repetition_penalty or 1.0,
                           no_repeat_ngram_size=no_repeat_ngram_size or 0)
    if do_sample:
        cfg.temperature, cfg.top_p = float(temperature), 1.0 if top_p is None else top_p
        cfg.top_k = top_k if top_k_as_given else top_k or 0   # 0: no top-k (None would become 50)
        cfg.min_p = min_p
    if sequence_bias is not None:   # HF's list form [[ids], bias] (its dict form wants float biases)
        cfg.sequence_bias = [[list(ids), float(bias)] for ids, bias in dict(sequence_bias).items()]
    if bad_words_ids is not None:
        cfg.bad_words_ids = [list(ids) for ids in bad_words_ids]
    return cfg


@torch.inference_mode()
def hf_generate(target, input_ids, *, max_new_tokens, eos_token_id=None, do_sample=False, temperature=1.0,
                top_k=None, top_p=None, repetition_penalty=None, no_repeat_ngram_size=None, min_p=None,
                min_new_tokens=None, sequence_bias=None, bad_words_ids=None, generator=None,
                assistant=None, gamma=None, schedule: str = "constant", prompt_lookup_num_tokens=None,
                top_k_as_given=False, **generation_options) -> list[int]:
    """New tokens of target.generate(): the one HF peer (assisted generation, prompt lookup, plain
    decoding) for the CLI, the perf suite and the conformance kit.

    Assisted by `assistant` (gamma tokens a round, `schedule` "constant" or HF's "heuristic"; the
    confidence threshold zeroed so that every round drafts gamma) or by prompt lookup, with every
    option set explicitly and an all-ones attention mask (without one, HF masks every prompt position
    equal to pad_token_id). HF reads gamma from the assistant's own generation_config, not from
    generate()'s: target's and assistant's configs are replaced for the call and put back after it,
    whatever happens (as_only_config). input_ids: a list of ints or a 1-D or (1, n) tensor.
    generation_options: further GenerationConfig fields, set as given. top_k_as_given: pass top_k=None
    on as None, which HF fills with its default of 50 (the harness mistake; for the kit's own tests)."""
    eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id
    cfg = _generation_config(max_new_tokens, eos, do_sample, temperature, top_k, top_p, min_p, min_new_tokens,
                             repetition_penalty, no_repeat_ngram_size, sequence_bias, bad_words_ids, top_k_as_given)
    for key, value in generation_options.items():
        setattr(cfg, key, value)
    if prompt_lookup_num_tokens is not None:
        cfg.prompt_lookup_num_tokens = prompt_lookup_num_tokens
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(target.device)
    kwargs = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(as_only_config(cfg, target))
        if assistant is not None:
            stack.enter_context(as_only_config(GenerationConfig(
                num_assistant_tokens=gamma, num_assistant_tokens_schedule=schedule,
                assistant_confidence_threshold=0.0, eos_token_id=eos, pad_token_id=cfg.pad_token_id), assistant))
            kwargs["assistant_model"] = assistant
        stack.enter_context(_seeded_global_rng(generator, target.device))
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def hf_assisted(target, assistant, prompt: torch.Tensor, gamma: int, max_new_tokens: int,
                eos_token_id=None, schedule: str = "constant") -> list[int]:
    """New tokens of HF assisted generation with `gamma` draft tokens a round (hf_generate)."""
    return hf_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       assistant=assistant, gamma=gamma, schedule=schedule)


def hf_prompt_lookup(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                     num_tokens: int = 10, max_ngram: int = 2) -> list[int]:
    """New tokens of HF's prompt-lookup decoding (`prompt_lookup_num_tokens`): greedy,
    drafting by n-gram match in the prompt and output so far, verified by `model` (hf_generate)."""
    return hf_generate(model, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram)


def hf_greedy_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_token_id=None) -> list[list[int]]:
    """Each row's new tokens from `model.generate(do_sample=False)` on a left-padded batch, cut
    after its EOS: HF's batch, the greedy peer of spec's batches."""
    cfg = _greedy_config(max_new_tokens, eos_token_id)
    with as_only_config(cfg, model):
        out = model.generate(input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             generation_config=cfg)
    rows = out[:, input_ids.shape[1]:].tolist()
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]
