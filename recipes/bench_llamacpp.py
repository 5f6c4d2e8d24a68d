"""llama.cpp's own speculative speedup on SmolLM2-135M-Instruct next to spec's and HF's, in one run.

Per seed prompt, back to back, at one thread everywhere (torch.set_num_threads(1), llama.cpp
n_threads=1): spec greedy and spec speculative with PromptLookup(max_ngram=3) at gamma 8 (fp32
PyTorch), HF prompt lookup (8 tokens, 3-grams), then llama.cpp plain greedy and llama.cpp prompt
lookup (LlamaPromptLookupDecoding(num_pred_tokens=8, max_ngram_size=3)) on the Q4_1 GGUF and on its
f32 dequantization. Each speculative output is compared with its own engine's greedy output.

    python recipes/bench_llamacpp.py [--tokens 128] [--out bench_llamacpp.json]
Needs the `llama` and `gguf` extras and the real model (python -m spec.realmodel).
"""

from __future__ import annotations

import argparse
import json
import platform

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default="bench_llamacpp.json")
    args = p.parse_args()
    torch.set_num_threads(1)

    import llama_cpp

    from spec import PromptLookup, experiment, realmodel
    from spec.conformance import llamacpp
    from spec.prompts import SEED_PROMPTS

    model, tokenizer = realmodel.load()
    q4 = realmodel.fetch()
    f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
    if not f32.exists():
        llamacpp.dequantized_gguf(q4, f32, "f32")
    engines = {"llama.cpp Q4_1": llamacpp.Engine(q4), "llama.cpp f32": llamacpp.Engine(f32)}
    rows = []
    for i, text in enumerate(SEED_PROMPTS, 1):
        ids = tokenizer(text).input_ids
        peers, settings = experiment.lookup_peers(model, [(8, 3)], max_new_tokens=args.tokens, eos=None)
        (run,) = experiment.time_runs(model, PromptLookup(), [ids], gamma=8, max_new_tokens=args.tokens, eos=None,
                                      repeats=1, device="cpu", peers=peers)
        rec = experiment.record(i, text, ids, run, model, peer_settings=settings)
        row = {"prompt": i, "spec greedy s": rec.greedy_s, "spec speculative s": rec.spec_s,
               "spec identical": rec.identical, "HF prompt lookup s": rec.peer.s,
               "HF identical": rec.peer.identical}
        for name, e in engines.items():
            g, g_s = e.greedy(ids, args.tokens)
            s, s_s = e.speculative(ids, args.tokens, draft="prompt-lookup", gamma=8)
            row.update({f"{name} greedy s": g_s, f"{name} speculative s": s_s, f"{name} identical": s == g})
        rows.append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    for e in engines.values():
        e.close()

    def total(key):
        return sum(r[key] for r in rows)

    summary = {
        "spec PromptLookup over spec greedy": total("spec greedy s") / total("spec speculative s"),
        "HF prompt lookup over spec greedy": total("spec greedy s") / total("HF prompt lookup s"),
        **{f"{name} prompt lookup over its greedy": total(f"{name} greedy s") / total(f"{name} speculative s")
           for name in engines},
        **{f"{name} greedy tokens/s": args.tokens * len(rows) / total(f"{name} greedy s") for name in engines},
        "spec greedy tokens/s (PyTorch fp32)": args.tokens * len(rows) / total("spec greedy s"),
        "identical": {k.removesuffix(" identical"): sum(r[k] for r in rows) for k in rows[0] if k.endswith("identical")},
    }
    for k, v in summary.items():
        print(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    with open(args.out, "w") as f:
        json.dump({"tokens": args.tokens, "threads": 1, "llama_cpp_python": llama_cpp.__version__,
                   "torch": torch.__version__, "python": platform.python_version(), "summary": summary,
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
