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


USER_DECODER = '''
def greedy_only(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None, min_p=None):
    return []
greedy_only.conformance_draft = "none"
greedy_only.conformance_sampling = False
{extra}
'''


@pytest.mark.parametrize("extra, message", [
    ("", None),
    ("greedy_only.conformance_sampeling = True", "unknown attribute conformance_sampeling"),
    ("greedy_only.conformance_batch = 'yes'", "conformance_batch must be True or False, got 'yes'"),
    ("greedy_only.conformance_options = ['top_k']", "conformance_options must be a collection of"),
])
def test_a_users_decoder_declares_its_capabilities_once(tmp_path, extra, message):
    """A module:function decoder's conformance_* attributes become its Impl's capabilities when it is loaded
    (read there only); a misspelt attribute or a bad value is an error naming it, never silently ignored."""
    path = tmp_path / "mine.py"
    path.write_text(USER_DECODER.format(extra=extra))
    if message:
        with pytest.raises(ValueError, match=message):
            impls.load(f"{path}:greedy_only")
        return
    impl = impls.load(f"{path}:greedy_only")
    assert (impl.draft, impl.sampling, impl.batch, impl.engine) == ("none", False, False, None)
    assert impl.options == frozenset({"min_p"})          # the optional keywords its signature names
    assert impls.load("spec").options == frozenset(impls.OPTION_KWARGS) and impls.load("spec").batch
