"""Side-by-side timing on SmolLM2-135M-Instruct (spec.realmodel) at one CPU thread: plain greedy,
spec's prompt-lookup draft, and HF prompt lookup at two settings, per prompt back to back, on the
five seed prompts with and without the chat template. Writes a JSON of every record.

    python recipes/bench_realmodel.py --max-new-tokens 128 --out bench-real.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from spec import PromptLookup, realmodel, theory
from spec.experiment.measure import verify_line
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--out", default="bench-real.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = realmodel.load()
    hf_settings = [(args.gamma, 3), (10, 2)]  # ours' settings; HF's documented example setting
    line = verify_line(model, encode_prompt(tok, SEED_PROMPTS[0]), max_gamma=16)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": 1, "gamma": args.gamma,
           "max_new_tokens": args.max_new_tokens, "hf_settings": hf_settings,
           "verify_line": {"fixed": line.fixed, "slope": line.slope, "measured": line.measured}, "runs": {}}
    for chat in (False, True):
        ids = [encode_prompt(tok, q, chat=chat) for q in SEED_PROMPTS]
        realmodel.compare(model, ids[:1], max_new_tokens=8, gamma=args.gamma, eos=None)  # warm-up
        records = realmodel.compare(model, ids, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                                    eos=tok.eos_token_id, draft=PromptLookup(), hf_lookup=hf_settings,
                                    say=lambda m: print(("chat " if chat else "raw ") + m, flush=True))
        for r in records:
            r.pop("greedy_tokens"), r.pop("spec_tokens")
            for h in r["hf_lookups"]:
                h.pop("tokens")
        out["runs"]["chat" if chat else "raw"] = records
        g = sum(r["greedy_s"] for r in records)
        acc = [k for r in records for k in r["accepted_per_round"]]
        dra = [d for r in records for d in r["drafted_per_round"]]
        summary = {"ours": g / sum(r["spec_s"] for r in records),
                   "identical": all(r["identical"] for r in records),
                   "hf": [g / sum(r["hf_lookups"][j]["s"] for r in records) for j in range(len(hf_settings))],
                   "hf_identical": [all(r["hf_lookups"][j]["identical"] for r in records)
                                    for j in range(len(hf_settings))],
                   "alpha": theory.alpha_from_accepted(acc, dra) if sum(dra) else None,
                   "tokens_per_round": sum(r["new_tokens"] for r in records) / sum(r["rounds"] for r in records),
                   "rounds_drafting": sum(d > 0 for d in dra) / len(dra),
                   "new_tokens": sum(r["new_tokens"] for r in records),
                   "predicted": realmodel.predicted_speedup(records, line.fixed, line.slope),
                   "predicted_flat": realmodel.predicted_speedup(records, 1.0, 0.0),
                   "per_prompt": [r["speedup"] for r in records]}
        out["runs"][("chat" if chat else "raw") + "_summary"] = summary
        print(json.dumps(summary), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
