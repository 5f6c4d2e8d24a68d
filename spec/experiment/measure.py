"""Measured costs: the paper's c is the time of one draft step over one target step."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from spec import batch, choose, hf
from spec.clock import now, sync  # noqa: F401  (sync: re-exported for callers of spec.experiment.measure.sync)
from spec.validate import check_pair, model_device


@torch.inference_mode()
def step_time(model, input_ids, *, steps: int = 32, warmup: int = 4, draft_impl: str | None = None) -> float:
    """Median wall time of one cached one-token forward pass after the prompt's prefill.

    Each step is timed alone, CUDA-synchronised, on the model's own device, with the model
    run as the decode loop runs it (spec.choose): as a target, or with draft_impl given, as a
    draft run that way, so that c is the cost the loop pays. An encoder-decoder model's step
    is its decoder's, over input_ids' encoder output."""
    device = model_device(model)
    if draft_impl is None:
        chosen = choose.runs({"model": model}, input_ids)
    else:
        chosen = choose.runs({"draft": model}, input_ids, room=warmup + steps + 1, draft_impl=draft_impl)
    prompt, (run,) = chosen.prompt, chosen.runs
    last_id = hf.vocab_rows(model) - 1  # looked up once, outside the timed steps
    logits = run(prompt, keep=1)
    token = logits[-1].argmax().reshape(1).clamp(max=last_id)
    times = []
    for i in range(warmup + steps):
        t0 = now(device)
        token = run(token, keep=1)[-1].argmax().reshape(1).clamp(max=last_id)
        if i >= warmup:
            times.append(now(device) - t0)
    return statistics.median(times)


@dataclass
class Costs:
    """One-token step times of a draft model and the target (None for a draft source, which has
    no model step to time), and the verify line where one was measured."""
    draft_step_s: float | None
    target_step_s: float | None
    verify: VerifyLine | None = None

    @property
    def c(self) -> float | None:
        return None if self.draft_step_s is None else self.draft_step_s / self.target_step_s


def cost_ratio(target, draft, input_ids, *, steps: int = 32, warmup: int = 4, draft_impl: str = "auto") -> Costs:
    """c = draft step time / target step time, both measured in this run, interleaved
    twice (draft, target, draft, target) so that drift on a shared machine hits both.
    The draft runs as speculative_generate(draft_impl=...) runs it."""
    check_pair(target, draft)
    d, t = [], []
    for _ in range(2):
        d.append(step_time(draft, input_ids, steps=steps // 2, warmup=warmup, draft_impl=draft_impl))
        t.append(step_time(target, input_ids, steps=steps // 2, warmup=warmup))
    return Costs(statistics.fmean(d), statistics.fmean(t))


@torch.inference_mode()
def pass_times(target, input_ids, gammas, *, repeats: int = 6) -> dict[int, float]:
    """Median time of a cached target pass over gamma+1 tokens after the prompt's prefill,
    for each gamma in `gammas` (0: a one-token step), timed interleaved, the cache put
    back after each pass."""
    device = model_device(target)
    chosen = choose.runs({"target": target}, input_ids)
    prompt, (run,) = chosen.prompt, chosen.runs
    run(prompt, keep=1)
    P = prompt.numel()
    fed = prompt[torch.arange(max(gammas) + 1, device=device) % P]  # any ids after the prompt
    times = {g: [] for g in gammas}
    for _ in range(repeats):
        for g in gammas:
            t0 = now(device)
            run(fed[:g + 1], keep=g + 1)
            times[g].append(now(device) - t0)
            run.crop(P)
    return {g: statistics.median(t) for g, t in times.items()}


def verify_cost(target, input_ids, gamma: int, *, repeats: int = 8) -> float:
    """A (gamma+1)-token verify pass in one-token target steps. Theorem 3.8 takes it as 1:
    true for a bandwidth-bound GPU target, not for a small CPU one (~1.25 at gamma 5)."""
    t = pass_times(target, input_ids, [0, gamma], repeats=repeats)
    return t[gamma] / t[0]


@dataclass
class VerifyLine:
    """A verify pass of g + 1 tokens (g >= 1 drafted) as fixed + slope * g one-token target steps.

    fixed is not 1: on a CPU a 2-token pass already costs more than a step (SmolLM2-135M at one
    thread: ~1.5), and a line through the one-token step would price short passes too low."""
    fixed: float
    slope: float
    measured: dict  # g -> measured pass time in one-token steps

    def cost(self, g: int) -> float:
        return self.fixed + self.slope * g if g else 1.0


def verify_line(target, input_ids, *, max_gamma: int = 16, repeats: int = 6) -> VerifyLine:
    """Time passes of 1 token and of g + 1 for a few g in [1, max_gamma]; fit the g >= 1 passes
    by least squares, in units of the one-token step."""
    gammas = sorted({0, 1, 2, max(1, max_gamma // 4), max(1, max_gamma // 2), max_gamma})
    med = pass_times(target, input_ids, gammas, repeats=repeats)
    steps = {g: med[g] / med[0] for g in gammas}
    xs = [g for g in gammas if g >= 1]
    mean_g = statistics.fmean(xs)
    mean_t = statistics.fmean(steps[g] for g in xs)
    sxx = sum((g - mean_g) ** 2 for g in xs)
    slope = max(0.0, sum((g - mean_g) * (steps[g] - mean_t) for g in xs) / sxx) if sxx else 0.0
    return VerifyLine(fixed=max(mean_t - slope * mean_g, 0.0), slope=slope, measured=steps)


def verify_slope(target, input_ids, *, max_gamma: int = 16, repeats: int = 6) -> float:
    """The extra cost of a verify pass per drafted token, in one-token target steps: passes
    of 1, and of gamma+1 for a few gamma up to max_gamma, fitted by least squares.
    Theorem 3.8 takes it as 0. It leaves out the pass's fixed cost: verify_line gives both."""
    gammas = sorted({0, max(1, max_gamma // 4), max(1, max_gamma // 2), max_gamma})
    med = pass_times(target, input_ids, gammas, repeats=repeats)
    mean_g = statistics.fmean(gammas)
    mean_t = statistics.fmean(med.values())
    slope = (sum((g - mean_g) * (med[g] - mean_t) for g in gammas)
             / sum((g - mean_g) ** 2 for g in gammas))
    return max(0.0, slope / med[0])


@torch.inference_mode()
def batch_step_time(model, prompts: list[list[int]], *, tokens: int = 1, steps: int = 12) -> float:
    """Median wall time of one batched pass (spec.batch.Rows) feeding `tokens` tokens to every row,
    on a cache holding the prompts, cut back after each pass: a batch's c (tokens=1, draft over
    target) and its verify pass (tokens=gamma + 1) in target steps."""
    device = model_device(model)
    rows = batch.Rows(model, len(prompts))
    ids = [torch.tensor(p, device=device) for p in prompts]
    rows(ids, keep=1)
    times = []
    for _ in range(steps):
        feed = [p[-tokens:] if p.numel() >= tokens else p[-1:].repeat(tokens) for p in ids]
        t0 = now(device)
        rows(feed, keep=tokens)
        times.append(now(device) - t0)
        rows.crop([p.numel() for p in ids])
    return statistics.median(times)
