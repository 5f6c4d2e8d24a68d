"""Time per token against sequence length for a state-snapshot target (a Mamba2), at one CPU thread.

A recurrent state cannot be cropped, so after a rejected round spec restores a copy of the state
and re-feeds tokens. If what is re-fed grows with the sequence, so does the time per token; this
run shows whether it does. The target is a seeded random Mamba2 (4 layers x 256, fp32, built from
config); the draft a seeded random 1-layer GPT-NeoX of the same vocabulary, which almost never
agrees with it: every round is rejected, the worst case for the rollback. Greedy decoding of the
same target runs alongside as the flat line to compare with. Per window of the output it prints
milliseconds per new token and the target tokens fed per new token (a spy on spec.hf.step).

    python recipes/bench_snapshot_cost.py --max-new-tokens 512 --window 64 [--out snapshot-cost.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import statistics
import time
from pathlib import Path

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

from spec import build_gpt_neox, greedy_generate, runner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # run from the source checkout
from fedcount import fed_per_round  # noqa: E402

VOCAB = 512


def mamba2(seed: int = 0) -> Mamba2ForCausalLM:
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64,
                       expand=2, n_groups=1, state_size=16, chunk_size=64, pad_token_id=0, bos_token_id=0,
                       eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Mamba2ForCausalLM(cfg).eval()


def counted_run(target, draft, prompt, **kwargs):
    """speculative_generate, traced, with the target's feeds counted (tests/fedcount.py)."""
    return fed_per_round(target, draft, prompt, trace=True, **kwargs)


def per_window(result, window: int, fed: list[int] | None = None) -> list[dict]:
    """Per window of new tokens: ms per token and target tokens fed per token."""
    rows, pos, bucket = [], 0, {}
    for r, f in zip(result.rounds, fed or [None] * len(result.rounds)):
        b = bucket.setdefault(pos // window, {"s": 0.0, "tokens": 0, "fed": 0})
        b["s"] += r.draft_s + r.verify_s
        b["tokens"] += r.emitted
        b["fed"] += f or 0
        pos += r.emitted
    for w in sorted(bucket):
        b = bucket[w]
        rows.append({"from": w * window, "to": min((w + 1) * window, pos), "ms_per_token": 1e3 * b["s"] / b["tokens"],
                     "fed_per_token": b["fed"] / b["tokens"] if fed else None})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    target = mamba2()
    draft = build_gpt_neox("tiny-draft", seed=1, vocab_size=VOCAB)
    prompt = torch.arange(1, 9)
    print(f"target path: {runner.path_of(target)}", flush=True)

    greedy_rows, spec_rows, fed, accepted = [], [], None, None
    ref = greedy_generate(target, prompt, max_new_tokens=args.max_new_tokens).tokens
    for _ in range(args.repeats):
        g = greedy_generate(target, prompt, max_new_tokens=args.max_new_tokens, trace=True)
        greedy_rows.append(per_window(g, args.window))
        s, fed = counted_run(target, draft, prompt, gamma=args.gamma, max_new_tokens=args.max_new_tokens)
        assert s.tokens == ref, "speculative output differs from greedy"
        accepted = s.accepted
        spec_rows.append(per_window(s, args.window, fed))

    med = lambda runs, i, key: statistics.median(run[i][key] for run in runs)  # noqa: E731
    print(f"gamma {args.gamma}, {args.max_new_tokens} new tokens, accepted {accepted} of "
          f"{s.drafted} drafted; target fed {sum(fed)} tokens in all; "
          f"median of {args.repeats} runs")
    print(f"{'new tokens':>12} {'greedy ms/tok':>14} {'spec ms/tok':>12} {'target fed/tok':>15}")
    table = []
    for i, row in enumerate(spec_rows[0]):
        line = {"from": row["from"], "to": row["to"], "greedy_ms": med(greedy_rows, i, "ms_per_token"),
                "spec_ms": med(spec_rows, i, "ms_per_token"), "fed_per_token": row["fed_per_token"]}
        table.append(line)
        print(f"{line['from']:>5}-{line['to']:<6} {line['greedy_ms']:>14.2f} {line['spec_ms']:>12.2f} "
              f"{line['fed_per_token']:>15.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gamma": args.gamma,
                       "max_new_tokens": args.max_new_tokens, "accepted": accepted, "fed": sum(fed),
                       "windows": table}, f, indent=1)


if __name__ == "__main__":
    main()
