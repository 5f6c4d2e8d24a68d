"""Sizes x threads x prompt lengths: spec against HF and llama.cpp (built natively), time and peak memory.

    python recipes/bench_grid.py [--sizes 135m,360m,1.7b] [--threads 1,2] [--prompts 64,700,2000] [--tokens 32]
                                 [--out results/grid.json] [--plot docs/grid.png]

One process per system and cell (peak RSS is a process's high-water mark), the systems of a cell back to back:

- `hf`: HF `generate`, greedy; the reference every other fp32 output is compared with.
- `spec greedy`; `spec + Q4_1 draft` (the model's own Q4_1 GGUF as draft, gamma 8); `spec + lookup`
  (PromptLookup, gamma 8; SmolLM2 only: on random weights its acceptance means nothing).
- `verify round`: a round of a draft whose 8 proposals are all accepted and cost nothing (greedy's own
  continuation), in one-token steps of spec greedy: what the target's 9-row pass and the loop cost (the
  median traced round after the first over spec greedy's median traced step after the first).
- `llama.cpp f32`, `llama.cpp Q4_1`: llama-cpp-python's greedy, built with native flags
  (requirements/build-llama-native: what `pip install llama-cpp-python` builds), never the portable test build.

Sizes: `135m` is SmolLM2-135M-Instruct (python -m spec.realmodel), its prompts a chat-formatted request to
summarize this repository's docs, cut to the length; `360m`, `1.7b` are SmolLM2's public shapes with seeded
random weights and random token prompts, their GGUFs (f32, and Q4_1 as llama.cpp's export lays it out) written
from the same weights (spec.conformance.llamacpp.llama_gguf) into $SPEC_CACHE/grid/. On random weights
acceptance means nothing, so the self-draft's speedup there is Theorem 3.8 priced with that size's measured
costs (the draft's time per proposal and the verify round, in target steps) at the acceptance SmolLM2 measured
at the same threads and prompt length; on SmolLM2 it is measured.

Each child loads its model, warms up on the prompt's first WARM ids (one-time costs: packing, probes, the native
library, the draft's first fill from the target's states),
then times a prefill (one new token) and the whole decode (--tokens new tokens); ms/token is the decode's
(total - prefill over tokens - 1), speedups are of the whole run, prefill included. Writes --out (every cell
as it finishes) and, with matplotlib, --plot.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

SHAPES = {  # SmolLM2's public shapes: hidden, layers, heads, kv heads, ffn
    "360m": (960, 32, 15, 5, 2560),
    "1.7b": (2048, 24, 32, 32, 8192),
}
GAMMA = 8
WARM = 80   # the warm-up's prompt: past spec.gguf_draft.FILL_FROM, so that its first long-prompt round is paid too
SYSTEMS = ("hf", "spec greedy", "spec + Q4_1 draft", "spec + lookup", "verify round", "llama.cpp f32",
           "llama.cpp Q4_1")
LLAMA = ("llama.cpp f32", "llama.cpp Q4_1")


def cache() -> Path:
    d = Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser()
    (d / "grid").mkdir(parents=True, exist_ok=True)
    return d


def native_llama() -> Path:
    return Path(os.environ.get("SPEC_LLAMA_NATIVE") or cache() / "llama-native")


# --- models and prompts (in the children) ---

def load(size: str):
    """(model fp32 eval, tokenizer or None)."""
    import torch
    if size == "135m":
        from spec import realmodel
        return realmodel.load(lambda *_: None, dtype=torch.float32)
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, heads, kv, ffn = SHAPES[size]
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()     # (to_empty gives each module its own storage: SmolLM2's head is its embedding)
    # to_empty leaves buffers uninitialized: the rotary table made again, on the CPU
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval(), None


def prompt(tok, length: int):
    """[1, length] ids: SmolLM2's chat template around a request to summarize the docs, cut to `length`; or
    random ids (random weights)."""
    import torch
    if tok is None:
        return torch.randint(0, 49152, (1, length), generator=torch.Generator().manual_seed(length))
    text = "\n\n".join((ROOT / f).read_text() for f in ("README.md", "docs/USAGE.md", "docs/DEVELOPING.md")
                       if (ROOT / f).exists())
    doc = tok(text).input_ids

    def ask(n):
        p = tok.apply_chat_template([{"role": "user", "content": "Summarize the following text in three sentences."
                                      "\n\n" + tok.decode(doc[:n])}], add_generation_prompt=True,
                                    return_tensors="pt")
        return p if isinstance(p, torch.Tensor) else p["input_ids"]
    n = length
    while ask(n).shape[1] > length:
        n -= ask(n).shape[1] - length
    return ask(n)


def gguf_paths(size: str) -> tuple[Path, Path]:
    """(f32, Q4_1) GGUFs of the size's weights."""
    if size == "135m":
        from spec import realmodel
        q4 = realmodel.gguf_path()
        return q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf")), q4
    d = cache() / "grid"       # ("tied": files made before the head was tied held an untied model's)
    return d / f"smollm2-{size}-tied-random.f32.gguf", d / f"smollm2-{size}-tied-random.Q4_1.gguf"


def make_ggufs(size: str) -> None:
    f32, q4 = gguf_paths(size)
    if size == "135m":
        if not f32.exists():
            from spec.conformance import llamacpp
            llamacpp.dequantized_gguf(q4, f32, "f32")
        return
    from spec.conformance import llamacpp
    for path, quantized in ((f32, False), (q4, True)):
        if not path.exists():
            model, _ = load(size)
            llamacpp.llama_gguf(model, path, quantized=quantized)
            del model


# --- one system, one cell (a child process) ---

def peak_rss_mb() -> float:
    """This process's peak RSS, MB: /proc/self/status's VmHWM, which starts afresh at exec. (getrusage's
    ru_maxrss does not: Linux carries the parent's high-water mark over the exec, so every child read at least
    the grid's own size, ~480 MB, and llama.cpp's Q4_1 children, smaller than that, read it.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(system: str, size: str, threads: int, ids: list[int], tokens: int) -> dict:
    if system in LLAMA:
        return llama_child(system, size, threads, ids, tokens)
    import torch
    from spec import PromptLookup, greedy_generate, speculative_generate
    torch.set_num_threads(threads)
    model, tok = load(size)
    length = len(ids)
    ids = torch.tensor([ids])
    extra: dict = {}
    if system == "spec + Q4_1 draft":
        from spec.gguf_draft import GGUFDraft
        draft = GGUFDraft(gguf_paths(size)[1], model, tok, threads=threads, n_ctx=max(4096, length + tokens + 64))
    elif system == "spec + lookup":
        draft = PromptLookup(max_ngram=3)
    elif system == "verify round":
        with torch.inference_mode():
            full = ids[0].tolist() + greedy_generate(model, ids, max_new_tokens=tokens + GAMMA + 1).tokens

        class Oracle(PromptLookup):
            def propose(self, history, limit):
                return full[len(history):len(history) + limit]
        draft = Oracle()
    else:
        draft = None

    def run(x, n, trace=False):
        with torch.inference_mode():
            if system == "hf":
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False)
                return out[0, x.shape[1]:].tolist(), None
            if draft is None:
                g = greedy_generate(model, x, max_new_tokens=n, trace=trace)
                return g.tokens, g if trace else None
            r = speculative_generate(model, draft, x, gamma=GAMMA, max_new_tokens=n, trace=trace)
            return r.tokens, r
    run(ids[:, :WARM], 4)
    t0 = time.perf_counter()
    run(ids, 1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, r = run(ids, tokens, trace=system in ("spec greedy", "verify round", "spec + Q4_1 draft"))
    total = time.perf_counter() - t0
    if system == "spec greedy":         # the median one-token step, and the median round after the first
        if len(r.trace) > 1:            # (and before a last one cut short by the token count)
            extra["step_ms"] = 1e3 * statistics.median(x.verify_s for x in r.trace[1:])
        r = None
    if system == "verify round" and len(r.trace) > 1:
        extra["round_ms"] = 1e3 * statistics.median(x.verify_s + x.draft_s for x in (r.trace[1:-1] or r.trace[1:]))
    if r is not None:
        extra.update(rounds=len(r.rounds), drafted=r.drafted, accepted=sum(r.accepted_per_round),
                     tokens_per_round=tokens / len(r.rounds))
        if r.trace:
            extra["draft_s"] = sum(x.draft_s for x in r.trace)
    if system == "spec + Q4_1 draft":
        extra["prefill_from_target"] = draft.why_own_prefill is None
    return {"prefill_s": prefill, "total_s": total, "ms_per_token": 1e3 * (total - prefill) / (tokens - 1),
            "peak_rss_mb": peak_rss_mb(), "tokens": out,
            "prompt_tokens": ids.shape[1], "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            **extra}


def llama_child(system: str, size: str, threads: int, ids: list[int], tokens: int) -> dict:
    import llama_cpp
    f32, q4 = gguf_paths(size)
    path = f32 if system == "llama.cpp f32" else q4
    length = len(ids)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=length + tokens + 64, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def greedy(x, n):
        llm.reset()
        out = []
        for t in llm.generate(list(x), top_k=1, temp=0.0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                              reset=True):
            out.append(int(t))
            if len(out) == n:
                break
        return out
    greedy(ids[:WARM], 4)
    t0 = time.perf_counter()
    greedy(ids, 1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = greedy(ids, tokens)
    total = time.perf_counter() - t0
    return {"prefill_s": prefill, "total_s": total, "ms_per_token": 1e3 * (total - prefill) / (tokens - 1),
            "peak_rss_mb": peak_rss_mb(), "tokens": out,
            "prompt_tokens": len(ids), "build": llama_cpp.llama_print_system_info().decode().strip()}


def prompt_ids(size: str, length: int) -> list[int]:
    """The cell's prompt (`prompt`), made here so that no child but the torch ones imports torch's models."""
    tok = None
    if size == "135m":
        from transformers import AutoTokenizer

        from spec import realmodel
        tok = AutoTokenizer.from_pretrained(str(realmodel.fp32_dir()))
    return prompt(tok, length)[0].tolist()


# --- the grid (the parent) ---

def native_build() -> dict:
    """The native llama-cpp-python's version, CMake flags (the FLAGS file beside its wheel) and system info."""
    wheel = Path((native_llama() / ".wheel").read_text().strip())
    flags = (wheel.parent / "FLAGS").read_text().splitlines()
    info = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(native_llama())))
    return {"version": flags[0].split()[-1], "cmake_args": flags[1].removeprefix("CMAKE_ARGS="),
            "system_info": info.stdout.strip(), "where": "requirements/build-llama-native"}

def spawn(system: str, size: str, threads: int, ids_file: Path, tokens: int) -> dict:
    env = dict(os.environ)
    if system in LLAMA:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(native_llama()), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, "--child", system, "--sizes", size, "--threads", str(threads),
                           "--ids", str(ids_file), "--tokens", str(tokens)], capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": (done.stderr or done.stdout)[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bandwidth() -> float:
    """The best of 5 reads of 256 MB (torch's sum, one thread), GB/s: the machine's limit for a step that
    streams the weights once."""
    import torch
    torch.set_num_threads(1)
    x = torch.ones(64 << 20)
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def verify_steps(rows: dict) -> float | None:
    """A cell's verify round in one-token steps of spec greedy: the traced medians (a round after the first
    over a step after the first), or, in results made before they were kept, the whole run less a one-token
    run over the rounds after the first (None where that came out at or below zero: the prefill's noise)."""
    rnd, greedy = rows.get("verify round"), rows.get("spec greedy")
    if not rnd or not greedy or "total_s" not in rnd or "total_s" not in greedy:
        return None
    if "round_ms" in rnd and "step_ms" in greedy:
        return rnd["round_ms"] / greedy["step_ms"]
    steps = (rnd["total_s"] - rnd["prefill_s"]) * 1e3 / max(rnd["rounds"] - 1, 1) / greedy["ms_per_token"]
    return steps if steps > 0 else None


def price(cell: dict, smollm: dict | None) -> dict | None:
    """Theorem 3.8 for the self-draft at this size: SmolLM2's measured acceptance at the same threads and
    prompt length, this size's draft cost per proposal and verify round, in this size's greedy steps."""
    from spec import theory
    q4, rnd, greedy = cell.get("spec + Q4_1 draft"), cell.get("verify round"), cell.get("spec greedy")
    ref = (smollm or {}).get("spec + Q4_1 draft")
    if not all(r and "error" not in r for r in (q4, rnd, greedy, ref)) or not q4.get("drafted"):
        return None
    step = greedy["ms_per_token"]
    c = 1e3 * q4["draft_s"] / q4["drafted"] / step
    verify = verify_steps(cell)
    if verify is None:
        return None
    alpha = theory.implied_alpha(min(ref["tokens_per_round"], GAMMA + 0.999), GAMMA)
    per_round = theory.expected_tokens_per_round(alpha, GAMMA)
    decode = per_round / (GAMMA * c + verify)
    # the whole run, prefill included: greedy's prefill (the target's) plus the decode at the priced speed
    n = len(greedy["tokens"])
    whole = greedy["total_s"] / (greedy["prefill_s"] + (greedy["total_s"] - greedy["prefill_s"]) / decode)
    return {"alpha": alpha, "c": c, "verify_steps": verify, "decode_speedup": decode, "speedup": whole,
            "tokens": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="135m,360m,1.7b")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompts", default="64,700,2000")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "grid.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "grid.png")
    p.add_argument("--replot", action="store_true", help="draw --plot from --out's cells, measuring nothing")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        ids = json.loads(args.ids.read_text())
        print(json.dumps(child(args.child, args.sizes, int(args.threads), ids, args.tokens)))
        return 0
    if args.replot:
        plot(json.loads(args.out.read_text()), args.plot)
        return 0
    sizes, threads = args.sizes.split(","), [int(t) for t in args.threads.split(",")]
    lengths = [int(n) for n in args.prompts.split(",")]
    if not (native_llama() / "llama_cpp").is_dir():
        sys.exit(f"no natively built llama-cpp-python in {native_llama()}: run bash requirements/build-llama-native")
    from spec.conformance import provenance
    result = {"meta": provenance.meta(command=provenance.recipe_command(__file__, argv)),
              "tokens": args.tokens, "gamma": GAMMA, "cells": [],
              "planned": [[s, n, t] for s in sizes for n in lengths for t in threads]}
    result["meta"]["build"] = {"llama.cpp": native_build()}
    for size in sizes:
        if size not in ("135m", *SHAPES):
            sys.exit(f"--sizes: 135m, 360m or 1.7b, got {size!r}")
        made = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'recipes')!r}); "
                               f"import bench_grid; bench_grid.make_ggufs({size!r})"], capture_output=True, text=True)
        if made.returncode:
            sys.exit(f"the GGUFs of {size}: {made.stderr[-1500:]}")
    result["bandwidth_GBps"] = bandwidth()
    smollm: dict = {}
    for size in sizes:
        for length in lengths:
            ids_file = cache() / "grid" / f"prompt-{size}-{length}.json"
            ids_file.write_text(json.dumps(prompt_ids(size, length)))
            for t in threads:
                systems = [s for s in SYSTEMS if size == "135m" or s != "spec + lookup"]
                rows = {}
                for system in systems:
                    rows[system] = spawn(system, size, t, ids_file, args.tokens)
                    r = rows[system]
                    print(f"{size} {length} t{t} {system}: " + (r["error"].splitlines()[-1] if "error" in r else
                          f"{r['total_s']:.2f} s, {r['ms_per_token']:.1f} ms/token, {r['peak_rss_mb']:.0f} MB"),
                          flush=True)
                ref = rows["hf"].get("tokens")
                for system, r in rows.items():
                    if "tokens" in r and system != "hf" and system not in LLAMA[1:]:
                        r["identical"] = r["tokens"] == ref
                cell = {"size": size, "threads": t, "prompt": length, "rows": rows, "verify_steps": verify_steps(rows)}
                if size == "135m":
                    smollm[(t, length)] = rows
                else:
                    cell["priced"] = price(rows, smollm.get((t, length)))
                result["cells"].append(cell)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.plot)
    return 0


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install -e '.[plots]')")
        return
    cells = result["cells"]
    sizes = list(dict.fromkeys(c["size"] for c in cells))
    threads = sorted({c["threads"] for c in cells})
    fig, axes = plt.subplots(len(threads), len(sizes), figsize=(4.2 * len(sizes), 3.4 * len(threads)), squeeze=False)
    shown = ("hf", "spec greedy", "spec + Q4_1 draft", "llama.cpp f32", "llama.cpp Q4_1")
    for i, t in enumerate(threads):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            mine = [c for c in cells if c["size"] == size and c["threads"] == t]
            xs = [c["prompt"] for c in mine]
            for system in shown:
                ys = []
                for c in mine:
                    r = c["rows"].get(system, {})
                    if system == "spec + Q4_1 draft" and size != "135m":    # random weights: priced, or nothing
                        g, priced = c["rows"]["spec greedy"], c.get("priced")
                        ys.append(1e3 * g["total_s"] / priced["speedup"] / len(g["tokens"]) if priced else float("nan"))
                    else:
                        ys.append(1e3 * r["total_s"] / len(r["tokens"]) if "total_s" in r else float("nan"))
                label = system + (" (priced)" if system == "spec + Q4_1 draft" and size != "135m" else "")
                ax.plot(xs, ys, marker="o", label=label)
            ax.set_title(f"{size}, {t} thread{'s' if t > 1 else ''}")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("ms per new token (prefill included)")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
