"""Greedy speculative decoding is exact: the same tokens as plain greedy decoding.

The target runs in fp64, so any divergence here is a bug (the failure message says
where, and shows the target's top-2 gap on both paths). Peers: HF generate(do_sample=False)
for greedy, HF assisted generation for speculative.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from oracles import assert_exact, reference_rounds
from strategies import gammas, max_new_tokens_values, short_token_id_prompts, text_prompts, token_id_prompts

from spec import greedy_generate, hfref, speculative_generate
from spec.models import perturbed_copy

VOCAB = 500  # ids every fixture model can embed (the tiny pair's "tokenizer")


@given(prompt=token_id_prompts(VOCAB), max_new_tokens=max_new_tokens_values(48))
def test_greedy_equals_hf_generate(target, prompt, max_new_tokens):
    ours = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    theirs = hfref.hf_greedy(target, torch.tensor(prompt), max_new_tokens)
    assert len(ours) == max_new_tokens
    assert_exact(target, prompt, theirs, ours)


@given(prompt=short_token_id_prompts(VOCAB), max_new_tokens=max_new_tokens_values(48), data=st.data())
def test_greedy_with_eos_equals_hf_generate(target, prompt, max_new_tokens, data):
    free = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    eos = free[data.draw(st.integers(0, len(free) - 1), label="eos position")]
    ours = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    theirs = hfref.hf_greedy(target, torch.tensor(prompt), max_new_tokens, eos_token_id=eos)
    assert_exact(target, prompt, theirs, ours.tokens)
    assert ours.tokens[-1] == eos and ours.stop_reason == "eos"
    assert eos not in ours.tokens[:-1]


@pytest.mark.parametrize("draft_kind", ["self", "random", "partial", "shallow"])
@given(prompt=token_id_prompts(VOCAB), gamma=gammas(16), max_new_tokens=max_new_tokens_values(64))
def test_speculative_equals_greedy(target, drafts, draft_kind, prompt, gamma, max_new_tokens):
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    actual = speculative_generate(target, drafts[draft_kind], prompt, gamma=gamma,
                                  max_new_tokens=max_new_tokens).tokens
    assert_exact(target, prompt, expected, actual)


@pytest.mark.parametrize("draft_kind", ["self", "partial", "shallow"])
@given(prompt=short_token_id_prompts(VOCAB), gamma=gammas(8), max_new_tokens=max_new_tokens_values(40),
       data=st.data())
def test_speculative_with_eos_equals_greedy(target, drafts, draft_kind, prompt, gamma, max_new_tokens, data):
    """EOS chosen from the continuation itself, so generation ends early: inside an
    accepted block, on the bonus token, or on a correction token."""
    free = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    eos = free[data.draw(st.integers(0, len(free) - 1), label="eos position")]
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    actual = speculative_generate(target, drafts[draft_kind], prompt, gamma=gamma,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert_exact(target, prompt, expected.tokens, actual.tokens)
    assert actual.stop_reason == expected.stop_reason == "eos"


@pytest.fixture(scope="session")
def fp64_partial_draft(target):
    """Like partial_draft, but fp64, so its own argmaxes are chunking-independent and
    the cache-free replay below predicts every round exactly."""
    return perturbed_copy(target, noise=0.1, seed=3)


@pytest.mark.parametrize("draft_impl", ["plain", "hf"])
@given(prompt=short_token_id_prompts(VOCAB), gamma=gammas(8), max_new_tokens=max_new_tokens_values(40),
       use_eos=st.booleans(), data=st.data())
def test_rounds_match_algorithm_1_replayed_without_caches(target, fp64_partial_draft, draft_impl, prompt, gamma,
                                                          max_new_tokens, use_eos, data):
    """Per-round drafted/accepted/emitted counts equal a cache-free replay of Algorithm 1.

    This is what catches a draft cache that is not rolled back: the output stays
    exact (the target decides every token), but the draft proposes from a wrong
    context and the accepted counts change."""
    eos = None
    if use_eos:
        free = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
        eos = free[data.draw(st.integers(0, len(free) - 1), label="eos position")]
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos).tokens
    run = speculative_generate(target, fp64_partial_draft, prompt, gamma=gamma,
                               max_new_tokens=max_new_tokens, eos_token_id=eos, draft_impl=draft_impl)
    assert_exact(target, prompt, expected, run.tokens)
    replay = reference_rounds(fp64_partial_draft, prompt, expected, gamma, max_new_tokens)
    assert list(zip(run.drafted_per_round, run.accepted_per_round, run.tokens_per_round)) == replay


@given(prompt=short_token_id_prompts(VOCAB), gamma=gammas(8), max_new_tokens=max_new_tokens_values(32))
def test_fp32_target_bf16_draft_equal_up_to_proven_ties(target_fp32, shallow_draft, prompt, gamma, max_new_tokens):
    """The seed's mixed set-up on CPU: fp32 target, bf16 draft. A divergence passes only
    if the diagnosis proves a tie at the first divergent position (and it is reported)."""
    expected = greedy_generate(target_fp32, prompt, max_new_tokens=max_new_tokens).tokens
    actual = speculative_generate(target_fp32, shallow_draft, prompt, gamma=gamma,
                                  max_new_tokens=max_new_tokens).tokens
    assert_exact(target_fp32, prompt, expected, actual, allow_ties=True)


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("prompt", [[7], [3, 141, 59, 26, 53, 58, 97, 93], list(range(1, 200, 3))])
def test_speculative_equals_hf_assisted_generation(target, partial_draft, prompt, gamma):
    """A second peer: HF assisted generation with the same gamma gives the same tokens."""
    ours = speculative_generate(target, partial_draft, prompt, gamma=gamma, max_new_tokens=24).tokens
    theirs = hfref.hf_assisted(target, hfref.assistant_for(target, partial_draft), torch.tensor(prompt), gamma, 24)
    assert_exact(target, prompt, theirs, ours)


@given(text=text_prompts(), gamma=gammas(8), max_new_tokens=max_new_tokens_values(24))
def test_shipped_pair_text_prompts(shipped_pair, text, gamma, max_new_tokens):
    """Text through the shipped tokenizer, the trained pair (target fp64, draft fp32)."""
    prompt = shipped_pair.tokenizer(text).input_ids
    assume(prompt)
    eos = shipped_pair.tokenizer.eos_token_id
    expected = greedy_generate(shipped_pair.target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    actual = speculative_generate(shipped_pair.target, shipped_pair.draft, prompt, gamma=gamma,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert_exact(shipped_pair.target, prompt, expected.tokens, actual.tokens)


def test_a_draft_wider_than_the_target_proposes_only_ids_the_target_scores(target, random_draft):
    """The 640-wide model drafting for the 512-wide one: its proposals are cut to the 512 ids both share,
    so greedy output is the narrow target's own, and sampling never proposes an id it cannot score."""
    narrow, wide = random_draft, target
    want = greedy_generate(narrow, [1, 2, 3], max_new_tokens=16).tokens
    assert speculative_generate(narrow, wide, [1, 2, 3], gamma=4, max_new_tokens=16).tokens == want
    sampled = speculative_generate(narrow, wide, [1, 2, 3], gamma=4, max_new_tokens=16, do_sample=True,
                                   generator=torch.Generator().manual_seed(0)).tokens
    assert max(sampled) < 512
