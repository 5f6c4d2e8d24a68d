"""spec.diagnose on real bugs, not only on ties: a perturbed verify path, a token outside
the target's two best, an fp32 gap far above fp32 noise; and the noise floor each dtype
gets, tested from both sides of its boundary.

Every expected position and gap is computed here from the model's own uncached forward
pass (HF's), not read back from the diagnosis.
"""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import logit_tolerance

from spec import build_gpt_neox, greedy_generate, speculative_generate
from spec import decode as decode_module
from spec.diagnose import diagnose, first_difference

PROMPT = [3, 141, 59, 26]


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits at the last of `ids`, one uncached forward, in float64."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double()


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_verify_path_perturbed_beyond_noise_is_a_bug_at_the_first_flip(target, partial_draft, monkeypatch):
    """The target's verify pass (several tokens at once) gets logit noise of 2e-2, far beyond
    fp64's ~1e-15 but below some top-2 gaps: greedy speculative output diverges where a
    perturbed argmax flipped. The diagnosis must call it a bug, at that position, with the
    unperturbed target's gap there."""
    gen = torch.Generator().manual_seed(0)

    from spec import runner

    class PerturbedVerify(runner.KVRunner):
        def __call__(self, ids, keep=0):
            logits = super().__call__(ids, keep)
            if self.model is target and keep > 1:
                logits = logits + 2e-2 * torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
            return logits

    expected = greedy_generate(target, PROMPT, max_new_tokens=48).tokens
    monkeypatch.setitem(runner.RUNNERS, "kv-cache", PerturbedVerify)
    actual = speculative_generate(target, partial_draft, PROMPT, gamma=4, max_new_tokens=48).tokens
    monkeypatch.undo()
    i = next(j for j, (a, b) in enumerate(zip(expected, actual)) if a != b)  # the perturbation did flip one

    d = diagnose(target, PROMPT, expected, actual)
    logits = last_logits(target, PROMPT + expected[:i])
    assert (d.position, d.expected, d.actual, d.verdict) == (i, expected[i], actual[i], "bug")
    rounding = logit_tolerance(torch.float64, logits)    # the gaps come from other passes than `logits`
    assert d.gap_step == pytest.approx(top2_gap(logits), abs=rounding)
    assert d.gap_block == pytest.approx(top2_gap(logits), abs=rounding)
    assert d.noise <= rounding < d.gap_step and d.dtype == "float64"
    assert str(d) == (f"first divergence at new token {i}: greedy {expected[i]}, got {actual[i]}; target top-2 "
                      f"logit gap {d.gap_step:.3g} (one-token step) / {d.gap_block:.3g} (block verify), noise "
                      f"{d.noise:.3g} (float64): BUG (gap beyond the dtype's noise)")


def test_token_outside_the_two_best_is_a_bug_even_at_a_zero_gap(target):
    """Two LM-head rows made equal: the top-2 gap is exactly 0 there. Emitting the twin is a
    tie; emitting the third-best token at the same position is a bug, gap or no gap."""
    tied = copy.deepcopy(target)
    i = 2
    tokens = greedy_generate(tied, PROMPT, max_new_tokens=6).tokens
    best = tokens[i]
    third = int(last_logits(tied, PROMPT + tokens[:i]).topk(2).indices[1])  # best's runner-up becomes third
    twin = (best + 123) % 500
    with torch.no_grad():
        tied.get_output_embeddings().weight[twin] = tied.get_output_embeddings().weight[best]
    tokens = greedy_generate(tied, PROMPT, max_new_tokens=6).tokens
    assert tokens[:i] == greedy_generate(target, PROMPT, max_new_tokens=i).tokens
    low, high = sorted((best, twin))
    assert tokens[i] == low

    tie = diagnose(tied, PROMPT, tokens[:i] + [low], tokens[:i] + [high])
    assert (tie.position, tie.verdict, tie.gap_step) == (i, "tie", 0.0)
    assert str(tie).endswith(f"noise {tie.noise:.3g} (float64): numerical tie")
    bug = diagnose(tied, PROMPT, tokens[:i] + [low], tokens[:i] + [third])
    assert (bug.position, bug.actual, bug.verdict) == (i, third, "bug")
    assert bug.gap_step == 0.0 <= bug.noise


def test_fp32_gap_far_above_fp32_noise_is_a_bug(target_fp32):
    """fp32 target; the checked output takes the runner-up where the gap is ~1e-2, four
    orders of magnitude above fp32 noise (~1e-6 of the largest logit)."""
    tokens = greedy_generate(target_fp32, PROMPT, max_new_tokens=10).tokens
    gaps = [top2_gap(last_logits(target_fp32, PROMPT + tokens[:j])) for j in range(10)]
    i = max(range(10), key=lambda j: gaps[j])
    runner_up = int(last_logits(target_fp32, PROMPT + tokens[:i]).topk(2).indices[1])
    d = diagnose(target_fp32, PROMPT, tokens, tokens[:i] + [runner_up] + tokens[i + 1:])
    assert (d.position, d.expected, d.actual, d.verdict, d.dtype) == (i, tokens[i], runner_up, "bug", "float32")
    rounding = logit_tolerance(torch.float32, last_logits(target_fp32, PROMPT + tokens[:i]))
    assert d.gap_step == pytest.approx(gaps[i], abs=rounding) and d.gap_block == pytest.approx(gaps[i], abs=rounding)
    assert gaps[i] > 1e3 * d.noise
    assert d.noise <= rounding


# --- the noise floor, per dtype ----------------------------------------------------------------
# A one-token prompt diverging at its first new token: the step path and the block path are
# the same computation, the measured difference is exactly 0, and the noise is the floor:
# 8 * eps(dtype) * max |logit| (spec/diagnose.py's docstring).

EPS = {torch.float64: 2.0 ** -52, torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ONE = [77]


def with_runner_up_at(model, ids: list[int], best: int, other: int, gap: float):
    """A copy of `model` whose LM-head row `other` is row `best` moved so that, at the last of
    `ids`, other's logit is best's minus `gap` (computed in fp64, then stored in the model's dtype)."""
    m = copy.deepcopy(model)
    seen = {}
    head = m.get_output_embeddings()
    def keep_input(module, inputs, output):
        seen["h"] = inputs[0][0, -1].double()  # the final hidden state the head multiplies

    hook = head.register_forward_hook(keep_input)
    last_logits(m, ids)
    hook.remove()
    h = seen["h"]
    with torch.no_grad():
        head.weight[other] = (head.weight[best].double() - gap * h / h.dot(h)).to(head.weight.dtype)
    return m


@pytest.fixture(scope="module", params=[torch.float64, torch.float32, torch.float16, torch.bfloat16],
                ids=lambda d: str(d).replace("torch.", ""))
def model_in_dtype(request):
    return build_gpt_neox("tiny-target", seed=1, dtype=request.param), request.param


def test_noise_is_the_dtype_floor_when_the_paths_agree(model_in_dtype):
    model, dtype = model_in_dtype
    logits = last_logits(model, ONE)
    best, second = logits.topk(2).indices.tolist()
    d = diagnose(model, ONE, [best], [second])
    floor = 8 * EPS[dtype] * float(logits.abs().max())
    assert d.noise == pytest.approx(floor, rel=1e-12)
    assert d.gap_step == d.gap_block == pytest.approx(top2_gap(logits), rel=1e-12)
    assert d.dtype == str(dtype).replace("torch.", "")
    assert d.verdict == ("tie" if top2_gap(logits) <= floor else "bug")


@pytest.mark.parametrize("side", ["below", "above"])
def test_noise_floor_boundary_from_both_sides(model_in_dtype, side):
    """The runner-up's gap set just under, then just over the floor: tie, then bug."""
    model, dtype = model_in_dtype
    best, second = last_logits(model, ONE).topk(2).indices.tolist()
    floor0 = 8 * EPS[dtype] * float(last_logits(model, ONE).abs().max())
    # built runner-ups at a few multiples of the floor; last, the model's own runner-up (in bf16
    # its natural gap is barely above the floor, so a built one above it would not be second)
    candidates = [(with_runner_up_at(model, ONE, best, (best + 250) % 500, scale * floor0), (best + 250) % 500)
                  for scale in ((0.7, 0.5, 0.3) if side == "below" else (1.4, 2.0))] + [(model, second)]
    for m, other in candidates:
        logits = last_logits(m, ONE)
        floor = 8 * EPS[dtype] * float(logits.abs().max())
        gap = top2_gap(logits)
        ranked = logits.topk(2).indices.tolist()
        # the built gap lands on the intended side, by a margin that rounding cannot cross
        if ranked == [best, other] and (gap < 0.9 * floor if side == "below" else gap > 1.1 * floor):
            break
    else:
        pytest.fail(f"could not build a {side}-floor gap in {dtype}")
    d = diagnose(m, ONE, [best], [other])
    assert (d.position, d.expected, d.actual) == (0, best, other)
    assert d.noise == pytest.approx(floor, rel=1e-12) and d.gap_step == pytest.approx(gap, rel=1e-12)
    assert d.verdict == ("tie" if side == "below" else "bug")


def test_first_difference_cases():
    assert first_difference([], []) is None
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [9, 2, 3]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1]) == 1
    assert first_difference([], [4]) == 0


def test_stopped_early_is_a_bug_with_none_for_the_missing_token(target):
    tokens = greedy_generate(target, PROMPT, max_new_tokens=6).tokens
    d = diagnose(target, PROMPT, tokens, tokens[:4])
    assert (d.position, d.expected, d.actual, d.verdict) == (4, tokens[4], None, "bug")
    logits = last_logits(target, PROMPT + tokens[:4])
    assert d.gap_step == pytest.approx(top2_gap(logits), abs=logit_tolerance(torch.float64, logits))


def test_diagnosis_deep_into_a_long_context(target):
    """Position 40 of a 64-token prompt: the block path spans the last 6 positions."""
    prompt = [(i * 37) % 500 for i in range(64)]
    tokens = greedy_generate(target, prompt, max_new_tokens=44).tokens
    logits = last_logits(target, prompt + tokens[:40])
    runner_up = int(logits.topk(2).indices[1])
    d = diagnose(target, prompt, tokens, tokens[:40] + [runner_up] + tokens[41:])
    assert (d.position, d.verdict) == (40, "bug")
    assert d.gap_step == pytest.approx(top2_gap(logits), abs=logit_tolerance(torch.float64, logits))
    assert 0 < d.noise <= logit_tolerance(torch.float64, logits)


# --- the verdict rule on scripted logits ----------------------------------------------------------
# The target's runner replaced by one that hands back chosen logits, call by call: with a one-token
# prompt diverging at once, diagnose makes two calls, the step path's and the block path's.
# Exact binary fractions keep every gap and noise exact in fp64 (floor: 8 * 2^-52 * 1.0 = 2^-49).

FLOOR64 = 2.0 ** -49


def scripted(monkeypatch, step, block):
    from spec import choose
    rows = iter([torch.tensor(step, dtype=torch.float64), torch.tensor(block, dtype=torch.float64)])
    class Scripted:
        def __call__(self, ids, keep=0):
            return next(rows)[None]

    monkeypatch.setattr(choose, "runs", lambda roles, ids, **kw: choose.Chosen(torch.tensor(ids).reshape(-1),
                                                                                [Scripted()], roles))


@pytest.mark.parametrize("gap,verdict", [(FLOOR64 / 2, "tie"), (FLOOR64, "tie"), (2 * FLOOR64, "bug")])
def test_gap_equal_to_the_noise_is_still_a_tie(target, monkeypatch, gap, verdict):
    row = [1.0, 1.0 - gap, 0.0, -1.0]
    scripted(monkeypatch, row, row)
    d = diagnose(target, ONE, [0], [1])
    assert (d.noise, d.gap_step, d.gap_block, d.verdict) == (FLOOR64, gap, gap, verdict)


def test_either_paths_top_two_counts(target, monkeypatch):
    """The runner-up differs between the paths (a three-way near tie): the token that is second
    on the block path alone is still one of 'the target's two best'."""
    a, b = 1.0 - 2.0 ** -50, 1.0 - 2.0 ** -49
    scripted(monkeypatch, [1.0, a, b, 0.0], [1.0, b, a, 0.0])
    d = diagnose(target, ONE, [0], [2])
    assert (d.noise, d.gap_step, d.gap_block, d.verdict) == (FLOOR64, 2.0 ** -50, 2.0 ** -50, "tie")


def test_measured_noise_above_the_floor_is_used(target, monkeypatch):
    scripted(monkeypatch, [1.0, 0.5, 0.25, 0.0], [1.0, 0.5 + 2.0 ** -10, 0.25, 0.0])
    d = diagnose(target, ONE, [0], [1])
    assert (d.noise, d.gap_step, d.gap_block, d.verdict) == (2.0 ** -10, 0.5, 0.5 - 2.0 ** -10, "bug")
    scripted(monkeypatch, [1.0, 1.0 - 2.0 ** -11, 0.0, 0.0], [1.0, 1.0 + 2.0 ** -10, 0.0, 0.0])
    d = diagnose(target, ONE, [0], [1])    # the paths disagree on the winner, by less than their difference
    assert (d.noise, d.gap_step, d.gap_block, d.verdict) == (3 * 2.0 ** -11, 2.0 ** -11, 2.0 ** -10, "tie")


# --- the block path as the docstring describes it ---------------------------------------------------


def path_logits(model, prompt, context):
    """Recomputed here with HF's own cache: greedy's step path (prefill the prompt, then one token at a
    time) and a verify block over the last min(6, ...) positions, never starting before the prompt's
    last token. The head runs on the last row only (logits_to_keep=1), as a decode step does."""
    from transformers import DynamicCache
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([context[:len(prompt)]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for t in range(len(prompt), len(context)):
            out = model(torch.tensor([context[t:t + 1]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = out.logits[0, -1].double()
        start = max(len(prompt) - 1, len(context) - 6)
        cache = DynamicCache(config=model.config)
        if start > 0:
            model(torch.tensor([context[:start]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        block = model(torch.tensor([context[start:]]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].double()
    return step, block


@pytest.mark.parametrize("prompt_len,position", [(2, 0), (3, 1), (64, 40), (9, 3)])
def test_noise_is_the_measured_step_block_difference(target_fp32, prompt_len, position):
    prompt = [(i * 53 + 7) % 500 for i in range(prompt_len)]
    tokens = greedy_generate(target_fp32, prompt, max_new_tokens=position + 1).tokens
    step, block = path_logits(target_fp32, prompt, prompt + tokens[:position])
    runner_up = int(step.topk(2).indices[1])
    d = diagnose(target_fp32, prompt, tokens, tokens[:position] + [runner_up])
    measured = float((step - block).abs().max())
    floor = 8 * 2.0 ** -23 * float(step.abs().max())
    assert d.noise == max(measured, floor)
    assert (d.gap_step, d.gap_block) == (top2_gap(step), top2_gap(block))
