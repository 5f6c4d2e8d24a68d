"""Reference answers the suite checks the decoders against."""

from __future__ import annotations

import warnings

import pytest

from spec import greedy_generate
from spec.diagnose import diagnose


def assert_exact(target, prompt, expected: list[int], actual: list[int], *, allow_ties: bool = False):
    """Fail with the diagnosis (position, both tokens, top-2 gap on both paths, verdict)
    unless the outputs agree. A proven tie passes only with allow_ties, and is reported."""
    d = diagnose(target, prompt, expected, actual)
    if d is None:
        return None
    if d.verdict == "tie" and allow_ties:
        warnings.warn(f"numerical tie, not a bug: {d}")
        return d
    pytest.fail(str(d), pytrace=False)


def reference_rounds(draft, prompt: list[int], greedy_tokens: list[int], gamma: int, max_new_tokens: int):
    """Algorithm 1 replayed without any cache: per round (drafted, accepted, emitted).

    Each round drafts min(gamma, tokens left - 1) tokens as the draft's own greedy
    continuation of the context (recomputed from scratch), accepts the prefix that
    matches the target's greedy output, and emits one more token (cut at the end,
    which is where greedy stopped at EOS or max_new_tokens)."""
    return replay_rounds(greedy_tokens, gamma, max_new_tokens,
                         lambda n, g: greedy_generate(draft, prompt + greedy_tokens[:n], max_new_tokens=g).tokens)


def replay_rounds(expected: list[int], gamma: int, max_new_tokens: int, propose):
    """Algorithm 1's bookkeeping for a target whose greedy output is `expected`: per round
    (drafted, accepted, emitted); propose(n, g) is the draft's g tokens after expected[:n]."""
    rounds, n = [], 0
    while n < len(expected):
        g = min(gamma, max_new_tokens - n - 1)
        proposals = propose(n, g) if g else []
        k = 0
        while k < g and n + k < len(expected) and proposals[k] == expected[n + k]:
            k += 1
        emitted = min(k + 1, len(expected) - n)
        rounds.append((g, k, emitted))
        n += emitted
    return rounds


# --- cache-free references (issue 13) ---------------------------------------------------

def _forward_kwargs(model, length: int) -> dict:
    """The forward as its authors call it: the ids, an all-ones attention mask, and no
    positions (the model counts them itself; RoBERTa's family counts from padding_idx + 1);
    use_cache=False where the forward takes it: the reference must not touch any cache."""
    import inspect

    import torch
    params = inspect.signature(type(model).forward).parameters
    kwargs = {"use_cache": False} if "use_cache" in params else {}
    if "attention_mask" in params:
        kwargs["attention_mask"] = torch.ones(1, length, dtype=torch.long, device=next(model.parameters()).device)
    return kwargs


def cache_free_greedy(model, prompt, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Greedy decoding with no cache at all: the full forward over the whole sequence at
    each step, argmax of the last position. Slow (quadratic) and independent of every
    cache, rollback and position-inference path, which is what makes it the reference."""
    import torch
    seq = [int(t) for t in (prompt.reshape(-1).tolist() if hasattr(prompt, "reshape") else prompt)]
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([seq], device=device), **_forward_kwargs(model, len(seq))).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            seq.append(token)
            if eos_token_id is not None and token == eos_token_id:
                break
    return out


def plain_greedy_generation_config(max_new_tokens: int):
    """A GenerationConfig for plain greedy decoding and nothing else. generate() fills every
    unset field from the model's own generation_config (BART's forced EOS, n-gram blocking,
    beams...), so callers also swap the model's config for this one while generating."""
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=0)


# The keywords a forward takes its cache under, and the output fields it returns it in.
_CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "state", "past_buckets_states", "mems")


def model_own_cached_greedy(model, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding on the model's OWN cache, driven as its authors drive it: the prompt, then
    one token at a time, each call given the new ids, the cache the last call returned and,
    where the forward takes it, the cache_position its authors' generate() passes, and nothing
    else (no positions, no mask: Mamba's mixer multiplies its hidden states by a mask it is given,
    and a mask over the whole sequence on a one-token step broadcasts). Where it
    disagrees with cache_free_greedy the model's cached forward is itself inconsistent with its
    full forward ("self-inconsistent"); HF generate disagreeing proves nothing of the kind (it
    passes its own 0-based positions, wrong for RoBERTa's family). Raises where the forward
    takes no cache (nothing to judge)."""
    import inspect

    import torch
    params = inspect.signature(type(model).forward).parameters
    name = next((k for k in _CACHE_KWARGS if k in params), None)
    if name is None:
        raise TypeError(f"{type(model).__name__}'s forward takes no cache")
    device = next(model.parameters()).device
    seq, feed, cache, out = [int(t) for t in prompt], [int(t) for t in prompt], None, []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            kwargs = {"input_ids": torch.tensor([feed], device=device), "use_cache": True}
            if cache is not None:
                kwargs[name] = cache
            if "cache_position" in params:
                kwargs["cache_position"] = torch.arange(len(seq) - len(feed), len(seq), device=device)
            result = model(**kwargs)
            cache = next((getattr(result, k) for k in _CACHE_KWARGS if getattr(result, k, None) is not None), None)
            if cache is None:
                raise TypeError(f"{type(model).__name__}'s forward returned no cache")
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            feed = [token]
    return out


def model_cached_greedy(model, prompt, max_new_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)` on the model, no EOS stop: the peer's verdict, reported
    beside spec's (tests/sweep_architectures.py), never used to excuse it."""
    import torch
    device = next(model.parameters()).device
    ids = torch.tensor([[int(t) for t in prompt]], device=device)
    config = plain_greedy_generation_config(max_new_tokens)
    saved, model.generation_config = model.generation_config, plain_greedy_generation_config(max_new_tokens)
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config = saved
    return out[0, ids.shape[1]:].tolist()
