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
(SPEC_PREPACK=0), linears of at least MIN_BYTES whose copies fit in half the memory available (`fits`), and the packed forward agreeing with the model's own within the probe's tolerance
(spec.probe, once per model); spec.runner's passes then run inside `swapped(forwards(model))`.

Few rows on few threads: spec.cpu.gemv's hand-written kernel (a panel-reordered copy of each weight,
streamed once per pass) runs passes of 1 to KERNEL_ROWS rows (12 with AVX-512F, 6 with AVX2+FMA) when
torch runs at most KERNEL_THREADS threads, faster there than oneDNN (docs/BENCHMARKS.md, "A hand-written
few-row kernel"); at 2 torch threads its panels split over 2 threads of its own pool and the rest of the
pass runs at one torch thread (`pass_threads`; "The kernel on two threads"). More rows, or more threads,
stay on oneDNN, whose copies are then made at their first use (a run that
prefills more than KERNEL_ROWS rows holds both: the linears' weight memory twice more).
`kernel_used(model)`: `used(model)`, not switched off (SPEC_GEMV=0), the library built and self-tested
in a subprocess (spec.cpu.gemv.library: no compiler, a compile error or a failed self-test leaves oneDNN,
with a debug-level log line), a CPU with AVX2+FMA at least, and the kernel's logits within the probe's
tolerance of the model's own (spec.probe 'gemv linears', once per model; a kernel off by more leaves
oneDNN alone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref

import torch

from spec.cpu import gemv, plainllama

log = logging.getLogger(__name__)

HINT = 16  # the batch size oneDNN picks the weight's layout for (4 and 16 measured alike)
# Packing pays where a pass streams the weights from memory; a model whose linears fit in the CPU's
# caches (the shipped pair: 6 MB) runs its many small products faster through F.linear.
MIN_BYTES = 64 << 20
MIN_ROWS = 3  # 1 and 2 rows are padded to 3: oneDNN's 3-row product is faster than its 1- and 2-row ones
# spec.cpu.gemv's kernel runs 1 to KERNEL_ROWS[its ISA] rows, the rows its panel kernel takes in
# one turn over the weight (AVX-512F 12, AVX2+FMA 6); more go to oneDNN. The plain-C variant is there for
# correctness only: not used here (docs/BENCHMARKS.md, "A hand-written few-row kernel").
KERNEL_ROWS = {2: 12, 1: 6}


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
    """Whether the packed copies of `size` bytes of linears (the kernel's panels and oneDNN's reordered
    weights: up to twice `size` more) fit in half the memory available now; where that is unknown,
    they are assumed to. A model too large for its copies runs its own linears, slower and whole."""
    free = memory_available()
    return free is None or 2 * size <= free // 2


def available(model) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def packed_forward(linear: torch.nn.Linear, kernel: bool = False, small=None):
    """linear's function, x -> x W^T + b: on spec.cpu.gemv's kernel (its panel copy of the weight, made here,
    or `small`, a gemv Product made elsewhere) for 1 to KERNEL_ROWS[its ISA] rows when `kernel` and torch
    runs at most KERNEL_THREADS threads (or inside `kernel_always()`), else on a oneDNN-reordered copy of
    its weight (made at the first call that needs it)."""
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    most = KERNEL_ROWS.get(gemv.isa(), 0) if kernel else 0
    if most and small is None:
        small = gemv.product(weight, bias, "panel")
    return Packed(weight, bias, small if most else None, most)


class Group:
    """Linears that read the same x (a layer's q, k, v; gate, up) as one function, x -> their outputs side
    by side [..., N1 + N2 + ...]: one spec.cpu.gemv product over panels they share (gemv.grouped; each
    column bit-identical to its own linear's) where the kernel runs the pass, else each member's packed
    forward, concatenated. `members`: the linears' packed forwards (each on its part of the panels)."""

    def __init__(self, members: list, whole=None):
        self.members, self.whole = members, whole
        self.most = members[0].most if whole is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if 0 < rows <= self.most and (_ALWAYS or torch.get_num_threads() <= KERNEL_THREADS):
            return self.whole(x)
        return torch.cat([m(x) for m in self.members], dim=-1)


def group(linears: tuple, kernel: bool = False) -> Group:
    """`linears` (nn.Linear reading the same x) packed as one Group; with `kernel`, their panels made once,
    together (where gemv.grouped cannot, each its own)."""
    parts: list = [None] * len(linears)
    whole = None
    if kernel and KERNEL_ROWS.get(gemv.isa(), 0):
        made = gemv.grouped([m.weight.detach() for m in linears],
                            [None if m.bias is None else m.bias.detach() for m in linears])
        if made is not None:
            whole, parts = made
    return Group([packed_forward(m, kernel, part) for m, part in zip(linears, parts)], whole)


class Packed:
    """A linear's packed forward (made by packed_forward); `kernel`: whether it runs spec.cpu.gemv's kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small, most: int):
        self.weight, self.bias, self.small, self.most = weight, bias, small, most
        self.kernel = small is not None
        self.reordered: torch.Tensor | None = None

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        if self.reordered is None:
            self.reordered = torch.ops.mkldnn._reorder_linear_weight(self.weight, HINT)
        return torch.ops.mkldnn._linear_pointwise(x, self.reordered, self.bias, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if 0 < rows <= self.most and (_ALWAYS or torch.get_num_threads() <= KERNEL_THREADS):
            return self.small(x)
        if not 0 < rows < MIN_ROWS:
            return self.onednn(x)
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
        y = self.onednn(flat)[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])


# model -> (the linears' weight versions and the kernel flags, {linear: its packed forward})
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forwards(model, kernel: bool | None = None, layers: bool | None = None) -> dict:
    """Each plain nn.Linear's packed forward, made once while the weights stay as they were (a walk
    over the model: a runner asks once and keeps the dict). `kernel`: spec.cpu.gemv's kernel for few rows
    (None: where `kernel_used(model)` says so). `layers`: each decoder layer's plain-tensor forward
    too (spec.cpu.plainllama, its products on these linears, q/k/v and gate/up each as one `Group`; None:
    where `layers_used(model)` says so), after the linears."""
    if kernel is None:
        kernel = kernel_used(model)
    if layers is None:
        layers = layers_used(model)
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear]
    key = (tuple(m.weight._version for m in mods), kernel, layers)
    known = _PACKED.get(model)
    if known is None or known[0] != key:
        made: dict = {}
        groups = {g: group(g, kernel) for g in plainllama.grouped_linears(model)} if layers else {}
        for g, packed in groups.items():
            made.update(zip(g, packed.members))
        for m in mods:
            if m not in made:
                made[m] = packed_forward(m, kernel)
        if layers:
            made.update(plainllama.forwards(model, groups, made))
        known = _PACKED[model] = (key, made)
    return known[1]


@contextlib.contextmanager
def swapped(packed: dict, rows: int | None = None):
    """Within the context, each linear in `packed` runs its packed forward (from `forwards`). `rows`: the
    rows of the pass to come, where known. A pass of 1 to KERNEL_ROWS rows whose linears run spec.cpu.gemv's
    kernel at 2 to KERNEL_THREADS torch threads splits the kernel's panels over that many threads of the
    library's pool and runs the rest of the pass at one torch thread (see `pass_threads`)."""
    mods = [m for m in packed if "forward" not in vars(m)]
    split = pass_threads(packed, rows)
    before = torch.get_num_threads()
    if split:
        gemv.set_threads(split)
        torch.set_num_threads(1)
    try:
        for m in mods:      # (object's setattr: nn.Module's own costs microseconds a call, 211 times a pass)
            object.__setattr__(m, "forward", packed[m])
        yield
    finally:
        for m in mods:
            vars(m).pop("forward", None)
        if split:
            torch.set_num_threads(before)
            gemv.set_threads(1)


def pass_threads(packed: dict, rows: int | None) -> int:
    """The threads spec.cpu.gemv's kernel splits a pass of `rows` rows over, or 0 where the pass runs as torch
    runs (one thread, no kernel in `packed`, more than KERNEL_ROWS rows, more than KERNEL_THREADS torch
    threads, or rows unknown). The small ops around the linears of a few-row pass then run at one torch
    thread: on the measured 2-core Zen 4, torch's second thread spinning beside the kernel's worker made a
    one-token step 49 ms against 28 (docs/BENCHMARKS.md, "The kernel on two threads")."""
    threads = torch.get_num_threads()
    if rows is None or not 1 < threads <= KERNEL_THREADS or _ALWAYS:
        return 0
    first = next(iter(packed.values()), None)      # (forwards makes every linear's the same way, first)
    return threads if isinstance(first, Packed) and 0 < rows <= first.most else 0


_ALWAYS = False      # inside kernel_always(): the kernel runs its rows whatever torch's threads
# The most torch threads at which the kernel runs its rows: at 2 threads on the 2-core Zen 4 it was 1.35x
# faster than oneDNN's two even on one thread (SmolLM2 greedy 30.3 against 41.0 ms a token, interleaved),
# and splits over 2 threads now; with more cores oneDNN's threads share the stream (not measured here: a
# 2-core machine).
KERNEL_THREADS = 2


@contextlib.contextmanager
def kernel_always():
    """Within the context, packed forwards with the kernel run it for 1 to KERNEL_ROWS rows at any
    number of threads (the probe checks the kernel itself, whatever the caller's threads)."""
    global _ALWAYS
    before, _ALWAYS = _ALWAYS, True
    try:
        yield
    finally:
        _ALWAYS = before


@contextlib.contextmanager
def packed_linears(model, kernel: bool | None = False):
    """Within the context, `model`'s nn.Linear modules (exactly that class) run packed_forward (oneDNN
    alone by default; `kernel`: as forwards takes it)."""
    with swapped(forwards(model, kernel, layers=False) if available(model) else {}):
        yield model


def used(model) -> bool:
    """Whether spec's runners run `model` packed (see the module docstring)."""
    if os.environ.get("SPEC_PREPACK", "1") == "0" or not available(model):
        return False
    from spec import probe
    return probe.once(model, "packed linears", _agrees)


def kernel_used(model) -> bool:
    """Whether the packed linears run spec.cpu.gemv's kernel for 1 to KERNEL_ROWS rows (at up to KERNEL_THREADS
    torch threads): the model is run packed (`used`), not switched off (SPEC_GEMV=0), the library built and
    self-tested (spec.cpu.gemv.library; else a debug-level reason) with an AVX2+FMA or AVX-512F variant for this CPU,
    and the kernel's logits within the probe's tolerance of the model's own (spec.probe 'gemv linears',
    once per model)."""
    if os.environ.get("SPEC_GEMV", "1") == "0" or not used(model) or gemv.isa() not in KERNEL_ROWS:
        return False
    from spec import probe
    return probe.once(model, "gemv linears", _kernel_agrees)


def layers_used(model) -> bool:
    """Whether the packed passes run `model`'s decoder layers in plain tensors (spec.cpu.plainllama): the
    model is run packed (`used`), not switched off (SPEC_PLAIN_LAYERS=0), its layers of a kind
    spec.cpu.plainllama runs (else a debug-level reason), and its logits that way within the probe's
    tolerance of the model's own (spec.probe 'plain layers', once per model; an exception there is a no,
    logged at debug level)."""
    if os.environ.get("SPEC_PLAIN_LAYERS", "1") == "0" or not used(model):
        return False
    why = plainllama.supports(model)
    if why is not None:
        log.debug("spec.cpu.prepack: %s's layers run as the model runs them: %s", type(model).__name__, why)
        return False
    from spec import probe
    return probe.once(model, "plain layers", _layers_agree)


def _matches(model, cuts, context) -> bool:
    """The model's logits over the probe's first n ids, for each n in `cuts` (0: all of them), run inside
    `context()` are within the probe's tolerance of the model's own forward's: the one check behind each
    of this module's probes."""
    from spec import hf, probe
    ids = probe.ids(model, probe.probe_length(model), next(model.parameters()).device)
    lengths = sorted({min(n, ids.numel()) if n else ids.numel() for n in cuts})
    want = [hf.authors_forward(model, ids[:n]) for n in lengths]
    with context():
        got = [hf.authors_forward(model, ids[:n]) for n in lengths]
    return all(probe.close(g, w, probe.tolerance(model)) for g, w in zip(got, want))


def _layers_agree(model) -> bool:
    """The plain layers' logits (on the linears the passes use) are within the probe's tolerance of the
    model's own, over the probe's ids (many rows), its first KERNEL_ROWS and its first id alone."""
    try:
        return _matches(model, (1, KERNEL_ROWS.get(gemv.isa(), 3), 0),
                        lambda: swapped(forwards(model, kernel_used(model), layers=True)))
    except Exception as e:          # (a release whose layers take other arguments: the model's own layers run)
        log.debug("spec.cpu.prepack: %s's plain layers failed (%s: %s); its own layers run", type(model).__name__,
                  type(e).__name__, e)
        _PACKED.pop(model, None)
        return False


def _kernel_agrees(model) -> bool:
    """The kernel's logits (whatever torch's threads) are within the probe's tolerance of the model's
    own, over the probe's first id alone (1 row), its first 3 and its first KERNEL_ROWS[ISA]."""
    @contextlib.contextmanager
    def kernel_everywhere():
        with packed_linears(model, kernel=True), kernel_always():
            yield
    return _matches(model, (1, 3, KERNEL_ROWS[gemv.isa()]), kernel_everywhere)


def _agrees(model) -> bool:
    """The model's linears are large enough to pay (MIN_BYTES), and the packed forward's logits are
    within the probe's tolerance of the model's own, over the probe's ids (many rows) and over its
    first id alone (one row, padded)."""
    size = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)
    if size < MIN_BYTES or not fits(size):
        return False
    return _matches(model, (0, 1), lambda: packed_linears(model))
