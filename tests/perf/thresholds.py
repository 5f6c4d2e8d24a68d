"""The performance gate's thresholds, kept as data: one table, looked up by hardware and pair.

SPEEDUP_FLOOR[hardware][pair]: the least speedup of speculative decoding (gamma = 5)
over greedy decoding of the target alone, both measured side by side in one run
(tests/perf), as the mean of the per-prompt speedups. It is a ratio, so it survives a
slower or faster machine of the same kind; absolute times are left to
pytest-benchmark's --benchmark-compare (docs/BENCHMARKS.md).

THEORY_TOLERANCE[hardware]: the allowed band for measured speedup / Theorem 3.8's
prediction from the alpha and c measured in the same run. The theorem assumes a
(gamma+1)-token target pass costs one target step; that holds for a bandwidth-bound
GPU target and not for a small CPU model, where a 6-token pass costs about 1.2 to 1.7
steps: on CPU the band applies to the prediction with that measured cost in.

Every number says where it came from. Update an entry only from a measurement on
that hardware.
"""

from __future__ import annotations

import torch

# Keys: "cpu", or a GPU name fragment matched against torch.cuda.get_device_name().
SPEEDUP_FLOOR: dict[str, dict[str, float]] = {
    "A100": {
        # Seed notebook (A100 80GB PCIe, target fp32 TF32 off, draft bf16, 256 tokens, 5 prompts):
        # speedups 0.99, 1.20, 1.48, 1.37, 1.39, mean 1.284 (against HF generate; the test's baseline
        # is greedy_generate, the same loop without drafting).
        "pythia-12b/pythia-410m": 1.28,
    },
    "H100": {
        # Not measured yet. Provisional: the fp32 target step is faster than on an A100 (bandwidth)
        # while the eager draft step is launch-bound and is not, so c rises and the speedup falls.
        # Replace with a measured value.
        "pythia-12b/pythia-410m": 0.8,
        "synthetic-pythia-12b/pythia-410m@0.8": 0.8,
    },
    "H200": {
        # Not measured yet; provisional as for H100.
        "pythia-12b/pythia-410m": 0.8,
        "synthetic-pythia-12b/pythia-410m@0.8": 0.8,
    },
    "cpu": {
        # Measured on the shared 2-core development box (tests/perf: 3 prompts x 40-48 tokens, 3 rounds,
        # 1 thread), set well under what was seen because the box is noisy:
        # shipped pair, 128x24 target + 1-layer draft (alpha 0.80-0.83, c ~0.10): 1.94x, 1.68x;
        #   with the plain-tensor draft (c 0.03-0.04): 1.87x, 2.36x
        #   (an earlier 128x16 training, alpha ~0.78, c ~0.14: 1.83x, 1.91x);
        # seeded stand-in (alpha ~0.80, c 0.13-0.21): 1.43x, 1.44x in the suite, 1.23x..1.72x exploring.
        # Re-measure the shipped pair's entry whenever the pair is retrained.
        "shipped-pair": 1.1,
        "seeded-damped-256x12": 1.0,
    },
}

# HF_ASSISTED_FLOOR[hardware][pair]: the least ratio HF assisted generation's time / ours, same
# pair, same gamma (5, HF's constant schedule), same prompts, timed side by side in one run.
HF_ASSISTED_FLOOR: dict[str, dict[str, float]] = {
    "cpu": {
        # Measured on the shared 2-core box, 1 thread, with the plain-tensor draft (spec.neox):
        # tests/perf (3 prompts x 40 tokens, 3 rounds): 1.71x, 1.53x; `python -m spec --peer hf --threads 1`
        # (5 prompts x 128 tokens, runs interleaved): 1.59x, 1.49x. Set under what was seen.
        "shipped-pair": 1.15,
    },
}

THEORY_TOLERANCE: dict[str, tuple[float, float]] = {
    "A100": (0.8, 1.2),
    "H100": (0.8, 1.2),
    "H200": (0.8, 1.2),
    # On CPU the band applies to the prediction with the verify pass at its measured cost (a 6-token pass
    # costs 1.2..1.4 one-token steps there; against the plain theorem, measured/predicted came out at
    # 0.58..0.83 with the plain-tensor draft). Measured/verify-costed seen: 0.79, 0.98.
    "cpu": (0.6, 1.3),
}


def hardware_key(device: torch.device | str) -> str | None:
    """"cpu", the table's GPU key whose fragment is in the CUDA device's name, or None."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((key for key in SPEEDUP_FLOOR if key != "cpu" and key in name), None)
    return None


def speedup_floor(hardware: str | None, pair: str) -> float | None:
    """The gate's least same-run speedup, or None where no entry exists (report, don't gate)."""
    return SPEEDUP_FLOOR.get(hardware or "", {}).get(pair)


def hf_assisted_floor(hardware: str | None, pair: str) -> float | None:
    """The least same-run ratio HF assisted time / ours, or None where no entry exists."""
    return HF_ASSISTED_FLOOR.get(hardware or "", {}).get(pair)


def theory_tolerance(hardware: str | None) -> tuple[float, float]:
    return THEORY_TOLERANCE.get(hardware or "", (0.5, 1.5))
