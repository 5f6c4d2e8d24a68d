"""OpenVINO GenAI's speculative decoding against its own plain greedy, on SmolLM2-135M-Instruct.

    SPEC_OPENVINO_PYTHON=/work/ov-venv/bin/python python recipes/openvino_check.py [--precision f32|default]
        [--draft int8|int4] [--reps 3] [--n 64] [--k 5]

The five seed prompts (raw text, no chat template; the ids from the model's own tokenizer) x n tokens,
through three LLMPipelines in child processes of SPEC_OPENVINO_PYTHON (spec/conformance/openvino.py):
plain greedy, a draft model (the int8 or int4 weight-compressed export, num_assistant_tokens=k) and
prompt lookup (num_assistant_tokens=k, max_ngram_size=3). Calls are interleaved (per rep, per prompt:
plain, draft, lookup), so the time ratios are paired. Per mode: outputs identical to its own plain
greedy; where not, the first divergent position and spec.diagnose's verdict from spec's fp32
transformers model (the top-2 gap there against the dtype's noise). The plain greedy is also compared
with spec's own fp32 greedy (transformers), for what OpenVINO's fp32 is next to PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec import greedy_generate, realmodel  # noqa: E402
from spec.conformance import openvino  # noqa: E402
from spec.diagnose import diagnose  # noqa: E402
from spec.models import encode_prompt  # noqa: E402
from spec.prompts import SEED_PROMPTS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="f32", help="f32 (INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION) "
                   "or default (the plugin's: bf16 compute and a u8 KV cache on a bf16 CPU)")
    p.add_argument("--draft", default="int8", help="the draft's weight format (int8, int4)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="num_assistant_tokens")
    args = p.parse_args(argv)
    python, why = openvino.python()
    if python is None:
        print(why)
        return 2
    target_dir, draft_dir = openvino.models(python, args.draft)
    model, tok = realmodel.load(say=lambda msg: None)
    prompts = [encode_prompt(tok, text) for text in SEED_PROMPTS]
    precision = None if args.precision == "default" else args.precision
    modes = ("plain", "draft", "lookup")
    pipes = {}
    for mode in modes:
        t0 = time.perf_counter()
        pipes[mode] = openvino.Pipeline(python, target_dir, mode=mode, draft=draft_dir, precision=precision)
        print(f"{mode}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    v = pipes["plain"].versions
    print(f"openvino-genai {v['openvino_genai']}, openvino {v['openvino']}, "
          f"precision {args.precision}, draft {args.draft}, n {args.n}, k {args.k}, reps {args.reps}")
    runs = {mode: [[] for _ in prompts] for mode in modes}
    try:
        for _ in range(args.reps):
            for i, ids in enumerate(prompts):
                for mode in modes:
                    runs[mode][i].append(pipes[mode].generate(ids, args.n, k=args.k))
    finally:
        for pipe in pipes.values():
            pipe.close()

    bad = 0
    for i, ids in enumerate(prompts):
        plain = runs["plain"][i][0].tokens
        if any(r.tokens != plain for r in runs["plain"][i]):
            print(f"prompt {i}: plain greedy differs between its own repeats")
            bad += 1
        hf = greedy_generate(model, ids, max_new_tokens=args.n).tokens
        d = diagnose(model, ids, hf, plain)
        print(f"prompt {i} ({len(ids)} ids): plain vs transformers fp32 greedy: "
              + ("identical" if d is None else str(d)))
        for mode in modes[1:]:
            rs = runs[mode][i]
            steps = [r.steps for r in rs]
            counters = f"steps {steps[0]}" + (f", drafted {rs[0].drafted}, accepted {rs[0].accepted}"
                                               if rs[0].drafted is not None else "")
            ratio = statistics.median(r.seconds / q.seconds for r, q in zip(rs, runs["plain"][i]))
            verdicts = []
            for r in rs:
                d = diagnose(model, ids, plain, r.tokens)
                verdicts.append("identical" if d is None else str(d))
                if d is not None and d.verdict.name != "TIE":
                    bad += 1
            same = len(set(verdicts)) == 1
            print(f"  {mode}: {counters}; time / plain (median of {len(rs)} paired) {ratio:.2f}; "
                  + (verdicts[0] if same else "; ".join(verdicts)))
    for mode in modes[1:]:
        ratios = [r.seconds / q.seconds for i in range(len(prompts)) for r, q in zip(runs[mode][i], runs["plain"][i])]
        tokens = sum(len(r.tokens) for i in range(len(prompts)) for r in runs[mode][i])
        steps = sum(r.steps for i in range(len(prompts)) for r in runs[mode][i])
        print(f"{mode}: time / plain, median of {len(ratios)} paired calls {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); tokens per step {tokens / steps:.2f}")
    plain_s = statistics.median(r.seconds for i in range(len(prompts)) for r in runs["plain"][i])
    print(f"plain: median {1e3 * plain_s / args.n:.1f} ms/token (absolute times inflated by the machine's other load)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
