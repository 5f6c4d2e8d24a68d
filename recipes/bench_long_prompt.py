"""The Q4_1 self-draft on long prompts: spec greedy against spec with SmolLM2's own Q4_1 GGUF, the draft
prefilled by itself (GGUFDraft prefill="own") and from the target's prefill (the default), one thread, gamma 8.

Prompts: two of about 700 tokens in the chat template (a summary and a question over the README's prose, cut
to 680 tokens) and two 40-token seed prompts. Each prompt: greedy, then each draft, back to back, after a
warm-up; every output checked against greedy.

    python recipes/bench_long_prompt.py [--tokens 64]      (python -m spec.realmodel first)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from spec import greedy_generate, realmodel, speculative_generate
from spec.gguf_draft import GGUFDraft
from spec.prompts import SEED_PROMPTS


def prompts(tok) -> list[torch.Tensor]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    prose = "\n\n".join(p for p in text.split("\n\n")
                        if len(p) > 200 and not p.startswith(("#", "```", "|", "-", "pip", "python")))
    ids = tok(prose).input_ids
    asks = ["Summarize the following text in three sentences.\n\n" + tok.decode(ids[:680]),
            "Read the document and answer: what does the suite check when speculative output differs from greedy?"
            "\n\nDocument:\n" + tok.decode(ids[100:760])] + list(SEED_PROMPTS[:2])
    out = []
    for ask in asks:
        p = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True, return_tensors="pt")
        out.append(p if isinstance(p, torch.Tensor) else p["input_ids"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = realmodel.load(lambda *_: None)
    drafts = {"own prefill": GGUFDraft(realmodel.gguf_path(), model, tok, prefill="own"),
              "target's prefill": GGUFDraft(realmodel.gguf_path(), model, tok)}
    with torch.inference_mode():
        for ids in prompts(tok):
            greedy_generate(model, ids, max_new_tokens=4)
            t0 = time.perf_counter()
            greedy = greedy_generate(model, ids, max_new_tokens=args.tokens).tokens
            seconds = time.perf_counter() - t0
            row = [f"prompt {ids.shape[1]:4d} ids: greedy {seconds:.2f} s"]
            for name, draft in drafts.items():
                draft.run.crop(0)                   # nothing held: each run prefills (or fills) afresh
                t0 = time.perf_counter()
                out = speculative_generate(model, draft, ids, gamma=8, max_new_tokens=args.tokens)
                took = time.perf_counter() - t0
                assert out.tokens == greedy, f"{name}: output differs from greedy"
                row.append(f"{name} {seconds / took:.2f}x ({len(out.tokens) / len(out.rounds):.1f} tokens a round)")
            print("; ".join(row), flush=True)


if __name__ == "__main__":
    main()
