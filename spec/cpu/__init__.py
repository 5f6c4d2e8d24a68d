"""spec's CPU runtime: what makes an fp32 target and a quantized GGUF draft fast on a CPU.

One native library (spec/cpu/native/*.c, built and chosen by `spec.cpu.native`) holds the few-row fp32
product, the Llama layer's small ops (RMSNorm, rotary, attention, the SiLU gate), a thread pool and the
block-quantized draft forward. The Python modules around it:

- `native`: the one build (explicit flags, cached by the sources' hash) and the one dispatch (the best
  variant this CPU runs, or the one SPEC_NATIVE_ISA forces); `library()` is None with one line saying why
  where it cannot be had, and spec stays exact on its torch path.
- `gemv`: the fp32 products and small ops as torch-facing functions.
- `executor`: an fp32 CPU target's passes, run by an object spec.runner calls in the model's place (no
  module's forward replaced, no thread setting changed); `executor_for(model)` and `describe(model)`.
- `prepack`, `plainllama`: the packed weights and the plain-tensor Llama layers the executor runs.
- `qdraft`: a Q4_1 / Q8_0 GGUF Llama as a draft Runner (spec.gguf_draft picks it or llama.cpp).
"""
