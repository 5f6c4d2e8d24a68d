"""What a state-snapshot runner re-feeds: bounded per round, whatever happened before.

A recurrent state cannot be cut back like a KV cache, so after a partly rejected round the
runner restores a copy of the state and feeds the kept tokens again. The cost of that must be
what the round kept (at most gamma+1 tokens), not everything since the last fully accepted
round: with a draft that rarely agrees, the latter grows with the sequence (measured on the
earlier runner: 5,606 target tokens fed for 96 new ones on a tiny Mamba2, one pass of 102).

Every token the target's forward is fed is counted (a spy on spec.hf.step, through which every
runner runs the model), and split into rounds at the target's verify passes: a round's work is
its verify pass plus whatever its rollback feeds before the next one.
"""

from __future__ import annotations

import architectures as archs
import pytest
import torch

from fedcount import fed_per_round
from oracles import assert_logits_close

from spec import greedy_generate, runner

GAMMA = 4
NEW = 32
PROMPT = [5, 17, 42, 9, 100, 3, 77]


def _fed_per_round(target, draft):
    """(result, tokens the target's forward was fed in each round)."""
    runner.path_of(target)                     # the probe's own passes are not the loop's
    return fed_per_round(target, draft, PROMPT, gamma=GAMMA, max_new_tokens=NEW)


# A draft of another family agrees almost never (every round rolls back to its own start); the
# target with weight noise agrees now and then (rollbacks land at varying depths). Mamba runs
# one token at a time (state-stepwise), Mamba2 in blocks (state-snapshot).
@pytest.mark.parametrize(("name", "draft_kind"), [("mamba2", "other family"), ("mamba2", "perturbed"),
                                                  ("mamba", "perturbed")])
def test_snapshot_runner_refeeds_at_most_gamma_plus_one_a_round(name, draft_kind):
    target = archs.cached_model(name)
    draft = archs.draft_model(name, "gpt2" if draft_kind == "other family" else None)
    assert runner.path_of(target) == archs.EXPECTED_PATH[name]      # state-snapshot / state-stepwise
    result, fed = _fed_per_round(target, draft)
    assert result.tokens == greedy_generate(target, PROMPT, max_new_tokens=NEW).tokens
    assert len(fed) == len(result.rounds)
    assert result.accepted < result.drafted           # rounds were rejected: the case under test
    new = [len(PROMPT) - 1 + r.drafted + 1 if i == 0 else r.drafted + 1 for i, r in enumerate(result.rounds)]
    refed = [tokens - new for tokens, new in zip(fed, new)]     # beyond the verify rows (and the prompt)
    worst = max(range(len(refed)), key=refed.__getitem__)
    assert refed[worst] <= GAMMA + 1, (
        f"round {worst}: the target was fed {fed[worst]} tokens for {new[worst]} new ones, {refed[worst]} "
        f"re-fed (gamma+1 = {GAMMA + 1}); {sum(fed)} tokens fed in all for {NEW} new")
    for i, r in enumerate(result.rounds):
        assert 0 <= refed[i] <= r.accepted + 1, f"round {i}: {refed[i]} re-fed, but the round kept {r.accepted + 1}"


@pytest.mark.parametrize("name", ["mamba2", "mamba"])
def test_snapshot_runner_stays_exact_after_any_crop(name):
    """Crops the loop never makes: two in a row, behind the state copy, to 0, past the end. Each
    is exact (a crop behind the copy starts over from nothing), and after it the runner holds
    exactly the kept positions."""
    model = archs.cached_model(name)
    cls = runner.RUNNERS[archs.EXPECTED_PATH[name]]
    ids = torch.randint(0, archs.VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(input_ids=ids[None], use_cache=False).logits[0]
        run = cls(model)
        for op, at in [("feed", 12), ("feed", 20), ("crop", 17), ("crop", 14), ("feed", 25), ("crop", 30),
                       ("feed", 31), ("crop", 9), ("feed", 22), ("crop", 0), ("feed", 5), ("crop", 4),
                       ("feed", 40)]:
            if op == "crop":
                before = len(run)
                run.crop(at)
                assert len(run) == min(at, before)
                continue
            start = len(run)
            got = run(ids[start:at], keep=at - start)
            # Mamba's head hands back fp32 logits from an fp64 model: a bound from fp32's epsilon
            assert_logits_close(got, full[start:at], what=f"{name}: positions {start}..{at - 1}")
