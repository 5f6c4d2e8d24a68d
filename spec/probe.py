"""What spec's behaviour probes share, and the one memo of what they found.

What a model can do is decided by behaviour, not by its name: a probe runs short seeded sequences
through one way of running the model and compares the logits with the model's own cache-free
forward (spec.hf.authors_forward), within a tolerance of its dtype. Three questions are asked:

  path      which runner path, with which positions mode, reproduces the model (spec.runner.verdict)
  trees     whether a tree of proposals can be scored in one pass under a 4-D mask (spec.runner)
  batches   whether the rows of a left-padded batch can share one cache (spec.batch)

Each answer (or refusal) is memoised here once per model, question, dtype and device, keyed weakly
(nothing is stored on the user's model); `forget(model)` drops every answer about a model.
spec.choose.capabilities reads them as one record.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Hashable

import torch

from spec import hf
from spec.positions import counted_pad

# How far a runner's logits may stray from the cache-free forward's, relative to the
# largest logit. Rounding alone, measured on tiny random models (CPU): up to 3e-7 in fp32
# and 2e-8 in fp64 for most families, 1e-2 in bf16 (docs/FACTS.md); but some families compute parts in fp32
# whatever the weights, and Qwen3-Next's gated delta rule (fp32 inside, a chunked kernel for
# a block and a recurrent one for a step) strays 1.0e-6 in fp64 where a crop restores a
# state part-way along and re-feeds on top of it (1.4e-6 stepwise). Real faults measured the
# same way: a cache that is ignored 3e-3, a multi-token pass that drops the recurrent state
# (Mamba) 3e-4. Half precision cannot tell faults that small from its own rounding; there
# the probe catches the gross ones.
PROBE_TOLERANCE = {torch.float64: 5e-6, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 2e-2}
LOOSEST = 5e-2          # a dtype the table lacks


def dtype_of(model) -> torch.dtype:
    return next(model.parameters()).dtype


def tolerance(model) -> float:
    return PROBE_TOLERANCE.get(dtype_of(model), LOOSEST)


# Config fields past which a model's attention changes what it looks at: sliding windows,
# and the key budget of indexer-selected sparse attention (DeepSeek's DSA: index_topk). The
# probe must run longer than these to see a rollback or a block pass cross them.
_REACH = re.compile(r"(window|topk)", re.I)
PROBE_MAX = 64


def reach_fields(cfg) -> dict[str, int]:
    """The config's window-like fields (sliding windows, sparse top-k) and their values."""
    return {k: v for k, v in vars(cfg).items()
            if _REACH.search(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0
            and not k.startswith(("num_experts", "moe_", "topk_group", "n_group", "norm_topk"))}


def probe_length(model) -> int:
    """Past every window-like reach of the model (sliding window, sparse top-k), at most PROBE_MAX."""
    cfg = hf.text_config(model)
    reach = max(reach_fields(cfg).values(), default=0)
    length = max(12, reach + 6) if reach + 6 <= PROBE_MAX else 12
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return min(length, limit) if isinstance(limit, int) and limit >= 4 else length


def ids(model, length: int, device) -> torch.Tensor:
    """Seeded random ids; with a pad token in the middle for a model that counts positions by
    skipping pad tokens (RoBERTa's family, spec.positions), so that its counting is checked
    across one."""
    gen = torch.Generator().manual_seed(1234)
    rows = hf.vocab_rows(model)
    out = torch.randint(0, rows, (length,), generator=gen)
    pad = counted_pad(model)
    if pad is not None and 0 <= pad < rows:
        out[length // 2] = pad
    return out.to(device)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """a within tol x (1 + the largest finite |b|) of the reference b, everywhere; equal
    infinities (masked logits) agree."""
    if a.shape != b.shape:
        return False
    # in blocks of CLOSE_BLOCK elements: a probe's logits over the whole vocabulary in fp64, whole, with their
    # differences, took ~300 MB beside a 135M model for a moment, more than the model's own generate needs
    a, b = a.reshape(-1), b.reshape(-1)
    worst, scale = 0.0, 0.0
    for at in range(0, a.numel(), CLOSE_BLOCK):
        x, y = a[at:at + CLOSE_BLOCK].double(), b[at:at + CLOSE_BLOCK].double()
        diff = torch.where(x == y, 0.0, (x - y).abs())
        if bool(diff.isnan().any()):
            return False
        worst = max(worst, float(diff.max()))
        finite = y[y.isfinite()]
        if finite.numel():
            scale = max(scale, float(finite.abs().max()))
    return worst <= tol * (1.0 + scale)


CLOSE_BLOCK = 1 << 18


# model -> {question: ((dtype, device), the answer, or the exception to raise again)}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ASKING: set = set()       # (id(model), question) while `once` probes it


def once(model, question: Hashable, ask: Callable[[Any], Any], remember: tuple = ()) -> Any:
    """`ask(model)`'s answer to `question`, probed once per model, dtype and device (under
    inference_mode); an exception of a `remember` type (a refusal) is an answer too, raised again
    as the same object; any other propagates and is not remembered."""
    key = (str(dtype_of(model)), str(next(model.parameters()).device))
    answers = _MEMO.setdefault(model, {})
    known = answers.get(question)
    if known is None or known[0] != key:
        _ASKING.add((id(model), question))
        try:
            with torch.inference_mode():
                known = (key, ask(model))
        except remember as error:
            known = (key, error)
        finally:
            _ASKING.discard((id(model), question))
        answers[question] = known
    if isinstance(known[1], Exception):
        raise known[1]
    return known[1]


def asking(model, question: Hashable) -> bool:
    """Whether `question` about `model` is being probed now (`once`'s ask is running)."""
    return (id(model), question) in _ASKING


def memo(model, question: Hashable) -> tuple | None:
    """The memoised ((dtype, device), answer) for `question` about `model`, or None (reports, tests)."""
    return _MEMO.get(model, {}).get(question)


def forget(model) -> None:
    """Drop every memoised answer about `model`, so that the next call probes it again."""
    _MEMO.pop(model, None)
