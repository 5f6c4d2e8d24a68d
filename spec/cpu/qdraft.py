"""A GGUF Llama draft run by spec's own block-quantized kernel: the same Q4_1 file the llama.cpp draft
reads, several times cheaper a token on a CPU with AVX-512 VNNI.

The draft's cost bounds what a self-draft can gain (Theorem 3.8: the speedup is E / (gamma c + V)), and a
draft's numbers never touch the output: whatever it proposes, the target's acceptance rule keeps the
output exactly the target's. So the draft may be computed the fastest way a CPU allows. This module reads
a GGUF written for llama.cpp's `llama` architecture (Q4_1 and Q8_0 matrices, f32 norms; the layout every
llama.cpp Q4_1 export of a Llama has; its header read here, its tensors where the file lies) into records of 16 rows x 32 inputs
(spec/cpu/native/qdraft.c says the layout), q/k/v and gate/up each as one matrix, q's and k's rows put
back in transformers' order (llama.cpp's converter interleaves each head's halves for its rotary), so the
forward runs the same layer ops as the fp32 target's plain layers (layer.c) around its own products.
Its key and value cache holds IEEE halves (llama.cpp's default cache type): half the memory, and half the
bytes a step reads of a long context, which at ~1,000 positions are as many as its weights'.

`library()` is spec.cpu.native's library where this CPU runs its VNNI variant (or SPEC_NATIVE_ISA forces a
variant: the tests run the plain-C one so), else None with `reason()`: spec.gguf_draft then runs llama.cpp.
`unsupported(path)` says why a file cannot run here (None: it can). `QuantRun(path)` is a Runner
(spec.protocols) over one sequence: `run(ids)` feeds ids after what the cache holds and returns the last
position's logits; `crop(keep)` forgets positions from keep on.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spec.cpu import gemv, heap, native

KINDS = {"Q4_1": 4, "Q8_0": 8}          # GGUF matrix types the kernel reads, and its record kind
GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}   # the rest: "type N"
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def library():
    """spec.cpu.native's library where the draft's kernel runs here, else None with `reason()` saying why
    (SPEC_QDRAFT=0; no AVX-512 VNNI on this CPU and no variant forced; no library)."""
    if os.environ.get("SPEC_QDRAFT", "1") == "0":
        return None
    lib = native.library()
    if lib is None or (native.forced() is None and native.isa() < 3):
        return None
    return lib


def reason() -> str | None:
    """Why `library()` is None (None when it is not)."""
    if os.environ.get("SPEC_QDRAFT", "1") == "0":
        return "SPEC_QDRAFT=0"
    if native.library() is None:
        return native.reason()
    if native.forced() is None and native.isa() < 3:
        return f"this CPU runs spec's native {native.NAMES[native.isa()]} variant, not AVX-512 VNNI (the draft's kernel)"
    return None


def forget() -> None:
    native.forget()


_INTS = ("n_layer", "dim", "n_head", "n_kv", "head_dim", "ffn", "vocab", "n_ctx")


class Model(ctypes.Structure):
    """spec_native.h's spec_qd_model."""
    _fields_ = ([(n, ctypes.c_int64) for n in _INTS]  # type: ignore[assignment]
                + [("eps", ctypes.c_float), ("theta", ctypes.c_float),
                   ("embd", ctypes.c_void_p), ("embd_kind", ctypes.c_int64),
                   ("out", ctypes.c_void_p), ("out_kind", ctypes.c_int64), ("out_norm", ctypes.c_void_p),
                   ("norms", ctypes.c_void_p), ("mats", ctypes.c_void_p), ("kinds", ctypes.c_void_p),
                   ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p), ("isa", ctypes.c_int64),
                   ("threads", ctypes.c_int64)])


def records(kind: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """A GGUF matrix's raw blocks (Q4_1 when kind is 4, Q8_0 when 8; [n rows, bytes]) as the kernel's
    records (qdraft.c's comment), in memory asked for huge pages (spec.cpu.gemv.buffer), made RECORD_ROWS
    rows at a time (their intermediate arrays are a few times the rows' bytes)."""
    row = (k // 32) * (20 if kind == 4 else 36)                      # a record's bytes over its 16 rows
    out = gemv.buffer(-(-n * row // 4)).view(torch.uint8)[:n * row].numpy()
    for r0 in range(0, n, RECORD_ROWS):
        r1 = min(n, r0 + RECORD_ROWS)
        out[r0 * row:r1 * row] = _records(kind, raw[r0:r1], r1 - r0, k).reshape(-1)
    return out


RECORD_ROWS = 1024       # (a multiple of 16: whole panels)


def _records(kind: int, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """records' for n rows (a multiple of 16), [n / 16, k / 32, record bytes]."""
    B, P = k // 32, n // 16
    d: np.ndarray
    m: np.ndarray
    if kind == 4:
        blk = raw.reshape(n, B, 20)
        d, m = blk[..., 0:2].copy().view(np.float16)[..., 0], blk[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blk[..., 4:20]
        u = np.concatenate([qs & 15, qs >> 4], axis=-1)            # element k < 16 low nibble, k >= 16 high
        h = u.reshape(P, 16, B, 2, 4, 4)
        w = (h[:, :, :, 0] | (h[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(P, B, 256)
    else:
        blk = raw.reshape(n, B, 34)
        d = blk[..., 0:2].copy().view(np.float16)[..., 0]
        m = (d.astype(np.float32) * -128).astype(np.float16)     # exact: a power of two
        u = (blk[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        w = u.reshape(P, 16, B, 8, 4).transpose(0, 2, 3, 1, 4).reshape(P, B, 512)
    scales: list[np.ndarray] = [a.reshape(P, 16, B).transpose(0, 2, 1).copy().view(np.uint8).reshape(P, B, 32)
                                for a in (d, m)]
    return np.concatenate([w, *scales], axis=-1)


def unpermute(raw: np.ndarray, heads: int) -> np.ndarray:
    """q's or k's rows ([heads * head size, bytes]) from llama.cpp's order (each head's rotary halves
    interleaved, row 2i + j of a head for transformers' row j * head_size / 2 + i) back to transformers'."""
    n = raw.shape[0]
    return raw.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)


class Unsupported(ValueError):
    """The kernel cannot run this file here (the message says why)."""


# GGUF's value types: the numeric ones as struct/NumPy formats (7: bool), 8 a string, 9 an array
_NUMERIC = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
            12: "<f8"}
# the types of tensors read here: (elements a block, bytes a block)
_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)}
_SKIPPED = ("tokenizer.ggml.merges",)    # (~50k strings nothing here reads: passed over, not decoded)


class _Cursor:
    """Reads GGUF's little-endian header values from `buf` (the mapped file) at `at`, moving on."""

    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def number(self, kind: int):
        v = np.frombuffer(self.buf, _NUMERIC[kind], 1, self.at)[0]
        self.at += v.nbytes
        return v.item()

    def string(self) -> str:
        start = self.skip()
        return bytes(self.buf[start:self.at]).decode("utf-8")

    def skip(self) -> int:
        """Moves past a string; returns where its bytes start."""
        n = self.number(10)
        if self.at + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return self.at - n

    def value(self, kind: int, keep: bool = True) -> Any:
        if kind == 8:
            return self.string() if keep else self.skip()
        if kind == 9:
            inner, n = self.number(4), self.number(10)
            if inner in _NUMERIC:
                a = np.frombuffer(self.buf, _NUMERIC[inner], n, self.at)
                self.at += a.nbytes
                return a.tolist() if keep else None
            items = [self.value(inner, keep) for _ in range(n)]
            return items if keep else None
        if kind not in _NUMERIC:
            raise ValueError(f"value type {kind}")
        return self.number(kind)


class GGUF:
    """A GGUF file's header (versions 2 and 3), read here: `fields` (key -> value; arrays as lists; the
    merges left out), `tensors` (name -> (type name, shape [ne0, ne1, ...])), `data(name)` (the raw bytes,
    [rows, bytes a row], a view of the file mapped once). (The `gguf` package's reader makes an object per
    token: ~120 MB and 2 s for SmolLM2's 49k-token vocabulary, where this takes a few MB and a tenth of it.)"""

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise Unsupported(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self._header(_Cursor(self._map))
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise Unsupported(f"{self.path.name}: its GGUF header cannot be read ({e})") from e

    def _header(self, c: _Cursor) -> None:
        c.at = 4
        version = c.number(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_fields = c.number(10), c.number(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = c.string()
            keep = not key.startswith(_SKIPPED)
            value = c.value(c.number(4), keep)
            if keep:
                self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            shape = [c.number(10) for _ in range(c.number(4))]
            infos.append((name, shape, c.number(4), c.number(10)))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-c.at // align) * align
        self.tensors = {name: (GGUF_TYPES.get(kind, f"type {kind}"), shape) for name, shape, kind, _ in infos}
        self._tensors = {name: (start + offset, shape, kind) for name, shape, kind, offset in infos}

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes, [rows, bytes a row] (a view of the mapped file)."""
        offset, shape, kind = self._tensors[name]
        if kind not in _BLOCKS:
            raise Unsupported(f"{name}: tensor type {kind} is not read here")
        per, size = _BLOCKS[kind]
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        row = shape[0] // per * size
        if offset + rows * row > len(self._map):
            raise Unsupported(f"{self.path.name}: {name} runs past the end of the file")
        return np.ndarray((rows, row), dtype=np.uint8, buffer=self._map, offset=offset)

    def drop_pages(self, *names: str) -> None:
        """Drop the mapped file's pages from the process, those of the tensors `names` (none: all of them);
        they are read again from the page cache if asked for. A QuantRun drops each matrix's once its
        records are made, so that the file is never resident whole beside them."""
        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        spans = [(0, len(mm))] if not names else [(o, o + d.nbytes) for o, d in
                                                   ((self._tensors[n][0], self.data(n)) for n in names)]
        for lo, hi in spans:
            lo -= lo % mmap.PAGESIZE
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(mm)) - lo)
            except (OSError, ValueError):
                pass


@functools.lru_cache(maxsize=2)
def _read(path: str, stamp: tuple) -> GGUF:
    return GGUF(path)


def read(path) -> GGUF:
    """The GGUF at `path`, read once while the file is unchanged (the reader takes about 2 s on SmolLM2)."""
    st = os.stat(path)
    return _read(str(Path(path).resolve()), (st.st_mtime_ns, st.st_size))


def unsupported(path) -> str | None:
    """Why the kernel cannot run the GGUF at `path` here (None: it can)."""
    try:
        _check(read(path))
    except Unsupported as e:
        return str(e)
    except OSError as e:
        return f"{Path(path).name} cannot be read: {e}"
    return None


def _check(g: GGUF) -> None:
    """Raise Unsupported naming why the kernel cannot run `g` here."""
    if library() is None:
        raise Unsupported(f"spec's quantized kernel is not available here: {reason()}")
    f = g.fields
    arch = f.get("general.architecture")
    if arch != "llama":
        raise Unsupported(f"architecture {arch!r} (the kernel runs 'llama' only)")
    for key in ("rope.scaling.type", "rope.scaling.factor", "attention.key_length", "attention.value_length"):
        if f.get(f"llama.{key}") not in (None, "none"):
            raise Unsupported(f"llama.{key} is set (the kernel has no rope scaling; head size = width / heads)")
    for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length",
                "attention.layer_norm_rms_epsilon"):
        if f.get(f"llama.{key}") is None:
            raise Unsupported(f"llama.{key} is missing")
    layers = int(f["llama.block_count"])
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(layers) for n in MATRICES + ("attn_norm", "ffn_norm")}
    extra = sorted(set(g.tensors) - expected)
    if extra:
        raise Unsupported(f"tensors the kernel does not compute: {', '.join(extra[:4])}")
    missing = sorted(expected - set(g.tensors) - {"output.weight"})
    if missing:
        raise Unsupported(f"tensors missing: {', '.join(missing[:4])}")
    for name, (kind, shape) in g.tensors.items():
        if name.endswith("_norm.weight"):
            if kind != "F32":
                raise Unsupported(f"{name} is {kind} (f32 norms only)")
        elif kind not in KINDS:
            raise Unsupported(f"{name} is {kind} (the kernel reads {', '.join(KINDS)})")
        elif len(shape) != 2 or shape[0] % 32 or shape[1] % 16:
            raise Unsupported(f"{name} is {shape[1:]} x {shape[0]} (rows a multiple of 16, inputs of 32)")
    for i in range(layers):
        for group in FUSED:
            if len({g.tensors[f"blk.{i}.{n}.weight"][0] for n in group}) > 1:
                raise Unsupported(f"blk.{i}: {', '.join(group)} are of different types (the kernel runs them as one)")


def _zeros(shape: tuple) -> np.ndarray:
    """Zeroed IEEE halves resident only where written, 4 KB at a time: an anonymous mapping (numpy asks Linux for
    huge pages for large arrays, and a cache's first positions in each layer would then make all of it
    resident, 2 MB a layer at a time: 90 MB for SmolLM2's half caches at 4096 positions)."""
    count = int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(2 * count, 1)), dtype=np.float16, count=count).reshape(shape)


class QuantRun:
    """A Runner over one sequence of the GGUF Llama at `path` on spec's kernel (the module docstring);
    n_ctx: the positions its KV cache holds; threads: the threads its products are split over (the
    rest of the forward runs on the caller's). Raises Unsupported (a ValueError) naming why where the
    kernel cannot run it here; `pieces`, `bos`, `eos`: the GGUF's tokens (spec.gguf_draft checks them);
    `n_layer`, `dim`: its shape. Its weights are read into the kernel's records at its first use (`model`), so
    that a draft made before a generate is not held beside the target's probes, which read the target's own
    weights before they are packed."""

    def __init__(self, path, *, n_ctx: int = 4096, threads: int = 1):
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads: a positive int expected, got {threads!r}")
        self.path, self.n_ctx, self.threads = Path(path), n_ctx, threads
        g = read(self.path)
        _check(g)
        self.n_layer, self.dim = int(g.fields["llama.block_count"]), int(g.fields["llama.embedding_length"])
        self.vocab = int(g.tensors["token_embd.weight"][1][1])
        self.pieces = g.fields.get("tokenizer.ggml.tokens") or []
        self.bos, self.eos = g.fields.get("tokenizer.ggml.bos_token_id"), g.fields.get("tokenizer.ggml.eos_token_id")
        self._keep: list = []
        self._model: Model | None = None
        self.kc: np.ndarray | None = None
        self.vc: np.ndarray | None = None
        self.lib = library()
        self.ids: np.ndarray = np.zeros(n_ctx, np.int32)
        self.n = 0
        self.logits: np.ndarray = np.zeros(self.vocab, np.float32)

    @property
    def model(self) -> Model:
        """The kernel's model (spec_native.h's spec_qd_model): its records made from the file at the first call."""
        if self._model is None:
            if self._closed:
                raise RuntimeError(f"the quantized draft over {self.path.name} is closed")
            self._model = self._made(read(self.path))
        return self._model

    def _made(self, g: GGUF) -> Model:
        _check(g)
        heap.trim()             # (what the target's first passes freed: given back before the records are made)

        def f(key: str, default: Any = None) -> Any:
            return g.fields.get("llama." + key, default)

        dim, heads = int(f("embedding_length")), int(f("attention.head_count"))
        kv = int(f("attention.head_count_kv", heads))
        layers, n_ctx = int(f("block_count")), self.n_ctx
        if (layers, dim, int(g.tensors["token_embd.weight"][1][1])) != (self.n_layer, self.dim, self.vocab):
            raise Unsupported(f"{self.path.name} changed since it was opened")
        heads_of = {"attn_q": heads, "attn_k": kv}

        def mat(*names: str) -> tuple[int, int]:
            kind, (k, _) = g.tensors[names[0]]
            parts = [unpermute(np.asarray(g.data(n)), heads_of[n.split(".")[-2]])
                     if n.split(".")[-2] in heads_of else np.asarray(g.data(n)) for n in names]
            raw = parts[0] if len(parts) == 1 else np.concatenate(parts)      # (one: read from the file's map)
            r = records(KINDS[kind], raw, raw.shape[0], k)
            g.drop_pages(*names)
            self._keep.append(r)
            return r.ctypes.data, KINDS[kind]

        def norm(name: str) -> int:
            a = np.array(g.data(name), copy=True).view(np.float32).reshape(-1)
            self._keep.append(a)
            return a.ctypes.data

        embd, embd_kind = mat("token_embd.weight")
        out, out_kind = mat("output.weight") if "output.weight" in g.tensors else (embd, embd_kind)
        mats: np.ndarray = np.zeros((layers, len(FUSED)), np.uint64)
        kinds: np.ndarray = np.zeros((layers, len(FUSED)), np.int64)
        norms: np.ndarray = np.zeros((layers, 2), np.uint64)
        for i in range(layers):
            for j, group in enumerate(FUSED):
                mats[i, j], kinds[i, j] = mat(*(f"blk.{i}.{n}.weight" for n in group))
            norms[i] = norm(f"blk.{i}.attn_norm.weight"), norm(f"blk.{i}.ffn_norm.weight")
        hd = dim // heads
        # halves: keys in blocks of 16 positions, d-major (spec_native.h: SPEC_QD_BLOCKS); values a row per position
        self.kc = _zeros((layers, kv, -(-n_ctx // 16), hd, 16))
        self.vc = _zeros((layers, n_ctx, kv * hd))
        self._keep += [mats, kinds, norms]
        model = Model(layers, dim, heads, kv, hd, int(f("feed_forward_length")), self.vocab, n_ctx,
                      float(f("attention.layer_norm_rms_epsilon")), float(f("rope.freq_base", 10000.0)),
                      embd, embd_kind, out, out_kind, norm("output_norm.weight"), norms.ctypes.data,
                      mats.ctypes.data, kinds.ctypes.data, self.kc.ctypes.data, self.vc.ctypes.data,
                      native.variant(), self.threads)
        g.drop_pages()          # (every byte it reads is in its records and norms now)
        heap.trim()             # (the records' intermediate arrays: freed, but kept by the heap)
        return model

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("ids: nothing to feed (a draft step needs at least one new token)")
        if (keep or len(ids)) != 1:
            raise ValueError(f"keep: the quantized draft returns the last position's logits only (keep=1), got "
                             f"{keep} for {len(ids)} ids")
        if self.n + len(ids) > self.n_ctx:
            raise ValueError(f"the quantized draft's context holds {self.n_ctx} positions; {self.n} + {len(ids)} "
                             f"do not fit (n_ctx=...)")
        new = np.ascontiguousarray(ids.numpy(), dtype=np.int32)
        if new.min() < 0 or new.max() >= self.vocab:
            raise ValueError(f"ids: token ids in [0, {self.vocab}) expected, got {int(new.min())}..{int(new.max())}")
        rc = self.lib.spec_qd_forward(ctypes.byref(self.model), new.ctypes.data, len(new), self.n,
                                      self.logits.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"spec.cpu.qdraft's forward failed ({'out of memory' if rc == -2 else rc})")
        self.ids[self.n:self.n + len(new)] = new
        self.n += len(new)
        return torch.from_numpy(self.logits.copy())[None]

    def fill(self, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        """Take `ids` [m] after what the cache holds with their keys and values made from `hidden`
        [m, n_layer, dim], each layer's input at each position (a target of this shape gives its own:
        transformers' hidden_states 0..n_layer-1) instead of this model's own forward: the draft then holds
        them as if it had fed them (its proposals are its own business: the target decides every token)."""
        m = len(ids)
        layers, dim = self.n_layer, self.dim
        if tuple(hidden.shape) != (m, layers, dim):
            raise ValueError(f"hidden: [{m}, {layers}, {dim}] expected (ids, layers, width), got {list(hidden.shape)}")
        self._fits(m)
        states = hidden.detach().to(device="cpu", dtype=torch.float32)
        if states.stride(2) != 1:
            states = states.contiguous()
        # read where they lie (no copy: a prompt's states are n_layer x its length x width floats)
        self._fill(states, m, states.stride(0), states.stride(1), 0, layers, self._tables(m))
        self._took(ids)

    def filler(self, ids: torch.Tensor):
        """fill, one layer at a time: `take(layer, x)` with layer 0, 1, .. n_layer - 1 in turn, x [m, dim] that
        layer's input at each of `ids`' positions (a target's pass hands them as it makes them, so a prompt's
        states at every layer are never held at once); the last layer's makes the draft hold `ids`."""
        m, layers, dim = len(ids), self.n_layer, self.dim
        self._fits(m)
        tables, at = self._tables(m), self.n

        def take(layer: int, x: torch.Tensor) -> None:
            if tuple(x.shape) != (m, dim):
                raise ValueError(f"x: [{m}, {dim}] expected (ids, width), got {list(x.shape)}")
            x = x.detach().to(device="cpu", dtype=torch.float32)
            if x.stride(1) != 1:
                x = x.contiguous()
            if self.n != at:
                raise RuntimeError(f"the draft's cache moved from {at} to {self.n} positions during a fill")
            self._fill(x, m, x.stride(0), 0, layer, layer + 1, tables)
            if layer == layers - 1:
                self._took(ids)
        return take

    def _fits(self, m: int) -> None:
        if self.n + m > self.n_ctx:
            raise ValueError(f"the quantized draft's context holds {self.n_ctx} positions; {self.n} + {m} do not fit")

    def _tables(self, m: int) -> np.ndarray:
        """The rotary tables (cos, sin) [2, m, head_dim] of the m positions after what the cache holds."""
        tables = np.empty((2, m, self.model.head_dim), np.float32)
        self.lib.spec_qd_tables(ctypes.byref(self.model), self.n, m, tables[0].ctypes.data, tables[1].ctypes.data)
        return tables

    def _fill(self, states: torch.Tensor, m: int, rs: int, ls: int, l0: int, l1: int, tables: np.ndarray) -> None:
        rc = self.lib.spec_qd_fill(ctypes.byref(self.model), states.data_ptr(), m, self.n, rs, ls, l0, l1,
                                   tables[0].ctypes.data, tables[1].ctypes.data)
        if rc != 0:
            raise RuntimeError(f"spec.cpu.qdraft's fill failed ({'out of memory' if rc == -2 else rc})")

    def _took(self, ids: torch.Tensor) -> None:
        self.ids[self.n:self.n + len(ids)] = ids.numpy().astype(np.int32)
        self.n += len(ids)

    def crop(self, keep: int) -> None:
        self.n = min(self.n, max(0, keep))

    def __len__(self) -> int:
        return self.n

    def held(self) -> torch.Tensor:
        return torch.from_numpy(self.ids[:self.n].astype(np.int64))

    def close(self) -> None:
        self._keep.clear()
        self.kc = self.vc = None
        self._model, self._closed = None, True

    _closed = False
