"""spec.PromptLookup, the model-free n-gram draft: its proposals, exactness for greedy (fp64
target, hypothesis) and for sampling (chi-square against exact laws), round bookkeeping.

The reference here (`lookup_reference`) is written independently of spec/lookup.py, in plain
Python lists: the most recent earlier occurrence of the longest matching tail n-gram, its
continuation copied, going on with the tokens just proposed where it reaches the end."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from oracles import assert_exact
from stats import Oracle, TableLM, goodness_of_fit, random_table
from strategies import gammas, max_new_tokens_values, short_token_id_prompts, token_id_prompts

from spec import PromptLookup, greedy_generate, speculative_generate

VOCAB = 500
ALPHA = 1e-3


def lookup_reference(history: list[int], limit: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    for k in range(max_ngram, min_ngram - 1, -1):
        if k >= len(history):
            continue
        starts = [i for i in range(len(history) - k) if history[i:i + k] == history[-k:]]
        if starts:
            # what followed the most recent match, then the tokens just proposed: period len(cont)
            cont = history[starts[-1] + k:]
            return [cont[j % len(cont)] for j in range(limit)]
    return []


# --- proposals, values by hand -------------------------------------------------------------

@pytest.mark.parametrize("history, limit, expected", [
    ([5, 6, 7, 8, 9, 5, 6, 7], 5, [8, 9, 5, 6, 7]),  # tail 5 6 7 seen at 0: what followed, then the tail itself
    ([5, 6, 7, 8, 9, 5, 6, 7], 2, [8, 9]),           # capped at the limit
    ([1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),              # 3-gram 2 1 2 unseen; 2-gram 1 2 at 0: period 2
    ([3, 3, 3], 4, [3, 3, 3, 3]),                    # a loop of one token is drafted in full
    ([1, 2, 3], 4, []),                              # nothing repeats: no proposal
    ([7], 4, []),                                    # one token: nothing earlier to match
    ([4, 1, 9, 1, 8, 1], 3, [8, 1, 8]),              # 1 occurs at 1, 3: the most recent (3) wins
    ([4, 2, 1, 9, 2, 1, 8, 2, 1], 1, [8]),           # 2 1 at 1 and 4: the most recent, 4
    ([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 3, [9, 2, 3]),  # 3-gram 1 2 3 at 0 beats the later 2-gram 2 3 at 4
])
def test_proposals(history, limit, expected):
    assert PromptLookup(min_ngram=1).propose(torch.tensor(history), limit) == expected
    assert lookup_reference(history, limit, min_ngram=1) == expected


def test_default_needs_two_tokens_to_match():
    assert PromptLookup().propose(torch.tensor([4, 1, 9, 1, 8, 1]), 3) == []      # only 1-grams repeat
    assert PromptLookup().propose(torch.tensor([4, 2, 1, 9, 2, 1]), 3) == [9, 2, 1]


def test_ngram_bounds():
    h = torch.tensor([1, 2, 3, 9, 2, 3, 5, 1, 2, 3])
    assert PromptLookup(max_ngram=2, min_ngram=1).propose(h, 2) == [5, 1]   # 2-gram 2 3, most recent at 4
    assert PromptLookup(max_ngram=3, min_ngram=3).propose(torch.tensor([4, 1, 9, 1]), 2) == []
    for bad in (dict(max_ngram=0), dict(min_ngram=0), dict(max_ngram=2, min_ngram=3), dict(max_ngram=1.5)):
        with pytest.raises(ValueError, match="ngram"):
            PromptLookup(**bad)


def test_defaults_and_messages():
    assert repr(PromptLookup()) == "PromptLookup(max_ngram=3, min_ngram=2)"
    for kwargs, message in [(dict(max_ngram=True), "max_ngram must be an integer >= 1, got True"),
                            (dict(max_ngram=0), "max_ngram must be an integer >= 1, got 0"),
                            (dict(min_ngram=False), "min_ngram must be an integer >= 1, got False"),
                            (dict(min_ngram=2.0), "min_ngram must be an integer >= 1, got 2.0"),
                            (dict(max_ngram=2, min_ngram=3), "min_ngram (3) must be <= max_ngram (2)")]:
        with pytest.raises(ValueError) as info:
            PromptLookup(**kwargs)
        assert str(info.value) == message
    assert repr(PromptLookup(max_ngram=1, min_ngram=1)) == "PromptLookup(max_ngram=1, min_ngram=1)"


@given(history=st.lists(st.integers(0, 4), min_size=1, max_size=40), limit=st.integers(0, 12),
       max_ngram=st.integers(1, 4), min_ngram=st.integers(1, 4))
def test_proposals_match_the_reference(history, limit, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    assert PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram).propose(torch.tensor(history), limit) == \
        lookup_reference(history, limit, max_ngram=max_ngram, min_ngram=min_ngram)


# --- greedy: exact, whatever was proposed ---------------------------------------------------

def repetitive_prompts(vocab: int):
    """Prompts made of a short random motif repeated (lookup finds matches) or random ids."""
    motif = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)
    return st.one_of(st.builds(lambda m, r: m * r, motif, st.integers(1, 8)), short_token_id_prompts(vocab))


@given(prompt=st.one_of(token_id_prompts(VOCAB), repetitive_prompts(VOCAB)), gamma=gammas(12),
       max_new_tokens=max_new_tokens_values(64), max_ngram=st.integers(1, 4))
def test_lookup_equals_greedy(target, prompt, gamma, max_new_tokens, max_ngram):
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    actual = speculative_generate(target, PromptLookup(max_ngram=max_ngram, min_ngram=1), prompt, gamma=gamma,
                                  max_new_tokens=max_new_tokens).tokens
    assert_exact(target, prompt, expected, actual)


@given(prompt=repetitive_prompts(VOCAB), gamma=gammas(8), max_new_tokens=max_new_tokens_values(40),
       data=st.data())
def test_lookup_with_eos_equals_greedy(target, prompt, gamma, max_new_tokens, data):
    free = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    eos = free[data.draw(st.integers(0, len(free) - 1), label="eos position")]
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    actual = speculative_generate(target, PromptLookup(), prompt, gamma=gamma, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos)
    assert_exact(target, prompt, expected.tokens, actual.tokens)
    assert actual.stop_reason == "eos"


@given(prompt=repetitive_prompts(VOCAB), gamma=gammas(10), max_new_tokens=max_new_tokens_values(48))
def test_rounds_follow_the_reference(target, prompt, gamma, max_new_tokens):
    """Every round: the reference's proposal for the history so far (fewer than gamma, or none,
    where the match's continuation allows), accepted as far as it agrees with greedy's output,
    plus one target token; the target cache holds all but the newest token; no draft cache."""
    greedy = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    run = speculative_generate(target, PromptLookup(), prompt, gamma=gamma, max_new_tokens=max_new_tokens,
                               trace=True)
    assert run.tokens == greedy
    n = 0
    for i, r in enumerate(run.trace):
        proposal = lookup_reference(prompt + greedy[:n], min(gamma, max_new_tokens - n - 1))
        agree = next((j for j, t in enumerate(proposal) if t != greedy[n + j]), len(proposal))
        assert (r.drafted, r.accepted, r.emitted) == (len(proposal), agree, agree + 1), f"round {i}"
        n += r.emitted
        assert r.target_cache == len(prompt) + n - 1 and r.draft_cache == 0
    assert n == max_new_tokens == len(run.tokens) and len(run.rounds) == len(run.trace)


def test_lookup_drafts_and_is_accepted_where_text_repeats(target):
    """Not vacuous: the random fp64 target's greedy text falls into a loop, which lookup drafts."""
    prompt = [3, 141, 59, 26, 53, 58, 97, 93]
    run = speculative_generate(target, PromptLookup(), prompt, gamma=8, max_new_tokens=96)
    assert run.tokens == greedy_generate(target, prompt, max_new_tokens=96).tokens
    assert run.accepted >= 20 and len(run.rounds) < 96 - 20, (run.accepted, len(run.rounds))
    assert 0 in run.drafted_per_round  # and rounds with no match drafted nothing


def test_lookup_auto_gamma_is_exact(target):
    prompt = [5, 9, 5, 9, 5, 9, 2]
    run = speculative_generate(target, PromptLookup(), prompt, gamma="auto", max_new_tokens=64)
    assert run.tokens == greedy_generate(target, prompt, max_new_tokens=64).tokens


# --- sampling: distributed exactly as the target ---------------------------------------------

@pytest.fixture(scope="module")
def table_target():
    """V = 4 second-order Markov chain (stats.TableLM), fp64; exact laws via stats.Oracle."""
    return TableLM(random_table(4, 4, seed=10))


def _draw(model, prompt, gamma, n, seed, m):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        r = speculative_generate(model, PromptLookup(min_ngram=1), list(prompt), gamma=gamma, do_sample=True,
                                 max_new_tokens=m, generator=gen)
        out.append((tuple(r.tokens), r.drafted_per_round[0], r.accepted_per_round[0]))
    return out


@pytest.mark.parametrize("prompt, gamma, n, seed", [
    ((1, 2, 1), 2, 1500, 1),   # proposes [2, 1] in round 1
    ((0, 1, 2), 3, 1000, 2),   # nothing to match in round 1 (drafts 0); matches come from the output
])
def test_lookup_sampling_matches_exact_law(table_target, prompt, gamma, n, seed):
    P = Oracle(table_target)
    m = 3
    batch = _draw(table_target, prompt, gamma, n, seed, m)
    seqs = list(itertools.product(range(4), repeat=m))
    probs = [math.prod(float(P(prompt + s[:i])[s[i]]) for i in range(m)) for s in seqs]
    observed = [0] * len(seqs)
    for tokens, _, _ in batch:
        observed[seqs.index(tokens[:m])] += 1
    joint = goodness_of_fit("joint law of the first 3 tokens", {"all": (observed, probs)})
    assert joint.df > 0 and not joint.rejects(ALPHA), str(joint)

    # First token by path. A one-hot q at the proposal x: accepted with probability p(x); on
    # rejection drawn from norm(max(0, p - q)) = p without x, so (x, rejected) is impossible.
    proposal = lookup_reference(list(prompt), gamma, min_ngram=1)
    p = P(prompt)
    if proposal:
        x = proposal[0]
        cells = [(t, acc) for t in range(4) for acc in (False, True)]
        probs = [float(p[t]) if (acc == (t == x)) else 0.0 for t, acc in cells]
        observed = [0] * len(cells)
        for tokens, g, k in batch:
            assert g == len(proposal)
            observed[cells.index((tokens[0], k >= 1))] += 1
        paths = goodness_of_fit("first token by path", {"all": (observed, probs)})
        assert paths.df > 0 and not paths.rejects(ALPHA), str(paths)
    else:
        assert all(g == 0 for _, g, _ in batch)


def test_lookup_sampling_check_catches_a_wrong_residual(table_target, monkeypatch):
    """The path check above must fail if a rejection resampled from p (q ignored)."""
    from spec import sampling
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    batch = _draw(table_target, (1, 2, 1), 2, 400, 5, 3)
    assert any(tokens[0] == 2 and k == 0 for tokens, _, k in batch)  # (x, rejected): probability 0
