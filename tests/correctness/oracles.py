"""Reference answers the suite checks the decoders against."""

from __future__ import annotations

import warnings

import pytest
import torch

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


# --- how far two computations of the same floating values may differ (issue 44) -----------------

# A bound in units of the dtype's epsilon times the values' scale (1 + the largest |value| of the
# reference, as spec.runner's probe measures it), never a number tuned on one CPU: the same sums
# come out in another order on another CPU (AVX2, AVX-512 and AMX kernels block them differently),
# and a tolerance that held on one flaked on the next (an fp32 atol of 1e-6 against a difference of
# 1.19e-6 on a Xeon with AMX; 2 fp32 ulps of a logit of 8).
#   fp64 and fp32 accumulate in their own precision, so two routes to one logit (a cached pass and
#   the cache-free forward, a block and one row at a time, plain tensors and the module) differ by
#   the rounding of every sum on the way: measured up to ~45 eps in fp32 (the Whisper decoder over
#   280 positions, tests/correctness/test_runner_positions.py) and ~25 in fp64. 256 eps leaves 5x
#   for a CPU that orders the sums worse.
#   bf16 and fp16 matmuls accumulate in fp32 and round once, so the difference is a few roundings of
#   the stored values: measured up to 1.8 eps in bf16 and 2.3 in fp16; 4 eps leaves 2x.
# What the bound must still catch: the runner faults measured in this project move the logits by
# 3e-4 (a multi-token pass dropping a recurrent state) to 3e-3 (an ignored cache) of the largest
# one, 2500+ fp32 eps, 10x the fp32 bound (3e-5 of the scale); a rotary table built from bf16
# positions moves bf16 logits by 7 eps past position 256, above the bf16 bound of 4.
ROUNDING_EPS = {torch.float64: 256, torch.float32: 256, torch.bfloat16: 4, torch.float16: 4}


def least_precise(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the largest epsilon: what a computation through all of them is rounded to."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def value_scale(reference: torch.Tensor) -> float:
    """1 + the largest finite |value| of the reference (a masked logit's -inf is not a scale)."""
    ref = reference.detach().double()
    finite = ref[ref.isfinite()]
    return 1.0 + (float(finite.abs().max()) if finite.numel() else 0.0)


def relative_tolerance(dtype: torch.dtype, eps: float | None = None) -> float:
    """The bound relative to the scale: `eps` (default ROUNDING_EPS[dtype]) times torch.finfo(dtype).eps."""
    return (ROUNDING_EPS[dtype] if eps is None else eps) * torch.finfo(dtype).eps


def logit_tolerance(dtype: torch.dtype, reference: torch.Tensor, eps: float | None = None) -> float:
    """The atol for values computed in `dtype` two ways: relative_tolerance(dtype, eps) times
    value_scale(reference). `dtype` is the least precise one the computation went through: the
    model's parameters, its logits (Mamba's head casts them to fp32 from an fp64 model), or a cast
    inside it (HF's eager attention takes its softmax in fp32 whatever the model's dtype)."""
    return relative_tolerance(dtype, eps) * value_scale(reference)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None, what: str = "",
                        eps: float | None = None) -> None:
    """got == want within logit_tolerance(dtype, want); dtype defaults to the least precise of the
    two tensors'. Infinities (masked logits) must match exactly. The message gives the difference
    in units of the dtype's epsilon times the scale, beside the bound's."""
    dtype = dtype or least_precise(got.dtype, want.dtype)
    atol = logit_tolerance(dtype, want, eps)
    g, w = got.detach().double(), want.detach().double()
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} against {tuple(w.shape)}"
    same = g == w                                            # equal infinities included
    diff = torch.where(same, torch.zeros_like(g), (g - w).abs())
    worst = float(diff.max()) if diff.numel() else 0.0
    unit = torch.finfo(dtype).eps * value_scale(want)
    assert not diff.isnan().any() and worst <= atol, (
        f"{what}{': ' if what else ''}largest difference {worst:.3g} = {worst / unit:.3g} eps x scale in {dtype} "
        f"(bound {atol / unit:g} eps x scale = {atol:.3g}; scale 1 + max|value| = {value_scale(want):.3g})")
