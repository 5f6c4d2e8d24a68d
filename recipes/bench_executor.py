"""The executor against the patches it replaced (issue 43's "an executor, not patches"), paired in one process.

  old   spec.cpu.prepack and spec.cpu.plainllama as of 203e101 (read from git): every nn.Linear's and decoder
        layer's `forward` swapped in for the pass, the model's own forward around them, and at 2 torch threads
        a few-row pass run with torch set to 1 thread and the kernel's pool to 2
  new   spec.cpu.executor: the runner calls the Executor; no forward replaced, torch's threads untouched,
        the kernel's threads named per call

Both on the same packed weights' code (spec.cpu.gemv), the same KVRunner and the same cache, for a one-token
step and a 9-row pass on top of P cached positions, at 1 and 2 torch threads; the configurations alternate
within each round, and each figure is the median over rounds of a round's median. Also the old code at 2
threads without its thread switch ("old-noswitch": what keeping torch's threads costs a pass whose torch ops
go parallel), with --noswitch. With --qwen2, a random Qwen2 of SmolLM2's shapes (not a plain Llama: the new
code runs it on executor.Linears, its own forward with its products packed) and its own forward unpacked
beside ("own").

    python recipes/bench_executor.py [--rounds 7] [--passes 8] [--cached 64 256] [--noswitch] [--qwen2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec import clock, hf, realmodel, runner  # noqa: E402
from spec.cpu import executor, gemv  # noqa: E402

OLD = "203e101"


class _OldGemv(types.ModuleType):
    """spec.cpu.gemv as the old code saw it: `set_threads(n)` a setting its products then run at (now
    named per call)."""

    def __init__(self):
        super().__init__("old_gemv")
        self.threads = 1

    def __getattr__(self, name):
        return getattr(gemv, name)

    def set_threads(self, n: int) -> int:
        self.threads = n
        return n

    def product(self, *a, **k):
        p = gemv.product(*a, **k)
        return lambda x: p(x, threads=self.threads)

    def grouped(self, *a, **k):
        made = gemv.grouped(*a, **k)
        if made is None:
            return None
        whole, parts = made
        return (lambda x: whole(x, threads=self.threads)), [(lambda x, p=p: p(x, threads=self.threads)) for p in parts]


def load_old():
    """The old prepack and plainllama modules, on _OldGemv."""
    shim = _OldGemv()
    mods = {}
    for name in ("plainllama", "prepack"):
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD}:spec/cpu/{name}.py"], check=True,
                                capture_output=True, text=True).stdout
        source = source.replace("from spec.cpu import gemv, plainllama", "from spec.cpu import gemv")
        source = source.replace("from spec.cpu import gemv\n", "")
        spec = importlib.util.spec_from_loader(f"old_{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        module.gemv = shim
        if name == "prepack":
            module.plainllama = mods["plainllama"]
        exec(compile(source, f"{OLD}:spec/cpu/{name}.py", "exec"), module.__dict__)
        mods[name] = module
    return mods["prepack"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--cached", type=int, nargs="+", default=[64, 256])
    p.add_argument("--noswitch", action="store_true")
    p.add_argument("--qwen2", action="store_true")
    args = p.parse_args(argv)
    if args.qwen2:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                             tie_word_embeddings=True)).float().eval()
    else:
        model, _ = realmodel.load(lambda msg: print(msg, file=sys.stderr))
    old = load_old()
    ids = torch.randint(0, 49152, (max(args.cached) + 16,), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    with torch.inference_mode():
        print("new:", executor.describe(model))
        assert old.used(model) and old.kernel_used(model) and old.layers_used(model) != args.qwen2
        packed = old.forwards(model)
    real_pass_threads = old.pass_threads

    def timed(run, P, n, context):
        out = []
        for _ in range(args.passes):
            t0 = clock.now()
            with context(n):
                run(ids[P:P + n], keep=n)
            out.append(clock.now() - t0)
            run.crop(P)
        return statistics.median(out)

    configs = [("old", 1), ("new", 1), ("old", 2), ("new", 2)] + ([("old-noswitch", 2)] if args.noswitch else []) \
        + ([("own", 1), ("own", 2)] if args.qwen2 else [])
    results: dict = {}
    with torch.inference_mode():
        runs = {}
        for name in ("old", "new", "own"):
            for P in args.cached:
                r = runner.KVRunner(model)
                r.executor = executor.executor_for(model) if name == "new" else None
                r(ids[:P])
                runs[name, P] = r
        for _ in range(args.rounds):
            for name, threads in configs:
                torch.set_num_threads(threads)
                if name == "old-noswitch":
                    old.pass_threads = lambda packed, rows: 0
                    old.gemv.threads = 2

                def context(n, name=name):
                    return old.swapped(packed, n) if name.startswith("old") else _null()
                for P in args.cached:
                    for n in (1, 9):
                        results.setdefault((name, threads, P, n), []).append(
                            timed(runs["old" if name.startswith("old") else name, P], P, n, context))
                old.pass_threads = real_pass_threads
                old.gemv.threads = 1
    torch.set_num_threads(1)
    print(f"{'config':14} {'threads':>7} {'cached':>6} {'rows':>4} {'median ms':>9}  rounds")
    for (name, threads, P, n), v in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][1], kv[0][0])):
        print(f"{name:14} {threads:7d} {P:6d} {n:4d} {statistics.median(v) * 1e3:9.2f}  "
              + " ".join(f"{x * 1e3:.1f}" for x in v))
    print("\nnew / old, per round (paired), median:")
    for threads in (1, 2):
        for P in args.cached:
            for n in (1, 9):
                ratios = [b / a for a, b in zip(results["old", threads, P, n], results["new", threads, P, n])]
                print(f"  {threads} threads, {P} cached, {n} rows: {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f}-{max(ratios):.3f})"
                      + (f"; own / old {statistics.median([b / a for a, b in zip(results['old', threads, P, n], results['own', threads, P, n])]):.3f}"
                         if args.qwen2 else ""))
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
