"""Tree drafts against chains, measured side by side in one run at one CPU thread.

Workloads: the shipped pair (its draft as a chain and as a TreeDraft; prompt lookup as a chain and
as a LookupTree) on the five code prompts, and with `--real` SmolLM2-135M-Instruct (prompt lookup
as a chain and as a LookupTree; a TreeDraft whose draft is SmolLM2 itself, the accepted-length
ceiling of a tree, not a speed-up) on the five seed prompts. For each: seconds (best of
--repeats, each decoder's repeats interleaved with plain greedy's), speed-up over plain greedy,
tokens per target pass, draft tokens (nodes) a round, and whether every output equals greedy's.
No Theorem 3.8 for trees here: a plain measured comparison.

    python recipes/bench_trees.py [--max-new-tokens 128] [--repeats 3] [--real] [--out trees.json]

The JSON is a results file (recipes/docs.py renders docs/BENCHMARKS.md from results/trees.json): per
workload a record per decoder, and a "meta" block (date, machine, commit, versions:
spec.conformance.provenance).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from spec import LookupTree, PromptLookup, TreeDraft, greedy_generate, load_pair, speculative_generate
from spec.conformance import provenance
from spec.models import encode_prompt
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS


def _time(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench(target, ids: list, decoders: dict, max_new_tokens: int, repeats: int) -> dict:
    """{name: record}; "greedy" is the reference every output is compared with."""
    def greedy():
        return [greedy_generate(target, x, max_new_tokens=max_new_tokens) for x in ids]

    def spec(draft, gamma):
        return lambda: [speculative_generate(target, draft, x, gamma=gamma, max_new_tokens=max_new_tokens)
                        for x in ids]
    runs = {"greedy": greedy} | {name: spec(*how) for name, how in decoders.items()}
    for run in runs.values():
        run()                                   # warm-up: probes and first calls, outside the timing
    best: dict = {name: float("inf") for name in runs}
    results: dict = {}
    for _ in range(repeats):
        for name, run in runs.items():          # interleaved: drift on a shared box hits all alike
            seconds, results[name] = _time(run)
            best[name] = min(best[name], seconds)
    reference = [r.tokens for r in results["greedy"]]
    out = {}
    for name, res in results.items():
        rounds = sum(len(r.rounds) for r in res)
        out[name] = {"seconds": round(best[name], 3), "speedup": round(best["greedy"] / best[name], 3),
                     "tokens_per_target_pass": round(sum(len(r.tokens) for r in res) / rounds, 3),
                     "drafted_per_round": round(sum(r.drafted for r in res) / rounds, 3),
                     "accepted_per_round": round(sum(r.accepted for r in res) / rounds, 3),
                     "equal_to_greedy": [r.tokens for r in res] == reference}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--real", action="store_true")
    p.add_argument("--out", default="trees.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report = {"meta": provenance.meta(provenance.recipe_command(__file__, argv)), "threads": 1,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    pair = load_pair()
    ids = [encode_prompt(pair.tokenizer, q) for q in CODE_PROMPTS]
    report["shipped pair"] = bench(pair.target, ids, {
        "draft chain g5": (pair.draft, 5),
        "TreeDraft b2 n10 g5": (TreeDraft(pair.draft, branches=2, nodes=10), 5),
        "TreeDraft b3 n12 g4": (TreeDraft(pair.draft, branches=3, nodes=12), 4),
        "PromptLookup g8": (PromptLookup(), 8),
        "LookupTree b3 n16 g8": (LookupTree(branches=3, nodes=16), 8),
    }, args.max_new_tokens, args.repeats)
    if args.real:
        from spec import realmodel
        model, tok = realmodel.load()
        ids = [encode_prompt(tok, q, chat=True) for q in SEED_PROMPTS]
        report["smollm2"] = bench(model, ids, {
            "PromptLookup g8": (PromptLookup(), 8),
            "LookupTree b3 n16 g8": (LookupTree(branches=3, nodes=16), 8),
            "LookupTree b5 n24 g8": (LookupTree(branches=5, nodes=24), 8),
        }, args.max_new_tokens, args.repeats)
    for workload, rows in report.items():
        if workload != "meta" and isinstance(rows, dict):
            print(f"\n{workload}")
            for name, r in rows.items():
                print(f"  {name:24s} {r['seconds']:8.2f} s  x{r['speedup']:.2f}  tokens/pass "
                      f"{r['tokens_per_target_pass']:.2f}  drafted/round {r['drafted_per_round']:.2f}  "
                      f"exact {r['equal_to_greedy']}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
