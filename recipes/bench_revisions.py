"""Single-prompt speed of this checkout against another git revision, in one run.

A restructuring of the decode loop must not cost speed at batch size 1. This recipe exports the
`spec/` package of `--base` (default: the parent commit) into a temporary folder and times the same
workloads with both revisions in one process, on the same model objects: each revision's `spec`
modules are imported side by side (put into sys.modules in turn before each of its runs, so that
its lazy imports find its own), the models are loaded once, and each prompt runs with both revisions
back to back (the first in turn), so that drift slower than one prompt's run hits both alike. Timing
fresh processes instead measures the process as much as the code: on a 2-core VM two processes of
the same revision differed by up to 40%; in one process the weights are the same objects for both.

Per workload it prints each revision's time (per prompt the median of the repeats, summed over the
prompts) and their ratio (this checkout / base: below 1 is faster); the same ratio from the best
times (per prompt the fastest repeat: interference only ever adds time); the spread of the
back-to-back pairs' ratios (10th to 90th percentile); the rounds (head's) and what head adds to a
round, in microseconds (per prompt the median of the back-to-back differences); and whether the
outputs are identical. Run it with `--base HEAD` first: what it prints for the same code is this
machine's noise floor. The "loop:" workloads put a one-layer, 16-wide GPT-NeoX in the target's place
(or the draft's): with the model's cost near zero, what the loop itself adds to a round is measured
well inside the noise that hides it in the real workloads; set against a real workload's seconds per
round it bounds what the loop's code can cost there.

Workloads (1 thread, the API's defaults otherwise): the shipped pair, speculative (gamma 5) and
greedy, and the same two with the near-free target, 5 code prompts x 128 tokens; with `--real`, SmolLM2-135M-Instruct fp32 (`python -m
spec.realmodel` first) with prompt lookup (gamma 8) and greedy, 5 seed prompts x 128 tokens.

    python recipes/bench_revisions.py [--base 071f4fe] [--repeats 10] [--real] [--out revisions.json]

The JSON carries a "meta" block (date, machine, commit, versions), as every results file of recipes/ does;
spec.conformance.provenance, which writes it, is loaded from this checkout's file, since the recipe swaps
`spec` packages in sys.modules.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 128


def _provenance():
    """spec.conformance.provenance of this checkout, loaded from its file (standard library only) outside
    the `spec` packages this recipe swaps."""
    loader = importlib.util.spec_from_file_location("_revisions_provenance",
                                                    ROOT / "spec" / "conformance" / "provenance.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def export(rev: str, into: Path) -> Path:
    """`spec/` as of `rev`, unpacked under `into` (an importable folder)."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "spec"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def _drop_spec() -> None:
    """Forget every imported `spec` module (another revision's go in next)."""
    for name in [m for m in sys.modules if m == "spec" or m.startswith("spec.")]:
        del sys.modules[name]


def import_spec(where: Path) -> dict:
    """The `spec` package found under `where`, imported fresh: its modules, by name."""
    _drop_spec()
    sys.path.insert(0, str(where))
    try:
        import spec  # noqa: F401 - imported for its side effect on sys.modules
        import spec.decode, spec.lookup, spec.models, spec.prompts  # noqa: F401, E401
        if Path(spec.__file__).resolve().parents[1] != where.resolve():
            raise RuntimeError(f"imported {spec.__file__}, not the spec under {where}")
    finally:
        sys.path.remove(str(where))
    return {m: mod for m, mod in sys.modules.items() if m == "spec" or m.startswith("spec.")}


def activate(modules: dict):
    """Put one revision's modules into sys.modules (for its lazy imports); its `spec` package."""
    _drop_spec()
    sys.modules.update(modules)
    return modules["spec"]


def workloads(spec, real: bool) -> tuple[dict, list]:
    """{name: (target, draft or None, gamma)} and the prompts' ids, loaded once by `spec`."""
    if real:
        from spec import realmodel
        target, tokenizer = realmodel.load(say=lambda *a: None)
        pairs = {"smollm2 prompt lookup g8": (target, "lookup", 8), "smollm2 greedy": (target, None, 0)}
        prompts = spec.prompts.SEED_PROMPTS
    else:
        pair = spec.load_pair()
        target, tokenizer = pair.target, pair.tokenizer
        tiny = near_free_model(target)
        pairs = {"pair speculative g5": (target, pair.draft, 5), "pair greedy": (target, None, 0),
                 "loop: tiny target, pair draft g5": (tiny, pair.draft, 5), "loop: tiny greedy": (tiny, None, 0)}
        prompts = spec.prompts.CODE_PROMPTS
    return pairs, [tokenizer(p, return_tensors="pt").input_ids for p in prompts]


def near_free_model(target):
    """A GPT-NeoX with the target's vocabulary and special ids but one layer 16 wide: its forward
    costs little beside the loop, so the loop's own cost per round shows (the "loop:" workloads)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    c = target.config
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=c.vocab_size, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=32,
                                            max_position_embeddings=c.max_position_embeddings,
                                            bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                                            pad_token_id=c.pad_token_id)).eval()


def time_once(spec, model, draft, gamma: int, x: torch.Tensor) -> tuple[float, list[int], int]:
    """One prompt's seconds with this revision's API, its output and its rounds. The garbage
    collector is off while it runs (as in timeit), so that a collection lands in neither side."""
    if draft is None:
        run = lambda: spec.decode.greedy_generate(model, x, max_new_tokens=MAX_NEW)     # noqa: E731
    else:                   # prompt lookup: this revision's class, fresh for each prompt
        drafter = spec.lookup.PromptLookup() if draft == "lookup" else draft
        run = lambda: spec.decode.speculative_generate(model, drafter, x, gamma=gamma,     # noqa: E731
                                                       max_new_tokens=MAX_NEW)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = run()
        return time.perf_counter() - t0, result.tokens, len(result.rounds)
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead of the shipped pair")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    provenance = _provenance()
    meta = provenance.meta(provenance.recipe_command(__file__))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="spec-revisions-") as tmp:
        sides = {"base": import_spec(export(args.base, Path(tmp) / "base")), "head": import_spec(ROOT)}
        pairs, ids = workloads(activate(sides["head"]), args.real)
        times: dict = {side: {name: [] for name in pairs} for side in sides}
        outputs: dict = {name: {} for name in pairs}
        rounds: dict = {name: {} for name in pairs}
        with torch.inference_mode():
            for name, (model, draft, gamma) in pairs.items():
                for side, modules in sides.items():          # warm-up: probes, first-call costs
                    for x in ids:
                        time_once(activate(modules), model, draft, gamma, x)
                for r in range(args.repeats):
                    row: dict = {side: [] for side in sides}
                    for i, x in enumerate(ids):             # each prompt with both sides back to back,
                        order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]     # first in turn
                        for side in order:
                            seconds, tokens, rounds[name][i] = time_once(activate(sides[side]), model, draft,
                                                                         gamma, x)
                            row[side].append(seconds)
                            outputs[name].setdefault(side, {})[i] = tokens
                    for side in sides:
                        times[side][name].append(row[side])
    rows = {}
    print(f"{'workload':33s} {'base s':>7s} {'head s':>7s} {'head/base':>9s} {'best':>6s} "
          f"{'pairs 10%..90%':>14s} {'rounds':>6s} {'+us/round':>9s}  outputs")
    for name in pairs:
        base, head = times["base"][name], times["head"][name]        # [repeat][prompt] seconds
        # Per prompt the median of the repeats, summed: each revision's time for the workload.
        median = {side: sum(statistics.median(run[i] for run in times[side][name]) for i in range(len(ids)))
                  for side in sides}
        best = {side: sum(min(run[i] for run in times[side][name]) for i in range(len(ids))) for side in sides}
        pairs_ = sorted(h / b for hs, bs in zip(head, base) for h, b in zip(hs, bs))
        decile = statistics.quantiles(pairs_, n=10) if len(pairs_) > 1 else pairs_ * 9
        # What head adds to a round: per prompt the median of the back-to-back differences, per round.
        extra = sum(statistics.median(hs[i] - bs[i] for hs, bs in zip(head, base)) for i in range(len(ids)))
        per_round = extra / sum(rounds[name].values()) * 1e6
        same = outputs[name]["base"] == outputs[name]["head"]
        rows[name] = dict(base_s=base, head_s=head, ratio=median["head"] / median["base"],
                          best_ratio=best["head"] / best["base"], rounds=sum(rounds[name].values()),
                          extra_us_per_round=per_round, identical=same)
        print(f"{name:33s} {median['base']:7.3f} {median['head']:7.3f} {median['head'] / median['base']:9.3f} "
              f"{best['head'] / best['base']:6.3f} {decile[0]:6.3f}..{decile[-1]:.3f} "
              f"{sum(rounds[name].values()):6d} {per_round:9.1f}  {'identical' if same else 'DIFFER'}")
    if args.out:
        args.out.write_text(json.dumps(dict(meta=meta, base=args.base, repeats=args.repeats, workloads=rows),
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
