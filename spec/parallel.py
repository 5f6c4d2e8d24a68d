"""Models split across processes (tensor parallelism under torchrun) or devices (device_map).

spec decodes a split target with the same loop as a whole one; what makes that exact:

  - Tensor parallelism (transformers' plan, `spec.models.load_model(..., tp_size=N)` under
    `torchrun --nproc-per-node N`): each forward pass is a collective, every rank computing its
    share of every layer. All ranks run the same decode loop: the target's logits are gathered
    (the LM head's output is whole on every rank), so every rank picks the same tokens, and the
    draft, replicated on every rank, proposes the same ones. Replicated rather than run on one
    rank and broadcast: a broadcast per draft token would cost a collective per token, the
    draft's memory on the other ranks costs nothing in time. What the loop needs is that the
    ranks agree on everything that decides the sequence of passes: the prompt, gamma, the stop
    ids, the sampling options and the random stream. `check` compares them across the group once
    per call (one small all-gather) and refuses, on every rank, a call where they differ, rather
    than hanging in a collective of mismatched shapes. gamma="auto" is refused: each rank would
    time its own passes and choose its own gamma (measured here: gloo aborts the run).
  - device_map (accelerate, layers on several devices or offloaded): one process runs the whole
    loop; accelerate's hooks move activations between devices and return the logits on the input
    device. Nothing to agree on; only the draft's plain-tensor and compiled forwards, which read
    the weights where they lie, are refused for a split draft.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from spec import hf
from spec.options import GammaMode


def _devices(model) -> list[str]:
    """The devices of the model's device_map ("cuda:1" for accelerate's bare index 1), sorted."""
    placement = hf.device_map(model) or {}
    return sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in placement.values()})


def is_split(model) -> bool:
    """Split over processes (tensor parallel) or over several devices / offloaded (device_map)."""
    return hf.tensor_parallel_size(model) > 1 or len(_devices(model)) > 1


def describe(model) -> str:
    """How the model is placed, for reports: whole on one device, tensor parallel, or a device map."""
    tp = hf.tensor_parallel_size(model)
    if tp > 1:
        import torch.distributed as dist
        backend = dist.get_backend(hf.tensor_parallel_group(model)) if dist.is_initialized() else "?"
        return f"tensor parallel over {tp} processes ({backend}; transformers' plan for {type(model).__name__})"
    if len(where := _devices(model)) > 1:
        return f"device_map over {', '.join(where)} ({len(hf.device_map(model) or {})} parts)"
    return f"whole on {next(model.parameters()).device}"


def _random_state(generator, device: torch.device) -> str:
    if generator is not None:
        state = generator.get_state()
    elif device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
    else:
        state = torch.get_rng_state()
    return hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest()[:16]


def check_draft(draft, draft_impl: str) -> None:
    """A split draft runs on its own forward only (spec.choose asks before it builds the draft)."""
    if is_split(draft) and draft_impl in ("plain", "compiled"):
        raise ValueError(f"draft_impl={draft_impl!r}: the draft is split ({describe(draft)}), and that forward "
                         f"reads its weights as whole tensors on one device; use draft_impl='hf' or 'auto'")


def check(target, draft=None, *, gamma=None, draft_impl: str = "auto", prompt: torch.Tensor,
          generator=None, **options) -> None:
    """Refuse, with the reason, what a split target or draft cannot run exactly; for a tensor-parallel
    target, also a call whose inputs differ between the ranks. No cost for whole models."""
    if draft is not None:
        check_draft(draft, draft_impl)
    tp = hf.tensor_parallel_size(target)
    if tp == 1:
        return
    if gamma == GammaMode.AUTO:
        raise ValueError(f"gamma='auto' with a tensor-parallel target ({describe(target)}): each rank would time "
                         f"its own passes and choose its own gamma, and the ranks' passes must match; "
                         f"pass a fixed gamma")
    import torch.distributed as dist
    mine = {"input_ids": prompt.tolist(), "gamma": gamma, **options}
    if options.get("do_sample"):
        mine["generator (random state)"] = _random_state(generator, prompt.device)
    group = hf.tensor_parallel_group(target)
    everyone: list[Any] = [None] * dist.get_world_size(group)     # each rank's `mine`, once gathered
    dist.all_gather_object(everyone, mine, group=group)
    for key in mine:
        values = [theirs.get(key) for theirs in everyone]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"{key} differs between the {tp} ranks of the tensor-parallel target (rank values: "
                f"{[_short(v) for v in values]}): every rank must decode the same call"
                + (", with a generator seeded the same on every rank" if key.startswith("generator") else ""))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def from_rank_zero(model, value):
    """`value` as rank 0 of a tensor-parallel model's group has it (for choices each rank made from its
    own timings, such as the CLI's calibrated gamma); `value` itself for a model that is not split."""
    if hf.tensor_parallel_size(model) == 1:
        return value
    import torch.distributed as dist
    group = hf.tensor_parallel_group(model)
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
