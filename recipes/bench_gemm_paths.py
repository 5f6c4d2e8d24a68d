"""Which CPU GEMM path a few-row fp32 linear should take (issue 43): SmolLM2-135M's own linears (its
real weights, read from the model's nn.Linear modules in forward order: 30 x q, k, v, o, gate, up, down,
then the 49152-wide head), at M = 1, 2, 3, 4, 5, 8, 9 and 16 rows, one thread, the paths interleaved
(every repeat runs each path at each M over all 211 products, paths in a rotating order). Paths:

    linear   F.linear(x, W), W [out, in]: what transformers runs (MKL sgemm)
    xWt      x @ W^T with W^T stored contiguous [in, out] once
    mkl      MKL packed GEMM: torch.ops.mkl._mkl_reorder_linear_weight(W, 1) once (the packed B does
             not depend on the hint), then torch.ops.mkl._mkl_linear(x, packed, W, b, M) (the batch size
             argument must equal x's rows or it falls back to aten::linear)
    dnnK     oneDNN prepacked: torch.ops.mkldnn._reorder_linear_weight(W, K) once (K: the batch size
             hint oneDNN picks the weight's layout for, e.g. dnn1, dnn4, dnn16), then
             torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "") for every M
    ...p     a path with a 2-row input padded to 3 rows (e.g. dnn16p; oneDNN's 2-row product is slow)
    ...P     the same with 1 and 2 rows padded to 3
    gemv     M separate one-row F.linear calls, concatenated (M <= 5)

Numerics: each path's max |y - F.linear| over all 211 products, relative to max |F.linear|, beside
F.linear's own error against an fp64 product (the scale of fp32 rounding).

--model: SmolLM2's cached passes after a 64-token prefix through spec's target runner (spec.choose),
1, 2, 3, 4, 5, 8, 9 and 16 tokens, linear against the paths in --model-paths applied to every nn.Linear
by a context manager that swaps the module's forward and puts it back (path prepack: spec.cpu.prepack's
packed_forward: dnn16P, bias included); each pass in one-token steps of
its own path, the fitted verify line, and the one-token step's ratio between paths.

--steps N: the one-token step alone, linear against --step-paths, N repeats alternating step by step.

--compile: torch.compile(freezing=True) of one Linear(576 -> 1536) at a static 4 rows, against F.linear.

    python recipes/bench_gemm_paths.py [--repeats 15] [--model] [--model-repeats 15] [--steps 200]
                                      [--compile]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

ROWS = (1, 2, 3, 4, 5, 8, 9, 16)
CLASSES = ("q", "k", "v", "o", "gate", "up", "down")


def linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """Every nn.Linear in forward order, named by its role (q ... down, head)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            role = name.rsplit(".", 1)[-1].removesuffix("_proj")
            out.append(("head" if role == "lm_head" else role, m))
    return out


def padded(fn, small=(2,)):
    """fn with an input of `small` rows padded to 3 (zero rows), the pad's output rows dropped."""
    def run(x):
        rows = x.numel() // x.shape[-1]
        if rows not in small:
            return fn(x)
        flat = x.reshape(rows, x.shape[-1])
        y = fn(torch.cat([flat, flat.new_zeros(3 - rows, flat.shape[1])]))[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return run


def prepare(path: str, w: torch.Tensor, rows: int = 0):
    """A callable x -> x W^T for one weight along one path (weights prepared here, not timed)."""
    if path[-1] in "pP":
        return padded(prepare(path[:-1], w, rows), (2,) if path[-1] == "p" else (1, 2))
    if path == "linear":
        return lambda x: F.linear(x, w)
    if path == "xWt":
        wt = w.t().contiguous()
        return lambda x: x @ wt
    if path == "mkl":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])
    if path.startswith("dnn"):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, int(path[3:]))
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if path == "gemv":
        return lambda x: torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])])
    raise ValueError(path)


def micro(model, repeats: int, paths: list[str]) -> None:
    """Each repeat runs every (rows, path) pair over all products, paths in a rotating order, so that
    load drift on a shared box hits every row count and path alike."""
    mods = linears(model)
    gen = torch.Generator().manual_seed(0)
    print(f"{len(mods)} products; paths {paths}; {repeats} repeats, rows and paths interleaved\n")
    fns = {p: [prepare(p, m.weight, 0) for _, m in mods] for p in paths}
    xs = {rows: {i: torch.randn(rows, i, generator=gen) for i in {m.in_features for _, m in mods}} for rows in ROWS}
    runs = {rows: [p for p in paths if p != "gemv" or rows <= 5] for rows in ROWS}
    for rows in ROWS:  # numerics
        err, scale = defaultdict(float), 0.0
        for k, (_, m) in enumerate(mods):
            x = xs[rows][m.in_features]
            ref = F.linear(x, m.weight)
            scale = max(scale, ref.abs().max().item())
            err["fp64"] = max(err["fp64"], (F.linear(x.double(), m.weight.double()) - ref.double()).abs().max().item())
            for p in runs[rows]:
                err[p] = max(err[p], (fns[p][k](x) - ref).abs().max().item())
        print(f"M = {rows}: max |y - F.linear| / max |F.linear|: "
              + ", ".join(f"{p} {err[p] / scale:.1e}" for p in ["fp64"] + runs[rows]))
    per = {(p, rows): defaultdict(list) for rows in ROWS for p in runs[rows]}
    for r in range(-1, repeats):  # r = -1: warm-up, not kept
        for rows in ROWS:
            these = runs[rows][r % len(runs[rows]):] + runs[rows][:r % len(runs[rows])]
            for p in these:
                sums = defaultdict(float)
                for k, (role, m) in enumerate(mods):
                    x = xs[rows][m.in_features]
                    t0 = time.perf_counter()
                    fns[p][k](x)
                    sums[role] += time.perf_counter() - t0
                if r >= 0:
                    for role, t in sums.items():
                        per[p, rows][role].append(t)
                    per[p, rows]["all"].append(sum(sums.values()))
    print("\nmedian ms by role (summed over the layers), best of all, median of paired ratios to linear")
    print(f"  {'M':>2} {'path':<7}" + "".join(f"{c:>7}" for c in CLASSES + ("head", "all")) + "   best  /linear")
    for rows in ROWS:
        for p in runs[rows]:
            med = {c: 1e3 * statistics.median(per[p, rows][c]) for c in CLASSES + ("head", "all")}
            ratio = statistics.median(a / b for a, b in zip(per[p, rows]["all"], per["linear", rows]["all"]))
            print(f"  {rows:>2} {p:<7}" + "".join(f"{med[c]:7.2f}" for c in CLASSES + ("head", "all"))
                  + f" {1e3 * min(per[p, rows]['all']):6.1f}  {ratio:6.3f}", flush=True)
    print("\nall 211 products, median ms (x the same path's 1-row median; x linear's at the same M, paired):")
    print("| M | " + " | ".join(paths) + " |")
    print("| --- |" + " --- |" * len(paths))
    for rows in ROWS:
        cells = []
        for p in paths:
            if (p, rows) not in per:
                cells.append("-")
                continue
            t, one = per[p, rows]["all"], per[p, 1]["all"]
            ratio = statistics.median(a / b for a, b in zip(t, per["linear", rows]["all"]))
            cells.append(f"{1e3 * statistics.median(t):.1f} ({statistics.median(t) / statistics.median(one):.2f}x; "
                         f"{ratio:.2f})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


@contextlib.contextmanager
def swapped(model, path: str, prepared: dict):
    """Every nn.Linear runs `path` (its weight prepared once in `prepared`); the model's own forwards
    are put back on exit."""
    mods = [m for _, m in linears(model)]
    if path == "linear":
        yield
        return
    if path not in prepared:
        t0 = time.perf_counter()
        prepared[path] = {id(m): prepare_module(path, m) for m in mods}
        print(f"{path}: weights prepared in {time.perf_counter() - t0:.2f} s")
    try:
        for m in mods:
            m.forward = prepared[path][id(m)]
        yield
    finally:
        for m in mods:
            del m.forward


def prepare_module(path: str, m: torch.nn.Linear):
    """prepare() for a whole module: bias, and inputs of any leading shape (flattened to rows)."""
    w, b = m.weight, m.bias
    if path == "prepack":
        from spec.cpu import prepack
        return prepack.packed_forward(m)
    if path[-1] in "pP":
        return padded(prepare_module(path[:-1], m), (2,) if path[-1] == "p" else (1, 2))
    if path == "mkl":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)

        def fwd(x):
            rows = x.numel() // x.shape[-1]
            return torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
        return fwd
    if path.startswith("dnn") and path[3:]:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, int(path[3:]))
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    if path == "xWt":
        wt = w.t().contiguous()
        return lambda x: torch.addmm(b, x.reshape(-1, x.shape[-1]), wt).reshape(*x.shape[:-1], -1) \
            if b is not None else x @ wt
    raise ValueError(path)


@torch.inference_mode()
def whole_model(model, tok, repeats: int, paths: list[str]) -> None:
    from spec import choose, realmodel  # noqa: F401
    text = ("The quick brown fox jumps over the lazy dog. " * 20)
    ids = torch.tensor(tok(text)["input_ids"][:64])
    chosen = choose.runs({"target": model}, ids)
    prompt, (run,) = chosen.prompt, chosen.runs
    prepared: dict = {}
    variants = ["linear"] + paths
    # numerics on the model: logits of a 9-token pass, each path against linear
    run(prompt, keep=1)
    P = prompt.numel()
    fed = prompt[torch.arange(16) % P]
    ref = run(fed[:9], keep=9).clone()
    run.crop(P)
    for v in paths:
        with swapped(model, v, prepared):
            out = run(fed[:9], keep=9)
        run.crop(P)
        same = bool((out.argmax(-1) == ref.argmax(-1)).all())
        print(f"model logits, 9-token pass, {v} vs linear: max |diff| {(out - ref).abs().max().item():.2e} "
              f"(logit scale {ref.abs().max().item():.1f}), argmax equal {same}")
    times = {(v, n): [] for v in variants for n in ROWS}
    for v in variants:  # warm-up
        with swapped(model, v, prepared):
            for n in ROWS:
                run(fed[:n], keep=n)
                run.crop(P)
    for r in range(repeats):  # a block per path, every pass size in it: a pass and its step seconds apart
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        sizes = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
        for v in order:
            with swapped(model, v, prepared):
                for n in sizes:
                    t0 = time.perf_counter()
                    run(fed[:n], keep=n)
                    times[v, n].append(time.perf_counter() - t0)
                    run.crop(P)
    med = {k: statistics.median(t) for k, t in times.items()}
    steps = {(v, n): statistics.median(a / b for a, b in zip(times[v, n], times[v, 1]))
             for v in variants for n in ROWS}
    print(f"\nwhole model, {repeats} repeats interleaved: pass of n tokens (g = n - 1 drafted): median ms; "
          "in one-token steps of the same path, median of the paired ratios (same repeat), then best pass / best step")
    print("| tokens n (g) | " + " | ".join(variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for n in ROWS:
        print(f"| {n} ({n - 1}) | " + " | ".join(
            f"{1e3 * med[v, n]:.1f} ms ({steps[v, n]:.2f}; {min(times[v, n]) / min(times[v, 1]):.2f})"
            for v in variants) + " |")
    gs = [n - 1 for n in ROWS if n > 1]
    for v in variants:
        ys = [steps[v, g + 1] for g in gs]
        mg, my = statistics.fmean(gs), statistics.fmean(ys)
        slope = sum((g - mg) * (y - my) for g, y in zip(gs, ys)) / sum((g - mg) ** 2 for g in gs)
        step_ratio = statistics.median(a / b for a, b in zip(times[v, 1], times["linear", 1]))
        print(f"{v:<7} verify line {my - slope * mg:.2f} + {slope:.3f} g steps; one-token step "
              f"{1e3 * med[v, 1]:.1f} ms (best {1e3 * min(times[v, 1]):.1f}): x linear's {step_ratio:.3f} "
              f"(median of paired ratios), {min(times[v, 1]) / min(times['linear', 1]):.3f} (best over best)")


@torch.inference_mode()
def step_ab(model, tok, repeats: int, paths: list[str], tokens: int = 1) -> None:
    """The one-token step (or a pass of `tokens`) alone, linear against each path, alternating pass
    by pass (rotating order), so that each path's pass has linear's a fraction of a second away."""
    from spec import choose
    ids = torch.tensor(tok("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"][:64])
    chosen = choose.runs({"target": model}, ids)
    prompt, (run,) = chosen.prompt, chosen.runs
    run(prompt, keep=1)
    P, fed = prompt.numel(), prompt[:tokens]
    prepared: dict = {}
    variants = ["linear"] + paths
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(-2, repeats):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            with swapped(model, v, prepared):
                t0 = time.perf_counter()
                run(fed, keep=tokens)
                if r >= 0:
                    times[v].append(time.perf_counter() - t0)
                run.crop(P)
    print(f"\n{tokens}-token pass alone, {repeats} repeats alternating:")
    for v in variants:
        ratio = statistics.median(a / b for a, b in zip(times[v], times["linear"]))
        print(f"  {v:<8} median {1e3 * statistics.median(times[v]):6.1f} ms, best {1e3 * min(times[v]):6.1f} ms; "
              f"x linear's: {ratio:.3f} (median of paired ratios), {min(times[v]) / min(times['linear']):.3f} "
              "(best over best)", flush=True)


def compiled(repeats: int) -> None:
    import torch._inductor.config as cfg
    cfg.freezing = True
    lin = torch.nn.Linear(576, 1536, bias=False).eval()
    x = torch.randn(4, 576)
    t0 = time.perf_counter()
    fn = torch.compile(lin)
    with torch.no_grad():
        y = fn(x)
    print(f"compile: {time.perf_counter() - t0:.1f} s; max |diff| vs F.linear "
          f"{(y - F.linear(x, lin.weight)).abs().max().item():.1e}")
    ws = [torch.randn(1536, 576) * 0.02 for _ in range(30)]  # 30 other weights between calls: out of cache
    a, b = [], []
    with torch.no_grad():
        for _ in range(repeats * 20):
            for w in ws:
                F.linear(x, w)
            t0 = time.perf_counter()
            fn(x)
            a.append(time.perf_counter() - t0)
            for w in ws:
                F.linear(x, w)
            t0 = time.perf_counter()
            F.linear(x, lin.weight)
            b.append(time.perf_counter() - t0)
    print(f"4 x 576 -> 1536, weight out of cache: compiled {1e6 * statistics.median(a):.0f} us, "
          f"F.linear {1e6 * statistics.median(b):.0f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--paths", default="linear,xWt,mkl,dnn1,dnn4,dnn16,dnn16p,gemv")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--model", action="store_true")
    p.add_argument("--model-paths", default="mkl,dnn16,dnn16p,prepack")
    p.add_argument("--model-repeats", type=int, default=15)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=0, help="repeats of the one-token step A/B (0: none)")
    p.add_argument("--step-paths", default="dnn16,dnn16P,prepack")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from spec import realmodel
    model, tok = realmodel.load()
    model.eval()
    if not args.skip_micro:
        micro(model, args.repeats, args.paths.split(","))
    if args.model:
        whole_model(model, tok, args.model_repeats, args.model_paths.split(","))
    if args.steps:
        step_ab(model, tok, args.steps, args.step_paths.split(","))
    if args.compile:
        compiled(args.repeats)


if __name__ == "__main__":
    main()
