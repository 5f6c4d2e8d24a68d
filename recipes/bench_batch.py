"""Batched speculative decoding against batched greedy, batch sizes 1 to 16, on the shipped pair.

For each batch size B the same B prompts (the shipped pair's code prompts, cycled) are decoded by
`greedy_generate` and `speculative_generate` as one batch, alternating, `--repeats` times each;
EOS is ignored, so every row makes `--max-new-tokens` tokens. Printed per B: tokens per second of
both, the speedup (greedy time / speculative time, medians), alpha (capped-geometric MLE over all
rows' rounds), c at that batch size (one batched draft step / one batched target step, each on a
cache holding the prompts), the cost of a batched verify pass (gamma + 1 tokens a row) in batched
target steps, and the predicted speedup: Theorem 3.8 from that alpha, gamma and c (a verify pass
priced as one step, as on a GPU where a pass is bound by reading the weights), and the same with
the verify pass at its measured cost (on a CPU a pass costs in proportion to the tokens it computes,
and a batch multiplies them).

    python recipes/bench_batch.py [--sizes 1 2 4 8 16] [--max-new-tokens 64] [--gamma 5] [--threads 1]
                                  [--repeats 3] [--out batch.json]

The JSON is a results file (recipes/docs.py renders docs/BENCHMARKS.md from results/batch.json): the
settings, a row per batch size and a "meta" block (date, machine, commit, versions:
spec.conformance.provenance).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from spec import clock, defaults, experiment, greedy_generate, load_pair, speculative_generate, theory
from spec.conformance import provenance
from spec.experiment.measure import batch_step_time


def one_size(pair, prompts: list[list[int]], *, gamma: int, max_new_tokens: int, repeats: int) -> dict:
    runs = {"greedy": [], "spec": []}
    rounds = []
    for _ in range(repeats):
        t0 = clock.now()
        greedy_generate(pair.target, prompts, max_new_tokens=max_new_tokens)
        runs["greedy"].append(clock.now() - t0)
        t0 = clock.now()
        out = speculative_generate(pair.target, pair.draft, prompts, gamma=gamma, max_new_tokens=max_new_tokens)
        runs["spec"].append(clock.now() - t0)
        rounds = [(r.accepted_per_round, r.drafted_per_round) for r in out]
    accepted = [k for acc, _ in rounds for k in acc]
    drafted = [g for _, g in rounds for g in g]
    alpha = theory.alpha_from_accepted(accepted, drafted)
    target_step = batch_step_time(pair.target, prompts)
    c = batch_step_time(pair.draft, prompts) / target_step
    verify = batch_step_time(pair.target, prompts, tokens=gamma + 1) / target_step   # a verify pass, in steps
    greedy_s, spec_s = statistics.median(runs["greedy"]), statistics.median(runs["spec"])
    tokens = len(prompts) * max_new_tokens
    return dict(batch=len(prompts), greedy_tok_s=tokens / greedy_s, spec_tok_s=tokens / spec_s,
                speedup=greedy_s / spec_s, alpha=alpha, c=c, verify=verify,
                predicted=theory.expected_speedup(alpha, gamma, c),
                predicted_costed=theory.expected_speedup_costed(alpha, gamma, c, verify_fixed=verify),
                greedy_s=runs["greedy"], spec_s=runs["spec"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=defaults.DEFAULT_GAMMA)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    pair = load_pair()
    texts = experiment.prompts(pair, "shipped", max_new_tokens=opts.max_new_tokens, ignore_eos=True).ids
    rows = []
    print("| B | greedy tok/s | speculative tok/s | speedup | alpha | c | verify pass (steps) | Theorem 3.8 "
          "| Theorem 3.8, verify priced |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in opts.sizes:
        prompts = [list(texts[i % len(texts)]) for i in range(size)]
        speculative_generate(pair.target, pair.draft, prompts, gamma=opts.gamma, max_new_tokens=8)   # warm-up, probes
        r = one_size(pair, prompts, gamma=opts.gamma, max_new_tokens=opts.max_new_tokens, repeats=opts.repeats)
        rows.append(r)
        print(f"| {size} | {r['greedy_tok_s']:.0f} | {r['spec_tok_s']:.0f} | {r['speedup']:.2f}x | {r['alpha']:.2f} "
              f"| {r['c']:.3f} | {r['verify']:.2f} | {r['predicted']:.2f}x | {r['predicted_costed']:.2f}x |", flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(meta=provenance.meta(provenance.recipe_command(__file__, argv)), settings=vars(opts),
                           rows=rows), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
