"""Stateful logits processors: repetition penalty and no-repeat n-gram.

Property processors_greedy: with the same processors, the decoder's greedy output equals HF's own
plain greedy generate() (the processors' reference semantics), over prompts that repeat (so the
processors bite), gammas, lengths, architectures and drafts. Both processors depend on the whole
sequence so far: a verify row must see exactly its own prefix, and state from a rejected draft
token must not reach later rounds -- the "random" draft, rejected almost always, is where such a
leak shows. (The sampling law under processors is a scenario of test_sampling_law.py.)
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.conformance.kit import ARCHS, DRAFT_KINDS, check_against_hf, kit_settings, looping_prompts, skip_unless_takes

PROCESSOR_OPTIONS = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8), dict(no_repeat_ngram_size=2),
                     dict(repetition_penalty=2.0, no_repeat_ngram_size=3), dict(no_repeat_ngram_size=1)]


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_processors_greedy(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)

    @kit_settings(budget, 8)
    @given(arch=st.sampled_from(ARCHS), prompt=looping_prompts(), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(1, 24), options=st.sampled_from(PROCESSOR_OPTIONS))
    def prop(arch, prompt, gamma, max_new_tokens, options):
        check_against_hf("processors_greedy", impl, arch, draft_kind, prompt, gamma, max_new_tokens,
                         dict(options, eos_token_id=None))
    prop()
