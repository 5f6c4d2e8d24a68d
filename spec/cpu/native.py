"""The one build and the one dispatch of spec's native library (spec/cpu/native/*.c).

Build: the system C compiler ($CC, else cc) compiles every source in spec/cpu/native/ (the self-test's
`main` aside) into one shared library with FLAGS: -O3, no FMA contraction and no fast-math (the sources'
sums round in the order written: the plain layers' small ops rely on it), warnings on. The library lands
in $SPEC_CACHE (default ~/.cache/spec)/native/<hash of the sources, compiler and flags>.so: the first use
in a checkout compiles it (2.5 s here with the self-test), a later process loads the file and
self-tests it in 0.15 s. A hand-written
call rather than setuptools' extension build, cffi or torch.utils.cpp_extension: spec needs no compiler to
install or run (without one it stays exact on its torch path), the same call builds the sanitizer and
cross builds the tests run, and none of those tools adds anything a single `cc` line does not do here
(docs/DEVELOPING.md, "The native library").

Dispatch: each variant's code carries its own target attribute, so the one library runs on any CPU of its
architecture and picks the best variant it has (`spec_native_isa`): 0 plain C, 1 AVX2+FMA, 2 AVX-512F,
3 AVX-512 VNNI (the quantized draft's kernel). SPEC_NATIVE_ISA=N forces variant N (at most what the CPU
has) everywhere: the tests run every variant this way.

Self-test: before its first use in a process the library's own self-test (selftest.c: every entry of every
variant up to the one in force, against a double-precision reference, on ragged shapes) runs in a
SUBPROCESS, so a crash is a return code here. Any failure (no compiler, a compile error, a crash or a wrong
result) gives None and `reason()`, never an exception: the callers keep their torch or llama.cpp paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "native"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-Wall", "-Wextra", "-pthread")
SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
NAMES = {0: "plain C", 1: "AVX2+FMA", 2: "AVX-512F", 3: "AVX-512 VNNI"}
SELFTEST_THREADS = (1, 3)

_STATE: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser() / "native"


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def sources(program: bool = False) -> list[Path]:
    """The library's C sources (with `program`, the self-test's main too)."""
    return sorted(p for p in SOURCES.glob("*.c") if program or p.name != "selftest_main.c")


def compile_c(out: Path | None = None, *, flags: tuple[str, ...] = FLAGS, program: bool = False,
              cc: str | None = None) -> Path:
    """The sources compiled by `cc` (default `compiler()`) with `flags` into a shared library (or, with
    `program`, an executable running the self-test), at `out` or in cache_dir() named by the hash of the
    sources, compiler and flags (a rerun finds it). RuntimeError naming the compiler and its output when it
    cannot be built."""
    cc = cc or compiler()
    files = sources(program)
    h = hashlib.sha256("\0".join([cc, *flags, str(program)]).encode())
    for p in files + sorted(SOURCES.glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    out = Path(out) if out else cache_dir() / f"{h.hexdigest()[:16]}{'' if program else '.so'}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        shape = [] if program else ["-shared"]
        try:
            done = subprocess.run([cc, *flags, *shape, "-o", str(built), *map(str, files), "-lm"],
                                  capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"C compiler {cc!r} could not run: {e}") from e
        if done.returncode != 0 or not built.exists():
            raise RuntimeError(f"C compiler {cc!r} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        os.replace(built, out)          # atomic: a concurrent build leaves one whole file
    return out


def forced() -> int | None:
    """The variant SPEC_NATIVE_ISA forces (None: the best the CPU has); ValueError naming it when it is
    not one of NAMES."""
    raw = os.environ.get("SPEC_NATIVE_ISA", "").strip()
    if not raw:
        return None
    if raw not in {str(k) for k in NAMES}:
        raise ValueError(f"SPEC_NATIVE_ISA: one of {', '.join(f'{k} ({v})' for k, v in NAMES.items())} "
                         f"expected, got {raw!r}")
    return int(raw)


_SELFTEST = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
msg = ctypes.create_string_buffer(512)
for isa in range(int(sys.argv[2]) + 1):
    for threads in map(int, sys.argv[3:]):
        if lib.spec_selftest(isa, threads, msg, 512):
            sys.exit(f"variant {isa}, {threads} threads: {msg.value.decode()}")
"""


def selftest(path: Path, up_to: int) -> str | None:
    """None if the library at `path` passes its self-test for every variant 0..up_to (in a subprocess: a
    crash is reported, not suffered), else what went wrong."""
    argv = [sys.executable, "-c", _SELFTEST, str(path), str(up_to), *map(str, SELFTEST_THREADS)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the self-test of {path} could not run: {e}"
    if done.returncode != 0:
        return (f"the self-test of {path} failed (return code {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-800:]}")
    return None


def _declare(lib) -> None:
    P, I, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.spec_native_isa.restype = i32
    lib.spec_pool_worked.restype = ctypes.c_long
    for fn in (lib.spec_gemv_rows, lib.spec_gemv_panel):
        fn.restype = i32
        fn.argtypes = [P] * 4 + [I] * 5 + [i32, i32]
    lib.spec_rms.argtypes = [P] * 3 + [I] * 2 + [ctypes.c_float]
    lib.spec_rotary.argtypes = [P] + [I] * 4 + [P] * 2
    lib.spec_silu_mul.argtypes = [P] * 2 + [I] * 2 + [i32]
    lib.spec_attend.restype = I
    lib.spec_attend.argtypes = [P, I, I, P, P, I, I, I, P, P, I, I, I, I, ctypes.c_float, i32, i32]
    lib.spec_qd_forward.restype = i32
    lib.spec_qd_forward.argtypes = [P, P, I, I, P]
    lib.spec_qd_fill.restype = i32
    lib.spec_qd_fill.argtypes = [P, P, I, I, I, I, I, I, P, P]
    lib.spec_qd_tables.argtypes = [P, I, I, P, P]


def _make():
    try:
        want = forced()
    except ValueError as e:
        return None, str(e)
    path = compile_c()
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    best = lib.spec_native_isa()
    if want is not None and want > best:
        return None, f"SPEC_NATIVE_ISA={want} ({NAMES[want]}): this CPU runs {best} ({NAMES[best]}) at most"
    why = selftest(path, best if want is None else want)
    return (None, why) if why else (lib, None)


def library():
    """The built, self-tested library (ctypes.CDLL), or None with `reason()` saying why; decided once per
    process (`forget()` decides again)."""
    if "lib" not in _STATE:
        try:
            lib, why = _make()
        except (RuntimeError, OSError) as e:
            lib, why = None, str(e)
        if why is not None:
            log.debug("spec's native library is not used (spec stays exact on its torch path): %s", why)
        _STATE.update(lib=lib, why=why)
    return _STATE["lib"]


def reason() -> str | None:
    """Why `library()` is None (None when it is not, or was not asked yet)."""
    return _STATE.get("why")


def forget() -> None:
    """Decide again at the next `library()` (tests: another $CC or SPEC_NATIVE_ISA)."""
    _STATE.clear()


def isa() -> int:
    """The variant in force: the one SPEC_NATIVE_ISA forces, else the best this CPU runs; -1 without a
    library."""
    lib = library()
    if lib is None:
        return -1
    want = forced()
    return lib.spec_native_isa() if want is None else want


def variant() -> int:
    """What the entries' `isa` argument takes for the variant in force (-1: the kernel's own choice per
    call, where nothing is forced)."""
    want = forced()
    return -1 if want is None else want


def describe() -> str:
    """One line: the library's variant and how it was chosen, or why there is none."""
    lib = library()
    if lib is None:
        return f"no native library: {reason()}"
    how = "forced by SPEC_NATIVE_ISA" if forced() is not None else "the best this CPU runs"
    return f"native library {NAMES[isa()]} ({how})"
