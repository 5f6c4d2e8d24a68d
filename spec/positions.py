"""Positions the way each model counts them.

A forward that takes `position_ids` and is given none computes them itself, and that
forward, called as its authors call it, is what spec must reproduce. Most models count
0, 1, 2, ...: passing those positions explicitly changes nothing and spares the model
from inferring them from a cache. RoBERTa-family decoders (RoBERTa, XLM-R, CamemBERT,
X-MOD, Data2Vec-text, ...) count from `padding_idx + 1` and give pad tokens the position
`padding_idx`: 0-based positions would shift every position embedding and change every
logit. So positions are passed only where they equal what the model computes for
itself, and which way that is, is decided by behaviour (`choose`, run by the probe):

  explicit  0-based positions, where the forward given them reproduces the forward given none;
  counted   the model's own counting function (`create_position_ids_from_input_ids`) over the
            whole sequence held, where that reproduces the forward given none; the count over
            the whole sequence (not just the new ids) is what keeps it exact after a pad token;
  own       nothing is passed: the model infers them (from its cache). The probe's replay
            then decides whether that is exact.
"""

from __future__ import annotations

import sys
import weakref

import torch

from spec import hf
from spec.options import Positions

MODES = tuple(Positions)


# Where each model's own counting function lives (the dotted name of its submodule, or None for
# the function beside the model class) and the pad id it skips; None where it has none. Found
# once a model, not by walking its modules on every forward. Keyed weakly, like spec.runner's.
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NAME = "create_position_ids_from_input_ids"


def _find_counter(model) -> tuple[str | None, int] | None:
    for name, module in model.named_modules():
        if callable(getattr(module, _NAME, None)) and isinstance(getattr(module, "padding_idx", None), int):
            return name, module.padding_idx
    # older releases keep the function at module level, beside the model class
    fn = getattr(sys.modules.get(type(model).__module__), _NAME, None)
    pad = getattr(model.config, "pad_token_id", None)
    return (None, pad) if callable(fn) and isinstance(pad, int) else None


def _counter(model):
    """(count(ids [1, n]) -> positions [1, n], padding_idx) as the model's own embeddings count, or None."""
    if model not in _COUNTERS:
        _COUNTERS[model] = _find_counter(model)
    found = _COUNTERS[model]
    if found is None:
        return None
    name, pad = found
    owner = sys.modules[type(model).__module__] if name is None else model.get_submodule(name)
    return getattr(owner, _NAME), pad


def counted_pad(model) -> int | None:
    """The pad id a model's own position count skips, where it counts that way."""
    counter = _counter(model)
    return counter[1] if counter is not None else None


def takes_positions(model) -> bool:
    return "position_ids" in hf.forward_params(type(model))


def position_ids(mode: str, model, held: torch.Tensor, start: int) -> torch.Tensor | None:
    """The positions ([1, n]) of held[start:], fed on top of held[:start]; None: pass none."""
    mode = Positions(mode)
    if mode is Positions.EXPLICIT:
        return torch.arange(start, held.numel(), device=held.device)[None]
    if mode is Positions.COUNTED:
        count, pad = _counter(model)
        return count(held[None], pad)[:, start:]
    return None


def mask_len(mode: str, length: int) -> int | None:
    """The attention mask length a pass over positions ..length needs: counted positions step
    back at a pad token, which transformers, given positions and no mask, would read as the
    start of another packed sequence (hf.step)."""
    return length if Positions(mode).needs_mask else None


# A second, longer check length: prime, so no chunk length from 2 to 130 divides it, and past twice
# the longest default chunk (Reformer LSH: 64). Models that
# pad the input to a multiple of a chunk length (Reformer) take another path once the sequence is
# longer than a chunk and no multiple of it, and that path may not take positions; the probe's own
# length can fall short of a chunk, or on a multiple of one.
CROSS_LENGTH = 131


def _primes_upto(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if all(k % d for d in range(2, int(k ** 0.5) + 1))]


def cross_length(model) -> int:
    """The longest prime length <= CROSS_LENGTH the model's position table holds."""
    cfg = hf.text_config(model)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    cap = min(CROSS_LENGTH, limit) if isinstance(limit, int) and limit >= 2 else CROSS_LENGTH
    return max(_primes_upto(cap), default=cap)


def _reproduces(mode: str, model, ids: torch.Tensor, full: torch.Tensor, close) -> bool:
    try:
        logits, _ = hf.step(model, ids, position_ids=position_ids(mode, model, ids, 0), use_cache=False,
                            mask_len=mask_len(mode, ids.numel()))
    except Exception:  # noqa: BLE001 - a forward that fails given positions must not be given them
        return False
    return close(logits, full)


def choose(model, ids: torch.Tensor, full: torch.Tensor, close) -> Positions:
    """The first mode whose cache-free forward reproduces the model's forward with no
    position_ids, over `ids` (whose forward is `full`) and over a longer sequence of prime
    length (`cross_length`); "own" where none does (or the forward takes none)."""
    if not takes_positions(model):
        return Positions.OWN
    longer = ids.repeat(-(-cross_length(model) // ids.numel()))[:cross_length(model)]
    longer_full = None
    for mode in (Positions.EXPLICIT, Positions.COUNTED):
        if mode is Positions.COUNTED and _counter(model) is None:
            continue
        if not _reproduces(mode, model, ids, full, close):
            continue
        if longer.numel() > ids.numel():
            if longer_full is None:
                try:
                    longer_full = hf.authors_forward(model, longer)
                except Exception:  # noqa: BLE001 - the model's own forward stops short of this length
                    return mode
            if not _reproduces(mode, model, longer, longer_full, close):
                continue
        return mode
    return Positions.OWN
