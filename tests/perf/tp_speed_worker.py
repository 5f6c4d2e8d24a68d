"""One rank of tests/perf/test_gpu_speed.py::test_tensor_parallel_target_speedup, started by
`torchrun --nproc-per-node N` on a machine with N GPUs (NCCL).

    torchrun --standalone --nproc-per-node N tests/perf/tp_speed_worker.py JOB.json OUT_DIR

The target is split over the N GPUs (spec.models.load_pair with tp_size=N), the draft whole on
each rank's GPU. Greedy and speculative decoding alternate prompt by prompt, `repeats` times, each
timed with the GPU synchronised; every rank writes its tokens and times to OUT_DIR/rank{R}.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spec import greedy_generate, speculative_generate
from spec.clock import timed
from spec.experiment.measure import cost_ratio
from spec.models import load_pair
from spec.parallel import describe


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    pair = load_pair(job["target"], job["draft"], device=job.get("device", "cuda"), target_dtype=getattr(torch, job["target_dtype"]),
                     draft_dtype=getattr(torch, job["draft_dtype"]), tp_size=int(os.environ["WORLD_SIZE"]))
    target, draft, n, gamma = pair.target, pair.draft, job["new_tokens"], job["gamma"]
    device = next(target.parameters()).device
    speculative_generate(target, draft, job["prompts"][0], gamma=gamma, max_new_tokens=16)  # warm-up
    costs = cost_ratio(target, draft, job["prompts"][0])
    out = {"split": describe(target), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, "c": costs.c,
           "outputs": [], "greedy_s": [], "spec_s": [], "accepted": [], "drafted": []}
    for _ in range(job["repeats"]):
        g_row, s_row = [], []
        for prompt in job["prompts"]:
            _, g_s = timed(lambda p=prompt: greedy_generate(target, p, max_new_tokens=n), device)
            _, s_s = timed(lambda p=prompt: speculative_generate(target, draft, p, gamma=gamma, max_new_tokens=n),
                           device)
            g_row.append(g_s)
            s_row.append(s_s)
        out["greedy_s"].append(g_row)
        out["spec_s"].append(s_row)
    for prompt in job["prompts"]:
        ref = greedy_generate(target, prompt, max_new_tokens=n).tokens
        s = speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=n)
        out["outputs"].append([ref, s.tokens])
        out["accepted"] += s.accepted_per_round
        out["drafted"] += s.drafted_per_round
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
