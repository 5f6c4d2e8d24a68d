"""The experiment's defaults and choices, importable without torch: `python -m spec --help`
reads them, and answers in well under a second because nothing heavier is imported."""

DTYPE_NAMES = ("fp32", "fp64", "bf16", "fp16")
DRAFT_IMPLS = ("auto", "plain", "hf", "compiled")  # spec.choose.DRAFT_IMPLS (a test keeps them equal)
CPU_MAX_NEW_TOKENS = 128
CUDA_MAX_NEW_TOKENS = 256

# gamma when none is asked, written here only: speculative_generate's default, `python -m spec`'s for a
# draft model (--target/--draft) and where gamma="auto" starts.
DEFAULT_GAMMA = 5
# --real's draft sources (prompt lookup, or SmolLM2's own Q4_1 GGUF on spec.cpu.qdraft's kernel, else llama.cpp)
# and each one's gamma, measured best on the seed prompts (docs/log/benchmarks.md, "Plain-tensor decoder
# layers": with the faster target step q4 at 8 beat 10 in --real and in recipes/bench_qdraft.py); a
# --draft FILE.gguf run takes "q4"'s.
REAL_GAMMA = {"lookup": 8, "q4": 8}

# --gamma calibrated: Theorem 3.8's optimal gamma, chosen once from a short calibration run.
CALIBRATION_TOKENS = 32
CALIBRATION_GAMMA = 5
MAX_AUTO_GAMMA = 16

# Timing: every prompt's greedy and speculative runs alternate, REPEATS times over all
# prompts; a prompt's time is the median of its repeats.
REPEATS = 3

# CPU threads when --threads is not given. On the shared 2-core box the shipped pair ran
# steadier and faster on one thread than on two whenever another process held a core
# (two OpenMP threads wait for each other at every barrier); docs/log/benchmarks.md has the
# measurement.
CPU_THREADS = 1

# When the run's own figures disagree by more than these, the report warns.
C_DISAGREEMENT = 2.0          # the two estimates of c (step timings vs the timed runs)
PREDICTION_MISMATCH = 0.30    # measured speedup vs the verify-costed prediction
