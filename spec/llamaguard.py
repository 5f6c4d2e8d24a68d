"""Refuses a llama.cpp build known to take the process down, before it loads a model.

Every llama.cpp path of spec (spec.gguf_draft's LlamaRun, the conformance kit's engine in
spec/conformance/llamacpp.py, the tests' llama-cpp-python server) calls `check()` first. It reads
llama-cpp-python's version and the CPU features its llama.cpp was compiled with
(`llama_cpp.llama_print_system_info()`, e.g. "CPU : SSE3 = 1 | AVX2 = 1 | AMX_INT8 = 1 | ...") and
raises `UnsafeLlamaBuild`, naming the feature, the version and the fix, when they match an entry of
`KNOWN_BAD`. Both are arguments, so the refusal can be tested on a CPU without the feature.

Known: llama-cpp-python 0.3.36 built with its default (native) flags on an Intel Xeon with AMX
(`AMX_INT8 = 1` in the system info) evaluates one token and segfaults inside llama_decode on a batch
of two or more (SmolLM2-135M-Instruct Q4_1, 1 thread); the same version built without AMX runs those
batches. docs/CONFORMANCE.md, "llama.cpp on AMX CPUs", has the measurements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PACKAGE = "llama-cpp-python"
# The portable flags requirements/build-llama builds with: x86-64 since Haswell / Zen, never AVX-512 or AMX.
PORTABLE_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
                       "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
                       "-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")


@dataclass(frozen=True)
class KnownBad:
    feature: str        # as llama_print_system_info names it ("AMX_INT8"), refused when "= 1"
    up_to: str          # llama-cpp-python versions <= this one are affected (newer: not known)
    what: str           # what happens, for the message


KNOWN_BAD = (
    KnownBad("AMX_INT8", "0.3.36", "its llama.cpp segfaults inside llama_decode on a batch of 2 or more tokens "
                                   "(llama.cpp's AMX matmul; one token runs)"),
)


class UnsafeLlamaBuild(RuntimeError):
    """The installed llama-cpp-python is a build known to crash the process (see KNOWN_BAD)."""


def features(info: str | bytes) -> dict[str, str]:
    """{feature: value} from llama_print_system_info's text ("CPU : AVX2 = 1 | AMX_INT8 = 1 | ...")."""
    if isinstance(info, bytes):
        info = info.decode("utf-8", errors="replace")
    return dict(re.findall(r"([A-Za-z0-9_]+)\s*=\s*([^|\s]+)", info))


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "0.3.36" -> (0, 3, 36), "0.3.37.dev1+cpu" -> (0, 3, 37)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in match.group(1).split("."))


def _not_newer(version: str, up_to: str) -> bool:
    a, b = _release(version), _release(up_to)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) <= b + (0,) * (width - len(b))


def problem(version: str, info: str | bytes) -> KnownBad | None:
    """The KNOWN_BAD entry this build (llama-cpp-python `version`, system info `info`) matches, or None."""
    found = features(info)
    for bad in KNOWN_BAD:
        if found.get(bad.feature) == "1" and _not_newer(version, bad.up_to):
            return bad
    return None


def fix(version: str) -> str:
    return (f"rebuild it without AMX: `bash requirements/build-llama` in a spec checkout (portable x86-64 flags, a "
            f"wheel pip's cache cannot replace), or CMAKE_ARGS=\"{PORTABLE_CMAKE_ARGS}\" pip install --no-cache-dir "
            f"--force-reinstall --no-deps {PACKAGE}=={version}")


def check(version: str | None = None, info: str | bytes | None = None) -> None:
    """Raise UnsafeLlamaBuild if llama-cpp-python (`version`, `info`; read from the installed llama_cpp
    where None) is a build KNOWN_BAD lists. Importing llama_cpp loads its library but runs no model."""
    if version is None or info is None:
        import llama_cpp
        version = llama_cpp.__version__ if version is None else version
        info = llama_cpp.llama_print_system_info() if info is None else info
    bad = problem(version, info)
    if bad is not None:
        text = info.decode("utf-8", errors="replace") if isinstance(info, bytes) else info
        raise UnsafeLlamaBuild(
            f"{PACKAGE} {version} was built with {bad.feature} (llama_print_system_info: {text.strip()}): "
            f"{bad.what}, which kills the process. Refused before loading a model; {fix(version)}. "
            f"(docs/CONFORMANCE.md, \"llama.cpp on AMX CPUs\")")
