"""A model's fp32 CPU linears as packed weights: the products spec.cpu.executor runs a pass on (issue 43;
docs/log/benchmarks.md, "Where the verify pass's intercept comes from (GEMM paths)").

Two packed forms of each weight, each made once:

- oneDNN: torch's F.linear runs MKL sgemm, which on the measured CPU costs 1.5-2 one-row products for 2 to
  16 rows (and 2.2x oneDNN's time even at 700 rows); oneDNN's brgemm over a weight reordered once (batch-size
  hint 16) costs about one from 3 to 9 rows. Its 1- and 2-row products are slower than its 3-row one, so 1
  and 2 rows are padded to 3 (zero rows, dropped from the output). The reordered copy is made only where it
  pays: at the first call of at most REORDER_ROWS rows that oneDNN runs where the kernel does not run the
  short passes (no kernel on this CPU, or more torch threads than it runs at), and only if it fits in memory
  then.
  Longer passes (a prompt's prefill) run oneDNN on the model's own weight, no copy kept (1.11-1.12x the
  reordered copy's time at 64 and 700 rows on the measured CPU, against 1.5x at 13 rows): so where the
  kernel runs every short pass, as in a decode at 1 or 2 threads and gamma up to 11, the linears cost their
  own memory and the kernel's panels, not a third copy.
- the kernel: spec.cpu.gemv's hand-written few-row product over a panel-reordered copy of the weight,
  streamed once per pass, for 1 to KERNEL_ROWS rows (12 with AVX-512F, 6 with AVX2+FMA), faster there than
  oneDNN (docs/log/benchmarks.md, "A hand-written few-row kernel"); its panels split over the threads the
  caller names per call (no setting of its own or of torch's is changed).

The outputs differ from F.linear's by fp32 rounding only (a different summation order), which
spec.cpu.executor's probes check against the model's own forward once per model. The packed copies add the
linears' weight memory once more for each form made (`fits`).

Nothing here touches a module: a Packed or a Group is a function the executor calls with the rows and the
threads of its pass.
"""

from __future__ import annotations

import torch

from spec.cpu import gemv

HINT = 16  # the batch size oneDNN picks the weight's layout for (4 and 16 measured alike)
# Packing pays where a pass streams the weights from memory; a model whose linears fit in the CPU's
# caches (the shipped pair: 6 MB) runs its many small products faster through F.linear.
MIN_BYTES = 64 << 20
MIN_ROWS = 3  # 1 and 2 rows are padded to 3: oneDNN's 3-row product is faster than its 1- and 2-row ones
REORDER_ROWS = 32  # the most rows at which oneDNN's reordered copy is made (beyond, the plain weight is as fast)
# spec.cpu.gemv's kernel runs 1 to KERNEL_ROWS[its ISA] rows, the rows its panel kernel takes in
# one turn over the weight (AVX-512F 12, AVX2+FMA 6); more go to oneDNN. The plain-C variant is there for
# correctness only: not used here (docs/log/benchmarks.md, "A hand-written few-row kernel").
KERNEL_ROWS = {2: 12, 1: 6}
ISA_NAMES = {2: "AVX-512F", 1: "AVX2+FMA"}
# The most torch threads at which the kernel runs its rows: at 2 threads on the 2-core Zen 4 it was 1.35x
# faster than oneDNN's two even on one thread (SmolLM2 greedy 30.3 against 41.0 ms a token, interleaved),
# and splits its panels over those 2 threads; with more cores oneDNN's threads share the stream (not
# measured here: a 2-core machine).
KERNEL_THREADS = 2


def memory_available() -> int | None:
    """Bytes of memory the system says it can give now (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fits(size: int) -> bool:
    """Whether a packed copy of `size` bytes of linears (the kernel's panels, or oneDNN's reordered weights:
    each made only where `Packed` says) fits in half the memory available now; where that is unknown, it is
    assumed to. A model too large for its copy runs its own forward, slower and whole."""
    free = memory_available()
    return free is None or size <= free // 2


def available(model) -> bool:
    """fp32 on CPU, with oneDNN in this torch."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def linear_bytes(model) -> int:
    """The bytes of the model's plain nn.Linear weights (what packing copies)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)


def kernel_rows() -> int:
    """The most rows spec.cpu.gemv's kernel runs on this CPU (0: none; the library not there, or no AVX2+FMA)."""
    return KERNEL_ROWS.get(gemv.isa(), 0)


class Packed:
    """A linear's function x -> x W^T + b on packed weights (made by `packed_forward`). `kernel`: whether
    it has the kernel's panels (`small`, for 1 to `most` rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small, most: int):
        self.weight, self.bias, self.small, self.most = weight, bias, small, most
        self.kernel = small is not None
        self.reordered: torch.Tensor | None = None

    def onednn(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """oneDNN's product: on the reordered copy where it exists, or where `rows` is few enough for it to
        pay and it fits in memory now (made here: two threads may both make it, the same copy, one kept);
        else on the model's own weight."""
        reordered = self.reordered
        if reordered is None and rows <= REORDER_ROWS and self._copy_pays() \
                and fits(self.weight.numel() * self.weight.element_size()):
            reordered = self.reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight, HINT)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight if reordered is None else reordered, self.bias,
                                                  "none", [], "")

    def _copy_pays(self) -> bool:
        """Whether oneDNN's short passes are the decode's: without the kernel, or above the torch threads it
        runs at (where it runs them, a short pass on oneDNN is a probe's, or a verify pass of 13 to
        REORDER_ROWS rows: gamma 12 and more, on the plain weight at most 1.5x the copy's time)."""
        return self.small is None or torch.get_num_threads() > KERNEL_THREADS

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        """x W^T + b: on the kernel, its panels split over `threads` threads, for 1 to `most` rows when
        `threads` > 0; else on oneDNN."""
        rows = x.numel() // x.shape[-1]
        if threads and 0 < rows <= self.most:
            return self.small(x, threads=threads)
        if not 0 < rows < MIN_ROWS:
            return self.onednn(x, rows)
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
        y = self.onednn(flat, rows)[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_forward(linear: torch.nn.Linear, kernel: bool = False, small=None) -> Packed:
    """linear's function on packed weights: with `kernel`, spec.cpu.gemv's panels too (made here, or `small`,
    a gemv Product made elsewhere) for 1 to KERNEL_ROWS[its ISA] rows; oneDNN's reordered copy of the
    weight is made at the first call that needs it."""
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    most = kernel_rows() if kernel else 0
    if most and small is None:
        small = gemv.product(weight, bias, "panel")
    return Packed(weight, bias, small if most else None, most)


class Group:
    """Linears that read the same x (a layer's q, k, v; gate, up) as one function, x -> their outputs side
    by side [..., N1 + N2 + ...]: one spec.cpu.gemv product over panels they share (gemv.grouped; each
    column bit-identical to its own linear's) where the kernel runs the call, else each member's packed
    forward, concatenated. `members`: the linears' Packed (each on its part of the panels)."""

    def __init__(self, members: list, whole=None):
        self.members, self.whole = members, whole
        self.most = members[0].most if whole is not None else 0

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if threads and 0 < rows <= self.most:
            return self.whole(x, threads=threads)
        return torch.cat([m(x, threads) for m in self.members], dim=-1)


def group(linears: tuple, kernel: bool = False) -> Group:
    """`linears` (nn.Linear reading the same x) packed as one Group; with `kernel`, their panels made once,
    together (where gemv.grouped cannot, each its own)."""
    parts: list = [None] * len(linears)
    whole = None
    if kernel and kernel_rows():
        made = gemv.grouped([m.weight.detach() for m in linears],
                            [None if m.bias is None else m.bias.detach() for m in linears])
        if made is not None:
            whole, parts = made
    return Group([packed_forward(m, kernel, part) for m, part in zip(linears, parts)], whole)
