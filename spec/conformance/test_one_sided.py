"""One-sided processors: a logits processor or warper applied on one side of Algorithm 1 only.

Algorithm 1 is exact for ANY draft law q, as long as q in the ratio is the law the proposal was
really drawn from and the target side (the ratio's p, the residual norm(max(0, p - q)), the bonus
token, the greedy argmax) uses the fully processed target law. So a processor on the target only
(the draft samples unprocessed and reports that same unprocessed q) is exact, and the kit must pass
it; these are wrong and must be rejected:
  draft only         the processor on the draft (its samples and its q), missing on the target side:
                     the output follows the unprocessed target law (the field's "bad_words_ids on the
                     draft only" class)
  q raw              drawn from the processed draft law, the ratio's q unprocessed (HF #47932's class)
  q processed        drawn from the unprocessed draft law, the ratio's q processed (the field's
                     "min_p on the target, not on the draft" class when the draft's q is still
                     computed with min_p: without that, it is the exact target-only case above)
  residual raw       the residual from the unprocessed p
  bonus raw          the bonus token from the unprocessed p

Properties:
  one_sided_law      the joint law of the first 3 tokens on the 4-token pair (as sampling_law) in one
                     scenario per option, each chosen so that the option removes or moves enough mass
                     of both the target's and the draft's law for every wrong variant above to be
                     rejected at n = 400 (see one_sided_power); below budget 1, min_p and bad words
                     (the two classes the kit once missed) stand for all.
  one_sided_greedy   greedy with each processor that can change an argmax (repetition penalty,
                     no-repeat n-gram, sequence bias, bad words), on fixed examples where it does:
                     output == HF's plain greedy generate() with the same option. A processor
                     missing on the target side emits the unprocessed argmax. (Temperature, top-k,
                     top-p and min-p never change the argmax: greedy cannot see them.)
  one_sided_power    negative controls, independent of --impl: Algorithm 1 on the exact laws
                     (laws.law_sampler) with each wrong variant, per scenario, must be
                     rejected at the property's sample size; the target-only variant must pass.
                     one_sided_greedy_power: spec with the option dropped fails one_sided_greedy.
The scenarios, controls and check bodies are in onesided_laws.py (a library module: tests call it).
"""

from __future__ import annotations

import pytest

from spec.conformance.impls import dropping
from spec.conformance.onesided_laws import (GREEDY_OPTIONS, ONE_SIDED, VARIANTS, one_sided_greedy, one_sided_law,
                                            one_sided_power)


@pytest.mark.parametrize("scenario", list(ONE_SIDED))
def test_one_sided_law(impl, budget, scenario, record_property):
    one_sided_law(impl, budget, scenario, record_property)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", list(ONE_SIDED))
def test_one_sided_power(budget, scenario, variant, record_property):
    """At one_sided_law's sample size, each wrong variant is rejected, the exact one passes."""
    one_sided_power(budget, scenario, variant, record_property)


@pytest.mark.parametrize("option", GREEDY_OPTIONS)
def test_one_sided_greedy(impl, option):
    one_sided_greedy(impl, option)


@pytest.mark.parametrize("option", GREEDY_OPTIONS)
def test_one_sided_greedy_power(option):
    """spec with the option dropped (so missing on the target side) fails one_sided_greedy."""
    with pytest.raises(pytest.fail.Exception, match="property one_sided_greedy violated"):
        one_sided_greedy(dropping(option), option)
