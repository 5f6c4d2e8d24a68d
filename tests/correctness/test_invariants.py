"""Bookkeeping invariants of every speculative run, whatever the draft."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import gammas, max_new_tokens_values, short_token_id_prompts

from spec import greedy_generate, speculative_generate

VOCAB = 500


@pytest.mark.parametrize("draft_impl", ["plain", "hf"])
@pytest.mark.parametrize("draft_kind", ["self", "random", "partial", "shallow"])
@given(prompt=short_token_id_prompts(VOCAB), gamma=gammas(16), max_new_tokens=max_new_tokens_values(40))
def test_round_statistics_are_consistent(target, drafts, draft_kind, draft_impl, prompt, gamma, max_new_tokens):
    run = speculative_generate(target, drafts[draft_kind], prompt, gamma=gamma,
                               max_new_tokens=max_new_tokens, trace=True, draft_impl=draft_impl)
    P = len(prompt)
    assert len(run.tokens) == max_new_tokens                    # no EOS given: never short, never over
    assert len(run.rounds) == len(run.drafted_per_round) == len(run.accepted_per_round) == len(run.trace)
    assert sum(run.tokens_per_round) == len(run.tokens)
    assert run.drafted == sum(r.drafted for r in run.trace)
    assert run.accepted == sum(r.accepted for r in run.trace) <= run.drafted
    n = P
    for i, r in enumerate(run.trace):
        left = max_new_tokens - (n - P)
        assert r.drafted == min(gamma, left - 1), f"round {i}: drafted {r.drafted} with {left} tokens left"
        assert 0 <= r.accepted <= r.drafted
        assert 1 <= r.emitted <= gamma + 1
        assert r.emitted == r.accepted + 1                       # no EOS: the prefix plus one target token
        assert (r.drafted, r.accepted, r.emitted) == (run.drafted_per_round[i], run.accepted_per_round[i],
                                                      run.tokens_per_round[i])
        n += r.emitted
        # After rollback both caches hold only final tokens: the target all but the newest,
        # the draft at most that (one behind after a fully accepted round).
        assert r.target_cache == n - 1, f"round {i}: target cache {r.target_cache}, sequence {n}"
        assert r.draft_cache <= n - 1, f"round {i}: draft cache {r.draft_cache} holds rejected tokens"
        if r.drafted:
            assert r.draft_cache >= n - 2, f"round {i}: draft cache {r.draft_cache} lags sequence {n}"
        assert r.draft_s >= 0 and r.verify_s > 0


def test_draft_equal_to_target_accepts_everything(target, self_draft):
    run = speculative_generate(target, self_draft, [5, 6, 7], gamma=4, max_new_tokens=23)
    assert run.tokens_per_round == [5, 5, 5, 5, 3]               # gamma+1 a round; the last round drafts 2
    assert run.accepted_per_round == run.drafted_per_round == [4, 4, 4, 4, 2]
    assert run.accept_rate == 1.0 and run.alpha == 1.0


def test_unrelated_random_draft_accepts_nothing(target, random_draft):
    run = speculative_generate(target, random_draft, [5, 6, 7], gamma=4, max_new_tokens=20)
    assert run.accepted == 0 and run.tokens_per_round == [1] * 20
    assert run.alpha == 0.0


def test_partial_acceptance_statistics(target, partial_draft):
    run = speculative_generate(target, partial_draft, list(range(10, 40)), gamma=5, max_new_tokens=64)
    assert 0 < run.accepted < run.drafted
    assert any(0 < k < 5 for k in run.accepted_per_round)
    assert run.accept_rate == pytest.approx(run.accepted / run.drafted)
    # alpha (per-token) exceeds accepted/drafted: tokens after a rejection are never tested.
    assert run.alpha > run.accept_rate
    assert run.mean_tokens_per_round == pytest.approx(len(run.tokens) / len(run.rounds))


def test_greedy_result_shape(target):
    run = greedy_generate(target, [1, 2, 3], max_new_tokens=9, trace=True)
    assert len(run.tokens) == 9 and len(run.rounds) == 9 and run.drafted == 0 and run.accepted == 0
    assert [r.target_cache for r in run.trace] == list(range(3, 12))


def test_sampling_draws_from_the_callers_generator_only(target, partial_draft):
    """The caller's generator decides every draw (the draft's, the acceptance test's, the residual's):
    the global RNG's state changes nothing, so a seeded run is reproducible wherever it is called from."""
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runs.append([speculative_generate(target, partial_draft, [1, 2, 3], do_sample=True, gamma=4,
                                          max_new_tokens=24, generator=torch.Generator().manual_seed(7)).tokens,
                     greedy_generate(target, [1, 2, 3], do_sample=True, max_new_tokens=8,
                                     generator=torch.Generator().manual_seed(7)).tokens])
    assert runs[0] == runs[1]


def test_traced_rounds_carry_their_phase_times_and_untraced_ones_none(target, partial_draft):
    """trace=True: each Round's draft and verify times are durations of this run (not clock readings or
    sums of them); trace=False: no timings and no cache sizes, so nothing pays for the clock."""
    traced = speculative_generate(target, partial_draft, [1, 2, 3], gamma=4, max_new_tokens=16, trace=True)
    assert traced.rounds and all(0 <= r.draft_s < 60 and 0 <= r.verify_s < 60 for r in traced.rounds)
    assert all(r.target_cache is not None and r.draft_cache is not None for r in traced.rounds)
    plain = speculative_generate(target, partial_draft, [1, 2, 3], gamma=4, max_new_tokens=16)
    assert plain.rounds and all(r.draft_s is None and r.verify_s is None and r.target_cache is None
                                for r in plain.rounds)
