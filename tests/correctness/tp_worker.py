"""One rank of tests/correctness/test_tensor_parallel.py, started by `torchrun --nproc-per-node 2`.

    torchrun --standalone --nproc-per-node 2 tests/correctness/tp_worker.py JOB.json OUT_DIR

For every case in JOB.json: the target is loaded split over the group (spec.models.load_model
with tp_size, i.e. transformers' DistributedConfig), the draft whole on this rank, and
spec.speculative_generate runs on every prompt and gamma, greedy and sampled (a generator seeded
the same on every rank). Then the calls spec must refuse on a split target, and, if the job names
one, the CLI (`python -m spec ... --tp 2`) in the same process group. Each rank writes what it got
to OUT_DIR/rank{R}.json; the test compares every rank with single-process greedy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spec import greedy_generate, speculative_generate
from spec.models import load_model
from spec.parallel import describe

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def run_case(case: dict) -> dict:
    target, _ = load_model(case["target"], dtype=DTYPES[case["dtype"]], role="target", tp_size=2)
    draft, _ = load_model(case["draft"], dtype=torch.float32, role="draft")
    out = {"split": describe(target), "speculative": {}, "greedy": [], "sampled": []}
    for p, prompt in enumerate(case["prompts"]):
        out["greedy"].append(greedy_generate(target, prompt, max_new_tokens=case["new_tokens"]).tokens)
        for gamma in case["gammas"]:
            result = speculative_generate(target, draft, prompt, gamma=gamma, max_new_tokens=case["new_tokens"])
            out["speculative"][f"{p}/{gamma}"] = result.tokens
        sampled = speculative_generate(target, draft, prompt, gamma=4, max_new_tokens=case["new_tokens"],
                                       do_sample=True, generator=torch.Generator().manual_seed(p))
        out["sampled"].append(sampled.tokens)
    out["refused"] = refusals(target, draft, case["prompts"][0])
    return out


def refusals(target, draft, prompt: list[int]) -> dict:
    """The message of each call spec must refuse on a split target (None: it was not refused)."""
    rank = dist.get_rank()
    calls = {
        "gamma auto": lambda: speculative_generate(target, draft, prompt, gamma="auto", max_new_tokens=4),
        "prompt differs": lambda: speculative_generate(target, draft, prompt + [rank + 3], max_new_tokens=4),
        "seed differs": lambda: speculative_generate(target, draft, prompt, max_new_tokens=4, do_sample=True,
                                                     generator=torch.Generator().manual_seed(rank)),
        "split draft compiled": lambda: speculative_generate(target, target, prompt, max_new_tokens=4,
                                                             draft_impl="compiled"),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except ValueError as err:
            found[name] = str(err)
    return found


def run_cli(argv: list[str], out_dir: str) -> dict:
    """`python -m spec ... --tp 2` in this process group: what this rank printed, and its exit status."""
    import contextlib
    import io

    from spec.__main__ import main as cli
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        status = cli([*argv, "--out", str(Path(out_dir, "cli")), "--no-plots"])
    return {"status": status, "stdout": printed.getvalue(), "stderr": errors.getvalue()}


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    results = {case["name"]: run_case(case) for case in job["cases"]}
    if job.get("cli"):
        results["cli"] = run_cli(job["cli"], out_dir)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
