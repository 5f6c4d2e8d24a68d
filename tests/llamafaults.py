"""Faults for the llama.cpp engine's child process (spec.conformance.llamacpp.Engine(make="llamafaults:...")):
built in the child, so this module imports only llama_cpp and spec's engine, not torch (a child starts
in a fraction of a second). tests/test_llamacpp.py uses them."""

from __future__ import annotations

import os

from spec.conformance import llamacpp

# In an engine's child process: llama_decode segfaults on a batch of 2 or more tokens and runs one token,
# as llama.cpp's AMX path does in llama-cpp-python 0.3.36 (docs/CONFORMANCE.md, "llama.cpp on AMX CPUs")
AMX_LIKE_CRASH = """
import ctypes
import llama_cpp.llama_cpp as native
real_decode = native.llama_decode
def decode(ctx, batch):
    if batch.n_tokens >= 2:
        ctypes.string_at(0)   # a read of address 0: SIGSEGV
    return real_decode(ctx, batch)
native.llama_decode = decode
"""


def amx_like(path, threads, n_ctx):
    """An engine (for Engine(make=...), built in the child) whose llama_decode crashes on 2+ tokens."""
    exec(AMX_LIKE_CRASH, {})
    return llamacpp.LocalEngine(path, threads, n_ctx)


def amx_reported(path, threads, n_ctx):
    """An engine (built in the child) whose llama-cpp-python reports the known-bad build."""
    import llama_cpp
    llama_cpp.__version__ = "0.3.36"
    llama_cpp.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | "
    return llamacpp.LocalEngine(path, threads, n_ctx)


class ExitsOnTokenize(llamacpp.LocalEngine):
    """An engine (built in the child) whose tokenize ends the process with status 3."""

    def tokenize(self, text):
        os._exit(3)
