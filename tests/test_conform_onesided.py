"""The kit's one-sided properties against the from-scratch decoders in tests/onesided.py (HF's own
processors, one switch per side of Algorithm 1): the exact ones pass, the wrong ones are rejected.
Only the greedy property runs here (a few seconds; the sampling scenarios cost 400-1600 runs each);
the full table, every variant through `python -m spec conform`, is in docs/log/conformance.md."""

from __future__ import annotations

import pytest

import onesided
from spec.conformance import impls
from spec.conformance import onesided_laws


def _load(name):
    return impls.load(f"{onesided.__file__}:{name}")


def test_the_correct_decoder_and_bad_words_on_the_target_only_pass_greedy():
    for name in ("generate", "bad_words_ids_target_only"):
        onesided_laws.one_sided_greedy(_load(name), "bad_words_ids")


def test_bad_words_on_the_draft_only_fails_greedy():
    with pytest.raises(pytest.fail.Exception, match="property one_sided_greedy violated"):
        onesided_laws.one_sided_greedy(_load("bad_words_ids_draft_only"), "bad_words_ids")

