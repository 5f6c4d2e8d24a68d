"""CPU limit: spec against what a CPU user runs instead, on SmolLM2-135M-Instruct, side by side (issue 43).

One process, per seed prompt (chat-formatted), back to back in an order rotated prompt by prompt, every
system decoding `--tokens` new tokens greedily (EOS ignored everywhere) at `--threads` threads:
  spec greedy (fp32 PyTorch, oneDNN-prepacked linears: spec.cpu.prepack) and spec greedy with SPEC_PREPACK=0;
  spec speculative with the model's own Q4_1 GGUF drafting on spec.cpu.qdraft's kernel (at --real's gamma for it,
  spec.defaults.REAL_GAMMA["q4"]) and in llama.cpp (gamma 6, its best when it drafted in llama.cpp), with
  PromptLookup and with LookupTree (at --real's lookup gamma, REAL_GAMMA["lookup"]), each checked token for
  token against spec greedy;
  HF generate greedy and HF prompt lookup (prompt_lookup_num_tokens=10), through spec.hfref (an explicit
  GenerationConfig: do_sample=False, EOS off, all-ones mask);
  llama.cpp greedy (llama-cpp-python, logits_all=False, greedy sampler: top_k=1, temp=0) on the f32 GGUF
  (the Q4_1 file dequantized: the same weights as the fp32 folder PyTorch runs) and on the Q4_1 GGUF;
  vLLM CPU plain greedy, when SPEC_VLLM_PYTHON names a python with vllm installed (a worker subprocess
  that is sent each prompt in turn), else a row saying it was skipped;
and the machine's limit: the bytes one one-token step must read (fp32 weights, tied embedding once, plus
the KV cache at the run's mean context) over the best measured streaming bandwidth (sum and copy of a
256 MB tensor), and its FLOPs over a measured fp32 GEMM rate (2048^3), both at `--threads` threads: the
lower bound of ms per token is the larger of the two.
The verify line: one pass over n = 1, 2, 4, 8, 9, 16 new tokens after a 64-token prefix (the first prompt and
its greedy continuation), every position's logits kept, in one-token steps (median of the paired ratios
n-token pass / 1-token pass of the same repeat): spec's runner (PyTorch eager, prepacked and
SPEC_PREPACK=0) and llama.cpp batch eval (logits_all=True, the cache cut back to the prefix between).

    python recipes/bench_cpu_limit.py [--tokens 64] [--prompts 5] [--threads 1] [--out bench_cpu_limit.json]
Needs the `llama` and `gguf` extras and the real model (python -m spec.realmodel). The JSON is a results file
(recipes/docs.py renders docs/BENCHMARKS.md from results/cpu_limit.json): the run's figures and a "meta"
block (date, machine, commit, versions, llama.cpp's build: spec.conformance.provenance).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import torch

import spec
from spec import choose, defaults, probe, realmodel
from spec.cpu import executor
from spec.conformance import llamacpp, provenance
from spec.gguf_draft import GGUFDraft
from spec.hfref import hf_generate, hf_greedy
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS

# Before each timed run the process sleeps SETTLE seconds, so that no system starts while another's threads
# still spin (llama.cpp's thread pool polls after a pass, torch's OpenMP threads and spec's kernel pool spin
# for a while). At 2 threads without it, spec greedy took 27.8-28.4 ms/token on the prompts where it ran
# right after llama.cpp's Q4_1 run and 21.1-21.4 on those where it ran first (2026-12-05, 06:05).
SETTLE = 0.05
SIZES = (1, 2, 4, 8, 9, 16)  # 9: a verify pass at gamma 8 (the 8 drafted tokens and the one before them)
Q4, LOOKUP = defaults.REAL_GAMMA["q4"], defaults.REAL_GAMMA["lookup"]   # --real's gammas, as a user gets them


def f32_gguf() -> Path:
    """SmolLM2's Q4_1 GGUF dequantized to f32 next to it (made once, as recipes/bench_llamacpp.py does)."""
    q4 = realmodel.fetch()
    f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
    if not f32.exists():
        llamacpp.dequantized_gguf(q4, f32, "f32")
    return f32


def set_prepack(target, on: bool) -> None:
    """Switch spec's prepacked linears on or off; forget the memoised probes (the next spec call probes
    again: callers run an untimed warm-up after this)."""
    if on:
        os.environ.pop("SPEC_PREPACK", None)
    else:
        os.environ["SPEC_PREPACK"] = "0"
    probe.forget(target)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- llama.cpp ---

def llama(path: Path, threads: int, logits_all: bool = False):
    Llama = llamacpp._llama()   # spec.llamaguard's check of the build first
    return Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False)


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """n tokens of llama.cpp's greedy decoding (sampler chain top_k=1, temp=0: the greedy sampler), from an
    empty cache (no prefix reuse across prompts)."""
    llm.reset()
    out = []
    for token in llm.generate(list(prompt), top_k=1, temp=0.0, top_p=1.0, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


# --- vLLM (a worker in its own python) ---

VLLM_WORKER = textwrap.dedent('''
    import json, sys, time
    from vllm import LLM, SamplingParams
    model, threads = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=False, seed=0)
    def run(ids, n):
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - t0
    run([1, 2, 3], 2)
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        toks, s = run(req["ids"], req["n"])
        print("@@" + json.dumps({"tokens": toks, "s": s}), flush=True)
''')


class VLLM:
    """vLLM's offline LLM in a worker process (SPEC_VLLM_PYTHON), asked one prompt at a time."""

    def __init__(self, python: str, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1
                   else f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        # vLLM refuses the fp32 folder's config (the GGUF quantization_config transformers wrote): the
        # export folder without it
        folder = realmodel.export_folder(realmodel.fp32_dir(), Path(tempfile.mkdtemp()) / "model")
        self.proc = subprocess.Popen([python, "-c", VLLM_WORKER, str(folder), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"vLLM worker exited (code {self.proc.wait()})")

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], float]:
        self.proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["tokens"], r["s"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def vllm_version(python: str) -> str:
    """The vLLM version installed for `python` (vllm-cpu or vllm), read from its package metadata."""
    code = ("import importlib.metadata as m\nfor n in ('vllm-cpu', 'vllm'):\n    try:\n        print(m.version(n)); break\n"
            "    except m.PackageNotFoundError: pass")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


# --- the machine's limit ---

def machine_limit(target, threads: int, context: float) -> dict:
    """Bytes and FLOPs of one one-token step over measured bandwidth and GEMM rate."""
    cfg = target.config
    params = sum(p.numel() for p in target.parameters())          # a tied embedding counted once
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    bytes_step = params * 4 + kv_per_pos * context
    # matmuls: 2 FLOPs per weight (the lm_head reads the tied embedding; the lookup is a copy) + attention
    flops_step = 2 * params + 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    x = torch.ones(64 << 20)                     # 256 MB, far past any cache
    y = torch.empty_like(x)
    sums, copies = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        sums.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copies.append(time.perf_counter() - t0)
    nbytes = x.numel() * 4
    bw_sum, bw_copy = nbytes / min(sums), 2 * nbytes / min(copies)   # copy: read + write
    del x, y
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    gemms = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        gemms.append(time.perf_counter() - t0)
    flops = 2 * 2048 ** 3 / min(gemms)
    bw = max(bw_sum, bw_copy)
    mem_ms, flop_ms = 1e3 * bytes_step / bw, 1e3 * flops_step / flops
    return {"threads": threads, "params": params, "mean_context": context, "bytes_per_step": bytes_step,
            "flops_per_step": flops_step, "bandwidth_sum_GBps": bw_sum / 1e9, "bandwidth_copy_GBps": bw_copy / 1e9,
            "gemm_GFLOPs": flops / 1e9, "memory_ms": mem_ms, "compute_ms": flop_ms, "limit_ms": max(mem_ms, flop_ms)}


# --- the verify line ---

def verify_lines(target, llms: dict, prefix: list[int], cont: list[int], repeats: int) -> dict:
    """Per system, per n in SIZES: the pass times (s) over n tokens after `prefix`, interleaved."""
    P = len(prefix)
    systems = {}
    ids = torch.tensor(prefix + cont)
    for name, on in (("spec eager (prepacked)", True), ("spec eager (SPEC_PREPACK=0)", False)):
        set_prepack(target, on)
        chosen = choose.runs({"target": target}, ids[:P])
        run = chosen.runs[0]
        with torch.inference_mode():
            run(chosen.prompt, keep=1)
        systems[name] = ("torch", run, on)
    set_prepack(target, True)
    for name, llm in llms.items():
        llm.reset()
        llm.eval(prefix)
        systems[name] = ("llama", llm, None)
    fed = ids[P:P + max(SIZES)]
    times = {(s, n): [] for s in systems for n in SIZES}
    check = {}

    def one(name, n):
        kind, obj, on = systems[name]
        if kind == "torch":
            if on:
                os.environ.pop("SPEC_PREPACK", None)
            else:
                os.environ["SPEC_PREPACK"] = "0"
            check[name] = (executor.executor_for(target) is not None)
            with torch.inference_mode():
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                obj(fed[:n], keep=n)
                t = time.perf_counter() - t0
            obj.crop(P)
        else:
            obj.n_tokens = P          # eval() cuts the cache back to n_tokens first
            time.sleep(SETTLE)
            t0 = time.perf_counter()
            obj.eval([int(t) for t in fed[:n]])
            t = time.perf_counter() - t0
        return t

    names = list(systems)
    for r in range(-1, repeats):          # one warm-up round
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for n in SIZES[r % len(SIZES):] + SIZES[:r % len(SIZES)]:
                t = one(name, n)
                if r >= 0:
                    times[name, n].append(t)
    os.environ.pop("SPEC_PREPACK", None)
    probe.forget(target)
    out = {}
    for name in names:
        out[name] = {"prepack_used": check.get(name),
                     "ms": {n: 1e3 * statistics.median(times[name, n]) for n in SIZES},
                     "steps": {n: statistics.median(a / b for a, b in zip(times[name, n], times[name, 1]))
                               for n in SIZES}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(SEED_PROMPTS))
    p.add_argument("--threads", type=int, default=1, choices=(1, 2))
    p.add_argument("--repeats", type=int, default=7, help="verify line repeats")
    p.add_argument("--out", default="bench_cpu_limit.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    N = args.tokens

    target, tok = realmodel.load(say=lambda m: None)
    q4, f32 = realmodel.fetch(), f32_gguf()
    prompts = [encode_prompt(tok, text, chat=True) for text in SEED_PROMPTS[:args.prompts]]
    gguf_draft = GGUFDraft(q4, target, tok, threads=args.threads, engine="native")
    gguf_draft_llama = GGUFDraft(q4, target, tok, threads=args.threads, engine="llama.cpp")
    llm_f32, llm_q4 = llama(f32, args.threads), llama(q4, args.threads)
    vllm_python = os.environ.get("SPEC_VLLM_PYTHON")
    vllm = None
    vllm_note = "skipped: SPEC_VLLM_PYTHON is not set (a python with vllm-cpu installed)"
    if vllm_python:
        try:
            vllm = VLLM(vllm_python, args.threads)
            vllm_note = None
        except Exception as err:   # noqa: BLE001 - reported as the row's note
            vllm_note = f"skipped: the vLLM worker ({vllm_python}) failed: {err}"

    def spec_greedy(ids):
        return spec.greedy_generate(target, torch.tensor(ids), max_new_tokens=N).tokens

    def spec_greedy_unpacked(ids):
        set_prepack(target, False)
        spec.greedy_generate(target, torch.tensor(ids), max_new_tokens=2)   # re-probe, untimed
        assert not (executor.executor_for(target) is not None)
        return ("timed", lambda: spec.greedy_generate(target, torch.tensor(ids), max_new_tokens=N).tokens)

    def speculative(draft, gamma):
        return lambda ids: spec.speculative_generate(target, draft, torch.tensor(ids), gamma=gamma,
                                                     max_new_tokens=N).tokens

    systems = {
        "spec greedy": spec_greedy,
        "spec greedy, SPEC_PREPACK=0": spec_greedy_unpacked,
        f"spec + Q4_1 GGUF draft, spec.cpu.qdraft (g{Q4})": speculative(gguf_draft, Q4),
        "spec + Q4_1 GGUF draft, llama.cpp (g6)": speculative(gguf_draft_llama, 6),
        f"spec + PromptLookup (g{LOOKUP})": speculative(spec.PromptLookup(), LOOKUP),
        f"spec + LookupTree (g{LOOKUP})": speculative(spec.LookupTree(), LOOKUP),
        "HF generate greedy": lambda ids: hf_greedy(target, torch.tensor(ids), N),
        "HF prompt lookup (10)": lambda ids: hf_generate(target, ids, max_new_tokens=N, prompt_lookup_num_tokens=10),
        "llama.cpp f32 greedy": lambda ids: llama_greedy(llm_f32, ids, N),
        "llama.cpp Q4_1 greedy": lambda ids: llama_greedy(llm_q4, ids, N),
    }
    if vllm is not None:
        systems["vLLM CPU greedy"] = lambda ids: ("measured",) + vllm.greedy(ids, N)

    # warm-up: every system once on a few tokens of the first prompt
    for name, fn in systems.items():
        r = fn(prompts[0][:])
        if isinstance(r, tuple) and r[0] == "timed":
            r[1]()
            set_prepack(target, True)
            spec.greedy_generate(target, torch.tensor(prompts[0]), max_new_tokens=2)

    names = list(systems)
    rows = []
    for i, ids in enumerate(prompts):
        row = {"prompt": i + 1, "prompt_tokens": len(ids), "s": {}, "tokens": {}}
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = systems[name]
            time.sleep(SETTLE)
            t0 = time.perf_counter()
            r = fn(ids)
            s = time.perf_counter() - t0
            if isinstance(r, tuple) and r[0] == "timed":     # spec with SPEC_PREPACK=0: set-up untimed
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                r = r[1]()
                s = time.perf_counter() - t0
                set_prepack(target, True)
                spec.greedy_generate(target, torch.tensor(ids), max_new_tokens=2)   # re-probe, untimed
                assert (executor.executor_for(target) is not None)
            elif isinstance(r, tuple) and r[0] == "measured":  # vLLM: its own clock, in the worker
                r, s = r[1], r[2]
            assert len(r) == N, f"{name}: {len(r)} tokens, not {N}"
            row["s"][name], row["tokens"][name] = s, list(r)
        rows.append(row)
        print(f"prompt {i + 1}: " + ", ".join(f"{k} {1e3 * v / N:.1f}" for k, v in row["s"].items()) + " ms/token",
              flush=True)

    # equality with spec greedy
    ref = "spec greedy"
    equal = {}
    for name in names:
        if name == ref:
            continue
        div = [first_divergence(r["tokens"][ref], r["tokens"][name]) for r in rows]
        equal[name] = {"identical": sum(d is None for d in div), "of": len(rows), "first_divergence": div}

    # the verify line, on the first prompt and its greedy continuation
    seq = prompts[0] + rows[0]["tokens"][ref]
    while len(seq) < 64 + max(SIZES):
        seq = seq + seq
    llms_v = {"llama.cpp f32 batch eval": llama(f32, args.threads, logits_all=True),
              "llama.cpp Q4_1 batch eval": llama(q4, args.threads, logits_all=True)}
    verify = verify_lines(target, llms_v, seq[:64], seq[64:64 + max(SIZES)], args.repeats)

    mean_context = statistics.fmean(len(p) for p in prompts) + N / 2
    limit = machine_limit(target, args.threads, mean_context)

    # table
    def per_prompt_ms(name):
        return [1e3 * r["s"][name] / N for r in rows]

    summary = {}
    for name in names:
        ms = per_prompt_ms(name)
        total = sum(r["s"][name] for r in rows)
        summary[name] = {
            "tokens_per_s": N * len(rows) / total, "ms_per_token": 1e3 * total / (N * len(rows)),
            "ms_per_token_median": statistics.median(ms),
            "speedup_over_spec_greedy": sum(r["s"][ref] for r in rows) / total,
            "speedup_median": statistics.median(r["s"][ref] / r["s"][name] for r in rows),
            "over_limit": 1e3 * total / (N * len(rows)) / limit["limit_ms"]}
    print(f"\n{len(rows)} prompts x {N} new tokens, {args.threads} thread(s); limit {limit['limit_ms']:.1f} ms/token "
          f"(memory {limit['memory_ms']:.1f} ms: {limit['bytes_per_step'] / 1e6:.0f} MB at "
          f"{max(limit['bandwidth_sum_GBps'], limit['bandwidth_copy_GBps']):.1f} GB/s; compute "
          f"{limit['compute_ms']:.1f} ms: {limit['flops_per_step'] / 1e6:.0f} MFLOP at {limit['gemm_GFLOPs']:.1f} GFLOP/s)")
    print("\n| system | tokens/s | ms/token (median) | x spec greedy speed (median) | x limit's ms/token | output vs spec greedy |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        s = summary[name]
        eq = "(reference)" if name == ref else (
            f"{equal[name]['identical']}/{equal[name]['of']} identical"
            + ("" if equal[name]["identical"] == equal[name]["of"] else
               "; first divergence at " + ", ".join("-" if d is None else str(d) for d in equal[name]["first_divergence"])))
        print(f"| {name} | {s['tokens_per_s']:.1f} | {s['ms_per_token']:.1f} ({s['ms_per_token_median']:.1f}) | "
              f"{s['speedup_over_spec_greedy']:.2f} ({s['speedup_median']:.2f}) | {s['over_limit']:.2f} | {eq} |")
    if vllm is None:
        print(f"| vLLM CPU greedy | - | - | - | - | {vllm_note} |")
    print(f"| machine limit (max of memory, compute) | {1e3 / limit['limit_ms']:.1f} | {limit['limit_ms']:.1f} | "
          f"{summary[ref]['ms_per_token'] / limit['limit_ms']:.2f} | 1.00 | - |")

    print(f"\nverify line: a pass over n new tokens after a 64-token prefix, every position's logits; median ms, "
          f"and in one-token steps (median of paired ratios), {args.repeats} repeats interleaved")
    print("| system | " + " | ".join(f"n={n}" for n in SIZES) + " |")
    print("| --- |" + " --- |" * len(SIZES))
    for name, v in verify.items():
        print(f"| {name} | " + " | ".join(f"{v['ms'][n]:.1f} ms ({v['steps'][n]:.2f})" for n in SIZES) + " |")
    checks = {k: v["prepack_used"] for k, v in verify.items() if v["prepack_used"] is not None}
    print(f"(executor.executor_for(target) is not None) during the passes: {checks}")

    if vllm is not None:
        vllm.close()
    for llm in (llm_f32, llm_q4, *llms_v.values()):
        llm.close()
    gguf_draft.run.close()
    meta = provenance.meta(provenance.recipe_command(__file__), llama=True)
    if vllm_python:
        meta["versions"]["vllm (SPEC_VLLM_PYTHON)"] = vllm_version(vllm_python)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "tokens": N, "threads": args.threads, "prompts": len(rows),
                   "vllm": vllm_note or "run", "limit": limit, "summary": summary, "equal": equal, "verify": verify,
                   "rows": rows}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
