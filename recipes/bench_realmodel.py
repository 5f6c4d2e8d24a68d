"""Side-by-side timing on SmolLM2-135M-Instruct (spec.realmodel) at one CPU thread: plain greedy,
spec's prompt-lookup draft, and HF prompt lookup at two settings, per prompt back to back, on the
five seed prompts with and without the chat template. Writes a JSON of every record.

    python recipes/bench_realmodel.py --max-new-tokens 128 --out bench-real.json

The JSON carries a "meta" block (date, machine, commit, versions: spec.conformance.provenance), as every
results file of recipes/ does.
"""

from __future__ import annotations

import argparse
import json

import torch

from spec import PromptLookup, defaults, experiment, realmodel
from spec.conformance import provenance
from spec.experiment.measure import verify_line
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=defaults.REAL_GAMMA["lookup"])
    p.add_argument("--out", default="bench-real.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = realmodel.load()
    hf_settings = [(args.gamma, 3), (10, 2)]  # ours' settings; HF's documented example setting
    line = verify_line(model, encode_prompt(tok, SEED_PROMPTS[0]), max_gamma=16)
    out = {"meta": provenance.meta(provenance.recipe_command(__file__)), "threads": 1, "gamma": args.gamma,
           "max_new_tokens": args.max_new_tokens, "hf_settings": hf_settings,
           "verify_line": {"fixed": line.fixed, "slope": line.slope, "measured": line.measured}, "runs": {}}
    for chat in (False, True):
        ids = [encode_prompt(tok, q, chat=chat) for q in SEED_PROMPTS]
        records = _records(model, ids[:1], 8, args.gamma, None, [])  # warm-up
        records = _records(model, ids, args.max_new_tokens, args.gamma, tok.eos_token_id, hf_settings,
                           say=lambda m: print(("chat " if chat else "raw ") + m, flush=True))
        rows = [r.to_json() for r in records]   # the records python -m spec writes, tokens left out
        for r in rows:
            for key in ("greedy_tokens", "spec_tokens", "text", "peer"):
                r.pop(key)
            for p in r["peers"]:
                p.pop("tokens")
        out["runs"]["chat" if chat else "raw"] = rows
        g = sum(r.greedy_s for r in records)
        alpha, _, per_round = experiment.pooled(records)
        dra = [d for r in records for d in r.spec.drafted_per_round]
        summary = {"ours": g / sum(r.spec_s for r in records),
                   "identical": all(r.identical for r in records),
                   "hf": [g / sum(r.peers[j].s for r in records) for j in range(len(hf_settings))],
                   "hf_identical": [all(r.peers[j].identical for r in records) for j in range(len(hf_settings))],
                   "alpha": alpha, "tokens_per_round": per_round,
                   "rounds_drafting": sum(d > 0 for d in dra) / len(dra),
                   "new_tokens": sum(len(r.spec.tokens) for r in records),
                   "predicted": experiment.predicted_speedup(records, line.fixed, line.slope),
                   "predicted_flat": experiment.predicted_speedup(records, 1.0, 0.0),
                   "per_prompt": [r.speedup for r in records]}
        out["runs"][("chat" if chat else "raw") + "_summary"] = summary
        print(json.dumps(summary), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def _records(model, ids, max_new_tokens, gamma, eos, hf_settings, say=lambda m: None):
    """Per prompt, once, side by side: greedy, our prompt lookup, HF prompt lookup at each setting
    (spec.experiment's steps, as `python -m spec --real` runs them)."""
    peers, settings = experiment.lookup_peers(model, hf_settings, max_new_tokens=max_new_tokens, eos=eos)
    runs = experiment.time_runs(model, PromptLookup(), ids, gamma=gamma, max_new_tokens=max_new_tokens, eos=eos,
                                repeats=1, device="cpu", peers=peers, say=say)
    return [experiment.record(i, None, x, run, model, peer_settings=settings)
            for i, (x, run) in enumerate(zip(ids, runs), 1)]


if __name__ == "__main__":
    main()
