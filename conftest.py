"""Shared fixtures, command-line options and hypothesis profiles for the spec suite.

Model fixtures are session-scoped and built from config with seeded weights, so
every run sees the same models; building them takes well under a second.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from spec import build_gpt_neox
from spec.models import SHIPPED_PAIR, TINY_TOKENIZER_SIZE, perturbed_copy, truncated_copy

# --- hypothesis profiles: `pytest --hypothesis-profile=NAME` ---------------------------
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=40, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=15, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The fixture models are tiny: one thread runs them fastest and keeps runs steady when
# other work shares the machine. The perf suite sets its own thread count.
torch.set_num_threads(1)


def pytest_addoption(parser):
    group = parser.getgroup("spec", "spec: real checkpoints for the GPU cases")
    group.addoption("--target", default=os.environ.get("SPEC_TARGET", "EleutherAI/pythia-12b"),
                    help="target model: local folder or cached hub id (env SPEC_TARGET)")
    group.addoption("--draft", default=os.environ.get("SPEC_DRAFT", "EleutherAI/pythia-410m"),
                    help="draft model: local folder or cached hub id (env SPEC_DRAFT)")
    kit = parser.getgroup("conformance", "spec: the conformance kit (tests/conformance)")
    kit.addoption("--impl", default=os.environ.get("SPEC_IMPL", "spec"),
                  help="decoder under test: spec, hf-assisted, hf-prompt-lookup, module:function or "
                       "path/to/file.py:function (env SPEC_IMPL; default spec)")
    kit.addoption("--conform-budget", type=float, default=1.0,
                  help="scale the kit's example counts and sample sizes (default 1)")
    kit.addoption("--conform-no-shrink", action="store_true",
                  help="report the first counterexample hypothesis finds, without shrinking it (faster)")


# --- model pairs ------------------------------------------------------------------------
# The target runs in fp64 on CPU: logit noise between a one-token step and a block
# verify is ~1e-15 there (NOTES.md), so any divergence from greedy is a bug, not a tie.

@pytest.fixture(scope="session")
def target():
    """Random tiny GPT-NeoX target in fp64, logits 640 wide (the wider, pythia-12b-like head)."""
    return build_gpt_neox("tiny-target", seed=1, dtype=torch.float64)


@pytest.fixture(scope="session")
def target_fp32(target):
    return build_gpt_neox("tiny-target", seed=1, dtype=torch.float32)


@pytest.fixture(scope="session")
def self_draft(target):
    """draft = target: every draft token is accepted."""
    return target


@pytest.fixture(scope="session")
def random_draft():
    """An unrelated random draft, 512 wide (the narrower, pythia-410m-like head): accepts almost nothing."""
    return build_gpt_neox("tiny-draft", seed=2)


@pytest.fixture(scope="session")
def partial_draft(target):
    """The target with 10% weight noise, in fp32: agrees on most tokens, not all."""
    return perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)


@pytest.fixture(scope="session")
def shallow_draft(target):
    """The target's first two layers, in bf16: partial acceptance from a cheaper model."""
    return truncated_copy(target, num_layers=2, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def drafts(self_draft, random_draft, partial_draft, shallow_draft):
    return {"self": self_draft, "random": random_draft, "partial": partial_draft, "shallow": shallow_draft}


@pytest.fixture(scope="session")
def tokenizer_size():
    return TINY_TOKENIZER_SIZE


@pytest.fixture(scope="session")
def shipped_pair():
    """The small trained pair shipped in spec/assets/pair, target in fp64 and draft in fp32."""
    from spec import load_pair
    if not (SHIPPED_PAIR / "target" / "config.json").exists():
        pytest.skip(f"no shipped pair at {SHIPPED_PAIR} (python -m spec.train makes it)")
    return load_pair(target_dtype=torch.float64, draft_dtype=torch.float32)
