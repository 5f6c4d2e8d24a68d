"""fp32 CPU linears through oneDNN with prepacked weights (issue 43; docs/BENCHMARKS.md, "Where the
verify pass's intercept comes from (GEMM paths)"). torch's F.linear runs MKL sgemm, which on the
measured CPU costs 1.5-2 one-row products for 2 to 16 rows; oneDNN's brgemm over a weight reordered
once (batch-size hint 16) costs about one from 3 to 9 rows. Its 1- and 2-row products are slower than
its 3-row one, so 1 and 2 rows are padded to 3 (zero rows, dropped from the output). The outputs
differ from F.linear's by fp32 rounding only (a different summation order), which a caller that needs
exactness checks as the runner probe does. The packed copies add the linears' weight memory once more.

`packed_linears(model)` swaps every plain nn.Linear's forward for the packed one while the context
is open and puts the model's own back on exit; a model that is not fp32 on CPU is left as it is.
"""

from __future__ import annotations

import contextlib

import torch

HINT = 16  # the batch size oneDNN picks the weight's layout for (4 and 16 measured alike)
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


@contextlib.contextmanager
def packed_linears(model):
    """Within the context, `model`'s nn.Linear modules (exactly that class) run packed_forward."""
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)] \
        if available(model) else []
    try:
        for m in mods:
            m.forward = packed_forward(m)
        yield model
    finally:
        for m in mods:
            vars(m).pop("forward", None)
