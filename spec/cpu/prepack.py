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
  reordered copy's time at 64 and 700 rows on the measured CPU, against 1.5x at 13 rows), where the weight
  is kept (`SPEC_SHED=0`, or one that cannot be given back: `shed`).
- the kernel: spec.cpu.gemv's hand-written few-row product over a panel-reordered copy of the weight,
  streamed once per pass, for 1 to KERNEL_ROWS rows (12 with AVX-512F, 6 with AVX2+FMA), faster there than
  oneDNN (docs/log/benchmarks.md, "A hand-written few-row kernel"); its panels split over the threads the
  caller names per call (no setting of its own or of torch's is changed). Once a weight's panels are made,
  the weight gives its memory back (`shed`: its pages dropped where it is mapped from its checkpoint, else
  moved to an unlinked file it is mapped from; values, shape and Parameter kept) and the kernel runs every
  pass of it, the longer ones in blocks of rows that stay in L2 (1.08-1.21x oneDNN's time on the model's
  own weight at 64-700 rows, SmolLM2's 135M-1.7B shapes, one thread): the linears then cost the panels'
  memory, about the model's own.

The outputs differ from F.linear's by fp32 rounding only (a different summation order), which
spec.cpu.executor's probes check against the model's own forward once per model, before any weight is given
back. A packed copy adds the linears' weight memory once more where its weight is kept (`fits`).

Nothing here touches a module: a Packed or a Group is a function the executor calls with the rows and the
threads of its pass.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from spec.cpu import gemv, heap

log = logging.getLogger(__name__)

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


# --- the model's own weights, where the kernel's panels serve every pass ---------------------------------

def shedding() -> bool:
    """Whether a linear whose panels run every pass gives up its own weight's memory (`shed`): SPEC_SHED=0
    keeps it (oneDNN then runs the long passes on it, 1.1-1.2x faster than the kernel, at twice the memory)."""
    return os.environ.get("SPEC_SHED", "1") != "0"


def long_on_kernel(threads: int) -> bool:
    """Whether a shed weight's longer passes (a prefill) run on the kernel, given the pass's `threads`:
    where the kernel's panels are split over them (spec.cpu.executor's plain layers, whose torch ops then stay
    on the calling thread) or torch runs one thread. Else (a model's own forward at 2 or more torch threads:
    its ops wake torch's thread team, and a kernel pass on the calling thread alone beside it measured 1.6x
    oneDNN's prefill, 700 rows, SmolLM2) oneDNN's threads run them over the weight, read back from its file."""
    return threads > 1 or torch.get_num_threads() == 1


def weights_dir() -> Path:
    return Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser() / "weights"


def shed(param: torch.nn.Parameter) -> bool:
    """Give back the memory of `param`'s values (fp32, 2-D, contiguous, on CPU) once packed copies serve every pass,
    keeping the values where the model reads them:

    - mapped from a file (transformers maps a checkpoint's safetensors) and holding the file's own bytes
      there: its pages are dropped from the process (madvise MADV_DONTNEED on the whole pages it spans; read
      again from the file, the page cache, if anything reads them). The Parameter is not touched.
    - in the process's own memory: its values are written to a file in weights_dir(), unlinked at once, and
      the Parameter's storage becomes a private mapping of it (same values and shape, same Parameter object,
      read from the page cache only when something reads it); its memory is freed (glibc's malloc_trim where
      that is the C library).

    Returns False, changing nothing, where it cannot (not such a tensor, a view into a larger storage, a
    mapped file whose bytes there differ from the values, a file that cannot be written)."""
    t = param.data
    if not _packable(t):
        return False
    if _given(param, False):
        return True                 # (given back already: `released`)
    drop = dropper(param)
    if drop is not None:
        return _given(param, drop(0, t.shape[0]))
    if t.untyped_storage().nbytes() != t.numel() * 4:
        return False
    try:
        weights_dir().mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=weights_dir(), suffix=".f32")
        try:
            with os.fdopen(fd, "wb") as f:
                t.numpy().tofile(f)
            copy = torch.from_file(name, shared=False, size=t.numel(), dtype=torch.float32)
        finally:
            os.unlink(name)
    except (OSError, RuntimeError) as e:
        log.debug("spec.cpu.prepack: a weight stays in memory (%s)", e)
        return False
    with torch.no_grad():
        param.data = copy.view(t.shape)
    heap.trim()
    return _given(param, True)


# id(param) -> (a weak reference to it, the data_ptr of its values when they were given back: shed, or
# released block by block): a weight given back is not read, checked or written again for it
_GIVEN: dict = {}


def _given(param: torch.nn.Parameter, done: bool) -> bool:
    """With `done`: `param`'s values as they are now are given back (returns True). Without: whether they are."""
    key = id(param)
    if done:
        def gone(_: weakref.ref) -> None:
            _GIVEN.pop(key, None)
        _GIVEN[key] = (weakref.ref(param, gone), param.data.data_ptr())
        return True
    held = _GIVEN.get(key)
    return held is not None and held[0]() is param and held[1] == param.data.data_ptr()


def releaser(param: torch.nn.Parameter):
    """A function of (lo, hi) that gives back the memory of `param`'s rows lo..hi as its packed copy is made,
    block by block, so that the copy and the weight are never both whole in memory; None where it cannot
    (`shed` fails). Mapped from its checkpoint: `dropper`'s. In the process's own memory (a model built or
    loaded without a map): moved to an unlinked file first (`shed`: its memory is freed at once), then the
    pages of those rows of the file's private mapping, read again while copying, are dropped (clean pages of
    spec's own file: read back from it, nothing to check). Returns whether it dropped them."""
    drop = dropper(param)
    if drop is not None:
        return drop
    if not shed(param):
        return None
    t = param.data
    row = t.shape[1] * 4
    return lambda lo, hi: _advise(t.data_ptr() + lo * row, (hi - lo) * row)


def _release_whole(param: torch.nn.Parameter):
    """A function of () that gives `param` back whole once its copy is made (a `releaser`'s drop over all
    its rows), or None where it cannot be."""
    drop = releaser(param)
    return None if drop is None else lambda: _given(param, drop(0, param.data.shape[0]))


def released(param: torch.nn.Parameter, drops: list) -> bool:
    """Whether `param` is given back: every block's drop (a `releaser`'s) done, or `shed` now."""
    return _given(param, True) if drops and all(drops) else shed(param)


PAGE = mmap.PAGESIZE


def _packable(t: torch.Tensor) -> bool:
    """A linear's weight `shed` and `dropper` take: fp32, 2-D, contiguous, on CPU, not empty."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.dim() == 2 and t.numel() > 0


def _file_mapping(ptr: int, nbytes: int) -> tuple[str, int] | None:
    """(the file, the offset in it) that [ptr, ptr + nbytes) is mapped from, where one mapping of a regular
    file covers it (/proc/self/maps), else None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= ptr < hi:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    if ptr + nbytes > hi or not path.startswith("/") or path.endswith(" (deleted)"):
                        return None
                    return path, ptr - lo + int(fields[2], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def dropper(param: torch.nn.Parameter):
    """Where `param` is mapped from a file (as `shed` says), a function of (lo, hi) that drops the pages of its
    rows lo..hi that hold the file's bytes (packing a large weight block by block: gemv.panels' `done`), so
    that its copy and itself are not both whole in memory; else None."""
    t = param.data
    if not _packable(t):
        return None
    mapped = _file_mapping(t.data_ptr(), t.numel() * 4)
    if mapped is None:
        return None
    path, offset = mapped
    row = t.shape[1] * 4
    return lambda lo, hi: _drop_pages(t[lo:hi], path, offset + lo * row)


def _drop_pages(t: torch.Tensor, path: str, offset: int) -> bool:
    """Drop the whole pages of mapped values `t` (contiguous) from the process where the file holds them at
    `offset` (read back 16 MB at a time, compared, and that part dropped); False where it does not (changed
    since mapped: the parts before it, equal to the file's, are dropped)."""
    ptr, nbytes = t.data_ptr(), t.numel() * 4
    values = t.numpy().reshape(-1).view(np.uint8)
    chunk = 16 << 20
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            at = 0
            while at < nbytes:              # (chunks end on whole pages: each one's pages dropped once compared)
                end = min(nbytes, (ptr + at + chunk) // chunk * chunk - ptr)
                disk = f.read(end - at)
                if disk != values[at:end].tobytes() or not _advise(ptr + at, end - at):
                    return False
                at = end
    except OSError:
        return False
    return True


def _advise(ptr: int, nbytes: int) -> bool:
    """Drop the whole pages inside [ptr, ptr + nbytes) of a clean mapping of a file from the process."""
    lo, hi = -(-ptr // PAGE) * PAGE, (ptr + nbytes) // PAGE * PAGE
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
            return False
    return True


class Packed:
    """A linear's function x -> x W^T + b on packed weights (made by `packed_forward`). `kernel`: whether
    it has the kernel's panels (`small`, for 1 to `most` rows; with `shed`, for every pass the kernel runs:
    the weight itself lives in a file, `shed`). The weight is read from the linear's Parameter at each
    oneDNN call (`param`): its storage may have moved."""

    def __init__(self, param: torch.Tensor, bias: torch.Tensor | None, small, most: int, shed: bool = False):
        self.param, self.bias, self.small, self.most, self.shed = param, bias, small, most, shed
        self.kernel = small is not None
        self.reordered: torch.Tensor | None = None
        self.reorder = True     # False: oneDNN never makes its copy (a probe's executor, beside a shedding one)

    @property
    def weight(self) -> torch.Tensor:
        return self.param.detach()

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
        return self.reorder and (self.small is None or torch.get_num_threads() > KERNEL_THREADS)

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        """x W^T + b: on the kernel, its panels split over `threads` threads, for 1 to `most` rows when
        `threads` > 0; else on oneDNN."""
        rows = x.numel() // x.shape[-1]
        if threads and rows and (rows <= self.most or self.shed and long_on_kernel(threads)):
            return self.small(x, threads=threads)
        if not 0 < rows < MIN_ROWS:
            return self.onednn(x, rows)
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
        y = self.onednn(flat, rows)[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_forward(linear: torch.nn.Linear, kernel: bool = False, small=None, shed_weight: bool = False) -> Packed:
    """linear's function on packed weights: with `kernel`, spec.cpu.gemv's panels too (made here, or `small`,
    a gemv Product made elsewhere) for 1 to KERNEL_ROWS[its ISA] rows, and with `shed_weight` for every pass,
    its own weight moved out of memory once they are made (`shed`); oneDNN's reordered copy of the weight is
    made at the first call that needs it."""
    bias = None if linear.bias is None else linear.bias.detach()
    most = kernel_rows() if kernel else 0
    dropped: list = []        # each block's drop (`releaser`): all done, the weight is given back already
    if most and small is None:
        drop = releaser(linear.weight) if shed_weight else None
        small = gemv.product(linear.weight.detach(), bias, "panel",
                             done=None if drop is None else lambda lo, hi: dropped.append(drop(lo, hi)))
    gone = bool(most) and shed_weight and released(linear.weight, dropped)
    return Packed(linear.weight, bias, small if most else None, most, gone)


class Group:
    """Linears that read the same x (a layer's q, k, v; gate, up) as one function, x -> their outputs side
    by side [..., N1 + N2 + ...]: one spec.cpu.gemv product over panels they share (gemv.grouped; each
    column bit-identical to its own linear's) where the kernel runs the call, else each member's packed
    forward, concatenated. `members`: the linears' Packed (each on its part of the panels)."""

    def __init__(self, members: list, whole=None):
        self.members, self.whole = members, whole
        self.most = members[0].most if whole is not None else 0
        self.shed = all(m.shed for m in members)    # every member's weight given back: the kernel runs every pass

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.most and threads and rows and (rows <= self.most or self.shed and long_on_kernel(threads)):
            return self.whole(x, threads=threads)
        return torch.cat([m(x, threads) for m in self.members], dim=-1)


def group(linears: tuple, kernel: bool = False, shed_weights: bool = False) -> Group:
    """`linears` (nn.Linear reading the same x) packed as one Group; with `kernel`, their panels made once,
    together (where gemv.grouped cannot, each its own), and with `shed_weights` each weight moved out of
    memory once they are (`packed_forward`)."""
    parts: list = [None] * len(linears)
    whole = None
    if kernel and kernel_rows():
        # each member given back as soon as its panels are made (`released`: packed_forward finds it so); a
        # weight in the process's memory is moved to a file here, so its values are read after that
        done = [_release_whole(m.weight) if shed_weights else None for m in linears]
        made = gemv.grouped([m.weight.detach() for m in linears],
                            [None if m.bias is None else m.bias.detach() for m in linears], done=done)
        if made is not None:
            whole, parts = made
    return Group([packed_forward(m, kernel, part, shed_weights) for m, part in zip(linears, parts)], whole)
