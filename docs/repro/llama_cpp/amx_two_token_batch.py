"""llama.cpp on AMX CPUs: SIGSEGV inside llama_decode on a batch of two or more tokens.

Seen with llama-cpp-python 0.3.36 built from source with its default flags (GGML_NATIVE: llama.cpp's native
build), whose llama_print_system_info() reports AMX_INT8 = 1, on an Intel Xeon with AVX-512 and AMX (lscpu flags
amx_bf16 amx_int8 amx_tile), on SmolLM2-135M-Instruct's Q4_1 GGUF with n_threads=1: one token evaluates, two
crash. The same version built with GGML_NATIVE=OFF and AVX-512 on (no AMX in the system info) evaluates
batches of 2, 3, 4 and 8 tokens. Needs llama-cpp-python and the GGUF (python -m spec.realmodel fetches it into
~/.cache/spec/smollm2-135m-instruct/). Exit status: a crash (SIGSEGV) reproduces it; 0 means both lines printed.

    python docs/repro/llama_cpp/amx_two_token_batch.py ~/.cache/spec/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import sys

import llama_cpp
from llama_cpp import Llama

print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=1, verbose=False)   # SmolLM2-135M-Instruct.Q4_1.gguf
ids = llm.tokenize(b"The quick brown fox jumps over the lazy dog", add_bos=False)
llm.eval(ids[:1])
print("1 token: ok", flush=True)
llm.reset()
llm.eval(ids[:2])   # with AMX_INT8 = 1: SIGSEGV inside llama_decode
print("2 tokens: ok", flush=True)
