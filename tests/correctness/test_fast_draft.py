"""draft_impl="compiled" (static KV cache + compiled draft step) changes speed, never tokens.

The draft is fp64 so that its proposals do not depend on how its cache is laid
out: the static-cache run must then match the dynamic-cache run round for round,
which is what shows that rolling the static cache back (moving its write
position) is exact."""

from __future__ import annotations

import pytest
from hypothesis import given
from strategies import gammas, max_new_tokens_values, short_token_id_prompts

from spec import hf, speculative_generate
from spec.models import perturbed_copy


@pytest.fixture(scope="module")
def fp64_draft(target):
    return perturbed_copy(target, noise=0.1, seed=3)


@pytest.fixture(scope="module")
def eager_static_step():
    """The static-cache path with the compile step replaced by the eager forward:
    compiling takes minutes on a 2-core CPU, the thorough test below does it once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "compile_step", lambda model: model.forward)
        yield


@given(prompt=short_token_id_prompts(500), gamma=gammas(10), max_new_tokens=max_new_tokens_values(40))
def test_static_draft_cache_matches_dynamic(target, fp64_draft, eager_static_step, prompt, gamma, max_new_tokens):
    plain = speculative_generate(target, fp64_draft, prompt, gamma=gamma, max_new_tokens=max_new_tokens)
    fast = speculative_generate(target, fp64_draft, prompt, gamma=gamma, max_new_tokens=max_new_tokens,
                                draft_impl="compiled", trace=True)
    assert fast.tokens == plain.tokens
    assert fast.accepted_per_round == plain.accepted_per_round
    n = len(prompt)
    for r in fast.trace:
        n += r.emitted
        assert r.draft_cache <= n - 1


@pytest.mark.thorough
def test_compiled_draft_step_is_exact(target):
    fp64_draft = perturbed_copy(target, noise=0.1, seed=3)  # a fresh model: no eager step cached on it
    prompt = [3, 141, 59, 26, 53]
    plain = speculative_generate(target, fp64_draft, prompt, gamma=4, max_new_tokens=40)
    fast = speculative_generate(target, fp64_draft, prompt, gamma=4, max_new_tokens=40, draft_impl="compiled")
    assert fast.tokens == plain.tokens and fast.accepted_per_round == plain.accepted_per_round


def test_static_cache_lengths_come_in_buckets(target, eager_static_step):
    """The compiled step is specialised to the cache's shape: prompts of different lengths
    must get the same static cache shape, or every call would recompile (minutes on CPU)."""
    def length(n):
        return hf.Cached(target, static_len=n).cache.layers[0].max_cache_len

    assert length(10) == length(200) == 256
    assert length(257) == length(512) == 512
    assert length(513) == 1024
