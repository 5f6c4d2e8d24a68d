"""SmolLM2-135M-Instruct fp32 (PyTorch, 1 thread) with its own Q4_1 GGUF drafting in llama.cpp (1 thread):
per seed prompt, back to back, greedy and speculative at gamma 2..8 and "auto"; per gamma: the measured
speedup over greedy (total times), alpha, tokens/round, c (draft time per drafted token over greedy's time
per token), and Theorem 3.8 flat and with the verify pass priced (spec.experiment.measure.verify_line).
Needs the `llama` extra and the model in the cache (`python -m spec.realmodel`).

  OMP_NUM_THREADS=1 python recipes/bench_gguf_draft.py [--tokens 128] [--gammas 2,3,4,5,6,8,auto]
"""

from __future__ import annotations

import argparse

import torch

from spec import clock, greedy_generate, realmodel, speculative_generate, theory
from spec.gguf_draft import GGUFDraft
from spec.experiment.measure import verify_line
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--gammas", default="2,3,4,5,6,8,auto")
    args = p.parse_args()
    gammas = [g if g == "auto" else int(g) for g in args.gammas.split(",")]
    torch.set_num_threads(1)
    target, tok = realmodel.load(say=lambda m: None)
    draft = GGUFDraft(realmodel.gguf_path(), target, tok)
    prompts = [encode_prompt(tok, text) for text in SEED_PROMPTS]
    eos = tok.eos_token_id
    speculative_generate(target, draft, prompts[0], gamma=4, max_new_tokens=8)   # warm-up
    line = verify_line(target, prompts[0], max_gamma=8)
    greedy_s, tokens, spec_s, runs = 0.0, 0, {g: 0.0 for g in gammas}, {g: [] for g in gammas}
    for ids in prompts:
        g_out, t = clock.timed(lambda: greedy_generate(target, ids, max_new_tokens=args.tokens, eos_token_id=eos))
        greedy_s, tokens = greedy_s + t, tokens + len(g_out.tokens)
        for gamma in gammas:
            out, t = clock.timed(lambda: speculative_generate(target, draft, ids, gamma=gamma,
                                                              max_new_tokens=args.tokens, eos_token_id=eos,
                                                              trace=True))
            assert out.tokens == g_out.tokens, f"gamma {gamma}: output differs from greedy"
            spec_s[gamma] += t
            runs[gamma].append(out)
    step = greedy_s / tokens
    print(f"target step {step * 1e3:.1f} ms; verify pass of g+1 tokens = {line.fixed:.2f} + {line.slope:.3f} g steps")
    print("| gamma | speedup | alpha | tokens/round | c | Thm 3.8 flat | Thm 3.8 priced |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gamma in gammas:
        rs = runs[gamma]
        acc = [a for r in rs for a in r.accepted_per_round]
        dra = [d for r in rs for d in r.drafted_per_round]
        alpha = theory.alpha_from_accepted(acc, dra)
        c = sum(t.draft_s for r in rs for t in r.trace) / sum(dra) / step
        per_round = sum(len(r.tokens) for r in rs) / sum(len(r.rounds) for r in rs)
        g = gamma if gamma != "auto" else round(sum(dra) / len(dra))
        a = min(alpha, 0.999)
        flat = theory.expected_speedup(a, g, c)
        priced = theory.expected_speedup_costed(a, g, c, verify_slope=line.slope, verify_fixed=line.fixed)
        label = gamma if gamma != "auto" else f"auto (mean {sum(dra) / len(dra):.1f})"
        print(f"| {label} | {greedy_s / spec_s[gamma]:.2f}x | {alpha:.3f} | {per_round:.2f} | {c:.3f} | "
              f"{flat:.2f}x | {priced:.2f}x |")
    print(f"all outputs identical to greedy ({len(prompts)} prompts x {len(gammas)} settings)")


if __name__ == "__main__":
    main()
