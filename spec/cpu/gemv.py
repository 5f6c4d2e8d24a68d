"""The fp32 few-row product, y[M, N] = x[M, K] W[N, K]^T (+ b), for CPU linears, and the Llama layer's small
ops, as torch-facing functions over the native library (spec.cpu.native; the C in spec/cpu/native/gemv.c
and layer.c).

Two layouts (gemv.c): "rows", nn.Linear's own weight read in place; "panel", what spec.cpu.prepack runs, a
copy reordered once into panels of 16 rows interleaved k by k, streamed once per pass. The panel copies
live on transparent huge pages where Linux gives them (`buffer`). `product(w, b)` is a function
x -> x W^T + b; `grouped` several that read the same x as one; `rms`, `rotary_`, `attend`, `silu_mul`
the small ops. Without the library (`library()` None, `reason()` says why) the callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

import torch

from spec.cpu import native

log = logging.getLogger(__name__)

PREFETCH = -1  # floats ahead in w's stream to prefetch into L1; -1: the kernel's own choice (see spec_gemv_panel)
FAR = -1       # floats ahead to prefetch into L2 (the panel layout); -1: the kernel's own choice

_THREADS = [1]


def library():
    """The native library (spec.cpu.native: built, self-tested, one per process), or None (`reason()`)."""
    return native.library()


def reason() -> str | None:
    return native.reason()


def forget() -> None:
    """Decide again at the next `library()` (tests: another $CC or SPEC_NATIVE_ISA)."""
    native.forget()


def set_threads(n: int) -> int:
    """The threads a Product splits its panels over when its call names none (the caller's and n - 1
    workers of the library's pool); the result does not depend on it. Returns the count in force. A Python
    default for callers that do not pass `threads` to the Product: the library itself keeps no count."""
    _THREADS[0] = max(1, min(64, int(n)))
    return _THREADS[0]


def worked() -> int:
    """Parts of products the pool's workers have run in this process (0 without a library)."""
    lib = library()
    return 0 if lib is None else lib.spec_pool_worked()


def isa() -> int:
    """The products' variant in force: 2 AVX-512F, 1 AVX2+FMA, 0 plain C (spec.cpu.native.isa, whose VNNI
    level runs the AVX-512F products); -1 without a library."""
    return min(native.isa(), 2)


# The panel copies live in anonymous memory asked for transparent huge pages (madvise(MADV_HUGEPAGE);
# Linux's default THP mode "madvise" gives them only where asked, torch's allocator does not ask). On the
# measured Zen 4 the 211 products over SmolLM2's 538 MB took 0.65-0.75 of the time on 4 KB pages at 1 row
# and 0.75-0.8 at 9 (docs/log/benchmarks.md, "A hand-written few-row kernel"): a TLB miss per 4 KB and
# hardware prefetchers that stop at each 4 KB page. Copies up to ARENA_CHUNK / 2 share 2 MB-aligned chunks
# of ARENA_CHUNK bytes (a chunk is unmapped when the last tensor in it goes), larger ones get their own
# mapping. Each chunk's last huge page is resident whole however little of it is used: SmolLM2's panels took
# 524 MB of huge pages in 64 MB chunks, 516 in 256 MB ones, for 513 MB of weights (only what is touched is
# resident: a chunk's untouched tail costs address space alone). Where there is no madvise or no
# MADV_HUGEPAGE (not Linux), or the mapping fails: torch's memory.
HUGE_PAGE = 2 << 20
ARENA_CHUNK = 256 << 20
_ARENA: dict = {"map": None, "base": 0, "used": 0, "size": 0}
_ARENA_LOCK = threading.Lock()


def _mapping(nbytes: int):
    """(an anonymous private mapping of at least nbytes from a 2 MB boundary, asked for huge pages, the
    boundary's offset in it)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor                                     # (an exported buffer would keep the map from closing)
    return mm, (-address) % HUGE_PAGE


def buffer(numel: int, huge: bool = True) -> torch.Tensor:
    """An fp32 tensor of `numel` elements, contents unspecified: with `huge`, 4 KB-aligned in memory asked
    for transparent huge pages (see HUGE_PAGE above), else (or where that is not possible) torch's."""
    nbytes = -(-numel * 4 // 4096) * 4096
    if not huge or not nbytes or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(numel, dtype=torch.float32)
    try:
        with _ARENA_LOCK:
            if nbytes > ARENA_CHUNK // 2:
                mm, offset = _mapping(nbytes)
            else:
                if _ARENA["map"] is None or _ARENA["used"] + nbytes > _ARENA["size"]:
                    mm, base = _mapping(ARENA_CHUNK)
                    _ARENA.update(map=mm, base=base, used=0, size=ARENA_CHUNK)
                mm, offset = _ARENA["map"], _ARENA["base"] + _ARENA["used"]
                _ARENA["used"] += nbytes
            return torch.frombuffer(mm, dtype=torch.float32, count=numel, offset=offset)
    except (OSError, ValueError) as e:
        log.debug("spec.cpu.gemv: no huge-page mapping (%s); torch's memory", e)
        return torch.empty(numel, dtype=torch.float32)


FILL_PANELS = 256   # panels filled at a time (4096 rows): `done` is told after each such block


def panels(weight: torch.Tensor, huge: bool = True, done=None) -> torch.Tensor:
    """W [N, K] reordered for the panel layout: [ceil(N/16), K, 16], panel p holding rows 16p..16p+15
    interleaved k by k (the last panel's missing rows zero); in `buffer`'s memory (`huge`: huge pages).
    `done(lo, hi)`, where given, is called once rows lo..hi of W are copied (FILL_PANELS panels at a time)."""
    N, K = weight.shape
    P = -(-N // 16)
    return _fill_panels(buffer(P * K * 16, huge).view(P, K, 16), weight, done)


def _fill_panels(out: torch.Tensor, weight: torch.Tensor, done=None) -> torch.Tensor:
    N, K = weight.shape
    P = out.shape[0]
    full = N // 16
    w = weight.detach()
    for p in range(0, full, FILL_PANELS):
        q = min(full, p + FILL_PANELS)
        out[p:q].copy_(w[p * 16:q * 16].view(q - p, 16, K).transpose(1, 2))
        if done is not None:
            done(p * 16, q * 16)
    if full < P:
        tail = w.new_zeros(16, K)
        tail[:N - full * 16] = w[full * 16:]
        out[full].copy_(tail.t())
        if done is not None:
            done(full * 16, N)
    return out


def product(weight: torch.Tensor, bias: torch.Tensor | None = None, layout: str = "panel",
            prefetch: int | None = None, variant: int = -1, far: int | None = None, huge: bool = True, done=None):
    """x -> x W^T + b on the library (which must be there: see `library()`), W [N, K] fp32 contiguous
    on CPU as nn.Linear stores it; x [..., K] fp32 on CPU. layout "rows": W read in place; "panel": a
    reordered copy made here once (`panels`; `huge`: on huge pages). `variant`: the ISA to use at most
    (-1: the one SPEC_NATIVE_ISA forces, else chosen by the kernel per call, see spec_gemv_panel; 2 AVX-512F,
    1 AVX2+FMA, 0 plain C).
    `prefetch`, `far`: floats ahead in the weight's stream prefetched into L1 and into L2 (None: PREFETCH,
    FAR; -1: the kernel's choice; 0 none; `far` only in the panel layout). `done`: as `panels`' (the panel
    layout). The Product keeps the tensors it reads alive (`keep`)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"spec.cpu.gemv's library is not available: {reason()}")
    if layout not in ("rows", "panel"):
        raise ValueError(f"layout: 'rows' or 'panel', got {layout!r}")
    w = weight.detach()
    b = None if bias is None else bias.detach()
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name}: fp32 contiguous on CPU expected, got {t.dtype} on {t.device}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
    if w.dim() != 2 or (b is not None and b.shape != (w.shape[0],)):
        raise ValueError(f"weight [N, K] and bias [N] expected, got {tuple(w.shape)} and "
                         f"{None if b is None else tuple(b.shape)}")
    N, K = w.shape
    return Product(lib.spec_gemv_panel if layout == "panel" else lib.spec_gemv_rows,
                   panels(w, huge, done) if layout == "panel" else w, b, N, K, PREFETCH if prefetch is None else prefetch,
                   FAR if far is None else far, native.variant() if variant < 0 else variant)


def grouped(weights: list[torch.Tensor], biases: list[torch.Tensor | None], huge: bool = True, done=None):
    """Products of several weights that read the same x (q, k, v; gate, up), in the panel layout:
    (one Product of all of them, x -> [x W1^T + b1 | x W2^T + b2 | ...], and one Product per weight),
    the per-weight ones reading their part of the whole one's panels (no second copy). Every output column
    is summed as in its own product (`product`'s): the whole one's columns are bit-identical to the parts'.
    None where a weight other than the last has rows not a multiple of 16 (its last panel would hold the
    next weight's rows), or the weights differ in K or layout (fp32 contiguous on CPU, as `product`).
    `done`: None, or a function (or None) per weight, called once that weight's panels are made."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"spec.cpu.gemv's library is not available: {reason()}")
    K = weights[0].shape[1]
    if any(w.dim() != 2 or w.shape[1] != K or w.dtype != torch.float32 or w.device.type != "cpu"
           or not w.is_contiguous() for w in weights) or any(w.shape[0] % 16 for w in weights[:-1]):
        return None
    Ns = [w.shape[0] for w in weights]
    Ps = [-(-n // 16) for n in Ns]
    whole = buffer(sum(Ps) * K * 16, huge).view(sum(Ps), K, 16)
    parts, at = [], 0
    for i, (w, P) in enumerate(zip(weights, Ps)):
        parts.append(_fill_panels(whole[at:at + P], w.detach()))
        if done is not None and done[i] is not None:
            done[i]()
        at += P
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
    make = lambda w, b, N: Product(lib.spec_gemv_panel, w, b, N, K, PREFETCH, FAR, native.variant())  # noqa: E731
    return make(whole, bias, sum(Ns)), [make(part, None if b is None else b.detach(), N)
                                         for part, b, N in zip(parts, biases, Ns)]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's function over the last axis of fp32 contiguous CPU `x` on the library (see spec_rms):
    weight * (x / sqrt(mean(x^2) + eps)), weight fp32 contiguous [n]. The caller has checked the library."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    library().spec_rms(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
    return y


def rotary_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding (rotate-half) in place on the first `heads` heads of fp32 contiguous
    CPU `x` [..., all heads, D], with cos and sin [..., D] contiguous (one row per row of x); returns x."""
    D = cos.shape[-1]
    rows = cos.numel() // D
    library().spec_rotary(x.data_ptr(), rows, heads, x.numel() // rows, D, cos.data_ptr(), sin.data_ptr())
    return x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           threads: int = 1):
    """Attention of one sequence on the library (spec_attend): q [1, H, T, D] (last axis contiguous), k and v
    [1, KV, L, D] with each head's rows contiguous, heads equally far apart in both (as a DynamicCache holds
    them, or spec.hf.cache_update's buffers with room), fp32 on CPU; `mask` None
    (row t sees keys up to L - T + t: one row sees all, T = L is causal) or bool [1, 1, T, L] (True: may
    attend); its key heads split over `threads` of the library's threads. Returns [1, T, H * D]; None where the
    inputs are not of that form, the CPU or head size is not covered, or a row may attend to no key: the
    caller runs its own attention then."""
    B, H, T, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    if (B != 1 or k.shape != v.shape or k.shape[0] != 1 or k.shape[3] != D or H % KV or q.stride(3) != 1
            or not q.dtype == k.dtype == v.dtype == torch.float32 or k.stride()[2:] != (D, 1)
            or v.stride()[1:] != k.stride()[1:] or L < T or isa() != 2 or D % 16):
        return None     # (the plain-C attention is the draft's: on other CPUs the target's SDPA is faster)
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape != (1, 1, T, L):
            return None
        mask = mask.contiguous()
    out = q.new_empty(1, T, H * D)
    done = library().spec_attend(q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(1), D, L,
                                 None if mask is None else mask.data_ptr(), out.data_ptr(), T, H, KV, D, scale,
                                 native.variant(), max(threads, 1))
    return out if done == 0 else None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fp32 CPU `gate_up` [..., 2 * inner], gate and up side by side (a Group's output):
    [..., inner] (see spec_silu_mul). The caller has checked the library."""
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    library().spec_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inner), inner,
                            native.variant())
    return out


class Product:
    """x -> x W^T + b through one of the library's entries (made by `product` or `grouped`)."""

    def __init__(self, call, w: torch.Tensor, b: torch.Tensor | None, N: int, K: int, prefetch: int, far: int,
                 variant: int):
        self.call, self.N, self.K, self.prefetch, self.far, self.variant = call, N, K, prefetch, far, variant
        self.keep = (w, b)        # the tensors whose memory the library reads
        self.wp, self.bp = w.data_ptr(), (None if b is None else b.data_ptr())

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x W^T + b, the panels split over `threads` threads (None: set_threads' count)."""
        K = self.K
        if x.shape[-1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x: fp32 [..., {K}] on CPU expected, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        M = x.numel() // K
        y = torch.empty(*x.shape[:-1], self.N, dtype=torch.float32)
        if M:
            self.call(x.data_ptr(), self.wp, self.bp, y.data_ptr(), M, self.N, K, self.prefetch, self.far,
                      self.variant, _THREADS[0] if threads is None else threads)
        return y
