"""Perf-only fixtures: the CPU pair (see perfkit), its greedy references and its costs."""

from __future__ import annotations

import os

import pytest
import torch

from perfkit import GPU_SCALE, NEW_TOKENS, REHEARSAL_SCALE, GpuScale, seeded_pair, shipped_pair
from spec import greedy_generate
from spec.experiment.measure import cost_ratio, verify_cost
from spec.models import SHIPPED_PAIR


@pytest.fixture(autouse=True, scope="module")
def perf_threads():
    """CPU timing runs on SPEC_PERF_THREADS threads (default 1). On a shared 2-core box two
    OpenMP threads stall at every barrier while another process holds a core: a 12-layer
    step measured 215 ms on 2 threads and 68 ms on 1 under the same load."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPEC_PERF_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cpu_pair():
    """fp32 on CPU: the shipped pair if trained, else the seeded damped stand-in
    (SPEC_PERF_PAIR=seeded forces the stand-in)."""
    if os.environ.get("SPEC_PERF_PAIR") != "seeded" and (SHIPPED_PAIR / "target" / "config.json").exists():
        return shipped_pair()
    return seeded_pair()


@pytest.fixture(scope="session")
def cpu_greedy(cpu_pair) -> list[list[int]]:
    """The target's greedy tokens per prompt (the exactness reference; also warms both models up)."""
    out = [greedy_generate(cpu_pair.target, p, max_new_tokens=NEW_TOKENS).tokens for p in cpu_pair.prompts]
    greedy_generate(cpu_pair.draft, cpu_pair.prompts[0], max_new_tokens=8)
    return out


@pytest.fixture(scope="session")
def cpu_costs(cpu_pair, cpu_greedy):
    """c for the pair, measured in this run (median one-token steps, draft and target interleaved)."""
    return cost_ratio(cpu_pair.target, cpu_pair.draft, cpu_pair.prompts[0])


@pytest.fixture(scope="session")
def cpu_verify(cpu_pair, cpu_greedy):
    """A 6-token target pass in units of a 1-token step, for the verify-costed prediction."""
    return verify_cost(cpu_pair.target, cpu_pair.prompts[0], 5)


@pytest.fixture
def gpu_scale(rehearsal) -> GpuScale:
    """The GPU cases' sizes: the seed experiment's on CUDA, tiny ones in the CPU rehearsal."""
    return REHEARSAL_SCALE if rehearsal else GPU_SCALE
