"""Reporting for `python -m spec`: the results table, results.json and results.png.

Everything here works on plain dicts (the per-prompt records and the summary that
spec/__main__.py builds), so the JSON file and the printed table show the same numbers.
matplotlib is optional (the `plots` extra); without it `plot` returns False.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path

PLOTS_HINT = 'plots need matplotlib: pip install "spec[plots]" (or pip install matplotlib)'

# The seed notebook's colours: greedy, speculative, acceptance.
C_G, C_S, C_A, C_P = "#7f9cbf", "#2ca25f", "#e08214", "#9e9ac8"

TABLE_COLUMNS = ["#", "prompt", "new tokens", "greedy s", "spec s", "greedy tok/s", "spec tok/s", "speedup",
                 "accept rate", "alpha", "tok/round", "IDs identical"]
PEER_COLUMNS = ["#", "hf assisted s", "hf tok/s", "hf speedup", "ours vs hf", "hf IDs identical"]


# --------------------------------------------------------------------------- machine


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    import torch
    import transformers

    gpu = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        gpu = torch.cuda.get_device_name(index)
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "cuda": torch.version.cuda,
        "device": str(device),
    }


# --------------------------------------------------------------------------- table


def short_prompt(text: str, width: int = 44) -> str:
    """The prompt on one line (newlines shown as \\n), cut to `width` characters like the seed's table."""
    flat = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return flat if len(flat) <= width else flat[:width] + "..."


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def identical_cell(record: dict) -> str:
    div = record.get("divergence")
    if record["ids_identical"]:
        return "YES"
    if div and div.get("verdict") == "tie":
        return f"TIE@{div['position']}"
    return f"NO (diverge@{div['position'] if div else '?'})"


def format_table(header: list[str], rows: list[list[str]], left: frozenset[int] = frozenset({1})) -> str:
    """A plain-text table; columns in `left` are left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def results_table(records: list[dict]) -> str:
    rows = [[str(r["index"]), short_prompt(r["prompt"]), str(r["new_tokens"]), _fmt(r["greedy_s"]),
             _fmt(r["spec_s"]), _fmt(r["greedy_tok_s"], 1), _fmt(r["spec_tok_s"], 1), f"{r['speedup']:.2f}x",
             _fmt(r["accept_rate"]), _fmt(r["alpha"]), _fmt(r["tokens_per_round"], 1), identical_cell(r)]
            for r in records]
    return format_table(TABLE_COLUMNS, rows)


def peer_table(records: list[dict]) -> str:
    rows = []
    for r in records:
        p = r["peer"]
        same = p["ids_identical"]
        # A peer that generated something else did other work: its time is not comparable.
        rows.append([str(r["index"]), _fmt(p["hf_s"]), _fmt(p["hf_tok_s"], 1),
                     f"{p['hf_speedup']:.2f}x" if same else "-", f"{p['ours_vs_hf']:.2f}x" if same else "-",
                     "YES" if same else f"NO: {peer_difference(p['tokens'], r['greedy_tokens'])}"])
    return format_table(PEER_COLUMNS, rows, left=frozenset())


def gamma_label(s: dict) -> str:
    """gamma as the run chose it: '5', 'calibrated 8', 'auto (online; mostly 7)'."""
    option, g = s.get("gamma_option", s["gamma"]), s["gamma"]
    if option == "calibrated":
        return f"{g} (calibrated)"
    if option == "auto":
        return f"auto (online; mostly {s['theory_gamma']})"
    return str(g)


def header(args, pair_info: dict, ps: dict) -> str:
    """The lines printed before the run: what is compared, on what."""
    device, eos = args.device, ps["eos"]
    lines = [f"note: {pair_info['note']}"] if pair_info["note"] else []
    lines.append(f"target: {pair_info['target_name']} ({pair_info['target_params'] / 1e6:.2f}M params, "
                 f"{args.target_dtype}) | draft: {pair_info['draft_name']} ({pair_info['draft_params'] / 1e6:.2f}M "
                 f"params, {args.draft_dtype}) | device: {device}"
                 + (f" | threads: {args.threads}" + (" (default)" if args.threads_default else "")
                    if args.threads is not None else ""))
    if not pair_info.get("target_split", "whole").startswith("whole"):
        lines.append(f"target split: {pair_info['target_split']} | draft: whole on every rank")
    if "target_path" in pair_info:
        lines.append(f"runs as: target {pair_info['target_path']} | draft {pair_info['draft_path']} "
                     "(spec.runner: how each model's state is rolled back)")
    lines.append(f"prompts: {len(ps['texts'])} ({ps['set']}) | max new tokens: {args.max_new_tokens}"
                 + (f" (default on {'CUDA' if device.startswith('cuda') else 'CPU'})" if args.max_new_tokens_default
                    else "")
                 + f" | EOS: {eos if eos is not None else 'none'} | repeats: {args.repeats}")
    return "\n".join(lines)


def calibration_line(cal: dict) -> str:
    return (f"gamma=calibrated: calibration alpha={cal['alpha']:.3f}, c={cal['c']:.3f}, verify pass "
            f"{cal.get('verify_fixed', 1.0):.2f} + "
            f"{cal['verify_slope']:.3f} x gamma steps -> gamma={cal['chosen_gamma']} (Theorem 3.8's optimum with "
            f"that verify cost, at most {cal['max_gamma']})")


def _in_run_lines(s: dict) -> list[str]:
    r, g = s.get("in_run"), s.get("theory_gamma", s["gamma"])
    if r is None:
        return []
    return [
        f"  from the timed runs themselves: c = {r['c']:.3f} (draft time per drafted token / greedy time per "
        f"token), a {g + 1}-token verify pass = {r['verify_over_step']:.2f} target steps",
        f"  Theorem 3.8 with that c: {r['predicted_speedup']:.2f}x (measured/predicted "
        f"{r['measured_over_predicted']:.2f}); it assumes a verify pass costs one step, and priced at "
        f"its measured cost: {r['predicted_speedup_verify_costed']:.2f}x "
        f"({r['measured_over_verify_costed']:.2f})",
        f"  share of speculative time inside the draft and verify phases: {r['share_in_model_phases']:.1%}",
    ]


def _optimal_line(s: dict) -> str:
    if s.get("optimal_gamma") is None:
        return "optimal gamma: - (no alpha measured)"
    if s.get("draft_cannot_win"):
        return (f"optimal gamma: none, the draft cannot win here: at alpha={_fmt(s['alpha'], 3)} and "
                f"c={s['c']:.3f} Theorem 3.8 predicts at best {_fmt(s['optimal_predicted_speedup'])}x "
                f"(gamma={s['optimal_gamma']}); a speedup needs alpha well above c (Corollary 3.9)")
    return (f"optimal gamma for the measured alpha and c: {s['optimal_gamma']} "
            f"(predicted {_fmt(s['optimal_predicted_speedup'])}x)")


def peer_difference(peer: list[int], greedy: list[int]) -> str | None:
    """Why a peer's output is not greedy's: None when identical."""
    if peer == greedy:
        return None
    at = next((i for i, (a, b) in enumerate(zip(peer, greedy)) if a != b), None)
    if at is None:
        return f"{len(peer)} tokens where greedy made {len(greedy)} (it stopped " + \
            ("early)" if len(peer) < len(greedy) else "later)")
    return f"differs at new token {at} ({peer[at]} vs greedy's {greedy[at]})"


def summary_lines(s: dict) -> list[str]:
    spread = ""
    if s.get("repeats", 1) > 1:
        spread = (f"; over {s['repeats']} repeats {min(s['repeat_speedups']):.2f}x to "
                  f"{max(s['repeat_speedups']):.2f}x")
    lines = [
        f"c (draft step / target step): {s['c']:.3f}  "
        f"({s['draft_step_s'] * 1e3:.2f} ms / {s['target_step_s'] * 1e3:.2f} ms, median cached one-token step)",
        f"alpha (pooled, per-token acceptance MLE): {_fmt(s['alpha'], 3)}   "
        f"accept rate (accepted/drafted): {_fmt(s['accept_rate'], 3)}   tokens/round: {_fmt(s['tokens_per_round'])}",
        f"speedup at gamma={gamma_label(s)}: predicted {_fmt(s['predicted_speedup'])}x (Theorem 3.8), "
        f"measured {_fmt(s['measured_speedup'])}x (total greedy s / total spec s; "
        f"per prompt {_fmt(s['speedup_min'])}x to {_fmt(s['speedup_max'])}x{spread})",
    ]
    return lines + _in_run_lines(s) + [_optimal_line(s)]


def render(results: dict) -> str:
    """The report after the run: tables, summary, the peer's figures and any warning."""
    records, s = results["prompts"], results["summary"]
    parts = [results_table(records)]
    if "hf_compared_prompts" in s:
        parts += ["", f"peer: Hugging Face assisted generation (gamma={s['peer_gamma']}, speedup vs our greedy)",
                  peer_table(records)]
    parts += [""] + summary_lines(s)
    if "hf_compared_prompts" in s:
        for r in records:
            if not r["peer"]["ids_identical"]:
                parts.append(f"HF assisted, prompt {r['index']}: output is not greedy's: "
                             f"{peer_difference(r['peer']['tokens'], r['greedy_tokens'])}; its time is left out")
        if s["hf_compared_prompts"]:
            parts.append(f"HF assisted: {s['hf_speedup']:.2f}x over greedy; ours is {s['ours_vs_hf']:.2f}x HF's "
                         f"speed (on the {s['hf_compared_prompts']} of {len(records)} prompts where its output is "
                         "greedy's)")
        else:
            parts.append("HF assisted: no output equal to greedy's, so no speed comparison")
    if results.get("warnings"):
        parts.append("WARNING: the run's own figures disagree: " + "; ".join(results["warnings"]))
    return "\n".join(parts)


def tie_lines(results: dict) -> list[str]:
    return [f"prompt {r['index']} ({short_prompt(r['prompt'])!r}) differs from greedy at new token "
            f"{r['divergence']['position']}, a proven numerical tie (not a failure):\n  {r['divergence']['message']}"
            for r in results["prompts"] if not r["ids_identical"] and r["divergence"]["verdict"] == "tie"]


def failure_lines(results: dict) -> list[str]:
    out = []
    for r in results["prompts"]:
        div = r["divergence"]
        if r["ids_identical"] or div["verdict"] == "tie":
            continue
        out.append(f"spec: FAIL: prompt {r['index']} ({short_prompt(r['prompt'])!r}): speculative output differs "
                   f"from greedy at new token {div['position']} (greedy {div['expected']}, speculative "
                   f"{div['actual']})" + (f"\n  {div['message']}" if div.get("message") else ""))
    return out


# --------------------------------------------------------------------------- JSON


def jsonable(obj):
    """Plain JSON values: dataclasses and Paths converted, NaN/inf written as null."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- figure


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(results: dict, path: Path) -> bool:  # pragma: no mutate block (layout and colours: looked at, not asserted)
    """results.png like the seed's: throughput per prompt, acceptance, one traced generation.

    Returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    _throughput_panel(axes[0], results)
    _acceptance_panel(axes[1], results)
    _trace_panel(axes[2], results)
    fig.suptitle(figure_title(results), fontsize=10.5)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figure_title(results: dict) -> str:
    pair, opts, summary = results["pair"], results["options"], results["summary"]
    title = (f"Speculative vs greedy: target {pair['target_name']} ({opts['target_dtype']}) + draft "
             f"{pair['draft_name']} ({opts['draft_dtype']}) on {results['machine']['gpu'] or 'CPU'}; "
             f"γ={gamma_label(summary)}, {opts['max_new_tokens']} new tokens; c={summary['c']:.3f}; speedup measured "
             f"{_fmt(summary['measured_speedup'])}x, Thm 3.8 predicts {_fmt(summary['predicted_speedup'])}x")
    if results.get("warnings"):
        title += "\n(WARNING: the run's own figures disagree; see results.json 'warnings')"
    return title


def _throughput_panel(ax, results: dict) -> None:
    """Tokens per second per prompt, greedy and speculative (and HF assisted), labelled with the speedup."""
    records, summary = results["prompts"], results["summary"]
    x = list(range(len(records)))
    peer = all(r.get("peer") for r in records)
    n_bars = 3 if peer else 2
    w = 0.8 / n_bars
    g_tok = [r["greedy_tok_s"] for r in records]
    s_tok = [r["spec_tok_s"] for r in records]
    ax.bar([i - w * (n_bars - 1) / 2 for i in x], g_tok, w, color=C_G, label="greedy")
    ax.bar([i - w * (n_bars - 1) / 2 + w for i in x], s_tok, w, color=C_S,
           label=f"speculative (γ={gamma_label(summary)})")
    if peer:
        ax.bar([i + w for i in x], [r["peer"]["hf_tok_s"] for r in records], w, color=C_P, label="HF assisted")
    top = max(g_tok + s_tok + ([r["peer"]["hf_tok_s"] for r in records] if peer else []))
    for i, r in enumerate(records):
        mark = "" if r["ids_identical"] else (" tie" if (r.get("divergence") or {}).get("verdict") == "tie" else " ≠")
        ax.text(i - w * (n_bars - 1) / 2 + w, s_tok[i] + top * 0.02, f"{r['speedup']:.2f}x{mark}",
                ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(x, [f"P{r['index']}" for r in records])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Throughput per prompt (label: speedup, median of {summary.get('repeats', 1)} repeats)")
    ax.legend(loc="upper center", fontsize=8, ncol=n_bars, frameon=False)
    ax.grid(axis="y", alpha=0.3)


def _acceptance_panel(ax, results: dict) -> None:
    """Accept rate and alpha (left axis), tokens per round (right axis)."""
    records, summary = results["prompts"], results["summary"]
    x = list(range(len(records)))
    top = max([summary.get("theory_gamma", summary["gamma"])] + [d for r in records for d in r["drafted_per_round"]])
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["accept_rate"] or 0 for r in records], w, color=C_A, label="accept rate")
    ax.bar([i + w / 2 for i in x], [r["alpha"] or 0 for r in records], w, color=C_A, alpha=0.45, label="α (MLE)")
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("acceptance")
    ax.set_xticks(x, [f"P{r['index']}" for r in records])
    ax2 = ax.twinx()
    ax2.plot(x, [r["tokens_per_round"] for r in records], "D-", color="#333333", label="tokens / round")
    ax2.axhline(top + 1, color="#333333", ls=":", lw=1)
    ax2.text(len(x) - 0.5, top + 1, f"max γ+1 = {top + 1}", ha="right", va="top", fontsize=8)
    ax2.set_ylim(0, (top + 1) * 1.35)
    ax2.set_ylabel("tokens / round")
    handles, handles2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper center", fontsize=8, ncol=3,
              frameon=False)
    ax.set_title(f"Acceptance (pooled α={_fmt(summary['alpha'])}, {_fmt(summary['tokens_per_round'])} tok/round)")
    ax.grid(axis="y", alpha=0.3)


def _trace_panel(ax, results: dict) -> None:
    """A traced generation: draft vs verify time per round (the median-speedup prompt)."""
    records = results["prompts"]
    order = sorted(range(len(records)), key=lambda i: records[i]["speedup"])
    pick = records[order[len(order) // 2]]
    trace = pick["trace"]
    rounds = list(range(1, len(trace) + 1))
    d_ms = [t["draft_s"] * 1e3 for t in trace]
    v_ms = [t["verify_s"] * 1e3 for t in trace]
    ax.bar(rounds, d_ms, 0.85, color=C_A, label="draft")
    ax.bar(rounds, v_ms, 0.85, bottom=d_ms, color=C_S, label="verify")
    ax.set_xlabel("round")
    ax.set_ylabel("ms")
    if trace:
        # The first round carries both prefills; keep the axis on the steady state.
        steady = [a + b for a, b in zip(d_ms[1:], v_ms[1:])] or [d_ms[0] + v_ms[0]]
        ymax = max(steady) * 1.35
        ax.set_ylim(0, ymax)
        if d_ms[0] + v_ms[0] > ymax:
            ax.text(1, ymax * 0.97, f"{d_ms[0] + v_ms[0]:.0f} ms\n(prefill)", ha="left", va="top", fontsize=7)
    ax3 = ax.twinx()
    ax3.plot(rounds, [t["emitted"] for t in trace], "o", ms=3, color="#333333", label="tokens emitted")
    ax3.set_ylim(0, (max([t["emitted"] for t in trace], default=1)) * 1.12 * 1.35)
    ax3.set_ylabel("tokens emitted")
    total_d, total_v = sum(d_ms), sum(v_ms)
    share = total_d / (total_d + total_v) if total_d + total_v else float("nan")
    h1, h3 = ax.get_legend_handles_labels(), ax3.get_legend_handles_labels()
    ax.legend(h1[0] + h3[0], h1[1] + h3[1], loc="upper center", fontsize=8, ncol=3, frameon=False)
    ax.set_title(f"Traced generation, P{pick['index']} ({len(trace)} rounds, draft {share:.0%} of time)")
