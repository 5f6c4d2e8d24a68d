"""Sweep every causal-LM family transformers can build through spec (issue 13's evidence).

    PYTHONPATH=/path/to/tree nice -n 10 env OMP_NUM_THREADS=1 python tests/sweep_architectures.py [--json out.json]
        [--families llama,mamba,...] [--timeout 90] [--lengths 64]

Not a pytest module (pytest collects test_*.py only). For each model type in
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES it builds a tiny seeded model (tests/correctness/
architectures.py), then compares against the cache-free greedy reference (full forward over
the whole sequence at each step):

  - the model's own cached greedy, driven as its authors drive it (prompt, then one token at a
    time on the cache it returns, an all-ones mask, no positions): if it already disagrees, the
    family is "self-inconsistent" (no cached decoder can be exact there) and is reported, not
    counted;
  - HF generate's greedy, reported beside as the peer's verdict and never used to excuse spec
    (it passes 0-based positions, wrong for RoBERTa's family);
  - spec.greedy_generate;
  - spec.speculative_generate with draft = the same model and draft = a perturbed copy,
    gamma 1..6 over two prompts, 24 new tokens (a sliding window of 8 is crossed, also
    inside verify passes);
  - HF assisted generation on the same models, for comparison;
  - with --lengths N, also spec.greedy_generate at every prompt length 1..N (LENGTH_NEW new
    tokens; seeded ids), so that lengths crossing a model's chunk or window are decoded too
    (Reformer pads to a multiple of its chunk length past one chunk).

Each spec outcome is one of:
  exact     every output equals the reference
  refused   an exception raised by spec itself (innermost frame in spec/) of a
            ValueError/TypeError/NotImplementedError kind: a clear refusal
  crash     any other exception (from inside transformers or torch)
  wrong     ran and returned a different sequence: silently wrong
and the family's verdict is the worst over all runs (wrong > crash > refused > exact).
A refusal is marked "late" when a forward on the prompt had already run before it was raised.
Not counted: "self-inconsistent" (the model's own cached forward ran and disagreed with the reference),
"cannot build" (the generic tiny config does not make a working model; the reason is printed)
and "timeout" (--timeout passed, almost always while building a huge default config).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "correctness"))

import torch  # noqa: E402

import architectures as archs  # noqa: E402
from oracles import cache_free_greedy, model_cached_greedy, model_own_cached_greedy  # noqa: E402

import spec  # noqa: E402
from spec import hf as spec_hf  # noqa: E402, hfref
from spec.models import perturbed_copy  # noqa: E402

MAX_NEW = 24
PROMPTS = [[5, 17, 99, 3, 250], [1, 44, 44, 7, 130, 201, 9, 66, 66, 12, 31, 8]]
# (draft, prompt index, gamma): every gamma 1..6 on both kinds of draft.
SPEC_RUNS = [("self", 0, 4), ("perturbed", 1, 3), ("self", 1, 1), ("perturbed", 0, 2), ("perturbed", 1, 6),
             ("perturbed", 0, 5)]
HF_RUNS = [("perturbed", 1, 3)]
LENGTHS = 0          # --lengths: prompt lengths 1..LENGTHS also decoded greedily (0: off)
LENGTH_NEW = 4
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)
SEVERITY = {"exact": 0, "refused": 1, "crash": 2, "wrong": 3}
SPEC_DIR = str(Path(spec.__file__).resolve().parent)


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("family took longer than --timeout")


def classify_exception(err: BaseException) -> tuple[str, str]:
    """('refused' | 'crash', one-line description with the innermost frame)."""
    frames = traceback.extract_tb(err.__traceback__)
    top = frames[-1] if frames else None
    where = f"{top.filename}:{top.lineno}" if top else "?"
    in_spec = top is not None and str(Path(top.filename).resolve()).startswith(SPEC_DIR)
    kind = "refused" if in_spec and isinstance(err, REFUSAL_TYPES) else "crash"
    short = where.replace(SPEC_DIR, "spec").split("site-packages/")[-1]
    return kind, f"{type(err).__name__}: {str(err).splitlines()[0][:150] if str(err) else ''} @ {short}"


class ForwardCounter:
    """Counts forward calls of a model on the user's prompt (to tell an up-front refusal from a
    late one). Forwards on other ids, such as a check of the model on a random sequence before
    decoding starts, are not decoding work and are not counted."""

    def __init__(self, *models, prompt=None):
        self.n = 0
        self.prompt = torch.tensor(prompt) if prompt is not None else None
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                        for m in {id(m): m for m in models}.values()]

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.prompt is None or not isinstance(ids, torch.Tensor):
            self.n += 1
        elif ids.shape[-1] >= 1 and ids.reshape(-1)[:1].tolist() == self.prompt[:1].tolist() and \
                torch.equal(ids.reshape(-1)[:min(ids.shape[-1], self.prompt.numel())],
                            self.prompt[:min(ids.shape[-1], self.prompt.numel())]):
            self.n += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def run_spec(fn, models, reference, prompt=None) -> tuple[str, str]:
    counter = ForwardCounter(*models, prompt=prompt)
    try:
        out = fn()
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - the point is to classify every failure
        kind, msg = classify_exception(err)
        if kind == "refused" and counter.n:
            msg = f"late ({counter.n} forwards on the prompt ran first) " + msg
        return kind, msg
    finally:
        counter.remove()
    if out != reference:
        first = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), min(len(out), len(reference)))
        verdict = ""
        if prompt is not None:
            try:  # a tie (top-2 gap within the dtype's noise) or a bug?
                from spec.diagnose import diagnose
                d = diagnose(models[0], prompt, reference, out)
                verdict = f", diagnose: {d.verdict} (gap {d.gap_step:.2g}, noise {d.noise:.2g})" if d else ""
            except Exception as err:  # noqa: BLE001
                verdict = f", diagnose failed: {type(err).__name__}"
        return "wrong", f"first mismatch at new token {first} (len {len(out)} vs {len(reference)}){verdict}"
    return "exact", ""


def worst(results: list[tuple[str, str]]) -> tuple[str, str]:
    return max(results, key=lambda r: SEVERITY[r[0]]) if results else ("exact", "")


def build_family(name: str):
    """(model, dtype) in fp64 if a forward runs in fp64, else fp32; a model that builds but
    whose forward fails on a plain prompt in both (MusicGen's takes one row per codebook) comes
    back in fp64 for spec to refuse; raises if none builds."""
    overrides = archs.OVERRIDES.get(name)
    errors, built = [], None
    for dtype in (torch.float64, torch.float32):
        try:
            model = archs.build(name, seed=0, dtype=dtype, overrides=overrides)
            built = built or (model, dtype)
            with torch.inference_mode():
                model(input_ids=torch.tensor([PROMPTS[0]]))
            return model, dtype
        except Timeout:
            raise
        except Exception as err:  # noqa: BLE001
            errors.append(classify_exception(err)[1])
    if built is not None:
        return built
    raise RuntimeError(" | ".join(errors))


def hf_assisted(target, draft, prompt, gamma) -> list[int]:
    """HF assisted generation, plain greedy, through spec's one HF peer (spec.hfref.hf_generate: both
    models' own generation configs swapped for bare ones while it runs, every round drafting gamma)."""
    return spec_hf.hf_assisted(target, draft, torch.tensor(prompt), gamma, MAX_NEW)


def sweep_family(name: str) -> dict:
    row = {"family": name}
    t0 = time.perf_counter()
    try:
        model, dtype = build_family(name)
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001
        return row | {"verdict": "cannot build", "detail": str(err)[:300], "seconds": time.perf_counter() - t0}
    row["dtype"] = str(dtype).replace("torch.", "")
    row["params"] = sum(p.numel() for p in model.parameters())
    row["kind"] = archs.cache_kind(model)
    drafts = {"self": model, "perturbed": perturbed_copy(model, noise=0.2, seed=1)}

    try:
        refs = [cache_free_greedy(model, p, MAX_NEW) for p in PROMPTS]
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001
        # No reference to judge against; spec must still refuse such a model up front, not crash.
        kind, msg = run_spec(lambda: spec.greedy_generate(model, PROMPTS[0], max_new_tokens=MAX_NEW).tokens,
                             [model], None, PROMPTS[0])
        verdict = {"refused": "refused", "crash": "crash"}.get(kind, "cannot build")
        return row | {"verdict": verdict, "detail": msg if kind in ("refused", "crash") else
                      "reference: " + classify_exception(err)[1], "seconds": time.perf_counter() - t0}

    for key, oracle in (("own_cached", model_own_cached_greedy), ("hf_generate", model_cached_greedy)):
        verdicts = []
        for p, ref in zip(PROMPTS, refs):
            try:
                verdicts.append("exact" if oracle(model, p, MAX_NEW) == ref else "wrong")
            except Timeout:
                raise
            except Exception as err:  # noqa: BLE001
                verdicts.append("crash: " + classify_exception(err)[1])
        row[key] = "exact" if all(v == "exact" for v in verdicts) else next(v for v in verdicts if v != "exact")

    greedy = [run_spec(lambda p=p: spec.greedy_generate(model, p, max_new_tokens=MAX_NEW).tokens, [model], ref, p)
              for p, ref in zip(PROMPTS, refs)]
    gen = torch.Generator().manual_seed(7)
    for length in range(1, LENGTHS + 1):
        p = torch.randint(1, 250, (length,), generator=gen).tolist()
        try:
            ref = cache_free_greedy(model, p, LENGTH_NEW)
        except Timeout:
            raise
        except Exception:  # noqa: BLE001 - the model's own forward stops short of this length
            continue
        greedy.append(run_spec(lambda p=p: spec.greedy_generate(model, p, max_new_tokens=LENGTH_NEW).tokens,
                               [model], ref, p))
        if greedy[-1][0] in ("crash", "wrong"):
            greedy[-1] = (greedy[-1][0], f"prompt length {length}: {greedy[-1][1]}")
            break
    specs = []
    for d, p, g in SPEC_RUNS:
        specs.append(run_spec(lambda: spec.speculative_generate(model, drafts[d], PROMPTS[p], gamma=g,
                                                                max_new_tokens=MAX_NEW).tokens,
                              [model, drafts[d]], refs[p], PROMPTS[p]))
        if specs[-1][0] in ("crash", "wrong"):
            break  # the verdict is already a failure; the rest would only cost time
    row["greedy"], row["greedy_detail"] = worst(greedy)
    row["spec"], row["spec_detail"] = worst(specs)
    row["spec_by_run"] = [f"{d}/p{p}/g{g}:{r[0]}" for (d, p, g), r in zip(SPEC_RUNS, specs)]

    hf = []
    for d, p, g in HF_RUNS:
        try:
            hf.append(("exact", "") if hf_assisted(model, drafts[d], PROMPTS[p], g) == refs[p] else ("wrong", ""))
        except Timeout:
            raise
        except Exception as err:  # noqa: BLE001
            msg = classify_exception(err)[1]
            # HF's own up-front refusals are ValueErrors raised from generation/utils.py.
            hf.append(("refused" if isinstance(err, ValueError) and "generation" in msg else "crash", msg))
    row["hf_assisted"], row["hf_detail"] = worst(hf)

    spec_verdict = worst([(row["greedy"], row["greedy_detail"]), (row["spec"], row["spec_detail"])])
    # Only the model's own cached forward that RAN and disagreed makes the family self-inconsistent;
    # one that crashed (or a forward with no cache) says nothing about the reference, and HF
    # generate's verdict (row["hf_generate"]) excuses nothing.
    # A family whose own cached forward disagrees with its full forward is reported as
    # self-inconsistent only where spec is wrong too; where spec is exact, it is counted exact.
    row["verdict"] = "self-inconsistent" if row["own_cached"] == "wrong" and spec_verdict[0] == "wrong" \
        else spec_verdict[0]
    row["detail"] = spec_verdict[1]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _sweep_one(name: str, timeout: int) -> dict:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # Reformer print()s
            return sweep_family(name)
    except Timeout:
        # Reported on its own: most are huge default configs still building (BLT), not a spec fault.
        return {"family": name, "verdict": "timeout", "detail": f"timeout after {timeout}s"}
    except MemoryError as err:
        return {"family": name, "verdict": "cannot build", "detail": f"MemoryError {err}"}
    finally:
        signal.alarm(0)


def _print_row(row: dict) -> None:
    print(f"{row['family']:28s} {row['verdict']:18s} greedy={row.get('greedy', '-'):7s} spec={row.get('spec', '-'):7s} "
          f"own={str(row.get('own_cached', '-'))[:5]:5s} hfgen={str(row.get('hf_generate', '-'))[:5]:5s} "
          f"hf={row.get('hf_assisted', '-'):7s} "
          f"{row.get('dtype', ''):7s} {row.get('kind', ''):14s} {row.get('seconds', 0):5.1f}s  "
          f"{row.get('detail', '')[:140]}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--families", help="comma-separated model types (default: all causal-LM families)")
    ap.add_argument("--timeout", type=int, default=90, help="seconds per family before it counts as a crash")
    ap.add_argument("--jobs", type=int, default=1, help="families swept in parallel worker processes")
    ap.add_argument("--memory-gb", type=float, default=8.0, help="address-space cap, so one huge default config "
                    "cannot take the machine")
    ap.add_argument("--lengths", type=int, default=0, help="also decode greedily at every prompt length 1..N")
    args = ap.parse_args(argv)
    global LENGTHS
    LENGTHS = args.lengths
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    limit = int(args.memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)

    families = args.families.split(",") if args.families else archs.all_families()
    print(f"spec from {SPEC_DIR}; transformers {transformers.__version__}; torch {torch.__version__}; "
          f"{len(families)} families", flush=True)
    rows = []
    t_start = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=8) as pool:
            for row in pool.imap_unordered(functools.partial(_sweep_one, timeout=args.timeout), families):
                rows.append(row)
                _print_row(row)
        rows.sort(key=lambda r: families.index(r["family"]))
    else:
        for name in families:
            rows.append(_sweep_one(name, args.timeout))
            _print_row(rows[-1])

    counted = [r for r in rows if r["verdict"] not in ("self-inconsistent", "cannot build", "timeout")]
    totals = {v: sum(r["verdict"] == v for r in rows) for v in
              ("exact", "refused", "crash", "wrong", "self-inconsistent", "cannot build", "timeout")}
    hf_totals = {v: sum(r.get("hf_assisted") == v for r in counted) for v in ("exact", "refused", "crash", "wrong")}
    hf_generate = {v: sum(str(r.get("hf_generate", "")).split(":")[0] == v for r in counted) for v in ("exact", "wrong", "crash")}
    late = sum(r.get("detail", "").startswith("late (") for r in rows)
    print(f"\nspec verdicts over {len(rows)} families: {totals}  (late refusals: {late})")
    print(f"HF assisted over the {len(counted)} counted families: {hf_totals}")
    print(f"HF generate's greedy over the {len(counted)} counted families: {hf_generate}")
    print(f"sweep took {time.perf_counter() - t_start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": SPEC_DIR, "transformers": transformers.__version__,
                                               "totals": totals, "hf_totals": hf_totals, "hf_generate": hf_generate,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
