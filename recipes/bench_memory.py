"""Peak memory beside time: HF `generate`, spec greedy and spec with the Q4_1 self-draft, each in a process of
its own (peak RSS is a process's high-water mark), on SmolLM2-135M-Instruct fp32 or a random-weight model of
SmolLM2's larger public shapes.

    python recipes/bench_memory.py [--shape 135m|360m|1.7b] [--prompt 700] [--tokens 32] [--threads 1]

Each system decodes the same prompt (the README's prose, cut to --prompt tokens; random ids for the random
shapes) twice: the first call pays the one-time costs (probes, packing, the native library), the second is
timed. Prints seconds of the second call and the process's peak RSS; every system's output is checked
against HF's. The Q4_1 draft runs only on the real model (its GGUF is in the cache: python -m spec.realmodel).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("hf", "spec greedy", "spec + Q4_1 draft")


def model_and_ids(shape: str, prompt: int):
    import torch
    from bench_grid import load     # (the random-weight shapes: one builder, bench_grid's)
    model, tok = load(shape)
    if tok is None:
        return model, None, torch.randint(0, 49152, (1, prompt), generator=torch.Generator().manual_seed(1))
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return model, tok, tok(text, return_tensors="pt").input_ids[:, :prompt]


def child(system: str, shape: str, prompt: int, tokens: int, threads: int) -> dict:
    import torch
    from bench_grid import peak_rss_mb
    from spec import greedy_generate, speculative_generate
    torch.set_num_threads(threads)
    model, tok, ids = model_and_ids(shape, prompt)
    draft = None
    if system == SYSTEMS[2]:
        from spec import realmodel
        from spec.gguf_draft import GGUFDraft
        draft = GGUFDraft(realmodel.gguf_path(), model, tok, threads=threads)

    def run() -> list[int]:
        with torch.inference_mode():
            if system == "hf":
                out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
                return out[0, ids.shape[1]:].tolist()
            if draft is None:
                return greedy_generate(model, ids, max_new_tokens=tokens).tokens
            return speculative_generate(model, draft, ids, gamma=8, max_new_tokens=tokens).tokens
    run()
    t0 = time.perf_counter()
    out = run()
    return {"seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb(),
            "tokens": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("135m", "360m", "1.7b"), default="135m")
    p.add_argument("--prompt", type=int, default=700)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.prompt, args.tokens, args.threads)))
        return 0
    systems = SYSTEMS if args.shape == "135m" else SYSTEMS[:2]
    rows = {}
    for system in systems:
        done = subprocess.run([sys.executable, __file__, "--child", system, "--shape", args.shape, "--prompt",
                               str(args.prompt), "--tokens", str(args.tokens), "--threads", str(args.threads)],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"{system}: failed\n{done.stderr[-2000:]}")
            return 1
        rows[system] = json.loads(done.stdout.strip().splitlines()[-1])
    ref = rows["hf"]
    print(f"{args.shape}, prompt {args.prompt} tokens, {args.tokens} new, {args.threads} thread(s): the second call's "
          f"seconds and the process's peak RSS")
    for system, r in rows.items():
        same = "(reference)" if system == "hf" else "identical" if r["tokens"] == ref["tokens"] else "DIFFERS"
        print(f"  {system:<20} {r['seconds']:7.2f} s  {r['peak_rss_mb']:8.0f} MB  {r['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x "
              f"HF's memory  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
