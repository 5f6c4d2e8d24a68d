"""Speed of speculative serving engines over their own plain servers, at 1, 4 and 16 requests in flight.

Each `--pair NAME=SPEC_URL,PLAIN_URL` is a speculative server and the same model served plainly (both
OpenAI-compatible, on 127.0.0.1). For each concurrency, every pair's two servers are timed in one run,
alternating which goes first from repeat to repeat, so drift on a shared machine hits both. A timing is
the wall time of `--requests` (default: 2 x c, at least 4) greedy completions of `--tokens` new tokens (the seed prompts in turn, as
token ids through the plain server's /tokenize; `--text` sends them as text, for a server that takes no
ids), sent by `c` workers at once; throughput is the completion tokens the servers report (usage) over
that time. Prints a table (median tokens/s of each, the ratio speculative/plain) and writes JSON: a results
file (recipes/docs.py renders docs/BENCHMARKS.md's served-engine table from results/endpoints*.json) with
each server's identity (owner and version, where it says) and a "meta" block (date, machine, commit,
versions: spec.conformance.provenance).

    python recipes/bench_endpoints.py --pair vllm-ngram=http://127.0.0.1:8712/v1,http://127.0.0.1:8711/v1 \
        [--pair ...] [--concurrency 1 4 16] [--requests N] [--tokens 48] [--repeats 2] [--out endpoints.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2

from spec.conformance import provenance
from spec.conformance.endpoint import Endpoint
from spec.prompts import SEED_PROMPTS


def timed(url: str, model: str, prompts: list, tokens: int, requests: int, workers: int) -> tuple[float, int]:
    """(seconds, completion tokens) for `requests` greedy completions, `workers` at once."""
    client = httpx2.Client(timeout=httpx2.Timeout(600.0, connect=5.0), trust_env=False)

    def one(i: int) -> int:
        body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": tokens, "temperature": 0.0,
                "ignore_eos": True}
        response = client.post(f"{url}/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = sum(pool.map(one, range(requests)))
    seconds = time.perf_counter() - start
    client.close()
    return seconds, done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", required=True, help="NAME=SPEC_URL,PLAIN_URL")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=None, help="completions per timing (default 2 x c, >= 4)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--text", action="store_true", help="send the prompts as text (servers that take no ids)")
    parser.add_argument("--out", default="endpoints.json")
    parser.add_argument("--title", default=None, help="what the servers are, for the table docs/BENCHMARKS.md renders")
    args = parser.parse_args(argv)
    pairs, servers = {}, {}
    for item in args.pair:
        name, _, urls = item.partition("=")
        spec_url, _, plain_url = urls.partition(",")
        if not (name and spec_url and plain_url):
            parser.error(f"--pair must be NAME=SPEC_URL,PLAIN_URL, got {item!r}")
        plain = Endpoint(plain_url)
        prompts = list(SEED_PROMPTS) if args.text else [plain.tokenize(p) for p in SEED_PROMPTS]
        if not args.text and not all(prompts):
            parser.error(f"{plain_url} has no /tokenize: use --text")
        pairs[name] = (spec_url, plain_url, plain.model, prompts)
        served = Endpoint(spec_url)
        servers[name] = {"speculative": served.identity(), "plain": plain.identity(), "model": plain.model}
        served.close()
        plain.close()
    rows = []
    for c in args.concurrency:
        for name, (spec_url, plain_url, model, prompts) in pairs.items():
            timed(spec_url, model, prompts, 8, c, c)          # warm both: first requests pay for setup
            timed(plain_url, model, prompts, 8, c, c)
            rates = {"speculative": [], "plain": []}
            requests = args.requests or max(4, 2 * c)
            for r in range(args.repeats):
                order = [("speculative", spec_url), ("plain", plain_url)]
                for kind, url in (order if r % 2 == 0 else order[::-1]):
                    seconds, done = timed(url, model, prompts, args.tokens, requests, c)
                    rates[kind].append(done / seconds)
            s, p = statistics.median(rates["speculative"]), statistics.median(rates["plain"])
            rows.append({"pair": name, "concurrency": c, "requests": requests, "speculative_tok_s": s,
                         "plain_tok_s": p, "ratio": s / p, "repeats": rates})
            print(f"{name:24} c={c:<3} speculative {s:8.1f} tok/s  plain {p:8.1f} tok/s  ratio {s / p:5.2f}x",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": provenance.meta(provenance.recipe_command(__file__, argv)), "title": args.title,
                   "servers": servers,
                   "tokens": args.tokens, "repeats": args.repeats, "rows": rows}, f, indent=2)
        f.write("\n")
    print("\n| server | in flight | speculative tok/s | plain tok/s | speculative / plain |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['pair']} | {row['concurrency']} | {row['speculative_tok_s']:.1f} | {row['plain_tok_s']:.1f} "
              f"| {row['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
