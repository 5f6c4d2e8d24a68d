"""The seed experiment on the shipped pair as a results file: `python -m spec --peer hf --threads 1` at each
`--gammas` value (the CLI's default gamma 5, and `auto`), one run after the other, each in its own process.

Each run is the README's command with HF assisted generation timed beside it (5 code prompts x 128 tokens;
greedy, speculative and HF assisted generation alternate prompt by prompt, `--repeats` times). What it keeps
of each run's results.json: the summary (measured speedup, per-prompt range, HF assisted over greedy, ours
over HF, alpha, c, Theorem 3.8 plain and with the verify pass at its measured cost, whether every output
equals greedy's; c and the verify pass's cost from the timed runs, and Theorem 3.8 with them) and the
per-prompt speedups; tokens and traces are left out. recipes/docs.py renders
docs/BENCHMARKS.md's seed-experiment table from results/seed.json.

    python recipes/bench_seed.py [--gammas 5 auto] [--repeats 3] [--out results/seed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from spec.conformance import provenance

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = ("gamma", "gamma_option", "alpha", "accept_rate", "c", "tokens_per_round", "measured_speedup",
                "speedup_min", "speedup_max", "repeat_speedups", "hf_speedup", "ours_vs_hf", "peer_gamma",
                "all_identical", "ties", "failures", "threads", "draft_impl", "greedy_s", "spec_s", "in_run",
                "optimal_gamma", "optimal_predicted_speedup")


def run(gamma: str, repeats: int, threads: int) -> dict:
    """One `python -m spec --peer hf` run in a child process: its command and the parts of results.json kept."""
    with tempfile.TemporaryDirectory(prefix="spec-seed-") as tmp:
        argv = ["--peer", "hf", "--threads", str(threads), "--repeats", str(repeats), "--no-plots", "--quiet",
                "--out", tmp] + ([] if gamma == "default" else ["--gamma", gamma])
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
        done = subprocess.run([sys.executable, "-m", "spec", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise SystemExit(f"python -m spec {' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        results = json.loads((Path(tmp) / "results.json").read_text())
    summary = results["summary"]
    keep = {k: summary.get(k) for k in SUMMARY_KEYS}
    keep["theory"] = {k: v for k, v in summary.items() if k.startswith("predicted") or k.startswith("measured_over")}
    keep["warnings"] = results.get("warnings", [])
    keep["per_prompt"] = [{"speedup": p["speedup"], "identical": p["ids_identical"], "alpha": p["alpha"]}
                          for p in results.get("prompts", [])]
    argv_shown = [a for a in argv if a not in ("--no-plots", "--quiet", "--out", tmp)]
    return {"command": "python -m spec " + " ".join(argv_shown), "summary": keep}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gammas", nargs="+", default=["default", "auto"],
                   help="gamma per run: 'default' (the CLI's, spec.defaults.DEFAULT_GAMMA), a number or 'auto'")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("seed.json"))
    args = p.parse_args(argv)
    runs = [run(g, args.repeats, args.threads) for g in args.gammas]
    for r in runs:
        s = r["summary"]
        print(f"{r['command']}: gamma {s['gamma']}, {s['measured_speedup']:.2f}x over greedy, HF assisted "
              f"{s['hf_speedup']:.2f}x, ours/HF {s['ours_vs_hf']:.2f}x, identical {s['all_identical']}", flush=True)
    out = {"meta": provenance.meta(provenance.recipe_command(__file__, argv)), "runs": runs}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
