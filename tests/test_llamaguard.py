"""spec.llamaguard: a llama.cpp build known to take the process down (llama-cpp-python <= 0.3.36 built
with AMX_INT8: a segfault inside llama_decode on any batch of 2+ tokens) is refused before a model is
loaded, with the feature, the version and the fix. The version and the system info are injected, so
this runs on any CPU and without llama-cpp-python."""

from __future__ import annotations

import pytest

from spec import llamaguard
from spec.llamaguard import UnsafeLlamaBuild

# llama_print_system_info() of llama-cpp-python 0.3.36 built with its default (native) flags on an Intel
# Xeon with AMX, and of the portable build requirements/build-llama makes (measured on an AMD EPYC)
AMX_INFO = (b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
            b"AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
            b"REPACK = 1 | ")
PORTABLE_INFO = (b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
                 b"OPENMP = 1 | REPACK = 1 | ")


def test_the_features_are_read_from_the_system_info():
    found = llamaguard.features(AMX_INFO)
    assert found["AMX_INT8"] == "1" and found["AVX2"] == "1" and "AMX_INT8" not in llamaguard.features(PORTABLE_INFO)
    assert llamaguard.features("CPU : AMX_INT8 = 0 | ") == {"AMX_INT8": "0"}


@pytest.mark.parametrize("version", ["0.3.36", "0.3.35", "0.2.90", "0.3.36+cpu"])
def test_amx_on_a_listed_version_is_refused(version):
    with pytest.raises(UnsafeLlamaBuild) as refused:
        llamaguard.check(version, AMX_INFO)
    assert isinstance(refused.value, RuntimeError)
    message = str(refused.value)
    assert "AMX_INT8" in message and f"llama-cpp-python {version}" in message
    assert "bash requirements/build-llama" in message
    assert "-DGGML_AMX_INT8=OFF" in message and f"--force-reinstall --no-deps llama-cpp-python=={version}" in message
    assert "--no-cache-dir" in message   # pip's wheel cache would serve the crashing build again


@pytest.mark.parametrize("version, info", [
    ("0.3.36", PORTABLE_INFO),                     # the same version without AMX
    ("0.3.36", "CPU : AVX2 = 1 | AMX_INT8 = 0 | "),  # AMX reported off
    ("0.3.37", AMX_INFO),                          # AMX on a version the table does not list
    ("1.0.0", AMX_INFO),
], ids=["no-amx", "amx-0", "amx-0.3.37", "amx-1.0"])
def test_other_builds_are_accepted(version, info):
    llamaguard.check(version, info)
    assert llamaguard.problem(version, info) is None


def test_the_table_is_what_is_checked(monkeypatch):
    """KNOWN_BAD is data: an entry added for another feature is refused the same way."""
    monkeypatch.setattr(llamaguard, "KNOWN_BAD", llamaguard.KNOWN_BAD + (
        llamaguard.KnownBad("AVX512_BF16", "0.3.40", "a made-up crash"),))
    with pytest.raises(UnsafeLlamaBuild, match=r"built with AVX512_BF16 .*a made-up crash"):
        llamaguard.check("0.3.38", AMX_INFO)
    assert llamaguard.problem("0.3.38", PORTABLE_INFO) is None


def test_without_arguments_it_reads_the_installed_llama_cpp(monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.36")
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: AMX_INFO)
    with pytest.raises(UnsafeLlamaBuild, match="llama-cpp-python 0.3.36 was built with AMX_INT8"):
        llamaguard.check()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: PORTABLE_INFO)
    llamaguard.check()


def test_a_version_that_is_not_one_is_an_error():
    with pytest.raises(ValueError, match="not a version"):
        llamaguard.check("unknown", AMX_INFO)
