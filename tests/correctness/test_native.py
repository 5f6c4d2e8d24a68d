"""spec's native library as a C project keeps it: the sources (spec/cpu/native/) build without a warning
under -Werror; the self-test of every variant this CPU runs is clean under AddressSanitizer and
UndefinedBehaviorSanitizer (a heap overrun or an undefined shift is a failure, not a silent wrong result);
gcc's static analyzer finds nothing; the plain-C variant cross-built for aarch64 passes its self-test
under qemu (where Debian's gcc-aarch64-linux-gnu and qemu-user are installed: .ci/run installs them); and
each variant, forced through SPEC_NATIVE_ISA, runs the library's entries exactly as the self-test
demands. A variant this CPU lacks is reported by name, never run."""

from __future__ import annotations

import platform
import shutil
import subprocess

import nativecheck
import pytest

from spec.cpu import native


@pytest.fixture(scope="module")
def cc():
    nativecheck.require_library()
    return native.compiler()


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)


def test_the_sources_build_without_a_warning(cc, tmp_path):
    out = tmp_path / "lib.so"
    native.compile_c(out, flags=native.FLAGS + ("-Werror",))
    assert out.exists()
    native.compile_c(tmp_path / "selftest", flags=native.FLAGS + ("-Werror",), program=True)


def test_the_self_test_is_clean_under_the_sanitizers(cc, tmp_path):
    """Every variant this CPU runs, at 1 and 3 threads, under -fsanitize=address,undefined (any report
    aborts the program: -fno-sanitize-recover)."""
    program = native.compile_c(tmp_path / "selftest-asan", program=True,
                               flags=("-ffp-contract=off", "-fno-fast-math", "-pthread") + native.SANITIZE)
    done = run([str(program)], env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1", "PATH": "/usr/bin:/bin"})
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert len(lines) == 2 * (native.library().spec_native_isa() + 1) and all(line.endswith(": ok") for line in lines), lines


def test_a_heap_overrun_is_caught_by_the_sanitized_self_test(cc, tmp_path, monkeypatch):
    """The sanitizer run is not vacuous: the AVX2 panel's last, partly filled panel writing all 16 outputs
    (past the end of y on the last row) aborts it."""
    if native.library().spec_native_isa() < 1:
        pytest.skip("this CPU has no AVX2 variant to break")
    nativecheck.plant(monkeypatch, tmp_path, "gemv.c", "for (int64_t j = 0; j < w; j++) out[m * N + j] = t[j];",
                      "for (int64_t j = 0; j < 16; j++) out[m * N + j] = t[j];")
    program = native.compile_c(tmp_path / "selftest-asan", program=True,
                               flags=("-ffp-contract=off", "-pthread") + native.SANITIZE)
    done = run([str(program), "1"])
    assert done.returncode != 0 and ("AddressSanitizer" in done.stderr or "wrote past" in done.stdout), done.stdout


def test_the_static_analyzer_finds_nothing(cc):
    if "gcc" not in run([cc, "--version"]).stdout.lower() and "free software foundation" not in \
            run([cc, "--version"]).stdout.lower():
        pytest.skip(f"{cc} is not gcc: -fanalyzer is gcc's")
    found = []
    for src in native.sources(program=True):
        done = run([cc, "-fanalyzer", "-O1", "-Wall", "-Wextra", "-c", str(src), "-o", "/dev/null"])
        found += [line for line in done.stderr.splitlines() if "warning" in line or "error" in line]
    assert not found, "\n".join(found)


def test_the_plain_c_variant_runs_on_aarch64(cc, tmp_path):
    """Cross-built for aarch64 (where only the plain-C variant exists) and run under qemu: the self-test
    passes, FMA contraction off there too (aarch64 GCC contracts by default)."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if platform.machine() == "aarch64":
        cross, qemu = cc, None
    if cross is None:
        pytest.skip("no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu qemu-user; .ci/run does)")
    program = native.compile_c(tmp_path / "selftest-aarch64", program=True, cc=cross,
                               flags=native.FLAGS + ("-Werror", "-static"))
    done = run(([qemu] if qemu else []) + [str(program)])
    assert done.returncode == 0 and done.stdout.splitlines() == ["variant 0, 1 thread: ok", "variant 0, 3 threads: ok"], \
        done.stdout + done.stderr


@pytest.mark.parametrize("isa", [0, 1, 2, 3])
def test_each_variant_forced_runs_as_the_self_test_demands(cc, isa, monkeypatch):
    """SPEC_NATIVE_ISA=N: the library's entries run variant N (the products report it), and the self-test
    of that variant alone passes in this process's library; a variant this CPU lacks is refused by name."""
    lib = native.library()
    best = lib.spec_native_isa()
    monkeypatch.setenv("SPEC_NATIVE_ISA", str(isa))
    if isa > best:
        native.forget()
        try:
            assert native.library() is None and f"SPEC_NATIVE_ISA={isa}" in native.reason()
        finally:
            monkeypatch.delenv("SPEC_NATIVE_ISA")
            native.forget()
        return
    import ctypes

    import torch

    from spec.cpu import gemv
    assert native.isa() == isa and gemv.isa() == min(isa, 2)
    w, x = torch.randn(37, 19), torch.randn(3, 19)
    f = gemv.product(w)
    assert f.variant == isa
    assert torch.allclose(f(x), x @ w.T, rtol=1e-5, atol=1e-5)
    msg = ctypes.create_string_buffer(512)
    assert lib.spec_selftest(isa, 2, msg, 512) == 0, msg.value.decode()


def test_a_bad_forced_variant_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SPEC_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="SPEC_NATIVE_ISA: one of 0 .plain C., 1"):
        native.forced()
