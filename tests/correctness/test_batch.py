"""Batches of prompts (spec.batch): every row equals its own solo run.

A batch decodes rows of different lengths in lockstep rounds, but each row accepts its own
number of drafts, is cut back on its own, stops on its own EOS or length, and leaves the batch
when done. Checked here: each row's tokens equal that prompt's solo greedy output (fp64 targets,
so a difference is a bug; the failure says where, with the target's top-2 gap); each row's
rounds (drafted, accepted, emitted) equal its solo speculative run's, which a batch that made
rows accept together, or lost one row's rollback, would change; finished rows stop costing; the
model families that share a left-padded cache and those that run their rows in turn; HF's
(B, n) + left-padded attention_mask form; bad input refused with the argument named; and, per
row, the sampling law.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from architectures import BY_NAME, cached_model, draft_model
from hypothesis import given
from hypothesis import strategies as st
from oracles import assert_exact
from stats import Oracle, goodness_of_fit
from strategies import batches_of_prompts, gammas

from spec import batch, choose, greedy_generate, hf, hfref, PromptLookup, speculative_generate
from spec.protocols import DraftSource
from spec.draft import ModelDraft
from spec.models import build_gpt_neox, perturbed_copy
from spec.tree import Tree

VOCAB = 500


@pytest.fixture(scope="module")
def fp64_partial_draft(target):
    """fp64, so that its proposals do not depend on the batch's shape: rounds can be compared."""
    return perturbed_copy(target, noise=0.1, seed=3)


def _solo(target, draft, prompt, **options):
    return speculative_generate(target, draft, prompt, **options) if draft is not None \
        else greedy_generate(target, prompt, **options)


def _proposes_the_same_in_a_batch(draft) -> bool:
    """A model-free draft, or an fp64 draft model: its proposals do not depend on the batch's shape,
    so each row's rounds can be held to its solo run's."""
    if draft is None:
        return False
    return not isinstance(draft, torch.nn.Module) or next(draft.parameters()).dtype == torch.float64


def _assert_rows_equal_solo(target, draft, prompts, results, **options):
    assert isinstance(results, list) and len(results) == len(prompts)
    for b, (prompt, got) in enumerate(zip(prompts, results)):
        want = greedy_generate(target, prompt, max_new_tokens=options["max_new_tokens"],
                               eos_token_id=options.get("eos_token_id"))
        assert_exact(target, prompt, want.tokens, got.tokens)
        assert got.stop_reason == want.stop_reason, f"row {b}"
        if _proposes_the_same_in_a_batch(draft):
            alone = _solo(target, draft, prompt, **options)
            assert (got.drafted_per_round, got.accepted_per_round, got.tokens_per_round) == \
                (alone.drafted_per_round, alone.accepted_per_round, alone.tokens_per_round), f"row {b}'s rounds"


@given(prompts=batches_of_prompts(VOCAB), gamma=gammas(8), max_new_tokens=st.integers(1, 24),
       draft_kind=st.sampled_from(["fp64-partial", "self", "random", "lookup"]), data=st.data())
def test_every_row_equals_its_solo_run(target, fp64_partial_draft, drafts, prompts, gamma, max_new_tokens,
                                       draft_kind, data):
    draft = {"fp64-partial": fp64_partial_draft, "lookup": PromptLookup(max_ngram=2, min_ngram=1)}.get(
        draft_kind, drafts.get(draft_kind))
    eos = None
    if data.draw(st.booleans(), label="with eos"):   # an id some row emits: that row stops early
        first = greedy_generate(target, prompts[0], max_new_tokens=max_new_tokens).tokens
        eos = first[data.draw(st.integers(0, len(first) - 1), label="eos position")]
        if isinstance(draft, torch.nn.Module) and eos >= hf.logit_width(draft):
            eos = None    # an EOS the narrower draft cannot emit is refused (test_validation): none then
    options = dict(gamma=gamma, max_new_tokens=max_new_tokens, eos_token_id=eos)
    _assert_rows_equal_solo(target, draft, prompts, speculative_generate(target, draft, prompts, **options), **options)
    greedy = greedy_generate(target, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos)
    _assert_rows_equal_solo(target, None, prompts, greedy, max_new_tokens=max_new_tokens, eos_token_id=eos)


# Families with a left-padded shared cache (sliding windows among them: mistral, qwen2, gemma2,
# phi3 slide over 8 tokens, which 24 new tokens cross), and families whose rows run in turn.
SHARED = ["llama", "mistral", "qwen2", "gemma2", "phi3", "gpt2", "opt", "gpt_neox"]
IN_TURN = {"mamba": "state-stepwise", "rwkv": "state-snapshot", "falcon_h1": "state-snapshot",
           "roberta": "'counted'", "bloom": "'own'"}


@pytest.mark.parametrize("family", SHARED + list(IN_TURN))
def test_families_batch_exactly(family):
    if family not in BY_NAME:
        pytest.skip(f"{family} is not in this transformers' registry")
    target, draft = cached_model(family), draft_model(family)
    rows = choose.rows({"target": target, "draft": draft}, [[3, 4], [5]]).target
    if family in IN_TURN:
        assert isinstance(rows, batch.EachRunner) and IN_TURN[family] in rows.why, rows.__dict__.get("why")
    else:
        assert isinstance(rows, batch.Rows)
    gen = torch.Generator().manual_seed(sum(map(ord, family)))
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 13, 4, 7)]
    free = greedy_generate(target, prompts[1], max_new_tokens=24).tokens
    # rows run in turn cost a solo run each: one setting for those, three for the shared cache
    for gamma, eos in ((4, free[5]),) if family in IN_TURN else ((1, None), (4, free[5]), (8, None)):
        options = dict(gamma=gamma, max_new_tokens=24, eos_token_id=eos)
        _assert_rows_equal_solo(target, draft, prompts, speculative_generate(target, draft, prompts, **options),
                                **options)


def test_hf_form_equals_list_form(target, fp64_partial_draft):
    prompts = [[5, 6, 7, 8, 9], [11], [12, 13, 14]]
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 5 - len(p):], mask[b, 5 - len(p):] = torch.tensor(p), 1
    listed = speculative_generate(target, fp64_partial_draft, prompts, gamma=3, max_new_tokens=12)
    padded = speculative_generate(target, fp64_partial_draft, ids, attention_mask=mask, gamma=3, max_new_tokens=12)
    assert [r.tokens for r in padded] == [r.tokens for r in listed]
    assert [r.tokens for r in greedy_generate(target, ids, attention_mask=mask, max_new_tokens=12)] == \
        [r.tokens for r in listed]
    # a (1, n) tensor with a mask is a batch of one: a list back, as HF would give a batch
    one = greedy_generate(target, ids[:1], attention_mask=mask[:1], max_new_tokens=4)
    assert isinstance(one, list) and len(one) == 1


def test_rows_equal_hf_generate_on_the_same_left_padded_batch():
    """HF generate with a batch as the greedy peer, on a Llama with sdpa attention in fp64. (With the
    registry's eager attention in fp64, transformers 5.25's own left-padded forward gives NaN logits
    on every row with padding, measured: HF's batch is then no peer at all; spec never feeds padding.)"""
    model = BY_NAME["llama"].build(seed=0)
    model.set_attn_implementation("sdpa")
    prompts = [[7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 6 - len(p):], mask[b, 6 - len(p):] = torch.tensor(p), 1
    theirs = hfref.hf_greedy_batch(model, ids, mask, max_new_tokens=16)
    ours = speculative_generate(model, draft_model("llama"), ids, attention_mask=mask, gamma=4, max_new_tokens=16)
    assert [r.tokens for r in ours] == theirs


def test_finished_rows_stop_costing(target, fp64_partial_draft, monkeypatch):
    """A row that stops leaves both caches: later passes carry fewer rows."""
    prompts = [[3, 4, 5], [6, 9, 10], [7, 8, 11]]
    free = greedy_generate(target, prompts[1], max_new_tokens=30).tokens
    eos = free[2]
    assert eos not in greedy_generate(target, prompts[0], max_new_tokens=30).tokens  # only row 1 stops early
    speculative_generate(target, fp64_partial_draft, prompts, max_new_tokens=1)   # the batch probes, once
    rows_per_pass = []
    real = hf.batch_step

    def counting(model, ids, cache, **kw):
        rows_per_pass.append((model is target, ids.shape[0]))
        return real(model, ids, cache, **kw)
    monkeypatch.setattr(hf, "batch_step", counting)
    out = speculative_generate(target, fp64_partial_draft, prompts, gamma=3, max_new_tokens=30, eos_token_id=eos)
    assert out[1].stop_reason == "eos" and len(out[1].tokens) == 3
    target_rows = [n for is_target, n in rows_per_pass if is_target]
    assert target_rows[0] == 3 and target_rows[-1] < 3 and target_rows == sorted(target_rows, reverse=True)
    assert sum(n == 3 for n in target_rows) == len(out[1].rounds)   # row 1 in exactly the passes of its rounds


@pytest.mark.parametrize("call, error, match", [
    (lambda t, d: speculative_generate(t, d, torch.tensor([[1, 2, 3], [4, 5, 0]]),
                                       attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])),
     ValueError, r"attention_mask must be left padding .*padding_side='left'"),
    (lambda t, d: speculative_generate(t, d, torch.tensor([[1, 2, 3], [4, 5, 6]]),
                                       attention_mask=torch.ones(2, 2, dtype=torch.long)),
     ValueError, r"attention_mask must be a tensor of input_ids' shape \(2, 3\), got \(2, 2\)"),
    (lambda t, d: speculative_generate(t, d, torch.tensor([[1, 2], [3, 4]]),
                                       attention_mask=torch.tensor([[1, 2], [1, 1]])),
     ValueError, "attention_mask must hold only 0 .padding. and 1 .token."),
    (lambda t, d: speculative_generate(t, d, [[1, 2], [3]], attention_mask=torch.ones(2, 2)),
     ValueError, "attention_mask goes with a .B, n. tensor"),
    (lambda t, d: speculative_generate(t, d, [[1, 2], [3, 700]]), ValueError,
     r"input_ids row 1: input_ids holds token id 700, outside the target's vocabulary \[0, 640\)"),
    (lambda t, d: speculative_generate(t, d, [[1, 2], [3]], draft_impl="plain"), ValueError,
     "draft_impl='plain': a batch runs the draft on its own forward"),
    (lambda t, d: greedy_generate(t, [[1, 2], [3]], decoder_input_ids=[0]), ValueError,
     "decoder_input_ids: a batch of prompts is decoded by decoder-only models"),
])
def test_bad_batches_are_refused_naming_the_argument(target, fp64_partial_draft, call, error, match):
    with pytest.raises(error, match=match):
        call(target, fp64_partial_draft)


def test_gamma_auto_gives_each_row_its_own_gamma(target, fp64_partial_draft):
    """gamma='auto' in a batch: each row runs its own controller (its own alpha, the batch's costs);
    each row's tokens equal its solo greedy run, and its rounds account for every token."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [7, 7, 7, 7]]
    rows = speculative_generate(target, fp64_partial_draft, prompts, gamma="auto", max_new_tokens=24)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == greedy_generate(target, prompt, max_new_tokens=24).tokens
        assert sum(row.tokens_per_round) == len(row.tokens) == 24


def test_the_batch_probe_catches_a_cache_that_is_not_shifted(monkeypatch):
    """The probe (and the decode) fail if a crop cut rows in place instead of re-aligning them."""
    model = cached_model("llama")
    assert batch.probe(model) is None

    def unshifted(cache, rows, starts, width):   # every row cut from the same column
        return real(cache, rows, [min(starts)] * len(starts), width)
    real = hf.regather
    monkeypatch.setattr(hf, "regather", unshifted)
    assert "differ from its own forward's" in batch.probe(model)


def _regather_last_row_offset_of_first(real):
    def wrong(cache, rows, starts, width):        # the last row cut where the first row is
        return real(cache, rows, [*starts[:-1], starts[0]] if len(starts) > 1 else starts, width)
    return wrong


def _regather_rows_sorted(real):
    def wrong(cache, rows, starts, width):        # rows kept in index order, not the order asked
        return real(cache, sorted(rows), starts, width)
    return wrong


def _join_rows_unordered(real):
    def wrong(caches, order):                     # rows joined as they come, the order ignored
        return real(caches, torch.arange(order.numel(), device=order.device))
    return wrong


def _join_rows_inverse_order(real):
    def wrong(caches, order):                     # the permutation applied backwards (a swap hides it)
        return real(caches, order.argsort())
    return wrong


@pytest.mark.parametrize("name,bug", [("regather", _regather_last_row_offset_of_first),
                                      ("regather", _regather_rows_sorted), ("join_rows", _join_rows_unordered),
                                      ("join_rows", _join_rows_inverse_order)])
def test_the_batch_probe_catches_row_order_and_uneven_crop_bugs(monkeypatch, name, bug):
    """Three and four ragged rows in several orders (short rows first and last, uneven crops, a
    row leaving from the middle and from the front): the probe itself rejects a cache that
    mixes rows up, not only the decode loop."""
    model = cached_model("llama")
    assert batch.probe(model) is None             # a correct batch passes
    monkeypatch.setattr(hf, name, bug(getattr(hf, name)))
    assert batch.probe(model) is not None


# --- sampling, per row ----------------------------------------------------------------------------

def _neox_pair():
    """GPT-NeoX, vocab 6: target fp64 with sharpened logits, draft a perturbed fp32 copy."""
    target = build_gpt_neox(dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                 vocab_size=6), seed=50, dtype=torch.float64)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30.0)
    return target, perturbed_copy(target, noise=0.3, seed=51, dtype=torch.float32)


BATCH_PROMPTS = [[1, 2], [3], [4, 5, 1, 0], [2, 2, 2]]


def _row_samples(target, draft, n: int, seed: int, **options):
    gen = torch.Generator().manual_seed(seed)
    rows = [[] for _ in BATCH_PROMPTS]
    for _ in range(n):
        for b, r in enumerate(speculative_generate(target, draft, BATCH_PROMPTS, gamma=2, max_new_tokens=2,
                                                   do_sample=True, generator=gen, **options)):
            rows[b].append(tuple(r.tokens))
    return rows


def _joint_fit(oracle, prompt, samples, width):
    cells = list(itertools.product(range(width), repeat=2))
    probs = [math.prod(float(oracle(tuple(prompt) + c[:i])[c[i]]) for i in range(2)) for c in cells]
    index = {c: i for i, c in enumerate(cells)}
    observed = [0] * len(cells)
    for tokens in samples:
        observed[index[tokens]] += 1
    return goodness_of_fit(f"joint law of the first 2 tokens after {prompt}", {"all": (observed, probs)})


ALPHA = 1e-3


@pytest.mark.parametrize("options, n", [
    ({}, 600),
    pytest.param(dict(temperature=1.4, top_k=4), 5000, marks=[pytest.mark.thorough, pytest.mark.slow]),
], ids=["plain", "processed"])
def test_each_row_samples_its_own_law(options, n):
    """n batches of 4 rows (different prompts, so different acceptance histories in each batch):
    each row's first two tokens against the exact law of its own prompt, chi-square at 0.001."""
    target, draft = _neox_pair()
    oracle = Oracle(target, **options)
    rows = _row_samples(target, draft, n, seed=61, **options)
    for prompt, samples in zip(BATCH_PROMPTS, rows):
        fit = _joint_fit(oracle, prompt, samples, 6)
        assert fit.df > 0 and not fit.rejects(ALPHA), str(fit)


def test_row_sampling_check_rejects_rows_given_each_others_draft_laws(monkeypatch):
    """Negative control: q handed to the wrong rows (reversed) must be rejected."""
    target, draft = _neox_pair()
    real = ModelDraft.draft

    def swapped(self, seq, n, g, live):
        trees = real(self, seq, n, g, live)
        return [Tree.chain(t.tokens, u.q) for t, u in zip(trees, trees[::-1])]
    monkeypatch.setattr(ModelDraft, "draft", swapped)
    rows = _row_samples(target, draft, 300, seed=62)
    oracle = Oracle(target)
    fits = [_joint_fit(oracle, prompt, samples, 6) for prompt, samples in zip(BATCH_PROMPTS, rows)]
    assert any(fit.rejects(ALPHA) for fit in fits), [str(f) for f in fits]


# A server's batch: greedy and sampled requests side by side, each with its own options.
MIXED = [dict(do_sample=False), dict(temperature=1.4, top_k=4), dict(do_sample=False, repetition_penalty=1.3), {}]


def _mixed_rows(target, draft, n: int, seed: int):
    """n batches of BATCH_PROMPTS with per_row=MIXED (sampling by default, one shared generator):
    each row's first two tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = [[] for _ in BATCH_PROMPTS]
    for _ in range(n):
        for b, r in enumerate(speculative_generate(target, draft, BATCH_PROMPTS, gamma=2, max_new_tokens=2,
                                                   do_sample=True, generator=gen, per_row=MIXED)):
            rows[b].append(tuple(r.tokens))
    return rows


def _mixed_verdict(target, rows) -> list[str]:
    """What is wrong with the rows of _mixed_rows: a greedy row other than its solo greedy run, or
    a sampled row whose joint law of two tokens is rejected at ALPHA. Empty when each row is exact."""
    wrong = []
    for prompt, options, samples in zip(BATCH_PROMPTS, MIXED, rows):
        if options.get("do_sample", True) is False:
            want = tuple(greedy_generate(target, prompt, max_new_tokens=2, **options).tokens)
            if set(samples) != {want}:
                wrong.append(f"greedy row {prompt}: {sorted(set(samples))} != solo greedy {want}")
        else:
            fit = _joint_fit(Oracle(target, **options), prompt, samples, 6)
            if fit.df < 1 or fit.rejects(ALPHA):
                wrong.append(str(fit))
    return wrong


def test_a_batch_mixing_greedy_and_sampled_rows_is_exact_per_row():
    """per_row: greedy rows (one with a repetition penalty) among sampled rows (one with its own
    temperature and top-k), in one batch with one generator: each greedy row is its solo greedy
    output every time, each sampled row follows its own options' law (chi-square at 0.001)."""
    target, draft = _neox_pair()
    rows = _mixed_rows(target, draft, 300, seed=63)
    assert not _mixed_verdict(target, rows)


def test_mixed_rows_check_rejects_a_batch_that_applies_the_calls_options_to_every_row(monkeypatch):
    """Negative control: per_row ignored (every row sampled at the call's options) is caught."""
    from spec import decode
    real = decode.picks_for
    monkeypatch.setattr(decode, "picks_for", lambda options, per_row, *rest: real(options, None, *rest))
    target, draft = _neox_pair()
    wrong = _mixed_verdict(target, _mixed_rows(target, draft, 150, seed=64))
    assert len(wrong) >= 3, wrong          # both greedy rows and the row with its own warpers


def test_per_row_options_are_checked_and_named_by_row(target):
    with pytest.raises(ValueError, match=r"per_row must be a list of 2 dicts"):
        greedy_generate(target, [[1, 2], [3]], max_new_tokens=2, per_row=[{}])
    with pytest.raises(ValueError, match=r"per_row\[1\]: 'beams' is not a row's option"):
        greedy_generate(target, [[1, 2], [3]], max_new_tokens=2, per_row=[{}, dict(beams=2)])
    with pytest.raises(ValueError, match=r"per_row\[0\]: temperature must be a number > 0"):
        speculative_generate(target, PromptLookup(), [[1, 2], [3]], max_new_tokens=2,
                             per_row=[dict(temperature=0), {}])
    with pytest.raises(ValueError, match=r"per_row\[1\]: do_sample must be True or False"):
        greedy_generate(target, [[1, 2], [3]], max_new_tokens=2, per_row=[{}, dict(do_sample="yes")])


def test_processors_count_from_each_rows_own_prompt(target, fp64_partial_draft):
    """repetition_penalty and min_new_tokens in a batch: each row equals its solo run, min_new_tokens
    counted from that row's own prompt (rows of different lengths)."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]
    free = greedy_generate(target, prompts[0], max_new_tokens=20, repetition_penalty=1.3).tokens
    # the long row's second token as EOS: masked for its first 6 new tokens, though its prompt is longer
    options = dict(max_new_tokens=20, repetition_penalty=1.3, eos_token_id=free[1], min_new_tokens=6)
    for got, prompt in zip(speculative_generate(target, fp64_partial_draft, prompts, gamma=4, **options), prompts):
        assert got.tokens == greedy_generate(target, prompt, **options).tokens
        assert len(got.tokens) >= 6
        alone = speculative_generate(target, fp64_partial_draft, prompt, gamma=4, **options)
        assert got.accepted_per_round == alone.accepted_per_round    # the draft masks as its solo run does
    for got, prompt in zip(greedy_generate(target, prompts, **options), prompts):
        assert got.tokens == greedy_generate(target, prompt, **options).tokens


class _Remembers(DraftSource):
    """A stateful model-free drafter: proposes nothing, remembers the final lengths it was told."""

    needs = frozenset()

    def __init__(self):
        self.seen = 0

    def begin(self, prompt):
        pass

    def draft(self, seq, n, g):
        return Tree.chain(seq[n:n])

    def observe(self, n, accepted):
        self.seen = n

    def __len__(self):
        return self.seen


def test_each_row_serves_a_single_prompt_with_the_drafter_itself_and_a_batch_with_copies(target):
    """One prompt: the drafter given is the one that drafts (no copy, so its state is the caller's).
    A batch: one copy a row, each told its own row's lengths; len is the longest row's."""
    mine = _Remembers()
    speculative_generate(target, mine, [3, 4, 5], gamma=2, max_new_tokens=5)
    assert mine.seen == 3 + 5                # told the final length after the last round
    rows = choose.rows({"target": target, "draft": mine}, [[3, 4, 5], [6]])
    each = rows.drafter
    assert len(each.drafters) == 2 and all(d is not mine for d in each.drafters)
    each.observe([9, 4], [0, 0], [0, 1])
    assert [d.seen for d in each.drafters] == [9, 4] and len(each) == 9


def test_a_drafter_that_cannot_be_copied_is_refused_for_a_batch_naming_it(target):
    import threading

    class Locked(_Remembers):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()     # deepcopy cannot copy a lock
    with pytest.raises(ValueError, match=r"draft: Locked cannot be copied for each of the 2 prompts \(TypeError: "
                                         r".*lock.*\); decode the prompts one at a time"):
        speculative_generate(target, Locked(), [[3, 4, 5], [6]], gamma=2, max_new_tokens=3)
    assert speculative_generate(target, Locked(), [3, 4, 5], gamma=2, max_new_tokens=3).tokens == \
        greedy_generate(target, [3, 4, 5], max_new_tokens=3).tokens


def test_a_short_rows_eos_between_its_own_minimum_and_the_widest_rows_stops_it(target, fp64_partial_draft):
    """min_new_tokens in a ragged batch, the other direction: the SHORT row's EOS falls at its own
    new token m = min_new_tokens, which a count from the widest row's prompt (8 tokens longer) would
    still mask. The row must stop there, as its solo run does, in both decoders."""
    short, wide = [12, 40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 30]
    free = greedy_generate(target, short, max_new_tokens=24).tokens
    m = next(j for j in range(3, 16) if free[j] not in free[:j])    # the first time this token comes
    options = dict(max_new_tokens=24, eos_token_id=free[m], min_new_tokens=m)
    solo = greedy_generate(target, short, **options)
    assert solo.stop_reason == "eos" and len(solo.tokens) == m + 1      # the case under test
    for outs in (speculative_generate(target, fp64_partial_draft, [short, wide], gamma=4, **options),
                 greedy_generate(target, [short, wide], **options)):
        assert outs[0].tokens == solo.tokens and outs[0].stop_reason == "eos"
        assert outs[1].tokens == greedy_generate(target, wide, **options).tokens
