"""fp32 CPU linears through oneDNN with prepacked weights (issue 43; docs/BENCHMARKS.md, "Where the
verify pass's intercept comes from (GEMM paths)"). torch's F.linear runs MKL sgemm, which on the
measured CPU costs 1.5-2 one-row products for 2 to 16 rows; oneDNN's brgemm over a weight reordered
once (batch-size hint 16) costs about one from 3 to 9 rows. Its 1- and 2-row products are slower than
its 3-row one, so 1 and 2 rows are padded to 3 (zero rows, dropped from the output). The outputs
differ from F.linear's by fp32 rounding only (a different summation order), which a caller that needs
exactness checks as the runner probe does. The packed copies add the linears' weight memory once more.

`packed_linears(model)` swaps every plain nn.Linear's forward for the packed one while the context
is open and puts the model's own back on exit; a model that is not fp32 on CPU is left as it is. The
packed copies are made once per model and kept while its weights are unchanged (keyed weakly).
`used(model)`: whether spec's runners run `model` packed: fp32 on CPU with oneDNN, not switched off
(SPEC_PREPACK=0), linears of at least MIN_BYTES, and the packed forward agreeing with the model's own within the probe's tolerance
(spec.probe, once per model); spec.runner's passes then run inside `swapped(forwards(model))`.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

HINT = 16  # the batch size oneDNN picks the weight's layout for (4 and 16 measured alike)
# Packing pays where a pass streams the weights from memory; a model whose linears fit in the CPU's
# caches (the shipped pair: 6 MB) runs its many small products faster through F.linear.
MIN_BYTES = 64 << 20
MIN_ROWS = 3  # 1 and 2 rows are padded to 3: oneDNN's 3-row product is faster than its 1- and 2-row ones


def available(model) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def packed_forward(linear: torch.nn.Linear):
    """linear's function, x -> x W^T + b, on a oneDNN-reordered copy of its weight."""
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), HINT)
    bias = None if linear.bias is None else linear.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not 0 < rows < MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return forward


# model -> (the linears' weight versions, {linear: its packed forward})
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forwards(model) -> dict:
    """Each plain nn.Linear's packed forward, made once while the weights stay as they were (a walk
    over the model: a runner asks once and keeps the dict)."""
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear]
    versions = tuple(m.weight._version for m in mods)
    known = _PACKED.get(model)
    if known is None or known[0] != versions:
        known = _PACKED[model] = (versions, {m: packed_forward(m) for m in mods})
    return known[1]


@contextlib.contextmanager
def swapped(packed: dict):
    """Within the context, each linear in `packed` runs its packed forward (from `forwards`)."""
    mods = [m for m in packed if "forward" not in vars(m)]
    try:
        for m in mods:      # (object's setattr: nn.Module's own costs microseconds a call, 211 times a pass)
            object.__setattr__(m, "forward", packed[m])
        yield
    finally:
        for m in mods:
            vars(m).pop("forward", None)


@contextlib.contextmanager
def packed_linears(model):
    """Within the context, `model`'s nn.Linear modules (exactly that class) run packed_forward."""
    with swapped(forwards(model) if available(model) else {}):
        yield model


def used(model) -> bool:
    """Whether spec's runners run `model` packed (see the module docstring)."""
    if os.environ.get("SPEC_PREPACK", "1") == "0" or not available(model):
        return False
    from spec import probe
    return probe.once(model, "packed linears", _agrees)


def _agrees(model) -> bool:
    """The model's linears are large enough to pay (MIN_BYTES), and the packed forward's logits are
    within the probe's tolerance of the model's own, over the probe's ids (many rows) and over its
    first id alone (one row, padded)."""
    from spec import hf, probe
    size = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)
    if size < MIN_BYTES:
        return False
    ids = probe.ids(model, probe.probe_length(model), next(model.parameters()).device)
    want = [hf.authors_forward(model, ids), hf.authors_forward(model, ids[:1])]
    with packed_linears(model):
        got = [hf.authors_forward(model, ids), hf.authors_forward(model, ids[:1])]
    return all(probe.close(g, w, probe.tolerance(model)) for g, w in zip(got, want))
