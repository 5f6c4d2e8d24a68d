"""The kit's hypothesis settings (derandomized, scaled by the budget; shrinking switched off by
--conform-no-shrink): a library module without torch, so that a served-model run imports none."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings
from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument

SHRINK = [True]  # --conform-no-shrink sets it False (spec/conformance/plugin.py)


def kit_settings(budget: float, examples: int):
    """Derandomized: the same examples every run (the suite's rule), scaled by --conform-budget."""
    phases = list(Phase) if SHRINK[0] else [p for p in Phase if p is not Phase.shrink]
    return settings(max_examples=max(1, round(examples * budget)), derandomize=True, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck), phases=phases)


def final_replay() -> bool:
    """True outside hypothesis and on its final replay of the smallest failing example."""
    try:
        return current_build_context().is_final
    except InvalidArgument:
        return True
