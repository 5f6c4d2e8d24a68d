"""Which model-free draft could pay on SmolLM2-135M-Instruct at one CPU thread? A replay, no timing.

Greedy output is fixed, so a draft policy's rounds can be replayed on it: each round the policy
proposes tokens from the sequence so far, the agreeing prefix plus one token is kept. The cost of a
round is the verify line measured in docs/log/benchmarks.md (a pass of g >= 1 drafted tokens costs
FIXED + SLOPE * g one-token steps; g = 0 costs one step), drafting is free. Predicted speedup over
greedy = tokens / cost. Policies:

  spec lookup         spec.PromptLookup(max_ngram=3, min_ngram=2): most recent match, loops drafted
  HF lookup           HF's prompt-lookup rule (n = 3 down to 1, earliest match, continuation cut at
                      the end of the sequence), at 8 tokens
  + docs n-gram       spec lookup, and where it finds nothing, a 2-4-gram table of text installed on
                      this machine (site-packages .rst/.txt, the standard library's .py, /usr/share/doc)
  + own n-gram        the same fallback built from the target's own greedy output on the other seed
                      prompts (the prompt's own raw and chat outputs left out)

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python recipes/replay_draft_sources.py [--outputs greedy.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
from pathlib import Path

import numpy as np
import torch

from spec import PromptLookup, greedy_generate, realmodel
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS

FIXED, SLOPE = 1.48, 0.034  # docs/log/benchmarks.md: the `--real` run's fitted verify line, in steps
GAMMA = 8


def greedy_outputs(path: Path, max_new_tokens: int) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    torch.set_num_threads(1)
    model, tok = realmodel.load()
    out = {}
    for chat in (False, True):
        for i, text in enumerate(SEED_PROMPTS):
            ids = encode_prompt(tok, text, chat=chat)
            new = greedy_generate(model, torch.tensor([ids]), max_new_tokens=max_new_tokens).tokens
            out[f"{'chat' if chat else 'raw'} {i}"] = {"prompt": ids, "new": new}
    path.write_text(json.dumps(out))
    return out


class NgramTable:
    """For each context of k tokens (k = 2..4), its most frequent next token, that token's count and
    the context's count, as sorted arrays (16 bits a token fits k <= 4 in an int64 key)."""

    ORDERS = (4, 3, 2)

    def __init__(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        self.tables = {}
        for k in self.ORDERS:
            ctx, nxt = self._keys(ids[:-1], k), ids[k:]
            order = np.lexsort((nxt, ctx))
            c, x = ctx[order], nxt[order]
            starts = np.r_[0, np.flatnonzero((np.diff(c) != 0) | (np.diff(x) != 0)) + 1]
            counts = np.diff(np.r_[starts, len(c)])
            uc, ux = c[starts], x[starts]
            totals = np.add.reduceat(counts, np.r_[0, np.flatnonzero(np.diff(uc) != 0) + 1])
            by_count = np.lexsort((counts, uc))                  # each context's best pair comes last
            best = by_count[np.r_[np.flatnonzero(np.diff(uc[by_count]) != 0), len(by_count) - 1]]
            self.tables[k] = (uc[best], ux[best], counts[best], totals)

    @staticmethod
    def _keys(ids, k):
        n = len(ids) - k + 1
        h = np.zeros(max(n, 0), dtype=np.int64)
        for j in range(k):
            h = (h << 16) | ids[j:j + n]
        return h

    def next_token(self, history, min_count=2, min_share=0.8):
        for k in self.ORDERS:
            if len(history) < k:
                continue
            key = 0
            for v in history[-k:]:
                key = (key << 16) | int(v)
            keys, best, count, total = self.tables[k]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key and total[i] >= min_count:
                return int(best[i]) if count[i] >= min_share * total[i] else None
        return None


def spec_lookup(seq, limit, lookup=PromptLookup()):
    return lookup.propose(torch.tensor(seq), limit)


def hf_lookup(seq, limit, max_ngram=3):
    """HF's PromptLookupCandidateGenerator rule: longest n-gram first, earliest match whose
    continuation is not empty, continuation cut at the end of the sequence."""
    t = torch.tensor(seq)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        hits = (t.unfold(0, n, 1) == t[-n:]).all(1).nonzero().flatten().tolist()
        for start in (h + n for h in hits):
            if start < len(seq):
                return seq[start:start + limit]
    return []


def with_fallback(table):
    def policy(seq, limit):
        found = spec_lookup(seq, limit)
        if found or table is None:
            return found
        out, history = [], list(seq)
        while len(out) < limit and (token := table.next_token(history)) is not None:
            out.append(token)
            history.append(token)
        return out
    return policy


def replay(policy, prompt, new):
    seq, pos, end, tokens, cost = prompt + new, len(prompt), len(prompt) + len(new), 0, 0.0
    while pos < end:
        draft = policy(seq[:pos], GAMMA)
        k = 0
        while k < len(draft) and pos + k < end and draft[k] == seq[pos + k]:
            k += 1
        gained = min(k + 1, end - pos)
        tokens, pos = tokens + gained, pos + gained
        cost += FIXED + SLOPE * len(draft) if draft else 1.0
    return tokens, cost


def docs_corpus(tok) -> list[int]:
    sp = site.getsitepackages()[0]
    files = glob.glob(sp + "/**/*.rst", recursive=True) + glob.glob(sp + "/**/*.txt", recursive=True)
    files += glob.glob(os.path.dirname(os.__file__) + "/*.py")
    files += [f for f in glob.glob("/usr/share/doc/**/*", recursive=True)
              if os.path.isfile(f) and not f.endswith(".gz") and os.path.getsize(f) < 2_000_000]
    ids = []
    for f in sorted(files):
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += tok.encode(text) + [tok.eos_token_id]
    return ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outputs", type=Path, default=Path("greedy-seed-outputs.json"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    runs = greedy_outputs(args.outputs, args.max_new_tokens)
    _, tok = realmodel.load()
    docs = NgramTable(docs_corpus(tok))
    print(f"docs corpus: {sum(len(t[0]) for t in docs.tables.values())} contexts")
    own = {i: NgramTable([t for name, r in runs.items() if not name.endswith(f" {i}") for t in r["new"] + [0]])
           for i in range(len(SEED_PROMPTS))}
    policies = {"spec lookup": lambda name: spec_lookup, "HF lookup": lambda name: hf_lookup,
                "+ docs n-gram": lambda name: with_fallback(docs),
                "+ own n-gram": lambda name: with_fallback(own[int(name.split()[1])])}
    print("predicted speedup over greedy (tokens / verify-line cost)")
    for kind in ("raw", "chat"):
        row = []
        for label, make in policies.items():
            totals = [replay(make(name), r["prompt"], r["new"]) for name, r in runs.items() if name.startswith(kind)]
            row.append(f"{label} {sum(t for t, _ in totals) / sum(c for _, c in totals):.3f}x")
        print(f"{kind}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
