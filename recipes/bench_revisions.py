"""Single-prompt speed of this checkout against another git revision, in one run.

A restructuring of the decode loop must not cost speed at batch size 1. This recipe exports the
`spec/` package of `--base` (default: the parent commit) into a temporary folder and times the
same workloads with both, alternating revision by revision and repeat by repeat (each repeat a
fresh process per revision, so neither gets a warmer process), so that drift on a shared machine
hits both. Per workload it prints the median seconds of each revision and their ratio (this
checkout / base: below 1 is faster), and checks the two revisions' outputs are identical.

Workloads (1 thread, the API's defaults otherwise): the shipped pair, speculative (gamma 5) and greedy, 5 code
prompts x 128 tokens; with `--real`, SmolLM2-135M-Instruct fp32 (`python -m spec.realmodel`
first) with prompt lookup (gamma 8) and greedy, 5 seed prompts x 128 tokens.

    python recipes/bench_revisions.py [--base 071f4fe] [--repeats 5] [--real] [--out revisions.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a child process with the revision's spec first on sys.path: time every workload once
# after a warm-up pass, print {workload: [seconds, tokens]} as JSON.
CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import spec
from spec import PromptLookup, greedy_generate, load_pair, speculative_generate
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS
assert spec.__file__.startswith(sys.argv[1]), spec.__file__
real, max_new = sys.argv[2] == "1", 128
if real:
    from spec import realmodel
    target, tokenizer = realmodel.load(say=lambda *a: None)
    pairs = {"smollm2 prompt lookup g8": (target, PromptLookup(), 8), "smollm2 greedy": (target, None, 0)}
    prompts = SEED_PROMPTS
else:
    pair = load_pair()
    target, tokenizer = pair.target, pair.tokenizer
    pairs = {"pair speculative g5": (target, pair.draft, 5), "pair greedy": (target, None, 0)}
    prompts = CODE_PROMPTS
ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
out = {}
for name, (model, draft, gamma) in pairs.items():
    def run():
        if draft is None:
            return [greedy_generate(model, x, max_new_tokens=max_new).tokens for x in ids]
        return [speculative_generate(model, draft, x, gamma=gamma, max_new_tokens=max_new).tokens for x in ids]
    run()                                   # warm-up: probes, first-call costs
    t0 = time.perf_counter()
    tokens = run()
    out[name] = [time.perf_counter() - t0, tokens]
print(json.dumps(out))
"""


def export(rev: str, into: Path) -> Path:
    """`spec/` as of `rev`, unpacked under `into` (an importable folder)."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "spec"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def time_once(where: Path, real: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(where), OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(where), "1" if real else "0"], env=env, cwd=where,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead of the shipped pair")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spec-revisions-") as tmp:
        sides = {"base": export(args.base, Path(tmp) / "base"), "head": ROOT}
        times: dict = {side: {} for side in sides}
        outputs: dict = {}
        for _ in range(args.repeats):
            for side, where in sides.items():
                for name, (seconds, tokens) in time_once(where, args.real).items():
                    times[side].setdefault(name, []).append(seconds)
                    outputs.setdefault(name, {})[side] = tokens
    rows = {}
    print(f"{'workload':28s} {'base s':>8s} {'head s':>8s} {'head/base':>10s}  outputs")
    for name in times["head"]:
        base, head = statistics.median(times["base"][name]), statistics.median(times["head"][name])
        same = outputs[name]["base"] == outputs[name]["head"]
        rows[name] = dict(base_s=times["base"][name], head_s=times["head"][name], ratio=head / base, identical=same)
        print(f"{name:28s} {base:8.3f} {head:8.3f} {head / base:10.3f}  {'identical' if same else 'DIFFER'}")
    if args.out:
        args.out.write_text(json.dumps(dict(base=args.base, repeats=args.repeats, workloads=rows), indent=1))


if __name__ == "__main__":
    main()
