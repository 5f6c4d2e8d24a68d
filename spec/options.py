"""The options that are names, as enums that carry what callers branch on.

Each is a StrEnum: a member equals its string (`RunnerPath.KV_CACHE == "kv-cache"`), so callers
and results.json keep the words users type and read, while the code asks the member what it means
instead of comparing strings in several places.
"""

from __future__ import annotations

from enum import StrEnum


class RunnerPath(StrEnum):
    """How a model's state is held between passes (spec.runner, chosen by its probe)."""
    KV_CACHE = "kv-cache"
    SNAPSHOT = "state-snapshot"
    STEPWISE = "state-stepwise"
    RECOMPUTE = "recompute"

    @property
    def restores_state(self) -> bool:
        """A crop restores a copy of the whole state (recurrent models): one row of a batch
        cannot be rolled back without the others."""
        return self in (RunnerPath.SNAPSHOT, RunnerPath.STEPWISE)

    @property
    def has_cache(self) -> bool:
        return self is not RunnerPath.RECOMPUTE


class Positions(StrEnum):
    """How a model is told its tokens' positions (spec.positions, chosen by the runner probe)."""
    EXPLICIT = "explicit"    # 0-based, passed as position_ids
    COUNTED = "counted"      # counted around pad tokens as the model counts them (RoBERTa's family), passed
    OWN = "own"              # none passed: the model counts for itself

    @property
    def passed(self) -> bool:
        """spec passes position_ids (and may then lay out trees and left-padded rows itself)."""
        return self is not Positions.OWN

    @property
    def needs_mask(self) -> bool:
        """Positions step back at a pad token: a pass needs an all-ones mask (spec.positions.mask_len)."""
        return self is Positions.COUNTED


class DraftImpl(StrEnum):
    """How a draft model runs (speculative_generate's draft_impl); none changes the output."""
    AUTO = "auto"            # PLAIN where it applies, else HF
    PLAIN = "plain"          # spec.neox: plain tensors on a preallocated buffer (GPT-NeoX only)
    HF = "hf"                # the model's own forward on the probed runner path
    COMPILED = "compiled"    # its forward on a StaticCache, the one-token step compiled

    @property
    def batches(self) -> bool:
        """Whether a batch of prompts can run the draft this way (over a left-padded cache)."""
        return self in (DraftImpl.AUTO, DraftImpl.HF)


class GammaMode(StrEnum):
    """gamma given as a name instead of a number."""
    AUTO = "auto"                # Theorem 3.8's optimum from alpha and c measured as the run goes
    CALIBRATED = "calibrated"    # the CLI: the optimum from a calibration run before timing

    @property
    def in_the_loop(self) -> bool:
        """The decode loop itself adapts gamma (speculative_generate takes it); else the CLI does."""
        return self is GammaMode.AUTO


class StopReason(StrEnum):
    """Why a row stopped (Result.stop_reason)."""
    MAX_NEW_TOKENS = "max_new_tokens"
    EOS = "eos"


class Verdict(StrEnum):
    """What a divergence between speculative and greedy output is (spec.diagnose)."""
    TIE = "tie"      # the target's top-2 gap at the first divergent position is within the dtype's noise
    BUG = "bug"      # beyond it
