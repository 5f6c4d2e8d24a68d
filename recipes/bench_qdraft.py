"""The Q4_1 self-draft on spec.cpu.qdraft's kernel against the same file in llama.cpp (issue 43).

1. The draft alone, same process, one thread: a 10-token prefill, then `--steps` one-token steps on each
   engine (ms a step), a 40-token prefill on each, and how often the two engines' argmax agree along
   llama.cpp's own greedy continuation (and their largest logit difference).
2. End to end on SmolLM2-135M-Instruct fp32 (one thread, seed prompts chat-formatted, `--tokens` new
   tokens, systems interleaved prompt by prompt): spec greedy, llama.cpp f32 greedy (the Q4_1 file
   dequantized, the fp32 weights), spec + the Q4_1 draft on spec.cpu.qdraft at each `--gammas`, and on
   llama.cpp at `--llama-gamma`; ms per new token (median over prompts), ratios, rounds per prompt, and
   every output checked against spec greedy.

    python recipes/bench_qdraft.py [--steps 50] [--prefill 40,700] [--tokens 64] [--prompts 5] [--gammas 6,8,10,12] [--llama-gamma 6]
Needs the `llama` extra (for the comparison) and the real model (python -m spec.realmodel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec  # noqa: E402
from spec import realmodel  # noqa: E402
from spec.cpu import qdraft  # noqa: E402
from spec.gguf_draft import GGUFDraft, LlamaRun  # noqa: E402
from spec.models import encode_prompt  # noqa: E402
from spec.prompts import SEED_PROMPTS  # noqa: E402
from bench_cpu_limit import f32_gguf, llama, llama_greedy  # noqa: E402


def draft_alone(path: Path, steps: int, prefills: list[int]) -> None:
    native, ref = qdraft.QuantRun(path), LlamaRun(path, threads=1)
    ids = torch.tensor([1, 504, 3458, 314, 253, 1345, 28, 339, 2365, 253])
    a, b = native(ids, keep=1), ref(ids, keep=1)
    agree, worst = int(a.argmax() == b.argmax()), float((a - b).abs().max())
    for _ in range(39):
        nxt = torch.tensor([int(b.argmax())])
        a, b = native(nxt), ref(nxt)
        agree, worst = agree + int(a.argmax() == b.argmax()), max(worst, float((a - b).abs().max()))
    print(f"argmax equal on {agree} of 40 positions; largest logit difference {worst:.3g} (llama.cpp's logit std "
          f"{float(b.std()):.3g})")
    for name, run in (("spec.cpu.qdraft", native), ("llama.cpp", ref)):
        t0 = time.perf_counter()
        for _ in range(steps):
            run(torch.tensor([5]))
        step = (time.perf_counter() - t0) / steps
        times = []
        for n in prefills:
            run.crop(0)
            t0 = time.perf_counter()
            run(torch.randint(0, 40000, (n,), generator=torch.Generator().manual_seed(0)), keep=1)
            times.append(f"{n} tokens {1e3 * (time.perf_counter() - t0):.0f} ms")
        print(f"{name}: one-token step {1e3 * step:.2f} ms; prefill of {', '.join(times)}")
    ref.close()


def end_to_end(args, path: Path) -> None:
    target, tok = realmodel.load(say=lambda m: None)
    native = GGUFDraft(path, target, tok, engine="native")
    on_llama = GGUFDraft(path, target, tok, engine="llama.cpp", threads=1)
    llm = llama(f32_gguf(), 1)
    prompts = [encode_prompt(tok, t, chat=True) for t in SEED_PROMPTS[:args.prompts]]
    N = args.tokens

    def speculative(draft, g):
        return lambda ids: spec.speculative_generate(target, draft, torch.tensor(ids), gamma=g, max_new_tokens=N)
    systems = {"spec greedy": lambda ids: spec.greedy_generate(target, torch.tensor(ids), max_new_tokens=N),
               "llama.cpp f32 greedy": lambda ids: llama_greedy(llm, ids, N)}
    for g in args.gammas:
        systems[f"spec + Q4_1 draft, spec.cpu.qdraft, gamma {g}"] = speculative(native, g)
    systems[f"spec + Q4_1 draft, llama.cpp, gamma {args.llama_gamma}"] = speculative(on_llama, args.llama_gamma)
    for f in systems.values():
        f(prompts[0])
    times: dict = {k: [] for k in systems}
    rounds: dict = {k: [] for k in systems}
    same: dict = {k: 0 for k in systems}
    for i, ids in enumerate(prompts):
        names = list(systems)[i % len(systems):] + list(systems)[:i % len(systems)]
        outs = {}
        for k in names:
            t0 = time.perf_counter()
            out = systems[k](ids)
            times[k].append((time.perf_counter() - t0) / N)
            outs[k] = out if isinstance(out, list) else out.tokens
            if hasattr(out, "rounds") and k != "spec greedy":
                rounds[k].append(len(out.rounds))
        for k in systems:
            same[k] += outs[k] == outs["spec greedy"]
    g, lf = statistics.median(times["spec greedy"]), statistics.median(times["llama.cpp f32 greedy"])
    print(f"\n{len(prompts)} prompts x {N} new tokens, one thread")
    print("| system | ms/token (median) | x spec greedy | x llama.cpp f32 greedy | rounds per prompt | output vs spec greedy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in times.items():
        m = statistics.median(v)
        r = f"{min(rounds[k])}-{max(rounds[k])}" if rounds[k] else "-"
        print(f"| {k} | {1e3 * m:.1f} | {g / m:.2f} | {lf / m:.2f} | {r} | {same[k]}/{len(prompts)} identical |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")], default=[40],
                   help="prompt lengths whose prefill is timed on each engine (default 40; e.g. 40,700,2000)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--gammas", type=lambda s: [int(x) for x in s.split(",")], default=[6, 8, 10, 12])
    p.add_argument("--llama-gamma", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    if qdraft.library() is None:
        sys.exit(f"spec.cpu.qdraft cannot run here: {qdraft.reason()}")
    path = realmodel.fetch()
    draft_alone(path, args.steps, args.prefill)
    end_to_end(args, path)


if __name__ == "__main__":
    main()
