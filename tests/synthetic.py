"""A draft with a chosen acceptance rate alpha, for checking Theorem 3.8 against measurement.

`SyntheticDraft` wraps a real draft model: every call runs the real forward pass
(so its time, and hence c, is real) and then replaces the logits. At each position
on the target's greedy path it proposes the target's true next token with
probability alpha, otherwise a wrong one. The coin flips are drawn once per
absolute sequence position from a seeded generator, so a run is deterministic and
the flips of different positions are independent: a round that starts at position
n accepts exactly the run of heads from n on, capped at gamma, which is Eq. 1's
capped geometric count.

The decode loop calls a draft only through `spec.hf.forward` (and reads config,
embeddings and parameters), so that is the interface kept here. It is not a
`PreTrainedModel`: HF `generate()` cannot drive it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import torch

from spec import hf

_LOGIT = 30.0  # the proposed token's logit; every other logit is 0


class SyntheticDraft(torch.nn.Module):
    """`draft` with acceptance rate `alpha` against the target whose greedy continuations are given.

    references: {prompt (tuple of ids): the target's greedy continuation (ids)}. A prompt
    not in it (e.g. the one spec.experiment.measure times the steps with) gets only wrong proposals.
    Positions past the end of a continuation are proposed wrong as well."""

    def __init__(self, draft: torch.nn.Module, references: Mapping[Sequence[int], Sequence[int]], alpha: float,
                 seed: int = 0):
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.draft = draft
        self.alpha, self.seed = float(alpha), int(seed)
        self.references = {tuple(int(t) for t in p): [int(t) for t in c] for p, c in references.items()}
        self._rows = hf.vocab_rows(draft)
        self._limit = min(self._rows, hf.logit_width(draft))  # ids it can both propose and be fed
        self._reset(())

    @classmethod
    def from_target(cls, draft, target, prompts: Sequence[Sequence[int]], max_new_tokens: int, alpha: float,
                    seed: int = 0) -> "SyntheticDraft":
        """References computed here: the target's greedy continuation of each prompt."""
        from spec.decode import greedy_generate
        refs = {tuple(p): greedy_generate(target, list(p), max_new_tokens=max_new_tokens).tokens for p in prompts}
        return cls(draft, refs, alpha, seed)

    # --- what the decode loop and check_pair read: the wrapped draft's -------------------
    @property
    def config(self):
        return self.draft.config

    @property
    def generation_config(self):
        return self.draft.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.draft.parameters()).device

    def get_input_embeddings(self):
        return self.draft.get_input_embeddings()

    def get_output_embeddings(self):
        return self.draft.get_output_embeddings()

    # --- the reference path ---------------------------------------------------------------
    def _reset(self, prompt: tuple[int, ...]) -> None:
        continuation = self.references.get(prompt)
        self._ref = list(prompt) + (continuation or [])
        # What the draft is fed on the path: the loop feeds a stand-in (the last row) for an
        # id the target can emit but the draft cannot embed (pythia-12b's wider head).
        self._ref_fed = [min(t, self._rows - 1) for t in self._ref]
        # heads[j]: does the coin at absolute position j say "propose the right token"?
        # Seeded by the prompt too, so that two prompts of equal length get different flips.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(repr(prompt).encode()))
        self._heads = (torch.rand(len(self._ref) + 1, generator=gen, dtype=torch.float64) < self.alpha).tolist()
        self._fed: list[int] = []
        self._on_path = 0  # length of the longest prefix of _fed that agrees with _ref

    def _propose(self, j: int) -> int:
        """The proposal for absolute position j, given the fed tokens _fed[:j]."""
        on_path = self._on_path >= j and j < len(self._ref)
        if on_path and self._heads[j] and self._ref[j] < self._limit:
            return self._ref[j]
        # Wrong: any id but the right one (off the path every id is as good as any other:
        # the target never tests a draft token after a rejected one).
        return (self._ref_fed[j] + 1) % self._limit if on_path else 0

    def forward(self, input_ids: torch.Tensor, use_cache: bool = True, logits_to_keep: int = 0, cache=None,
                past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"SyntheticDraft takes one sequence, input_ids of shape (1, n); "
                             f"got {tuple(input_ids.shape)}")
        start = hf.cache_len(cache) if cache is not None else 0
        ids = input_ids[0]
        # The real forward pass, for its cost (and its cache, which the loop crops and reads).
        logits = hf.forward(self.draft, ids, cache, keep=logits_to_keep)
        fed = ids.tolist()
        if start == 0:
            self._reset(tuple(fed))
        else:
            # The caller cropped the cache to `start` (rejected drafts): forget what it dropped.
            del self._fed[start:]
            self._on_path = min(self._on_path, start)
        if len(self._fed) != start:
            raise RuntimeError(f"SyntheticDraft lost track: cache holds {start} positions, {len(self._fed)} recorded")
        self._fed.extend(fed)
        while self._on_path < min(len(self._fed), len(self._ref)) \
                and self._fed[self._on_path] == self._ref_fed[self._on_path]:
            self._on_path += 1
        # Row r of the output is the prediction for absolute position first + r + 1.
        rows = logits.shape[0]
        first = len(self._fed) - rows
        proposals = [self._propose(first + r + 1) for r in range(rows)]
        out = torch.zeros_like(logits)
        out[torch.arange(rows, device=out.device), torch.tensor(proposals, device=out.device)] = _LOGIT
        return SimpleNamespace(logits=out[None], past_key_values=cache)


# --- what the synthetic draft should produce -----------------------------------------------

def tokens_per_round_pmf(alpha: float, gamma: int) -> list[float]:
    """P(tokens in a round = t), t = 1..gamma+1: a geometric count of accepted drafts capped at gamma, plus one."""
    return [alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma]


def tokens_per_round_interval(alpha: float, gamma: int, rounds: int, z: float = 4.0) -> tuple[float, float]:
    """Interval for the mean tokens per round over `rounds` independent full rounds:
    Eq. 1's mean +- z standard errors of the capped-geometric variance (normal approximation)."""
    pmf = tokens_per_round_pmf(alpha, gamma)
    mean = sum((t + 1) * p for t, p in enumerate(pmf))
    var = sum((t + 1 - mean) ** 2 * p for t, p in enumerate(pmf))
    half = z * math.sqrt(var / rounds)
    return mean - half, mean + half
