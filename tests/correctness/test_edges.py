"""Named edge cases of the contract, each a plain deterministic test."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_exact

from spec import greedy_generate, hf, hfref, speculative_generate

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93]


@pytest.fixture(scope="module")
def continuation(target):
    return greedy_generate(target, PROMPT, max_new_tokens=40).tokens


def _first_occurrence_positions(tokens):
    seen, first = set(), {}
    for i, t in enumerate(tokens):
        if t not in seen:
            seen.add(t)
            first[i] = t
    return first


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_eos_as_bonus_token(target, self_draft, continuation, gamma):
    """draft = target: every round emits gamma+1 tokens, so position gamma is round 1's bonus."""
    firsts = _first_occurrence_positions(continuation)
    bonus_positions = [p for p in firsts if (p + 1) % (gamma + 1) == 0]
    assert bonus_positions, "fixture continuation has no first-seen token at a bonus position"
    pos = bonus_positions[0]
    run = speculative_generate(target, self_draft, PROMPT, gamma=gamma, max_new_tokens=40,
                               eos_token_id=firsts[pos], trace=True)
    assert run.tokens == continuation[:pos + 1]
    assert run.stop_reason == "eos" and run.trace[-1].emitted == gamma + 1


@pytest.mark.parametrize("gamma", [4, 8])
def test_eos_inside_accepted_block(target, self_draft, continuation, gamma):
    firsts = _first_occurrence_positions(continuation)
    inside = [p for p in firsts if 0 < (p + 1) % (gamma + 1) < gamma]
    pos = inside[0]
    run = speculative_generate(target, self_draft, PROMPT, gamma=gamma, max_new_tokens=40,
                               eos_token_id=firsts[pos], trace=True)
    assert run.tokens == continuation[:pos + 1]                  # nothing after EOS, even though accepted
    assert run.stop_reason == "eos"
    last = run.trace[-1]
    assert last.emitted < gamma + 1 and last.accepted == last.emitted  # cut inside the block


def test_eos_as_first_new_token(target, self_draft, continuation):
    run = speculative_generate(target, self_draft, PROMPT, gamma=5, max_new_tokens=40,
                               eos_token_id=continuation[0])
    assert run.tokens == continuation[:1] and len(run.rounds) == 1


def test_eos_list_stops_on_any(target, partial_draft, continuation):
    firsts = _first_occurrence_positions(continuation)
    late, early = sorted(firsts)[-1], sorted(firsts)[3]
    run = speculative_generate(target, partial_draft, PROMPT, gamma=3, max_new_tokens=40,
                               eos_token_id=[firsts[late], firsts[early]])
    assert run.tokens == continuation[:early + 1]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_gamma_larger_than_tokens_left(target, self_draft, continuation, max_new_tokens):
    run = speculative_generate(target, self_draft, PROMPT, gamma=16, max_new_tokens=max_new_tokens)
    assert run.tokens == continuation[:max_new_tokens]
    assert run.drafted_per_round[0] == max_new_tokens - 1 and len(run.rounds) == 1


def test_eos_none_means_no_stopping(target, self_draft, continuation):
    """eos_token_id=None does not fall back to the config's EOS (id 0 here)."""
    prompt = [0] * 5
    ours = speculative_generate(target, self_draft, prompt, gamma=3, max_new_tokens=30)
    assert len(ours.tokens) == 30 and ours.stop_reason == "max_new_tokens"
    assert ours.tokens == hfref.hf_greedy(target, torch.tensor(prompt), 30)


def test_input_forms_agree(target, partial_draft):
    forms = [PROMPT, torch.tensor(PROMPT), torch.tensor([PROMPT]), torch.tensor(PROMPT, dtype=torch.int32)]
    outs = [speculative_generate(target, partial_draft, f, gamma=3, max_new_tokens=12).tokens for f in forms]
    assert all(o == outs[0] for o in outs)


def test_target_emits_ids_the_draft_cannot_embed(target, random_draft):
    """Pythia-like widths: target logits 640 wide, draft embeds 512 rows. The random
    target's continuation uses ids >= 512, and the run must still be exact."""
    prompt = list(range(40, 60))
    expected = greedy_generate(target, prompt, max_new_tokens=48).tokens
    assert max(expected) >= hf.vocab_rows(random_draft), "fixture no longer exercises the wide ids"
    for gamma in (1, 4):
        run = speculative_generate(target, random_draft, prompt, gamma=gamma, max_new_tokens=48)
        assert_exact(target, prompt, expected, run.tokens)


class _WideHeadDraft(torch.nn.Module):
    """Wraps a draft and appends logit columns beyond the target's width that always
    win its argmax, as if the draft's padding rows were hot. A correct decoder never
    proposes those ids (it compares over the common range only)."""

    def __init__(self, inner, extra):
        super().__init__()
        self.inner, self.config, self.extra = inner, inner.config, extra
        self.head = torch.nn.Linear(1, hf.logit_width(inner) + extra, bias=False)

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        out = self.inner(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                         logits_to_keep=logits_to_keep)
        hot = out.logits.new_full(out.logits.shape[:-1] + (self.extra,), 1e4)
        out.logits = torch.cat([out.logits, hot], dim=-1)
        return out


def test_draft_proposals_stay_in_the_common_vocab_range(target, self_draft):
    wide = _WideHeadDraft(self_draft, extra=8)   # 648 wide vs the target's 640
    expected = greedy_generate(target, PROMPT, max_new_tokens=20).tokens
    run = speculative_generate(target, wide, PROMPT, gamma=4, max_new_tokens=20)
    assert run.tokens == expected
    assert run.accepted_per_round == run.drafted_per_round  # the hot columns were never proposed


def _eos_lists(target, continuation):
    """EOS lists whose stopping id is neither first, nor the smallest, nor the largest: ids that
    never occur in the continuation on both sides of it, one that occurs only later, and the
    model config's own EOS ids."""
    firsts = _first_occurrence_positions(continuation)
    pos = sorted(firsts)[len(firsts) // 2]
    stopper = firsts[pos]
    later = next(t for p, t in sorted(firsts.items()) if p > pos)
    absent = [t for t in range(hf.logit_width(target)) if t not in continuation]
    low = max(t for t in absent if t < stopper)
    high = min(t for t in absent if t > stopper)
    config = target.config.eos_token_id
    config = [config] if isinstance(config, int) else list(config or [])
    config = [t for t in config if t not in continuation[:pos + 1]]
    return pos, [[later, stopper], [low, stopper, high], [high, *config, stopper, low], [*config, later, low, stopper]]


@pytest.mark.parametrize("which", range(4))
@pytest.mark.parametrize("mode", ["greedy", "speculative"])
def test_eos_lists_stop_where_hf_generate_stops(target, partial_draft, continuation, which, mode):
    """Every id of an EOS list stops, wherever it sits in the list (the plain loop and the rounds)."""
    pos, lists = _eos_lists(target, continuation)
    eos = lists[which]
    if mode == "greedy":
        run = greedy_generate(target, PROMPT, max_new_tokens=40, eos_token_id=eos)
    else:
        run = speculative_generate(target, partial_draft, PROMPT, gamma=3, max_new_tokens=40, eos_token_id=eos)
    assert run.tokens == hfref.hf_greedy(target, torch.tensor(PROMPT), 40, eos_token_id=eos)
    assert run.tokens == continuation[:pos + 1] and run.stop_reason == "eos"
