"""The perf suite's pairs and prompts, side-by-side timing, and the numbers every case reports.

The CPU pair is the shipped trained pair (spec/assets/pair) when present. Otherwise a
seeded stand-in of about the same cost: a 12-layer, 256-wide GPT-NeoX target whose
layers above the first are damped (output projections scaled by 0.03), and its first
layer as the draft. Random weights give near-uniform logits, so an undamped truncated
copy hardly ever agrees (alpha 0.02 measured for a 6-layer one); damping makes the upper
layers small corrections, as in a trained model: the copy then agrees at alpha ~0.8
while the target still computes all twelve layers.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass

import pytest
import torch

from serial_timing import timed_alone
from spec import theory
from spec.clock import timed
from spec.diagnose import diagnose
from spec.models import SHAPES, SHIPPED_PAIR, TINY_TOKENIZER_SIZE, build_gpt_neox, truncated_copy
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS

# Kept short: the whole default perf run must stay within about two minutes on 2 shared cores.
NEW_TOKENS = 40
REPEATS = 3  # side-by-side rounds of the gated comparison (others: 1 or 2); speedups are ratios of medians

# Prompts: the shipped pair gets the first three code prompts; the GPU cases the seed's five.
CODE_PROMPTS = CODE_PROMPTS[:3]

DAMPED_SHAPE = dict(hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024,
                    vocab_size=4096)


@dataclass(frozen=True)
class GpuScale:
    """The sizes of the GPU cases (tests/perf/test_gpu_speed.py): the seed experiment's on CUDA,
    tiny ones for their CPU rehearsal (conftest's gpu_device), which runs the same code in seconds."""
    new_tokens: int
    repeats: int
    batch_sizes: tuple[int, ...]
    target_shape: str | dict          # the synthetic target (pythia-12b's shapes on CUDA)
    draft_shape: str | dict           # the synthetic draft base (pythia-410m's)
    tp_target_shape: dict             # the tensor-parallel case's target
    tp_new_tokens: int
    prompt_vocab: int                 # prompts' ids are drawn below this (the shared tokenizer's size)


GPU_SCALE = GpuScale(new_tokens=256, repeats=2, batch_sizes=(1, 2, 4, 8, 16), target_shape="pythia-12b",
                     draft_shape="pythia-410m",
                     # pythia-12b's width, 8 of its 36 layers: 2.9B params, 11.5 GB in fp32
                     tp_target_shape=dict(hidden_size=5120, num_hidden_layers=8, num_attention_heads=40,
                                          intermediate_size=20480, vocab_size=50688),
                     tp_new_tokens=128, prompt_vocab=50277)
# The suite's tiny pair: two logit widths, as in the pythia pair (the target's head the wider).
REHEARSAL_SCALE = GpuScale(new_tokens=8, repeats=1, batch_sizes=(1, 2), target_shape="tiny-target",
                           draft_shape="tiny-draft", tp_target_shape=SHAPES["tiny-target"],
                           tp_new_tokens=8, prompt_vocab=TINY_TOKENIZER_SIZE)


@dataclass
class PerfPair:
    key: str                    # the pair's key in thresholds.py
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[list[int]]


def damped_target(shape: dict = DAMPED_SHAPE, *, damping: float = 0.03, seed: int = 1) -> torch.nn.Module:
    target = build_gpt_neox(shape, seed=seed)
    with torch.no_grad():
        for layer in target.gpt_neox.layers[1:]:
            layer.attention.dense.weight.mul_(damping)
            layer.mlp.dense_4h_to_h.weight.mul_(damping)
    return target


def shipped_pair() -> PerfPair:
    from spec import load_pair
    pair = load_pair(target_dtype=torch.float32, draft_dtype=torch.float32)
    if pair.tokenizer is None:
        pytest.skip(f"the shipped pair at {SHIPPED_PAIR} has no tokenizer")
    prompts = [pair.tokenizer(p)["input_ids"] for p in CODE_PROMPTS]
    return PerfPair("shipped-pair", pair.target, pair.draft, prompts)


def seeded_pair() -> PerfPair:
    target = damped_target()
    draft = truncated_copy(target, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4000, (16,), generator=gen).tolist() for _ in range(len(CODE_PROMPTS))]
    return PerfPair("seeded-damped-256x12", target, draft, prompts)


@dataclass
class SideBySide:
    baseline: list            # outputs of the last baseline round, one per item
    candidate: list           # outputs of the last candidate round
    baseline_s: list[list[float]]   # [round][item] seconds
    candidate_s: list[list[float]]

    @property
    def speedups(self) -> list[float]:
        """Per item: median baseline time / median candidate time."""
        items = range(len(self.baseline))
        return [statistics.median(r[i] for r in self.baseline_s) / statistics.median(r[i] for r in self.candidate_s)
                for i in items]

    @property
    def round_speedups(self) -> list[float]:
        """Per side-by-side round (repeat): the mean over items of that round's baseline time / candidate
        time. Their spread is what the gate weighs a verdict against (gate.judge)."""
        return [statistics.fmean(b / c for b, c in zip(base, cand))
                for base, cand in zip(self.baseline_s, self.candidate_s)]

    @property
    def mean_speedup(self) -> float:
        """The mean of the per-item speedups (the seed notebook's summary: 1.29x on an A100)."""
        return statistics.fmean(self.speedups)

    @property
    def total_speedup(self) -> float:
        return statistics.median(map(sum, self.baseline_s)) / statistics.median(map(sum, self.candidate_s))


def side_by_side(benchmark, baseline, candidate, items, *, rounds: int, device: torch.device | None = None):
    """Time candidate(item) for every item with pytest-benchmark, and baseline(item) for every
    item right before each of its rounds.

    pytest-benchmark's pedantic `setup` runs before every round and stays out of the
    benchmark's statistics, so the baseline runs there, timed here: the two alternate,
    and drift on a shared machine hits both. The benchmark's own numbers are the
    candidate's time for all items (for --benchmark-compare)."""
    result = SideBySide([], [], [], [])

    def each(fn, outs, times):
        outs.clear()
        row = []
        for item in items:
            out, seconds = timed(lambda: fn(item), device)
            outs.append(out)
            row.append(seconds)
        times.append(row)

    def setup():
        each(baseline, result.baseline, result.baseline_s)

    def run():
        each(candidate, result.candidate, result.candidate_s)

    if benchmark.disabled and timed_alone():
        # pytest-benchmark turns itself off in an xdist worker, but there this case has the
        # machine to itself (serial_timing): run the same rounds, so the gate's ratios are
        # medians over as many rounds as in a serial run; the last one through pedantic below.
        for _ in range(rounds - 1):
            setup()
            run()
        rounds = 1
    # (With --benchmark-disable pedantic runs setup and the function once each.)
    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    return result


def acceptance(results) -> dict:
    """alpha (capped-geometric MLE), accepted/drafted and tokens per round, pooled over runs."""
    accepted = [k for r in results for k in r.accepted_per_round]
    drafted = [g for r in results for g in r.drafted_per_round]
    tokens = sum(len(r.tokens) for r in results)
    rounds = sum(len(r.rounds) for r in results)
    return {
        "alpha": theory.alpha_from_accepted(accepted, drafted),
        "accept_rate": sum(accepted) / sum(drafted),
        "tokens_per_round": tokens / rounds,
        "rounds": rounds,
        "mean_gamma": sum(drafted) / rounds,
    }


def prediction(alpha: float, gamma: int, costs, verify: float | None = None) -> dict:
    """Theorem 3.8 from the measured alpha and c; with `verify` (verify_cost) also the same
    model with the verify pass at its measured cost: E[tokens] / (gamma c + verify)."""
    alpha = min(alpha, 1.0)
    out = {
        "c": costs.c,
        "draft_step_ms": costs.draft_step_s * 1e3,
        "target_step_ms": costs.target_step_s * 1e3,
        "predicted_speedup": theory.expected_speedup(alpha, gamma, costs.c),
    }
    if verify is not None:
        out["verify_pass_over_step"] = verify
        tokens = theory.expected_tokens_per_round(alpha, gamma)
        out["predicted_speedup_verify_costed"] = tokens / (gamma * costs.c + verify)
    return out


def overhead(seconds: float, draft_steps: int, target_passes: int, costs, verify: float | None = None) -> dict:
    """Measured time against the sum of the model step times the run needed: `draft_steps`
    one-token draft steps and `target_passes` target passes at the medians in `costs`.
    1.0 means no time outside the models. Theorem 3.8 prices a (gamma+1)-token verify
    pass as one step; with `verify` (verify_cost) it is also priced at its measured cost."""
    model_s = draft_steps * costs.draft_step_s + target_passes * costs.target_step_s
    out = {"model_step_time_s": model_s, "measured_over_model_steps": seconds / model_s}
    if verify is not None:
        costed = draft_steps * costs.draft_step_s + target_passes * costs.target_step_s * verify
        out["measured_over_model_steps_verify_costed"] = seconds / costed
    return out


def assert_same_tokens(target, prompts, expected: list[list[int]], actual: list[list[int]], what: str) -> None:
    """Token-identical to greedy, prompt by prompt; a divergence is diagnosed (tie or bug).
    A proven numerical tie (fp32 top-2 gap within rounding noise) is reported, not failed."""
    for prompt, e, a in zip(prompts, expected, actual):
        d = diagnose(target, prompt, e, a)
        if d is None:
            continue
        if d.verdict == "tie":
            warnings.warn(f"{what}: numerical tie, not a bug: {d}")
        else:
            pytest.fail(f"{what}: {d}", pytrace=False)


def report(benchmark, **info) -> None:
    """Into benchmark.extra_info (saved with --benchmark-autosave/--benchmark-json) and printed (-s)."""
    rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in info.items()}
    benchmark.extra_info.update(rounded)
    print(" ".join(f"{k}={v}" for k, v in rounded.items()))
