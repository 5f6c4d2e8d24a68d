"""What the native library's tests expect of this machine, decided without the library itself (so a
library that fails to build or fails its self-test fails the tests that need it instead of skipping
them): a C compiler on PATH means spec.cpu.native must load; a CPU whose /proc/cpuinfo lists AVX-512 VNNI
(and the rest of the draft kernel's set) means spec.cpu.qdraft must run. And `plant`: a copy of the
sources with one fault planted, for tests that check a broken library is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spec.cpu import native, qdraft

VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")   # /proc/cpuinfo's names


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compiler_present() -> bool:
    return shutil.which(native.compiler()) is not None


def require_library():
    """The library; a skip only where there is no C compiler, a failure where there is one and the
    library did not build or pass its self-test."""
    lib = native.library()
    if lib is None:
        if not compiler_present():
            pytest.skip(f"no C compiler ({native.compiler()}): {native.reason()}")
        pytest.fail(f"spec's native library should run here (a C compiler is present) but: {native.reason()}")
    return lib


def require_qdraft():
    """The quantized draft's library: a skip where this CPU lacks AVX-512 VNNI (and nothing forces a
    variant) or there is no compiler; a failure where it should run and does not."""
    lib = qdraft.library()
    if lib is None:
        if not compiler_present():
            pytest.skip(f"no C compiler ({native.compiler()}): {qdraft.reason()}")
        if native.forced() is None and not set(VNNI_FLAGS) <= cpu_flags():
            pytest.skip(f"this CPU lacks AVX-512 VNNI: {qdraft.reason()}")
        pytest.fail(f"spec.cpu.qdraft should run here but: {qdraft.reason()}")
    return lib


def plant(monkeypatch, tmp_path, file: str, old: str, new: str) -> None:
    """spec.cpu.native builds, from now on in this test, a copy of its sources with `old` in `file`
    replaced by `new` (into a cache of its own)."""
    folder = tmp_path / "native"
    shutil.copytree(native.SOURCES, folder)
    text = (folder / file).read_text()
    assert old in text, f"{old!r} is not in {file}: the fault was not planted"
    (folder / file).write_text(text.replace(old, new, 1))
    monkeypatch.setattr(native, "SOURCES", folder)
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path / "cache"))
    native.forget()


def resident(ptr: int, nbytes: int) -> int:
    """Bytes of the whole pages in [ptr, ptr + nbytes) this process has mapped (/proc/self/pagemap's "present"
    bit, readable without privileges; Linux only)."""
    import mmap
    page = mmap.PAGESIZE
    lo, hi = -(-ptr // page) * page, (ptr + nbytes) // page * page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // page * 8)
        raw = f.read(max(0, hi - lo) // page * 8)
    return sum(int.from_bytes(raw[i:i + 8], "little") >> 63 for i in range(0, len(raw), 8)) * page
