"""Greedy conformance: the decoder's output is the target's own greedy decoding, token for token.

Properties (each test's name is the property a failure reports):
  greedy_exact            over prompts, gammas (also beyond the tokens left) and lengths, three
                          architectures, drafts that accept all / some / almost nothing / no model
  length_without_eos      eos_token_id=None: exactly max_new_tokens tokens, even where the target emits
                          the EOS id its config (and generation_config) names
  eos_stop                stop right after the first EOS wherever it falls: inside an accepted block,
                          on a correction or bonus token, at the first or the last position
  eos_list                eos_token_id as a list: stop at the first of any of them
Targets are fp64 (kit.zoo), so a divergence is a bug; the failure gives hypothesis's smallest
counterexample and spec.diagnose's verdict (position, both tokens, top-2 gap on both paths).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.conformance import kit
from spec.conformance.kit import (ARCHS, DRAFT_KINDS, EOS_AT, EOS_PROMPT, TOKENS, greedy, kit_settings, prompts, run,
                                  skip_unless_takes, zoo)


def check_exact(prop, impl, arch, draft_kind, prompt, gamma, max_new_tokens, eos=None):
    kit.greedy_property(prop, impl, kit.zoo_subject(impl, arch, draft_kind, gamma), prompt, max_new_tokens,
                        f"arch={arch} draft={draft_kind} gamma={gamma} max_new_tokens={max_new_tokens} "
                        f"eos_token_id={eos}", options={"eos_token_id": eos})


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_exact(impl, budget, arch, draft_kind):
    skip_unless_takes(impl, draft_kind)

    @kit_settings(budget, 6)
    @given(prompt=prompts(), gamma=st.integers(1, 8), max_new_tokens=st.integers(1, 24))
    def prop(prompt, gamma, max_new_tokens):
        check_exact("greedy_exact", impl, arch, draft_kind, prompt, gamma, max_new_tokens)
    prop()


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_length_without_eos(impl, arch, draft_kind):
    """The continuation of EOS_PROMPT emits the models' config EOS at position EOS_AT; with
    eos_token_id=None the decoder must run on to max_new_tokens (HF's generate() fills an unset
    eos_token_id from the model's generation_config: an adapter has to override that)."""
    skip_unless_takes(impl, draft_kind)
    z = zoo(arch)
    assert greedy(arch, tuple(EOS_PROMPT), EOS_AT + 1)[EOS_AT] == z["eos"]
    for gamma, max_new_tokens in [(1, EOS_AT + 1), (3, 12), (5, 16)]:
        actual = run(impl, z["target"], z[draft_kind], EOS_PROMPT, gamma=gamma, max_new_tokens=max_new_tokens,
                     eos_token_id=None)
        if len(actual) != max_new_tokens:
            pytest.fail(f"property length_without_eos violated by {impl.name}: {len(actual)} tokens, "
                        f"max_new_tokens={max_new_tokens}, eos_token_id=None\n  arch={arch} draft={draft_kind} "
                        f"gamma={gamma} prompt={EOS_PROMPT}; the model config's EOS is {z['eos']}\n"
                        f"  tokens {actual}", pytrace=False)
        check_exact("length_without_eos", impl, arch, draft_kind, EOS_PROMPT, gamma, max_new_tokens)


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_eos_stop(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)

    @kit_settings(budget, 10)
    @given(arch=st.sampled_from(ARCHS), prompt=prompts(), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(1, 24), data=st.data())
    def prop(arch, prompt, gamma, max_new_tokens, data):
        free = greedy(arch, tuple(prompt), max_new_tokens)
        eos = free[data.draw(st.integers(0, len(free) - 1), label="eos position")]
        check_exact("eos_stop", impl, arch, draft_kind, prompt, gamma, max_new_tokens, eos)
    prop()


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_eos_list(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)

    @kit_settings(budget, 6)
    @given(arch=st.sampled_from(ARCHS), prompt=prompts(), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(2, 24), data=st.data())
    def prop(arch, prompt, gamma, max_new_tokens, data):
        free = greedy(arch, tuple(prompt), max_new_tokens)
        positions = data.draw(st.lists(st.integers(0, len(free) - 1), min_size=1, max_size=2), label="eos positions")
        eos = sorted({free[i] for i in positions} | {TOKENS + 1})  # plus an id the target never emits here
        check_exact("eos_list", impl, arch, draft_kind, prompt, gamma, max_new_tokens, eos)
    prop()
