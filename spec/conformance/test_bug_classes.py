"""Greedy properties for the bug classes the field keeps reporting, with HF's option names and
semantics (HF's own plain greedy generate() with the same options is the reference):

  min_new_tokens   the EOS is masked until min_new_tokens, also where the EOS comes inside a drafted
                   block that the target accepts (the class of vLLM PR #26317: an EOS inside an
                   accepted block ended generation early). The EOS id is drawn from the free greedy
                   continuation and min_new_tokens past its position, so the mask always bites.
  logit_bias       sequence_bias (one-token and two-token keys) and bad_words_ids (one- and two-token
                   bans) drawn from the free greedy continuation, so they bite; a verify row must
                   see exactly its own prefix for a multi-token key (the class of SGLang #10617:
                   logit bias ignored under speculation).
Each runs only against decoders that take the option (spec.conformance.impls); each has a negative control
(`*_power`): the same check, at the same example count, must reject spec with the option dropped.
The sampling side of these classes (min_p, logit bias, q from processed logits, penalties per
token, a bf16 draft) is in test_sampling_law.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.conformance import hypo
from spec.conformance.kit import ARCHS, DRAFT_KINDS, check_against_hf, greedy, kit_settings, prompts, skip_unless_takes
from spec.conformance.impls import Impl, dropping


def min_new_tokens_property(impl, budget, draft_kind, examples=8):
    @kit_settings(budget, examples)
    @given(arch=st.sampled_from(ARCHS), prompt=prompts(), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(3, 24), data=st.data())
    def prop(arch, prompt, gamma, max_new_tokens, data):
        free = greedy(arch, tuple(prompt), max_new_tokens)
        at = data.draw(st.integers(0, len(free) - 2), label="EOS position in the free continuation")
        minimum = data.draw(st.integers(at + 1, max_new_tokens), label="min_new_tokens")
        check_against_hf("min_new_tokens", impl, arch, draft_kind, prompt, gamma, max_new_tokens,
                         dict(eos_token_id=free[at], min_new_tokens=minimum))
    prop()


def logit_bias_property(impl, budget, draft_kind, examples=8):
    @kit_settings(budget, examples)
    @given(arch=st.sampled_from(ARCHS), prompt=prompts(), gamma=st.integers(1, 8),
           max_new_tokens=st.integers(3, 24), which=st.sampled_from(["sequence_bias", "bad_words_ids", "both"]),
           data=st.data())
    def prop(arch, prompt, gamma, max_new_tokens, which, data):
        free = greedy(arch, tuple(prompt), max_new_tokens)
        i, j = sorted(data.draw(st.lists(st.integers(1, len(free) - 1), min_size=2, max_size=2), label="positions"))
        options = {}
        if which in ("sequence_bias", "both"):   # biases exact in float32, as HF holds them
            bias = data.draw(st.sampled_from([-4.0, -1.5, 2.5]), label="bias")
            options["sequence_bias"] = {(free[i],): bias, (free[j - 1], free[j]): -3.0}
        if which in ("bad_words_ids", "both"):
            options["bad_words_ids"] = [[free[j]], [free[i - 1], free[i]]]
        check_against_hf("logit_bias", impl, arch, draft_kind, prompt, gamma, max_new_tokens, options)
    prop()


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_min_new_tokens(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)
    min_new_tokens_property(impl, budget, draft_kind)


@pytest.mark.parametrize("draft_kind", DRAFT_KINDS)
def test_logit_bias(impl, budget, draft_kind):
    skip_unless_takes(impl, draft_kind)
    logit_bias_property(impl, budget, draft_kind)


# --- negative controls: the same checks reject spec with the option dropped --------------------------

@pytest.mark.parametrize("control", ["min_new_tokens", "logit_bias"])
def test_bug_class_power(budget, control, monkeypatch):
    """At the example count the property uses (self draft: every block accepted, so the EOS is
    inside a drafted block), a decoder that ignores the option is rejected (not shrunk: only the
    rejection matters here)."""
    monkeypatch.setattr(hypo, "SHRINK", [False])     # hypo.kit_settings reads it (a list: setitem wants a dict)
    check = min_new_tokens_property if control == "min_new_tokens" else logit_bias_property
    broken = dropping("min_new_tokens" if control == "min_new_tokens" else "sequence_bias")
    if control == "logit_bias":
        base = broken.generate

        def generate(target, draft, input_ids, **kwargs):  # and bad_words_ids
            kwargs.pop("bad_words_ids", None)
            return base(target, draft, input_ids, **kwargs)
        broken = Impl("spec without sequence_bias and bad_words_ids", generate, draft="any",
                      options=frozenset({"sequence_bias", "bad_words_ids"}))
    with pytest.raises(pytest.fail.Exception, match=f"property {control} violated"):
        check(broken, budget, "self")
