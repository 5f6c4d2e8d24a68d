"""Does a hand-written fp32 GEMV/small-GEMM kernel (spec.cpu.gemv) reach llama.cpp's bandwidth on SmolLM2's
linears? (issue 43.) SmolLM2-135M-Instruct's 211 nn.Linear weights (real, in forward order: 30 x q, k, v,
o, gate, up, down, then the 49152-wide tied head; 538 MB fp32), one thread, at M = 1, 2, 3, 4, 8, 9 rows of
x. Paths, interleaved: every repeat runs every path over all 211 products at every M, the paths in an
order rotated repeat by repeat, so load from other processes falls on all of them alike:

    linear    F.linear(x, W, b) (MKL sgemm): what transformers runs
    prepack   spec.cpu.prepack.packed_forward (oneDNN, weight reordered once, 1-2 rows padded to 3)
    numpy     x @ W.T in numpy (OpenBLAS), on views of the same memory
    rows      spec.cpu.gemv.product(layout="rows"): W read in place, one row at a time against up to 8 rows
              of x (the best ISA this CPU has, no software prefetch)
    panel     spec.cpu.gemv.product(layout="panel"), what spec.cpu.prepack runs: W reordered once into panels of 16
              rows interleaved k by k (on transparent huge pages), up to 12 rows of x a turn, no horizontal
              sums; the kernel's own choice of code (AVX-512 CPU: the AVX2+FMA code for 1-2 rows, AVX-512F
              from 3 with a prefetch into L1 1024 floats ahead, from 7 rows 512 ahead into L1 and 8192
              ahead into L2)
    ...-avx512, ...-avx2   that ISA's code alone, no software prefetch (panel-avx2: what a CPU without
              AVX-512 runs)
    ...-pfD   with a software prefetch into L1 D floats ahead in W's stream (e.g. panel-avx512-pf1024)
    ...-farD  with a software prefetch into L2 D floats ahead (e.g. panel-avx512-pf512-far8192)
    ...-4k    the panels in torch's memory (4 KB pages) instead of huge pages
    panel-prev  the kernel as of 63683c8: no far prefetch (far=0), torch's memory (panel-far0-4k)

Per path and M: the median and the best over repeats of the 211 products' total (ms), the weights' bytes
over the best (GB/s), and the median of the paired ratios path / prepack (same repeat). Numerics: max |y - F.linear|
over all 211 products relative to max |F.linear|, and max |y - fp64| relative to max |fp64| (F.linear's
own figure beside it is the scale of fp32 rounding).

--model: spec's whole one-token step and verify passes of --passes tokens on SmolLM2 (spec.choose.runs, after
a 64-token prefix, every position's logits kept as recipes/bench_cpu_limit.py's verify_lines does), one
runner whose spec.cpu.executor runs spec.cpu.gemv (`gemv`, what spec runs), the kernel as of 63683c8 (`gemv-prev`:
no far prefetch, 4 KB pages, no grouped products) or oneDNN (`oneDNN`, as with SPEC_GEMV=0), swapped pass by pass, and llama.cpp's batch
eval of the same tokens on the f32 GGUF (logits_all, one thread, the cache cut back to the prefix between),
interleaved in a rotated order; paired ratios to oneDNN and each path's pass / its one-token step (the
median of the per-repeat ratios, and best over best); and spec
greedy == spec speculative (PromptLookup, gamma 8) on the 5 seed prompts x --check-tokens (96) with the gemv path
on (in 32 tokens none of lookup's proposals is accepted on them, on any path).

    python recipes/bench_gemv_kernel.py [--repeats 15] [--rows 1,2,3,4,8,9] [--paths ...] [--model]
                                        [--model-repeats 30] [--passes 1,9] [--check-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from spec.cpu import executor, gemv, prepack


def linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def prepare(path: str, lin: torch.nn.Linear):
    w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
    if path == "linear":
        return lambda x: F.linear(x, w, b)
    if path == "prepack":
        return prepack.packed_forward(lin)
    if path == "numpy":
        wt = w.numpy().T
        bn = None if b is None else b.numpy()
        return (lambda x: torch.from_numpy(x.numpy() @ wt)) if bn is None else \
            (lambda x: torch.from_numpy(x.numpy() @ wt + bn))
    if path == "panel-prev":
        path = "panel-far0-4k"
    for layout in ("rows", "panel"):
        if path.startswith(layout):
            rest = path[len(layout):]
            huge = not rest.endswith("-4k")
            rest = rest.removesuffix("-4k")
            variant = {"-avx2": 1, "-avx512": 2}.get(rest.split("-pf")[0].split("-far")[0], -1)
            rest = rest.removeprefix("-avx2").removeprefix("-avx512")
            pf, far = (-1, -1) if variant < 0 else (0, 0)
            if rest.startswith("-pf"):
                pf, _, rest = rest[3:].partition("-")
                pf, rest = int(pf), "-" + rest if rest else ""
            if rest.startswith("-far"):
                far, rest = int(rest[4:]), ""
            if rest == "":
                return gemv.product(w, b, layout, prefetch=pf, variant=variant, far=far, huge=huge)
    raise ValueError(f"--paths: unknown path {path!r}")


def micro(model, repeats: int, rows: list[int], paths: list[str]) -> None:
    lins = linears(model)
    nbytes = sum(m.weight.numel() * 4 for m in lins)
    fns = {p: [prepare(p, m) for m in lins] for p in paths}
    g = torch.Generator().manual_seed(0)
    xs = {M: [torch.randn(M, m.in_features, generator=g) for m in lins] for M in rows}
    print(f"{len(lins)} linears, {nbytes / 1e6:.0f} MB fp32; gemv ISA {gemv.isa()} (2 AVX-512F, 1 AVX2+FMA, 0 C); "
          f"threads {torch.get_num_threads()}")
    # numerics first (not timed)
    print("\nnumerics over all products, max |y - ref| / max |ref|:")
    for M in rows:
        line = []
        for p in paths:
            e_lin, e_64 = 0.0, 0.0
            for f, x, m in zip(fns[p], xs[M], lins):
                with torch.inference_mode():
                    y = f(x)
                    ref = F.linear(x, m.weight, m.bias)
                    r64 = F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())
                e_lin = max(e_lin, ((y - ref).abs().max() / ref.abs().max()).item())
                e_64 = max(e_64, ((y.double() - r64).abs().max() / r64.abs().max()).item())
            line.append(f"{p} {e_lin:.1e} (fp64 {e_64:.1e})")
        print(f"  M={M}: " + "; ".join(line))
    times = {(p, M): [] for p in paths for M in rows}
    with torch.inference_mode():
        for r in range(-2, repeats):                 # two warm-up rounds
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            for M in rows:
                for p in order:
                    fs, x = fns[p], xs[M]
                    t0 = time.perf_counter()
                    for f, xi in zip(fs, x):
                        f(xi)
                    t = time.perf_counter() - t0
                    if r >= 0:
                        times[p, M].append(t)
    base = "prepack" if "prepack" in paths else paths[0]
    print(f"\nall {len(lins)} products over {repeats} interleaved repeats: median ms / best ms (GB/s at the best) "
          f"[median paired ratio to {base}]")
    print("M   " + "".join(f"{p:>28}" for p in paths))
    for M in rows:
        cells = []
        for p in paths:
            ms, best = 1e3 * statistics.median(times[p, M]), 1e3 * min(times[p, M])
            ratio = statistics.median(a / b for a, b in zip(times[p, M], times[base, M]))
            cells.append(f"{ms:6.1f}/{best:5.1f} ({nbytes / best / 1e6:4.1f}) [{ratio:4.2f}]")
        print(f"{M:<4}" + "".join(f"{c:>28}" for c in cells))


def whole_model(model, tok, repeats: int, check_tokens: int, passes: list[int]) -> None:
    """The one-token step and verify passes of `passes` tokens on one runner, its linears on gemv, gemv-prev
    or oneDNN (swapped pass by pass), and llama.cpp f32, interleaved; paired."""
    from spec import choose
    from spec.models import encode_prompt
    from spec.prompts import SEED_PROMPTS
    from spec import greedy_generate, speculative_generate, PromptLookup
    passes = sorted(set([1] + passes))
    prompt = encode_prompt(tok, SEED_PROMPTS[0])
    P, most = 64, max(passes)
    cont = greedy_generate(model, prompt, max_new_tokens=P + most - len(prompt) if len(prompt) < P else most).tokens
    ids = torch.tensor((list(prompt) + list(cont))[:P + most])
    set_gemv(model, True)
    chosen = choose.runs({"target": model}, ids[:P])
    run = chosen.runs[0]
    with torch.inference_mode():
        run(chosen.prompt, keep=1)
    made = run.executor
    print(f"target's logits: {executor.describe(model)}")
    if not made or not made.most:
        raise SystemExit("the runner does not run spec.cpu.gemv's kernel here")

    def other(small):
        """An Executor of the model whose products run `small`'s kernel (None: oneDNN alone), each linear
        its own product (no grouped panels)."""
        ex = executor.Executor(model, kernel=small is not None)
        if small is not None:
            for f in ex.linears.values():
                f.small = small(f.weight, f.bias)
            for g in ex.groups.values():
                g.whole, g.most = None, 0
        return ex
    packs = {"gemv": made,
             "gemv-prev": other(lambda w, b: gemv.product(w, b, "panel", far=0, huge=False)),
             "oneDNN": other(None)}
    names = list(packs)
    llm = f32_llama(P, [int(t) for t in ids[:P]])
    if llm is not None:
        names.append("llama.cpp f32")
    times = {(s, n): [] for s in names for n in passes}
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with torch.inference_mode():
        for r in range(-2, repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                for n in (passes if r % 2 == 0 else passes[::-1]):
                    if name == "llama.cpp f32":
                        llm.n_tokens = P          # eval() cuts the cache back to n_tokens first
                        t0 = time.perf_counter()
                        llm.eval([int(t) for t in ids[P:P + n]])
                        t = time.perf_counter() - t0
                    else:
                        run.executor = packs[name]
                        t0 = time.perf_counter()
                        run(ids[P:P + n], keep=n)
                        t = time.perf_counter() - t0
                        run.crop(P)
                    if r >= 0:
                        times[name, n].append(t)
    run.executor = made
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("ms median / best; [pass / its step: paired median, best / best]; (paired ratio to oneDNN)")
    print("n   " + "".join(f"{name:>36}" for name in names))
    for n in passes:
        cells = []
        for name in names:
            g, d, one = times[name, n], times["oneDNN", n], times[name, 1]
            cells.append(f"{1e3 * statistics.median(g):5.1f}/{1e3 * min(g):5.1f} "
                         f"[{statistics.median(a / b for a, b in zip(g, one)):.2f},{min(g) / min(one):.2f}] "
                         f"({statistics.median(a / b for a, b in zip(g, d)):.3f})")
        print(f"{n:<4}" + "".join(f"{c:>36}" for c in cells))
    set_gemv(model, True)
    for text in SEED_PROMPTS:         # all five; in 32 tokens lookup has none of its proposals accepted here
        p = encode_prompt(tok, text)
        greedy = greedy_generate(model, p, max_new_tokens=check_tokens).tokens
        out = speculative_generate(model, PromptLookup(), p, gamma=8, max_new_tokens=check_tokens)
        print(f"spec greedy == spec speculative (PromptLookup), {check_tokens} tokens: {out.tokens == greedy} "
              f"(accepted {out.accepted} of {sum(r.drafted for r in out.rounds)} proposed; {text[:30]!r})")
        assert out.tokens == greedy
    os.environ.pop("SPEC_GEMV", None)


def f32_llama(P: int, prefix: list[int]):
    """llama.cpp (llama-cpp-python) on SmolLM2's f32 GGUF (the Q4_1 file dequantized, as
    recipes/bench_cpu_limit.py makes it), one thread, every position's logits kept, `prefix` evaluated;
    None (with the reason printed) where llama-cpp-python or the gguf extra is missing."""
    try:
        from spec import realmodel
        from spec.conformance import llamacpp
        q4 = realmodel.fetch()
        f32 = q4.with_name(q4.name.replace(".Q4_1.gguf", ".f32.gguf"))
        if not f32.exists():
            llamacpp.dequantized_gguf(q4, f32, "f32")
        llm = llamacpp._llama()(model_path=str(f32), n_ctx=1024, n_threads=1, n_threads_batch=1, logits_all=True,
                                verbose=False)
    except Exception as e:          # an optional row: say why it is missing
        print(f"llama.cpp f32 row skipped: {type(e).__name__}: {e}")
        return None
    llm.reset()
    llm.eval(prefix[:P])
    return llm


def set_gemv(model, on: bool) -> None:
    from spec import probe
    if on:
        os.environ.pop("SPEC_GEMV", None)
    else:
        os.environ["SPEC_GEMV"] = "0"
    probe.forget(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,8,9")
    ap.add_argument("--paths", default="linear,prepack,numpy,panel,panel-prev,panel-4k,panel-avx512-pf1024,"
                                       "panel-avx512-pf512-far8192,panel-avx2")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--model-repeats", type=int, default=30)
    ap.add_argument("--passes", default="1,9", help="tokens per pass, for --model (1 always)")
    ap.add_argument("--check-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-micro", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from spec import realmodel
    model, tok = realmodel.load()
    assert next(model.parameters()).dtype == torch.float32, "SmolLM2 fp32 expected"
    if gemv.library() is None:
        raise SystemExit(f"spec.cpu.gemv's library is not available: {gemv.reason()}")
    if not args.skip_micro:
        micro(model, args.repeats, [int(r) for r in args.rows.split(",")], args.paths.split(","))
    if args.model:
        whole_model(model, tok, args.model_repeats, args.check_tokens, [int(n) for n in args.passes.split(",")])


if __name__ == "__main__":
    main()
