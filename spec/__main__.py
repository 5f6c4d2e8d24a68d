"""`python -m spec` (console script `spec`): the seed experiment as one command.

Loads a target/draft pair, times plain greedy decoding and speculative decoding
(Leviathan et al. 2023, Algorithm 1) on a few prompts, checks the outputs are
token-identical, measures c, and compares the measured speedup with Theorem 3.8.
Writes results.json and results.png to --out. Exit status: 0 when every
speculative output equals greedy (or differs only at a proven numerical tie),
1 when one does not, 2 for bad options, missing weights or an unusable device.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from spec import decode, hf, measure, models, report, theory
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_MAX_NEW_TOKENS = 128
CUDA_MAX_NEW_TOKENS = 256
CALIBRATION_TOKENS = 32
CALIBRATION_GAMMA = 5
MAX_AUTO_GAMMA = 16


class UsageError(Exception):
    """A problem the user can fix (missing weights, unusable device, bad prompt file): exit 2."""


# --------------------------------------------------------------------------- options


def _gamma(text: str):
    if text == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spec",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1) against plain greedy "
                    "decoding: times both per prompt, checks the outputs are token-identical, measures the cost "
                    "ratio c and compares the speedup with Theorem 3.8.",
        epilog=(
            "pair: by default the small GPT-NeoX pair shipped in spec/assets/pair (trained on Python source);\n"
            "  while it is absent, a seeded random tiny pair (build_gpt_neox 'tiny-target'/'tiny-draft') stands\n"
            "  in and the output says so. --target/--draft: local folders or hub ids already in the local cache\n"
            "  (nothing is downloaded).\n"
            "prompts: for the shipped (or stand-in) pair, five Python code prompts, since that pair was trained\n"
            "  on code; for any other checkpoints, the seed notebook's five prompts. --prompts FILE: one prompt\n"
            "  a line, blank lines skipped, \\n \\t and \\\\ decoded so one line can hold a multi-line prompt.\n"
            "  A pair without a tokenizer is fed the prompt's UTF-8 bytes as token ids.\n"
            f"max new tokens: {CUDA_MAX_NEW_TOKENS} on CUDA as in the seed; {CPU_MAX_NEW_TOKENS} on CPU, so that the\n"
            "  default run finishes in a few minutes on a couple of cores.\n"
            "exit status: 0 all outputs identical to greedy (or differing only at a proven numerical tie),\n"
            "  1 a speculative output differs from greedy, 2 bad options / missing weights / unusable device."
        ),
    )
    p.add_argument("--target", help="target model: local folder or cached hub id (default: the shipped pair)")
    p.add_argument("--draft", help="draft model: local folder or cached hub id (give with --target)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--target-dtype", choices=list(DTYPES), default="fp32", help="(default: %(default)s)")
    p.add_argument("--draft-dtype", choices=list(DTYPES), default="fp32", help="(default: %(default)s)")
    p.add_argument("--gamma", type=_gamma, default=5,
                   help="draft tokens a round, or 'auto': Theorem 3.8's optimal gamma for alpha from a short "
                        f"calibration run ({CALIBRATION_TOKENS} tokens at gamma={CALIBRATION_GAMMA} on the first "
                        f"prompt) and the measured c, at most {MAX_AUTO_GAMMA} (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"new tokens per prompt (default: {CUDA_MAX_NEW_TOKENS} on CUDA, {CPU_MAX_NEW_TOKENS} on CPU)")
    p.add_argument("--prompts", type=Path, metavar="FILE", help="prompt file, one prompt a line")
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (default: stop at the tokenizer's EOS)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's own choice, here %d); on a busy machine 1 can be "
                        "much faster for small models" % torch.get_num_threads())
    p.add_argument("--peer", choices=["hf"], help="also time Hugging Face assisted generation as a peer")
    p.add_argument("--draft-impl", choices=list(decode.DRAFT_IMPLS), default="auto",
                   help="how the draft runs: 'plain' (its forward in plain tensors on a preallocated KV buffer, "
                        "GPT-NeoX drafts), 'hf' (the model's own forward), 'compiled' (static cache + compiled "
                        "step, CUDA graphs on GPU; compiling takes minutes on CPU), 'auto' (plain where it "
                        "applies) (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("spec-results"),
                   help="output folder for results.json and results.png (default: ./spec-results)")
    p.add_argument("--seed", type=int, default=0, help="torch seed; also seeds the random stand-in pair "
                                                       "(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    p.add_argument("--no-plots", action="store_true", help="do not write results.png")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("argument --target/--draft: give both or neither")
    if args.max_new_tokens is None:
        args.max_new_tokens = CUDA_MAX_NEW_TOKENS if args.device.startswith("cuda") else CPU_MAX_NEW_TOKENS
        args.max_new_tokens_default = True
    else:
        args.max_new_tokens_default = False
    return args


# --------------------------------------------------------------------------- helpers


class Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _timed(device: str, fn):
    measure.sync(device)
    t0 = time.perf_counter()
    out = fn()
    measure.sync(device)
    return out, time.perf_counter() - t0


def read_prompts(path: Path) -> list[str]:
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


def _check_device(device: str) -> None:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _is_shipped(path: str) -> bool:
    try:
        return Path(path).expanduser().resolve().parent == models.SHIPPED_PAIR.resolve()
    except OSError:
        return False


def _short_name(path: str) -> str:
    """The last two parts of a folder or hub id: 'EleutherAI/pythia-12b', 'pair/target'."""
    return "/".join(Path(path).parts[-2:]) or path


def load(args, say) -> tuple[models.Pair, dict]:
    """The pair and a description of it; raises UsageError for anything the user can fix."""
    _check_device(args.device)
    td, dd = DTYPES[args.target_dtype], DTYPES[args.draft_dtype]
    shipped_present = (models.SHIPPED_PAIR / "target" / "config.json").exists() and \
        (models.SHIPPED_PAIR / "draft" / "config.json").exists()
    if args.target is None and not shipped_present:
        say(f"shipped pair not found at {models.SHIPPED_PAIR}: building a seeded random tiny pair instead")
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
        pair = models.Pair(target, draft, None)
    else:
        t_path = args.target or str(models.SHIPPED_PAIR / "target")
        d_path = args.draft or str(models.SHIPPED_PAIR / "draft")
        shipped = _is_shipped(t_path) and _is_shipped(d_path)
        say(f"loading target {t_path} ({args.target_dtype}) and draft {d_path} ({args.draft_dtype}) on {args.device}")
        try:
            pair = models.load_pair(t_path, d_path, device=args.device, target_dtype=td, draft_dtype=dd)
        except (FileNotFoundError, ValueError, OSError) as err:
            raise UsageError(str(err)) from None
        info = {"source": "shipped" if shipped else "paths", "target": t_path, "draft": d_path,
                "target_name": "shipped target" if shipped else _short_name(t_path),
                "draft_name": "shipped draft" if shipped else _short_name(d_path), "note": None}
    info["target_params"] = sum(p.numel() for p in pair.target.parameters())
    info["draft_params"] = sum(p.numel() for p in pair.draft.parameters())
    info["tokenizer"] = pair.tokenizer is not None
    return pair, info


def encode(prompt: str, pair: models.Pair, index: int) -> list[int]:
    rows = min(hf.vocab_rows(pair.target), hf.vocab_rows(pair.draft))
    if pair.tokenizer is not None:
        ids = list(pair.tokenizer.encode(prompt))
    else:
        ids = [b % rows for b in prompt.encode("utf-8")]
    if not ids:
        raise UsageError(f"prompt {index}: no tokens")
    if max(ids) >= rows:
        raise UsageError(f"prompt {index}: token id {max(ids)} is outside the models' vocabulary [0, {rows})")
    return ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _diagnose(target, prompt_ids, expected, actual):
    """spec.diagnose's verdict on where and why two outputs differ; a position-only record
    (verdict "unknown") when that module is not available."""
    position = first_difference(expected, actual)
    fallback = {"position": position,
                "expected": expected[position] if position is not None and position < len(expected) else None,
                "actual": actual[position] if position is not None and position < len(actual) else None,
                "verdict": "unknown", "message": None}
    try:
        from spec.diagnose import diagnose
    except ImportError:
        fallback["message"] = (f"outputs differ at new token {position} (spec.diagnose is not available "
                               "to tell a numerical tie from a bug)")
        return fallback
    div = diagnose(target, prompt_ids, expected, actual)
    if div is None:
        fallback["message"] = f"outputs differ at new token {position}; spec.diagnose found no divergence"
        return fallback
    record = {k: getattr(div, k, None) for k in
              ("position", "expected", "actual", "gap_step", "gap_block", "noise", "dtype", "verdict")}
    record["message"] = str(div)
    return record


def _trace_dicts(result) -> list[dict]:
    return [dict(drafted=r.drafted, accepted=r.accepted, emitted=r.emitted, draft_s=r.draft_s,
                 verify_s=r.verify_s, target_cache=r.target_cache, draft_cache=r.draft_cache)
            for r in (result.trace or [])]


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# --------------------------------------------------------------------------- run


def run(args) -> int:
    say = Progress(args.quiet)
    if args.quiet:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pair, pair_info = load(args, say)
    target, draft, tok = pair.target, pair.draft, pair.tokenizer
    device = args.device

    if args.prompts is not None:
        prompts, prompt_set = read_prompts(args.prompts), str(args.prompts)
    elif pair_info["source"] in ("shipped", "random"):
        prompts, prompt_set = CODE_PROMPTS, "code (shipped pair)"
    else:
        prompts, prompt_set = SEED_PROMPTS, "seed"
    prompt_ids = [encode(p, pair, i) for i, p in enumerate(prompts, 1)]
    eos = None if args.ignore_eos or tok is None else tok.eos_token_id
    N = args.max_new_tokens

    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out: cannot create {str(args.out)!r}: {err}") from None

    if pair_info["note"]:
        print(f"note: {pair_info['note']}")
    print(f"target: {pair_info['target_name']} ({pair_info['target_params'] / 1e6:.2f}M params, {args.target_dtype})"
          f" | draft: {pair_info['draft_name']} ({pair_info['draft_params'] / 1e6:.2f}M params, {args.draft_dtype})"
          f" | device: {device}")
    print(f"prompts: {len(prompts)} ({prompt_set}) | max new tokens: {N}"
          + (f" (default on {'CUDA' if device.startswith('cuda') else 'CPU'})" if args.max_new_tokens_default else "")
          + f" | EOS: {eos if eos is not None else 'none'}")

    # Warm-up: allocator, kernels, lazy initialisation, outside every timed region.
    say("warm-up")
    warm_gamma = args.gamma if isinstance(args.gamma, int) else CALIBRATION_GAMMA
    decode.greedy_generate(target, prompt_ids[0], max_new_tokens=min(8, N), eos_token_id=eos)
    decode.speculative_generate(target, draft, prompt_ids[0], gamma=warm_gamma, max_new_tokens=min(16, N),
                                eos_token_id=eos, draft_impl=args.draft_impl)

    say("measuring c (cached one-token steps of draft and target)")
    costs = measure.cost_ratio(target, draft, prompt_ids[0], draft_impl=args.draft_impl)
    theory_c = costs.c

    calibration = None
    if args.gamma == "auto":
        say(f"calibrating gamma: {CALIBRATION_TOKENS} tokens at gamma={CALIBRATION_GAMMA} on prompt 1")
        cal = decode.speculative_generate(target, draft, prompt_ids[0], gamma=CALIBRATION_GAMMA,
                                          max_new_tokens=CALIBRATION_TOKENS, eos_token_id=eos,
                                          draft_impl=args.draft_impl)
        cal_alpha = cal.alpha if cal.drafted else 0.0
        say("measuring the verify pass's cost per drafted token")
        slope = measure.verify_slope(target, prompt_ids[0], max_gamma=MAX_AUTO_GAMMA)
        gamma = theory.optimal_gamma(min(cal_alpha, 0.999), theory_c, MAX_AUTO_GAMMA, verify_slope=slope)
        calibration = {"tokens": len(cal.tokens), "gamma": CALIBRATION_GAMMA, "alpha": cal_alpha,
                       "c": theory_c, "verify_slope": slope, "chosen_gamma": gamma, "max_gamma": MAX_AUTO_GAMMA}
        print(f"gamma=auto: calibration alpha={cal_alpha:.3f}, c={theory_c:.3f}, verify pass 1 + {slope:.3f} x gamma "
              f"steps -> gamma={gamma} (Theorem 3.8's optimum with that verify cost, at most {MAX_AUTO_GAMMA})")
    else:
        gamma = args.gamma

    # Prompt by prompt, greedy, speculative and the peer run back to back, so that a shared
    # machine's drift hits all three alike: every speedup is a ratio measured side by side.
    peers = [None] * len(prompts)
    assistant = None
    if args.peer == "hf":
        say("HF assisted generation: warm-up")
        assistant = hf.assistant_for(target, draft)
        hf.hf_assisted(target, assistant, torch.tensor(prompt_ids[0]), gamma, min(16, N), eos)
    greedy, spec = [], []
    for i, ids in enumerate(prompt_ids, 1):
        res, secs = _timed(device, lambda: decode.greedy_generate(target, ids, max_new_tokens=N, eos_token_id=eos))
        greedy.append((res, secs))
        say(f"greedy {i}/{len(prompts)}: {len(res.tokens)} tokens in {secs:.2f}s")
        res, secs = _timed(device, lambda: decode.speculative_generate(
            target, draft, ids, gamma=gamma, max_new_tokens=N, eos_token_id=eos, trace=True,
            draft_impl=args.draft_impl))
        spec.append((res, secs))
        say(f"speculative {i}/{len(prompts)}: {len(res.tokens)} tokens in {secs:.2f}s, "
            f"{res.mean_tokens_per_round:.2f} tokens/round")
        if assistant is not None:
            toks, secs = _timed(device, lambda: hf.hf_assisted(target, assistant, torch.tensor(ids), gamma, N, eos))
            peers[i - 1] = (toks, secs)
            say(f"HF assisted {i}/{len(prompts)}: {len(toks)} tokens in {secs:.2f}s")

    # Per-prompt records: every figure of the table, plus traces and tokens.
    records, failures, ties = [], [], []
    for i, (prompt, ids, (g, g_s), (s, s_s), peer) in enumerate(zip(prompts, prompt_ids, greedy, spec, peers), 1):
        identical = g.tokens == s.tokens
        divergence = None
        if not identical:
            say(f"prompt {i}: speculative output differs from greedy, diagnosing")
            divergence = _diagnose(target, ids, g.tokens, s.tokens)
            (ties if divergence.get("verdict") == "tie" else failures).append((i, prompt, divergence))
        rec = {
            "index": i, "prompt": prompt, "prompt_tokens": len(ids),
            "new_tokens": len(s.tokens), "greedy_new_tokens": len(g.tokens),
            "greedy_s": g_s, "spec_s": s_s,
            "greedy_tok_s": len(g.tokens) / g_s, "spec_tok_s": len(s.tokens) / s_s,
            "speedup": g_s / s_s,
            "accept_rate": _nan_to_none(s.accept_rate), "alpha": _nan_to_none(s.alpha),
            "tokens_per_round": s.mean_tokens_per_round, "rounds": s.rounds,
            "drafted": s.drafted, "accepted": s.accepted,
            "ids_identical": identical, "divergence": divergence,
            "stop_reason": s.stop_reason, "greedy_stop_reason": g.stop_reason,
            "greedy_tokens": g.tokens, "spec_tokens": s.tokens,
            "text": tok.decode(s.tokens) if tok is not None else None,
            "drafted_per_round": s.drafted_per_round, "accepted_per_round": s.accepted_per_round,
            "tokens_per_round_list": s.tokens_per_round,
            "trace": _trace_dicts(s),
            "peer": None,
        }
        if peer is not None:
            toks, p_s = peer
            rec["peer"] = {"name": "hf_assisted", "hf_s": p_s, "hf_tok_s": len(toks) / p_s,
                           "hf_speedup": g_s / p_s, "ours_vs_hf": p_s / s_s,
                           "ids_identical": toks == g.tokens, "new_tokens": len(toks), "tokens": toks}
        records.append(rec)

    # Summary: pooled alpha, Theorem 3.8's prediction next to the measured speedup.
    acc = [k for r in records for k in r["accepted_per_round"]]
    dra = [g_ for r in records for g_ in r["drafted_per_round"]]
    alpha = theory.alpha_from_accepted(acc, dra) if sum(dra) else None
    total_g = sum(r["greedy_s"] for r in records)
    total_s = sum(r["spec_s"] for r in records)
    summary = {
        "gamma": gamma, "gamma_option": args.gamma, "calibration": calibration,
        "c": theory_c, "draft_step_s": costs.draft_step_s, "target_step_s": costs.target_step_s,
        "alpha": alpha,
        "accept_rate": sum(acc) / sum(dra) if sum(dra) else None,
        "tokens_per_round": sum(r["new_tokens"] for r in records) / sum(r["rounds"] for r in records),
        "predicted_tokens_per_round": theory.expected_tokens_per_round(alpha, gamma) if alpha is not None else None,
        "predicted_speedup": theory.expected_speedup(alpha, gamma, theory_c) if alpha is not None else None,
        "measured_speedup": total_g / total_s,
        "mean_speedup": statistics.fmean(r["speedup"] for r in records),
        "speedup_min": min(r["speedup"] for r in records), "speedup_max": max(r["speedup"] for r in records),
        "greedy_s": total_g, "spec_s": total_s,
        "in_run": _in_run(records, alpha, gamma, total_g / total_s),
        "draft_impl": args.draft_impl,
        "optimal_gamma": theory.optimal_gamma(alpha, theory_c) if alpha is not None else None,
        "all_identical": all(r["ids_identical"] for r in records),
        "ties": len(ties), "failures": len(failures),
    }
    summary["optimal_predicted_speedup"] = (theory.expected_speedup(alpha, summary["optimal_gamma"], theory_c)
                                            if alpha is not None else None)

    if args.peer == "hf":
        hf_total = sum(r["peer"]["hf_s"] for r in records)
        summary["hf_speedup"] = total_g / hf_total
        summary["ours_vs_hf"] = hf_total / total_s
    exit_status = 1 if failures else 0
    summary["exit_status"] = exit_status

    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"spec_version": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "options": options, "pair": pair_info, "machine": report.machine_info(device),
               "prompt_set": prompt_set, "eos_token_id": eos, "prompts": records, "summary": summary}

    print()
    print(report.results_table(records))
    if args.peer == "hf":
        print()
        print("peer: Hugging Face assisted generation (same gamma, speedup vs our greedy)")
        print(report.peer_table(records))
    print()
    for line in report.summary_lines(summary):
        print(line)
    if args.peer == "hf":
        print(f"HF assisted: {summary['hf_speedup']:.2f}x over greedy; ours is {summary['ours_vs_hf']:.2f}x HF's speed")

    json_path = args.out / "results.json"
    report.write_json(json_path, results)
    png_path = args.out / "results.png"
    if args.no_plots:
        wrote_png = False
    else:
        say("plotting")
        wrote_png = report.plot(results, png_path)
        if not wrote_png:
            print(f"no results.png: {report.PLOTS_HINT}")
    print(f"wrote {json_path}" + (f" and {png_path}" if wrote_png else ""))

    for i, prompt, div in ties:
        print(f"prompt {i} ({report.short_prompt(prompt)!r}) differs from greedy at new token {div['position']}, "
              f"a proven numerical tie (not a failure):\n  {div['message']}")
    for i, prompt, div in failures:
        print(f"spec: FAIL: prompt {i} ({report.short_prompt(prompt)!r}): speculative output differs from greedy "
              f"at new token {div['position']} (greedy {div['expected']}, speculative {div['actual']})"
              + (f"\n  {div['message']}" if div.get("message") else ""), file=sys.stderr)
    if not failures:
        say("done: every speculative output equals greedy" + (" (up to proven numerical ties)" if ties else ""))
    return exit_status


def _in_run(records: list[dict], alpha: float | None, gamma: int, measured: float) -> dict | None:
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
    wall = sum(r["spec_s"] for r in records)
    phases = sum(t["draft_s"] + t["verify_s"] for r in records for t in r["trace"])
    return {"target_step_s": step, "c": c, "verify_over_step": verify,
            "predicted_speedup": predicted, "measured_over_predicted": measured / predicted,
            "predicted_speedup_verify_costed": costed, "measured_over_verify_costed": measured / costed,
            "share_in_model_phases": phases / wall}


def _version() -> str:
    from spec import __version__
    return __version__


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["conform"]:  # `python -m spec conform ...`: the conformance kit (spec/conform.py)
        from spec import conform
        return conform.main(argv[1:])
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a bad option (2, message already on stderr)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        return run(args)
    except UsageError as err:
        print(f"spec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
