"""The built-in adapters are tested too: the default run checks each one with the kit
(pytest.ini: --impl=spec,hf-assisted,hf-prompt-lookup at a small budget), and here an adapter with
the classic harness mistake is shown to fail the property that the recorded findings about HF
depend on. HF's generate() fills every None field of a GenerationConfig from the model's own
config and its defaults: an adapter that passes top_k=None on samples from the top 50 only."""

from __future__ import annotations

import pytest

from spec import hfref
from spec.conformance import impls
from spec.conformance import laws


def hf_assisted_default_top_k(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None,
                              do_sample=False, temperature=1.0, top_k=None, top_p=None, generator=None):
    """hf-assisted with the bug: top_k=None reaches the GenerationConfig as None, so HF uses 50."""
    return hfref.hf_generate(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                             generator=generator, assistant=impls._assistant(target, draft), gamma=gamma,
                             top_k_as_given=True)


def test_an_adapter_that_lets_hf_default_top_k_fails_the_wide_sampling_law():
    broken = impls.Impl("hf-assisted-default-top-k", hf_assisted_default_top_k)
    with pytest.raises(pytest.fail.Exception, match="property sampling_law_wide violated"):
        laws.sampling_law_wide(broken, 1.0, lambda *args: None)


def test_the_adapter_passes_the_same_property():
    laws.sampling_law_wide(impls.load("hf-assisted"), 1.0, lambda *args: None)
