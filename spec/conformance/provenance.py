"""Where and with what a report was made, so that a number or a verdict can be traced and re-measured:
the date, the machine (CPU model, cores, the instruction sets that decide which kernels run), the commit of
the checkout spec ran from, the versions of the libraries that did the work, and how llama.cpp was built
(its CMake flags and what its system info reports). `python -m spec conform` writes it into its report as
"meta"; the benchmark recipes (recipes/results.py) write the same block into their results files, and
recipes/docs.py renders the docs from them. Standard library only: a served-model run imports no torch."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

# every meta block has these keys (tests/test_docs.py holds the results files to them)
REQUIRED = ("date", "source", "command", "commit", "machine", "versions", "build")
# the CPU flags that decide which kernels run (spec's, llama.cpp's, oneDNN's), as /proc/cpuinfo names them
ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
       "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
PACKAGES = ("torch", "transformers", "numpy", "llama-cpp-python", "hypothesis", "pytest")
CHECKOUT = Path(__file__).resolve().parents[2]   # the folder spec/ sits in (a git checkout, or site-packages)


def machine() -> dict:
    """CPU model, cores this process may use, and the ISA flags of ISA the CPU lists."""
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "arch": platform.machine(), "flags": [f for f in ISA if f in flags]}


def commit(where: Path = CHECKOUT) -> str | None:
    """The checkout's HEAD, with " (uncommitted changes)" where tracked code outside docs/ and results/ differs
    from it; None where spec does not run from a git checkout."""
    def git(*words):
        return subprocess.run(["git", "-C", str(where), *words], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!results").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" (uncommitted changes)" if dirty else "")


def versions(packages=PACKAGES) -> dict:
    """Installed versions, read from package metadata (nothing is imported); Python's own too."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def llama_build(python: str = sys.executable) -> dict | None:
    """llama-cpp-python's build: the CMake flags requirements/build-llama recorded beside the wheel it
    installed (its FLAGS file), and llama_print_system_info() read in a child process (a broken build cannot
    take this one down); None where llama-cpp-python is not installed."""
    try:
        dist = importlib.metadata.distribution("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None
    out = {"version": dist.version, "cmake_args": "not recorded (not installed by requirements/build-llama)"}
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    flags = Path(url.removeprefix("file://")).with_name("FLAGS") if url.startswith("file://") else None
    if flags is not None and flags.is_file():
        for line in flags.read_text().splitlines():
            if line.startswith("CMAKE_ARGS="):
                out["cmake_args"] = line.removeprefix("CMAKE_ARGS=")
    try:
        info = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                              capture_output=True, text=True, timeout=120)
        out["system_info"] = info.stdout.strip() if info.returncode == 0 else f"unreadable (exit {info.returncode})"
    except (OSError, subprocess.SubprocessError) as err:
        out["system_info"] = f"unreadable ({err})"
    return out


def recipe_command(recipe: str, argv=None) -> str:
    """How a recipe was run, as a command line from the checkout's root: `python recipes/NAME.py ARGS`."""
    path = Path(recipe).resolve()
    shown = path.relative_to(CHECKOUT) if path.is_relative_to(CHECKOUT) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def meta(command: str, *, llama: bool = False, packages=PACKAGES) -> dict:
    """The block a results file carries: measured now, on this machine, by `command`; with llama.cpp's build
    where `llama` (the run used llama.cpp)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "source": "measured", "command": command,
            "commit": commit(), "machine": machine(), "versions": versions(packages),
            "build": {"llama.cpp": llama_build()} if llama else {}}
