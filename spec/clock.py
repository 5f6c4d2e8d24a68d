"""The one clock: wall time read after the device's queued work is done.

Every timing in spec (measure's step and pass times, the decode loop's trace, the
CLI's runs) and in tests/perf reads this clock, so that all of them follow the same
rule: on CUDA, work is queued asynchronously, and a timer read without a
synchronisation measures the launch, not the work.
"""

from __future__ import annotations

import time


def sync(device) -> None:
    """Wait for queued CUDA work on `device` (a torch.device, a string or None for CPU). torch is imported
    only for a device: a served-model conformance run times itself here without it."""
    if device is None:
        return
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device=None) -> float:
    """Seconds on a monotonic clock, read once `device` has finished its queued work."""
    sync(device)
    return time.perf_counter()


def timed(fn, device=None):
    """(fn(), seconds it took on `device`), synchronised on both sides."""
    t0 = now(device)
    out = fn()
    return out, now(device) - t0
