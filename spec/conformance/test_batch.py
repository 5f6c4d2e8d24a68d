"""Batch invariance: a decoder that takes several prompts at once gives each the output of its solo run.

Properties:
  batch_invariance   for decoders that take a batch (conformance_batch = True): over batches of 2 to 4
                     prompts of different lengths, gammas 1-8, lengths 1-16 and an EOS that stops some
                     rows early, every row equals the same decoder's solo run on that prompt, which
                     equals the target's greedy output. Rows drift apart in length and cache contents
                     after each round; a row rolled back with another's count, a finished row that keeps
                     going, or padding that leaks into a row shows up here.
  hf_batch_peer      HF generate(do_sample=False) on the same prompts as one left-padded batch (HF's
                     batch form) gives every row its solo greedy output (the peer, for the zoo's models).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec import hfref
from spec.conformance import kit
from spec.conformance.kit import ARCHS, DRAFT_KINDS, greedy, kit_settings, prompts, run, skip_unless_takes, zoo


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_batch_invariance(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)
    if not impl.batch:
        pytest.skip(f"{impl.name} takes one prompt at a time (conformance_batch is not set)")

    @kit_settings(budget, 8)
    @given(arch=st.sampled_from(ARCHS), rows=st.lists(prompts(), min_size=2, max_size=4), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(1, 16), data=st.data())
    def prop(arch, rows, gamma, max_new_tokens, data):
        z = zoo(arch)
        eos = None
        if data.draw(st.booleans(), label="with eos"):   # an id the first row emits: it stops early
            first = greedy(arch, tuple(rows[0]), max_new_tokens)
            eos = first[data.draw(st.integers(0, len(first) - 1), label="eos position")]
        options = dict(gamma=gamma, max_new_tokens=max_new_tokens, eos_token_id=eos)
        together = run(impl, z["target"], z[draft_kind], rows, **options)
        for b, (prompt, got) in enumerate(zip(rows, together)):
            alone = run(impl, z["target"], z[draft_kind], prompt, **options)
            expected = greedy(arch, tuple(prompt), max_new_tokens, eos)
            if got != alone or got != expected:
                verdict = kit.diagnosis(z["target"], prompt, expected, got)
                pytest.fail(f"property batch_invariance violated by {impl.name}: row {b} of {len(rows)}\n"
                            f"  arch={arch} draft={draft_kind} gamma={gamma} max_new_tokens={max_new_tokens} "
                            f"eos_token_id={eos}\n  prompts={rows}\n  {verdict}\n"
                            f"  target greedy {expected}\n  solo run      {alone}\n  in the batch  {got}",
                            pytrace=False)
    prop()


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_batch_peer(arch):
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = torch.tensor(row), 1
    theirs = hfref.hf_greedy_batch(zoo(arch)["target"], ids, mask, 16)
    for b, row in enumerate(rows):
        assert theirs[b] == greedy(arch, tuple(row), 16), f"property hf_batch_peer: HF's batch row {b} ({arch})"
