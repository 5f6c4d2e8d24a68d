"""The seed experiment, step by step: what `python -m spec` runs.

Each step is one function that returns plain data (dicts, lists, the loaded pair);
spec/report.py renders that data and spec/__main__.py parses options, calls the
steps in order and prints. The steps:

  setup      seed, threads, transformers' own logging silenced, the output folder
  load       the target/draft pair (the shipped one, the seeded stand-in, or paths)
  prompts    the prompt texts and their token ids, checked against the models' limits
  costs      warm-up, then c from interleaved one-token steps of draft and target
  gamma      the gamma to run: fixed, calibrated once, or the online controller
  time_runs  greedy, speculative (and the HF peer) alternating, repeated
  compare    per-prompt records: speedups, acceptance, exactness (diagnosed if not)
  summarize  pooled alpha, Theorem 3.8 next to the measured speedup, warnings
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from spec import clock, decode, defaults, hf, measure, models, parallel, seq2seq, theory, validate
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(Exception):
    """A problem the user can fix (missing weights, unusable device, bad prompt file): exit 2."""


# --------------------------------------------------------------------------- setup and load


def setup(args) -> None:
    """Seed, thread count and quiet third-party output; the output folder exists afterwards."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars would land in the middle of the report
    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = defaults.CPU_THREADS
        args.threads_default = True
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out: cannot create {str(args.out)!r}: {err}") from None


def check_device(device: str) -> None:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def looks_like_path(name: str) -> bool:
    """A folder rather than a hub id ('org/name'): absolute, relative with ./ or ../, ~, or deeper."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", "..") or name.count("/") > 1


def check_paths(args) -> None:
    for option, name in (("--target", args.target), ("--draft", args.draft)):
        if name is not None and looks_like_path(name) and not Path(name).expanduser().exists():
            raise UsageError(f"{option}: no such folder {name!r} (a local model folder with config.json "
                             "and weights was expected)")


def _is_shipped(path: str) -> bool:
    try:
        return Path(path).expanduser().resolve().parent == models.SHIPPED_PAIR.resolve()
    except OSError:
        return False


def _short_name(path: str) -> str:
    """The last two parts of a folder or hub id: 'EleutherAI/pythia-12b', 'pair/target'."""
    return "/".join(Path(path).parts[-2:]) or path


def _stand_in(args, say) -> tuple[models.Pair, dict]:
    say(f"shipped pair not found at {models.SHIPPED_PAIR}: building a seeded random tiny pair instead")
    td, dd = DTYPES[args.target_dtype], DTYPES[args.draft_dtype]
    if args.device.startswith("cuda") and td == torch.float32:  # as load_pair does: TF32 flips near-ties
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    target = models.build_gpt_neox("tiny-target", seed=args.seed, dtype=td, device=args.device)
    draft = models.build_gpt_neox("tiny-draft", seed=args.seed + 1, dtype=dd, device=args.device)
    info = {"source": "random", "target": None, "draft": None,
            "target_name": "random tiny-target", "draft_name": "random tiny-draft",
            "note": f"shipped pair not found at {models.SHIPPED_PAIR}; seeded random tiny pair "
                    f"(build_gpt_neox 'tiny-target'/'tiny-draft', seed {args.seed}) used instead: "
                    "timings and acceptance say nothing about a trained pair"}
    return models.Pair(target, draft, None), info


def load(args, say) -> tuple[models.Pair, dict]:
    """The pair and a description of it; raises UsageError for anything the user can fix."""
    check_device(args.device)
    check_paths(args)
    shipped_present = all((models.SHIPPED_PAIR / role / "config.json").exists() for role in ("target", "draft"))
    if args.target is None and not shipped_present:
        if args.tp > 1:
            raise UsageError(f"--tp {args.tp}: the seeded stand-in pair cannot be split; pass --target/--draft")
        pair, info = _stand_in(args, say)
    else:
        t_path = args.target or str(models.SHIPPED_PAIR / "target")
        d_path = args.draft or str(models.SHIPPED_PAIR / "draft")
        shipped = _is_shipped(t_path) and _is_shipped(d_path)
        say(f"loading target {t_path} ({args.target_dtype}) and draft {d_path} ({args.draft_dtype}) on {args.device}")
        try:
            pair = models.load_pair(t_path, d_path, device=args.device, target_dtype=DTYPES[args.target_dtype],
                                    draft_dtype=DTYPES[args.draft_dtype], tp_size=args.tp)
        except (FileNotFoundError, ValueError, OSError, ImportError) as err:
            raise UsageError(str(err)) from None
        info = {"source": "shipped" if shipped else "paths", "target": t_path, "draft": d_path,
                "target_name": "shipped target" if shipped else _short_name(t_path),
                "draft_name": "shipped draft" if shipped else _short_name(d_path), "note": None}
    if (why := seq2seq.cli_refusal(pair.target, args.peer, args.features)) is not None:
        raise UsageError(why)
    info["target_split"] = parallel.describe(pair.target)  # whole, tensor parallel, or a device map
    info["target_path"], info["draft_path"] = runner_paths(args, pair)
    info["target_params"] = sum(p.numel() for p in pair.target.parameters())
    info["draft_params"] = sum(p.numel() for p in pair.draft.parameters())
    info["tokenizer"] = pair.tokenizer is not None
    return pair, info


def runner_paths(args, pair: models.Pair) -> tuple[str, str]:
    """How each model is run and rolled back (spec.runner): a model spec cannot decode exactly is
    refused here, before any timing."""
    from spec import neox, runner

    if seq2seq.is_encoder_decoder(pair.target):
        return "encoder-decoder (decoder kv-cache)", "encoder-decoder (decoder kv-cache)"
    try:
        target_path = runner.path_of(pair.target)
    except runner.UnsupportedModelError as err:
        raise UsageError(f"--target: {err}") from None
    impl = args.draft_impl
    if impl == "plain" or (impl == "auto" and neox.supports(pair.draft)):
        return target_path, "plain (spec.neox)"
    if impl == "compiled":
        return target_path, "compiled (static cache)"
    try:
        return target_path, runner.path_of(pair.draft)
    except runner.UnsupportedModelError:
        return target_path, "recompute (no cached path reproduces it; a draft cannot change the output)"


# --------------------------------------------------------------------------- prompts


def read_prompts(path: Path) -> list[str]:
    import re

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--prompts: cannot read {str(path)!r}: {err}") from None
    unescape = {"n": "\n", "t": "\t", "\\": "\\"}
    prompts = [re.sub(r"\\([nt\\])", lambda m: unescape[m.group(1)], line)
               for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts: {str(path)!r} holds no prompt (one prompt a line)")
    return prompts


def encode(prompt: str, pair: models.Pair, index: int, chat: bool = False) -> list[int]:
    rows = min(hf.vocab_rows(pair.target), hf.vocab_rows(pair.draft))
    if pair.tokenizer is not None:
        try:
            ids = models.encode_prompt(pair.tokenizer, prompt, chat=chat)
        except ValueError as err:
            raise UsageError(f"--chat: {err}") from None
    elif chat:
        raise UsageError("--chat: the model has no tokenizer, so no chat template")
    else:
        ids = [b % rows for b in prompt.encode("utf-8")]
    if not ids:
        raise UsageError(f"prompt {index}: no tokens")
    if max(ids) >= rows:
        raise UsageError(f"prompt {index}: token id {max(ids)} is outside the models' vocabulary [0, {rows})")
    return ids


def prompts(args, pair: models.Pair, pair_info: dict) -> dict:
    """{"texts", "ids", "set", "eos"}: the prompts to run, refused up front if any of them
    with --max-new-tokens runs past the target's or the draft's position limit."""
    if args.prompts is not None:
        texts, prompt_set = read_prompts(args.prompts), str(args.prompts)
    elif pair_info["source"] in ("shipped", "random"):
        texts, prompt_set = CODE_PROMPTS, "code (shipped pair)"
    else:
        texts, prompt_set = SEED_PROMPTS, "seed"
    if args.features:  # encoder-decoder pairs on audio features (spec.seq2seq): each file is one prompt
        texts, prompt_set, ids = seq2seq.feature_prompts(args.features, UsageError)
        eos = None if args.ignore_eos or pair.tokenizer is None else pair.tokenizer.eos_token_id
        return {"texts": list(texts), "ids": ids, "set": prompt_set, "eos": eos}
    ids = [encode(p, pair, i, args.chat) for i, p in enumerate(texts, 1)]
    for i, row in enumerate(ids, 1):
        try:
            validate.check_positions(len(row), args.max_new_tokens, {"target": pair.target, "draft": pair.draft})
        except ValueError as err:
            raise UsageError(f"prompt {i}: {err}") from None
    eos = None if args.ignore_eos or pair.tokenizer is None else pair.tokenizer.eos_token_id
    return {"texts": list(texts), "ids": ids, "set": prompt_set, "eos": eos}


# --------------------------------------------------------------------------- costs and gamma


def _spec(args, pair, ids, gamma, max_new_tokens, eos, trace=False):
    return decode.speculative_generate(pair.target, pair.draft, ids, gamma=gamma, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos, trace=trace, draft_impl=args.draft_impl)


def costs(args, pair, ps: dict, say) -> measure.Costs:
    """Warm-up (allocator, kernels, lazy initialisation), then c from one-token steps."""
    say("warm-up")
    first, eos, n = ps["ids"][0], ps["eos"], args.max_new_tokens
    decode.greedy_generate(pair.target, first, max_new_tokens=min(8, n), eos_token_id=eos)
    warm_gamma = args.gamma if isinstance(args.gamma, int) else defaults.CALIBRATION_GAMMA
    _spec(args, pair, first, warm_gamma, min(16, n), eos)
    say("measuring c (cached one-token steps of draft and target)")
    return measure.cost_ratio(pair.target, pair.draft, first, draft_impl=args.draft_impl)


def choose_gamma(args, pair, ps: dict, cost: measure.Costs, say) -> tuple[int | str, dict | None]:
    """(gamma to run, calibration record or None). --gamma calibrated: Theorem 3.8's optimum
    for alpha from a short run at CALIBRATION_GAMMA and the measured c and verify slope,
    chosen once. --gamma auto: the API's online controller, re-chosen every round."""
    if args.gamma != "calibrated":
        return args.gamma, None
    g0, n0, top = defaults.CALIBRATION_GAMMA, defaults.CALIBRATION_TOKENS, defaults.MAX_AUTO_GAMMA
    say(f"calibrating gamma: {n0} tokens at gamma={g0} on prompt 1")
    cal = _spec(args, pair, ps["ids"][0], g0, min(n0, args.max_new_tokens), ps["eos"])
    alpha = cal.alpha if cal.drafted else 0.0
    say("measuring the verify pass's cost per drafted token")
    line = measure.verify_line(pair.target, ps["ids"][0], max_gamma=top)
    gamma = theory.optimal_gamma(min(alpha, 0.999), cost.c, top, verify_slope=line.slope, verify_fixed=line.fixed)
    gamma = parallel.from_rank_zero(pair.target, gamma)  # a split target's ranks timed apart: one gamma for all
    return gamma, {"tokens": len(cal.tokens), "gamma": g0, "alpha": alpha, "c": cost.c, "verify_slope": line.slope,
                   "verify_fixed": line.fixed, "chosen_gamma": gamma, "max_gamma": top}


# --------------------------------------------------------------------------- timing


def time_runs(args, pair, ps: dict, gamma, say) -> list[dict]:
    """Per prompt: {"greedy": [(Result, s)...], "spec": [...], "peer": [...] or None}, one entry
    per repeat. Greedy, speculative and the peer alternate prompt by prompt, and the repeats
    go round all prompts again, so a shared machine's drift hits every method alike."""
    assistant, peer_gamma = None, gamma if isinstance(gamma, int) else defaults.CALIBRATION_GAMMA
    if args.peer == "hf":
        say("HF assisted generation: warm-up")
        assistant = hf.assistant_for(pair.target, pair.draft)
        hf.hf_assisted(pair.target, assistant, torch.tensor(ps["ids"][0]), peer_gamma, min(16, args.max_new_tokens),
                       ps["eos"])
    runs = [{"greedy": [], "spec": [], "peer": [] if assistant is not None else None} for _ in ps["ids"]]
    n, eos, device, total = args.max_new_tokens, ps["eos"], args.device, args.repeats * len(ps["ids"])
    for rep in range(args.repeats):
        for i, ids in enumerate(ps["ids"]):
            run = runs[i]
            run["greedy"].append(clock.timed(lambda: decode.greedy_generate(
                pair.target, ids, max_new_tokens=n, eos_token_id=eos), device))
            run["spec"].append(clock.timed(lambda: _spec(args, pair, ids, gamma, n, eos, trace=True), device))
            if assistant is not None:
                run["peer"].append(clock.timed(lambda: hf.hf_assisted(
                    pair.target, assistant, torch.tensor(ids), peer_gamma, n, eos), device))
            say(_progress_line(rep * len(ps["ids"]) + i + 1, total, i + 1, len(ps["ids"]), rep + 1, run))
    return runs


def _progress_line(done: int, total: int, prompt: int, prompts: int, rep: int, run: dict) -> str:
    (g, g_s), (s, s_s) = run["greedy"][-1], run["spec"][-1]
    line = (f"[{done}/{total}] repeat {rep}, greedy {prompt}/{prompts}: {len(g.tokens)} tokens in {g_s:.2f}s, "
            f"speculative {prompt}/{prompts}: {len(s.tokens)} tokens in {s_s:.2f}s, "
            f"{s.mean_tokens_per_round:.2f} tokens/round")
    if run["peer"]:
        toks, p_s = run["peer"][-1]
        line += f", HF assisted {prompt}/{prompts}: {len(toks)} tokens in {p_s:.2f}s"
    return line


# --------------------------------------------------------------------------- compare


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diagnose_outputs(target, prompt_ids, expected, actual) -> dict:
    """spec.diagnose's verdict on where and why two outputs differ; a position-only record
    (verdict "unknown") when it finds none."""
    from spec.diagnose import diagnose

    position = first_difference(expected, actual)
    div = diagnose(target, prompt_ids, expected, actual)
    if div is None:
        return {"position": position,
                "expected": expected[position] if position is not None and position < len(expected) else None,
                "actual": actual[position] if position is not None and position < len(actual) else None,
                "verdict": "unknown",
                "message": f"outputs differ at new token {position}; spec.diagnose found no divergence"}
    record = {k: getattr(div, k, None) for k in
              ("position", "expected", "actual", "gap_step", "gap_block", "noise", "dtype", "verdict")}
    record["message"] = str(div)
    return record


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _trace_dicts(result) -> list[dict]:
    return [dict(drafted=r.drafted, accepted=r.accepted, emitted=r.emitted, draft_s=r.draft_s,
                 verify_s=r.verify_s, target_cache=r.target_cache, draft_cache=r.draft_cache)
            for r in (result.trace or [])]


def _median_s(samples) -> float:
    return statistics.median(s for _, s in samples)


def record(index: int, prompt: str, ids: list[int], run: dict, pair: models.Pair, say) -> dict:
    """One prompt's row: median times over the repeats, the speculative run's acceptance and
    trace (from a repeat that differs from greedy, if any, else the first: "trace_repeat"),
    exactness and its diagnosis."""
    target, tokenizer = pair.target, pair.tokenizer
    g = run["greedy"][0][0]
    kept = next((k for k, (r, _) in enumerate(run["spec"]) if r.tokens != g.tokens), 0)
    s = run["spec"][kept][0]
    g_s, s_s = _median_s(run["greedy"]), _median_s(run["spec"])
    identical, divergence = g.tokens == s.tokens, None
    if not identical:
        say(f"prompt {index}: speculative output differs from greedy, diagnosing")
        divergence = diagnose_outputs(target, ids, g.tokens, s.tokens)
    return {
        "index": index, "prompt": prompt, "prompt_tokens": len(ids),
        "new_tokens": len(s.tokens), "greedy_new_tokens": len(g.tokens),
        "greedy_s": g_s, "spec_s": s_s,
        "greedy_tok_s": len(g.tokens) / g_s, "spec_tok_s": len(s.tokens) / s_s,
        "speedup": g_s / s_s,
        "greedy_s_repeats": [t for _, t in run["greedy"]], "spec_s_repeats": [t for _, t in run["spec"]],
        "accept_rate": _nan_to_none(s.accept_rate), "alpha": _nan_to_none(s.alpha),
        "tokens_per_round": s.mean_tokens_per_round, "rounds": len(s.rounds),
        "drafted": s.drafted, "accepted": s.accepted,
        "ids_identical": identical, "divergence": divergence,
        "stop_reason": s.stop_reason, "greedy_stop_reason": g.stop_reason,
        "greedy_tokens": g.tokens, "spec_tokens": s.tokens,
        "text": tokenizer.decode(s.tokens) if tokenizer is not None else None,
        "drafted_per_round": s.drafted_per_round, "accepted_per_round": s.accepted_per_round,
        "tokens_per_round_list": s.tokens_per_round,
        "trace": _trace_dicts(s), "trace_repeat": kept,
        "peer": _peer_record(run["peer"], g.tokens, g_s, s_s) if run["peer"] else None,
    }


def _peer_record(samples, greedy_tokens, g_s: float, s_s: float) -> dict:
    toks, p_s = samples[0][0], _median_s(samples)
    return {"name": "hf_assisted", "hf_s": p_s, "hf_tok_s": len(toks) / p_s, "hf_speedup": g_s / p_s,
            "ours_vs_hf": p_s / s_s, "ids_identical": all(t == greedy_tokens for t, _ in samples),
            "new_tokens": len(toks), "tokens": toks, "hf_s_repeats": [t for _, t in samples]}


def compare(pair, ps: dict, runs: list[dict], say) -> list[dict]:
    """The per-prompt records, in prompt order."""
    out = []
    for i, (text, ids, run) in enumerate(zip(ps["texts"], ps["ids"], runs), 1):
        out.append(record(i, text, ids, run, pair, say))
    return out


# --------------------------------------------------------------------------- summary


def theory_gamma(gamma, records: list[dict]) -> int:
    """The gamma the theory is evaluated at: the fixed one, or for the online controller
    the draft length it chose most often (the last, clipped round of each prompt left out)."""
    if isinstance(gamma, int):
        return gamma
    counts = Counter(g for r in records for g in r["drafted_per_round"][:-1] if g > 0)
    return counts.most_common(1)[0][0] if counts else defaults.CALIBRATION_GAMMA


def in_run(records: list[dict], alpha: float | None, gamma: int, measured: float) -> dict | None:
    """c and the verify pass's cost from the timed runs themselves, not from separate step
    timings: this box's speed drifts by tens of percent within seconds, and these figures
    come from the same interleaved runs as the speedup. The target step is greedy's time
    per token; the draft's cost is its phase time per drafted token (catch-up included);
    the verify cost is the mean verify phase of full-gamma rounds (the prefill round left out)."""
    trace = [t for r in records for t in r["trace"][1:]]
    full = [t["verify_s"] for t in trace if t["drafted"] == gamma]
    drafted = sum(t["drafted"] for t in trace)
    if alpha is None or not full or not drafted:
        return None
    step = sum(r["greedy_s"] for r in records) / sum(r["greedy_new_tokens"] for r in records)
    c = sum(t["draft_s"] for t in trace) / drafted / step
    verify = statistics.fmean(full) / step
    predicted = theory.expected_speedup(alpha, gamma, c)
    costed = theory.expected_tokens_per_round(alpha, gamma) / (gamma * c + verify)
    wall = sum(r["spec_s_repeats"][r["trace_repeat"]] for r in records)  # the repeat the traces come from
    phases = sum(t["draft_s"] + t["verify_s"] for r in records for t in r["trace"])
    return {"target_step_s": step, "c": c, "verify_over_step": verify,
            "predicted_speedup": predicted, "measured_over_predicted": measured / predicted,
            "predicted_speedup_verify_costed": costed, "measured_over_verify_costed": measured / costed,
            "share_in_model_phases": phases / wall}


def repeat_speedups(records: list[dict]) -> list[float]:
    """Total greedy time / total speculative time, one figure per repeat."""
    repeats = len(records[0]["greedy_s_repeats"])
    return [sum(r["greedy_s_repeats"][k] for r in records) / sum(r["spec_s_repeats"][k] for r in records)
            for k in range(repeats)]


def _theory(alpha, gamma: int, c: float) -> dict:
    """Theorem 3.8 at the run's gamma and at its own optimum; whether any gamma can win."""
    if alpha is None:
        return {"predicted_tokens_per_round": None, "predicted_speedup": None, "optimal_gamma": None,
                "optimal_predicted_speedup": None, "draft_cannot_win": None}
    best = theory.optimal_gamma(alpha, c)
    best_speedup = theory.expected_speedup(alpha, best, c)
    return {"predicted_tokens_per_round": theory.expected_tokens_per_round(alpha, gamma),
            "predicted_speedup": theory.expected_speedup(alpha, gamma, c), "optimal_gamma": best,
            "optimal_predicted_speedup": best_speedup, "draft_cannot_win": best_speedup <= 1.0}


def summarize(args, records: list[dict], gamma, calibration: dict | None, cost: measure.Costs) -> dict:
    acc = [k for r in records for k in r["accepted_per_round"]]
    dra = [g for r in records for g in r["drafted_per_round"]]
    alpha = theory.alpha_from_accepted(acc, dra) if sum(dra) else None
    g_th = theory_gamma(gamma, records)
    total_g, total_s = sum(r["greedy_s"] for r in records), sum(r["spec_s"] for r in records)
    per_repeat = repeat_speedups(records)
    summary = {
        "gamma": gamma, "gamma_option": args.gamma, "theory_gamma": g_th, "calibration": calibration,
        "c": cost.c, "draft_step_s": cost.draft_step_s, "target_step_s": cost.target_step_s, "alpha": alpha,
        "accept_rate": sum(acc) / sum(dra) if sum(dra) else None,
        "tokens_per_round": sum(r["new_tokens"] for r in records) / sum(r["rounds"] for r in records),
        **_theory(alpha, g_th, cost.c),
        "measured_speedup": total_g / total_s,
        "mean_speedup": statistics.fmean(r["speedup"] for r in records),
        "speedup_min": min(r["speedup"] for r in records), "speedup_max": max(r["speedup"] for r in records),
        "repeats": args.repeats, "repeat_speedups": per_repeat,
        "repeat_spread": max(per_repeat) - min(per_repeat),
        "greedy_s": total_g, "spec_s": total_s,
        "in_run": in_run(records, alpha, g_th, total_g / total_s),
        "draft_impl": args.draft_impl, "threads": torch.get_num_threads(),
        "all_identical": all(r["ids_identical"] for r in records),
        "ties": sum(1 for r in records if not r["ids_identical"] and r["divergence"]["verdict"] == "tie"),
    }
    summary["failures"] = sum(1 for r in records if not r["ids_identical"]) - summary["ties"]
    if args.peer == "hf":
        # Speed ratios only over prompts where HF produced greedy's tokens: other output is other work.
        same = [r for r in records if r["peer"]["ids_identical"]]
        hf_total = sum(r["peer"]["hf_s"] for r in same)
        summary["hf_compared_prompts"] = len(same)
        summary["hf_speedup"] = sum(r["greedy_s"] for r in same) / hf_total if same else None
        summary["ours_vs_hf"] = hf_total / sum(r["spec_s"] for r in same) if same else None
        summary["peer_gamma"] = gamma if isinstance(gamma, int) else defaults.CALIBRATION_GAMMA
    summary["exit_status"] = 1 if summary["failures"] else 0
    return summary


def consistency_warnings(summary: dict) -> list[str]:
    """The run's own figures checked against each other; each disagreement is one line."""
    out = []
    r = summary.get("in_run")
    if r is not None and summary["c"] > 0 and r["c"] > 0:
        ratio = max(summary["c"], r["c"]) / min(summary["c"], r["c"])
        if ratio > defaults.C_DISAGREEMENT:
            out.append(f"the two estimates of c disagree {ratio:.1f}-fold ({summary['c']:.3f} from one-token "
                       f"steps, {r['c']:.3f} from the timed runs): the draft costs more inside the decode loop "
                       "than in a bare step, or the machine's load changed; Theorem 3.8 from either c is uncertain")
    effect = abs(summary["measured_speedup"] - 1.0)
    if summary["repeats"] > 1 and summary["repeat_spread"] > effect:
        lo, hi = min(summary["repeat_speedups"]), max(summary["repeat_speedups"])
        out.append(f"the speedup varied from {lo:.2f}x to {hi:.2f}x between repeats, more than its distance "
                   f"from 1x ({summary['measured_speedup']:.2f}x): the timings are noise")
    if r is not None:
        off = r["measured_over_verify_costed"] - 1.0
        if abs(off) > defaults.PREDICTION_MISMATCH:
            out.append(f"measured speedup {summary['measured_speedup']:.2f}x is {abs(off):.0%} "
                       f"{'above' if off > 0 else 'below'} the verify-costed prediction "
                       f"{r['predicted_speedup_verify_costed']:.2f}x: time went somewhere the model does not price")
    return out


def results(args, pair_info: dict, ps: dict, records: list[dict], summary: dict, machine: dict) -> dict:
    """Everything results.json holds."""
    from spec import __version__

    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"spec_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "options": options, "pair": pair_info, "machine": machine,
            "prompt_set": ps["set"], "eos_token_id": ps["eos"], "prompts": records, "summary": summary,
            "warnings": consistency_warnings(summary)}
