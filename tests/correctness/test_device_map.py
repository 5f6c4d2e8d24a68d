"""A target split across devices with a device_map (accelerate) is decoded exactly (issue 27).

One process runs the whole loop; accelerate's hooks move activations between the parts and, for
offloaded parts, fetch the weights for each pass. On this CPU the split that can be made is an
offload: a layer whose weights live on disk (its parameters are on the meta device until a hook
loads them), which puts accelerate's hooks in every forward, as a split across GPUs does. The GPU
cases (`pytest -m gpu`) split a target's layers over two GPUs (skipped with fewer), and offload a
layer to the CPU on one GPU; in the default run they are rehearsed on CPU (conftest's gpu_device),
a disk offload standing in for the second GPU and for the CPU offload. device_map needs accelerate
(the gguf extra brings it): without it the module skips with that reason.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("accelerate", reason="device_map needs accelerate (pip install accelerate, or the gguf extra)")

import architectures
from spec import greedy_generate, speculative_generate
from spec.models import perturbed_copy
from spec.parallel import describe, is_split

NEW_TOKENS = 16
PROMPT = [5, 9, 17, 33, 65, 129, 200, 7, 11]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama target (fp64) and a perturbed fp32 copy as its draft, saved; the target's greedy tokens."""
    root = tmp_path_factory.mktemp("device_map")
    target = architectures.build("llama", seed=0, dtype=torch.float64)
    target.save_pretrained(root / "target")
    perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32).save_pretrained(root / "draft")
    return root, greedy_generate(target, PROMPT, max_new_tokens=NEW_TOKENS).tokens


def _map(last_layer, rest) -> dict:
    return {"model.embed_tokens": rest, "model.rotary_emb": rest, "model.layers.0": rest,
            "model.layers.1": last_layer, "model.norm": rest, "lm_head": rest}


@pytest.mark.slow
def test_a_layer_offloaded_to_disk_decodes_exactly(saved, tmp_path):
    root, expected = saved
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float64, device_map=_map("disk", "cpu"),
                                                  offload_folder=tmp_path).eval()
    draft = AutoModelForCausalLM.from_pretrained(root / "draft", dtype=torch.float32).eval()
    assert target.model.layers[1].mlp.up_proj.weight.device.type == "meta"  # the weights really are elsewhere
    assert is_split(target) and describe(target) == "device_map over cpu, disk (6 parts)"
    for gamma in (1, 4):
        assert speculative_generate(target, draft, PROMPT, gamma=gamma, max_new_tokens=NEW_TOKENS).tokens == expected


def test_a_split_draft_is_refused_on_forwards_that_read_its_weights(tmp_path):
    """The plain-tensor and compiled draft forwards read the weights where they lie: refused for a
    split draft; "auto" runs it on its own forward instead."""
    target = architectures.build("gpt_neox", seed=0, dtype=torch.float32)
    target.save_pretrained(tmp_path / "neox")
    split = {"gpt_neox.embed_in": "cpu", "gpt_neox.rotary_emb": "cpu", "gpt_neox.layers.0": "cpu",
             "gpt_neox.layers.1": "disk", "gpt_neox.final_layer_norm": "cpu", "lm_head": "cpu"}
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "neox", dtype=torch.float32, device_map=split,
                                                 offload_folder=tmp_path / "offload").eval()
    for impl in ("plain", "compiled"):
        with pytest.raises(ValueError, match=f"draft_impl='{impl}': the draft is split \\(device_map over cpu, disk"):
            speculative_generate(target, draft, PROMPT, max_new_tokens=4, draft_impl=impl)
    expected = greedy_generate(target, PROMPT, max_new_tokens=8).tokens
    assert speculative_generate(target, draft, PROMPT, gamma=3, max_new_tokens=8).tokens == expected


@pytest.mark.parametrize("where", ["two-gpus", "cpu-offload"])
def test_a_target_split_on_gpus_decodes_exactly(saved, where, gpu_device, rehearsal, tmp_path):
    """two-gpus: the second layer, the norm and the head on cuda:1 (needs 2 GPUs); cpu-offload: the
    second layer's weights on the CPU, brought to cuda:0 for each pass. Rehearsed on CPU with the
    disk standing in for cuda:1 and for the CPU offload (a split that puts accelerate's hooks in)."""
    if where == "two-gpus" and not rehearsal and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}")
    first, second, offload = (0, 1, "cpu") if not rehearsal else ("cpu", "disk", "disk")
    root, expected = saved
    placement = _map(offload, first) if where == "cpu-offload" else {**_map(second, first), "model.norm": second,
                                                                      "lm_head": second}
    on_first = torch.device("cuda", 0) if not rehearsal else gpu_device
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float64, device_map=placement,
                                                  offload_folder=tmp_path).eval()
    draft = AutoModelForCausalLM.from_pretrained(root / "draft", dtype=torch.float32).to(on_first).eval()
    assert is_split(target)
    whole = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float64).to(on_first).eval()
    on_gpu = greedy_generate(whole, PROMPT, max_new_tokens=NEW_TOKENS).tokens
    assert on_gpu == expected, "fp64 greedy on the GPU should equal the CPU's"
    for gamma in (1, 4):
        assert speculative_generate(target, draft, PROMPT, gamma=gamma, max_new_tokens=NEW_TOKENS).tokens == expected
