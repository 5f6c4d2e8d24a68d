"""Reporting for `python -m spec`: the results table, results.json and results.png.

Everything here renders the typed records of spec/experiment/records.py (the per-prompt records and the
summary that spec.experiment builds), and results.json is their `to_json()`, so the JSON file
and the printed table show the same numbers. matplotlib is optional (the `plots` extra);
without it `plot` returns False.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from spec.experiment.records import peer_label
from spec.options import GammaMode

if TYPE_CHECKING:
    from spec.experiment.records import Calibration, PairInfo, PeerSummary, PromptRecord, Prompts, Results, Summary

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


def fmt(value, digits: int = 2) -> str:
    """A figure in a table cell: `digits` decimals, "-" for none (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def identical_cell(record: PromptRecord) -> str:
    div = record.divergence
    if record.identical:
        return "YES"
    if div is not None and div.verdict == "tie":
        return f"TIE@{div.position}"
    return f"NO (diverge@{div.position if div is not None else '?'})"


def format_table(header: list[str], rows: list[list[str]], left: frozenset[int] = frozenset({1})) -> str:
    """A plain-text table; columns in `left` are left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def results_table(records: list[PromptRecord]) -> str:
    rows = []
    for r in records:
        g, s = len(r.greedy.tokens), len(r.spec.tokens)
        rows.append([str(r.index), short_prompt(r.prompt), str(s), fmt(r.greedy_s), fmt(r.spec_s),
                     fmt(g / r.greedy_s, 1), fmt(s / r.spec_s, 1), f"{r.speedup:.2f}x", fmt(r.spec.accept_rate),
                     fmt(r.spec.alpha), fmt(r.spec.mean_tokens_per_round, 1), identical_cell(r)])
    return format_table(TABLE_COLUMNS, rows)


def peer_cells(record: PromptRecord, peer) -> list[str]:
    """A peer's speedup over our greedy and our speed over its, or "-" where its output is not
    greedy's (it did other work: its time is not comparable), and whether it is."""
    same = peer.identical
    return [f"{record.greedy_s / peer.s:.2f}x" if same else "-", f"{peer.s / record.spec_s:.2f}x" if same else "-",
            "YES" if same else f"NO: {peer_difference(peer.tokens, record.greedy.tokens)}"]


def _peer_of(record: PromptRecord, name: str | None):
    return record.peer if name is None else next(p for p in record.peers if p.name == name)


def peer_table(records: list[PromptRecord], name: str | None = None) -> str:
    """One peer's table (the first peer's when name is None): HF assisted generation's columns say
    "hf", any other peer's "peer"."""
    rows = [[str(r.index), fmt(p.s), fmt(p.tok_s, 1), *peer_cells(r, p)] for r in records
            for p in [_peer_of(r, name)]]
    first = name or records[0].peer.name
    columns = PEER_COLUMNS if first == "hf_assisted" else [c.replace("hf assisted", "peer").replace("hf", "peer")
                                                           for c in PEER_COLUMNS]
    return format_table(columns, rows, left=frozenset())



def gamma_label(s: Summary) -> str:
    """gamma as the run chose it: '5', 'calibrated 8', 'auto (online; mostly 7)'."""
    if s.gamma_option == GammaMode.CALIBRATED:
        return f"{s.gamma} (calibrated)"
    if s.gamma_option == GammaMode.AUTO:
        return f"auto (online; mostly {s.theory_gamma})"
    return str(s.gamma)


def header(pair_info: PairInfo, ps: Prompts, *, device: str, target_dtype: str, draft_dtype: str,
           threads: int | None, threads_default: bool, max_new_tokens: int, max_new_tokens_default: bool,
           repeats: int) -> str:
    """The lines printed before the run: what is compared, on what."""
    info, eos = pair_info, ps.eos
    lines = [f"note: {info.note}"] if info.note else []
    draft = (f"{info.draft_name} ({info.draft_params / 1e6:.2f}M params, {draft_dtype})" if info.draft_params
             else info.draft_name + ("" if info.draft_path in info.draft_name else f" ({info.draft_path})"))
    lines.append(f"target: {info.target_name} ({info.target_params / 1e6:.2f}M params, "
                 f"{target_dtype}) | draft: {draft} | device: {device}"
                 + (f" | threads: {threads}" + (" (default)" if threads_default else "")
                    if threads is not None else ""))
    if not info.target_split.startswith("whole"):
        lines.append(f"target split: {info.target_split} | draft: whole on every rank")
    lines.append(f"runs as: target {info.target_path} | draft {info.draft_path} "
                 "(spec.runner: how each model's state is rolled back)")
    if info.target_logits:
        lines.append(f"target's logits: {info.target_logits}")
    lines.append(f"prompts: {len(ps.texts)} ({ps.name}) | max new tokens: {max_new_tokens}"
                 + (f" (default on {'CUDA' if device.startswith('cuda') else 'CPU'})" if max_new_tokens_default
                    else "")
                 + f" | EOS: {eos if eos is not None else 'none'} | repeats: {repeats}")
    return "\n".join(lines)


def calibration_line(cal: Calibration) -> str:
    return (f"gamma=calibrated: calibration alpha={cal.alpha:.3f}, c={cal.c:.3f}, verify pass "
            f"{cal.verify_fixed:.2f} + "
            f"{cal.verify_slope:.3f} x gamma steps -> gamma={cal.chosen_gamma} (Theorem 3.8's optimum with "
            f"that verify cost, at most {cal.max_gamma})")


def _in_run_lines(s: Summary) -> list[str]:
    r, g = s.in_run, s.theory_gamma
    if r is None:
        return []
    return [
        f"  from the timed runs themselves: c = {r.c:.3f} (draft time per drafted token / greedy time per "
        f"token), a {g + 1}-token verify pass = {r.verify_over_step:.2f} target steps",
        f"  Theorem 3.8 with that c: {r.predicted_speedup:.2f}x (measured/predicted "
        f"{r.measured_over_predicted:.2f}); it assumes a verify pass costs one step, and priced at "
        f"its measured cost: {r.predicted_speedup_verify_costed:.2f}x "
        f"({r.measured_over_verify_costed:.2f})",
        f"  share of speculative time inside the draft and verify phases: {r.share_in_model_phases:.1%}",
    ]


def _optimal_line(s: Summary) -> str:
    th = s.theory
    if th.optimal_gamma is None:
        return "optimal gamma: - (no alpha measured)"
    if th.draft_cannot_win:
        return (f"optimal gamma: none, the draft cannot win here: at alpha={fmt(s.alpha, 3)} and "
                f"c={s.c:.3f} Theorem 3.8 predicts at best {fmt(th.optimal_predicted_speedup)}x "
                f"(gamma={th.optimal_gamma}); a speedup needs alpha well above c (Corollary 3.9)")
    return (f"optimal gamma for the measured alpha and c: {th.optimal_gamma} "
            f"(predicted {fmt(th.optimal_predicted_speedup)}x)")


def peer_difference(peer: list[int], greedy: list[int]) -> str | None:
    """Why a peer's output is not greedy's: None when identical."""
    if peer == greedy:
        return None
    at = next((i for i, (a, b) in enumerate(zip(peer, greedy)) if a != b), None)
    if at is None:
        return f"{len(peer)} tokens where greedy made {len(greedy)} (it stopped " + \
            ("early)" if len(peer) < len(greedy) else "later)")
    return f"differs at new token {at} ({peer[at]} vs greedy's {greedy[at]})"


def _c_line(s: Summary) -> str:
    if s.draft_step_s is None:
        return (f"c (draft time per drafted token / greedy time per token, from the timed runs): {fmt(s.c, 4)}; "
                f"{s.rounds_drafting_nothing:.0%} of rounds drafted nothing")
    return (f"c (draft step / target step): {s.c:.3f}  "
            f"({s.draft_step_s * 1e3:.2f} ms / {s.target_step_s * 1e3:.2f} ms, median cached one-token step)")


def _verify_lines(s: Summary) -> list[str]:
    v = s.verify
    if v is None:
        return []
    measured = ", ".join(f"g={g} {t:.2f}" for g, t in sorted(v.measured.items()) if g in (1, 2, 4, 8, 16))
    return [f"verify pass of g+1 tokens = {v.fixed:.2f} + {v.slope:.3f} g target steps (fitted, g = 1..16; "
            f"measured: {measured})",
            f"predicted from the rounds as drafted: {v.predicted_speedup:.2f}x with that verify cost, "
            f"{v.predicted_speedup_flat:.2f}x if a pass cost one step (Theorem 3.8's assumption); measured/predicted "
            f"{s.measured_speedup / v.predicted_speedup:.2f}"]


def summary_lines(s: Summary) -> list[str]:
    spread = ""
    if s.repeats > 1:
        spread = f"; over {s.repeats} repeats {min(s.repeat_speedups):.2f}x to {max(s.repeat_speedups):.2f}x"
    lines = [
        _c_line(s),
        f"alpha (pooled, per-token acceptance MLE): {fmt(s.alpha, 3)}   "
        f"accept rate (accepted/drafted): {fmt(s.accept_rate, 3)}   tokens/round: {fmt(s.tokens_per_round)}",
        f"speedup at gamma={gamma_label(s)}: predicted {fmt(s.theory.predicted_speedup)}x (Theorem 3.8), "
        f"measured {fmt(s.measured_speedup)}x (total greedy s / total spec s; "
        f"per prompt {fmt(min(s.speedups))}x to {fmt(max(s.speedups))}x{spread})",
    ]
    return lines + _in_run_lines(s) + [_optimal_line(s)] + _verify_lines(s) + _passes_lines(s)


def _passes_lines(s: Summary) -> list[str]:
    """The target's passes by the path that produced their logits (spec.cpu.executor), where it had one."""
    counts = {k: v for k, v in s.target_passes.items() if k != "declined"}
    if not counts:
        return []
    line = "target's passes by path: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    declined = s.target_passes.get("declined") or {}
    if declined:
        line += " (its own forward: " + "; ".join(f"{why}: {n}" for why, n in declined.items()) + ")"
    return [line]


def _peer_title(name: str, peer: PeerSummary, s: Summary) -> str:
    if name == "hf_assisted":
        return f"Hugging Face assisted generation (gamma={s.peer_gamma}, speedup vs our greedy)"
    if peer.setting is not None:
        return (f"HF prompt lookup (prompt_lookup_num_tokens={peer.setting[0]}, "
                f"max_matching_ngram_size={peer.setting[1]}; speedup vs our greedy)")
    return f"{name} (speedup vs our greedy)"


def _peer_lines(records: list[PromptRecord], s: Summary) -> list[str]:
    parts = []
    for name, peer in s.peers.items():
        parts += ["", f"peer: {_peer_title(name, peer, s)}", peer_table(records, name)]
    parts += [""] + summary_lines(s)
    for name, peer in s.peers.items():
        label = peer_label(name)
        for r in records:
            p = _peer_of(r, name)
            if not p.identical:
                parts.append(f"{label}, prompt {r.index}: output is not greedy's: "
                             f"{peer_difference(p.tokens, r.greedy.tokens)}; its time is left out")
        if peer.compared_prompts:
            parts.append(f"{label}: {peer.speedup:.2f}x over greedy; ours is {peer.ours_vs:.2f}x its speed (on the "
                         f"{peer.compared_prompts} of {len(records)} prompts where its output is greedy's)")
        else:
            parts.append(f"{label}: no output equal to greedy's, so no speed comparison")
    return parts


def render(records: list[PromptRecord], summary: Summary, warnings: list[str] = ()) -> str:
    """The report after the run: tables, summary, the peer's figures and any warning."""
    parts = [results_table(records)]
    parts += _peer_lines(records, summary) if summary.peers else [""] + summary_lines(summary)
    if warnings:
        parts.append("WARNING: the run's own figures disagree: " + "; ".join(warnings))
    return "\n".join(parts)


def tie_lines(records: list[PromptRecord]) -> list[str]:
    return [f"prompt {r.index} ({short_prompt(r.prompt)!r}) differs from greedy at new token "
            f"{r.divergence.position}, a proven numerical tie (not a failure):\n  {r.divergence.message}"
            for r in records if r.is_tie]


def failure_lines(records: list[PromptRecord]) -> list[str]:
    out = []
    for r in records:
        div = r.divergence
        if r.identical or r.is_tie:
            continue
        out.append(f"spec: FAIL: prompt {r.index} ({short_prompt(r.prompt)!r}): speculative output differs "
                   f"from greedy at new token {div.position} (greedy {div.expected}, speculative "
                   f"{div.actual})" + (f"\n  {div.message}" if div.message else ""))
    return out


# --------------------------------------------------------------------------- JSON


def jsonable(obj):
    """Plain JSON values: records (their to_json), dataclasses and Paths converted, NaN/inf written as null."""
    if callable(getattr(obj, "to_json", None)) and not isinstance(obj, type):
        return jsonable(obj.to_json())
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


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- figure


def can_plot() -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    del matplotlib   # only whether it imports
    return True


def plot(results: Results, path: Path) -> bool:  # pragma: no mutate block (layout and colours: looked at, not asserted)
    """results.png like the seed's: throughput per prompt, acceptance, one traced generation.

    Returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    _throughput_panel(axes[0], results.records, results.summary)
    _acceptance_panel(axes[1], results.records, results.summary)
    _trace_panel(axes[2], results.records)
    fig.suptitle(figure_title(results), fontsize=10.5)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figure_title(results: Results) -> str:
    pair, opts, summary = results.pair, results.options, results.summary
    draft = f"{pair.draft_name} ({opts['draft_dtype']})" if pair.draft_params else pair.draft_name  # or a source
    title = (f"Speculative vs greedy: target {pair.target_name} ({opts['target_dtype']}) + draft "
             f"{draft} on {results.machine['gpu'] or 'CPU'}; "
             f"γ={gamma_label(summary)}, {opts['max_new_tokens']} new tokens; c={summary.c:.3f}; speedup measured "
             f"{fmt(summary.measured_speedup)}x, Thm 3.8 predicts {fmt(summary.theory.predicted_speedup)}x")
    if results.warnings:
        title += "\n(WARNING: the run's own figures disagree; see results.json 'warnings')"
    return title


def _throughput_panel(ax, records: list[PromptRecord], summary: Summary) -> None:
    """Tokens per second per prompt, greedy and speculative (and HF assisted), labelled with the speedup."""
    x = list(range(len(records)))
    peer = all(r.peer for r in records)
    n_bars = 3 if peer else 2
    w = 0.8 / n_bars
    g_tok = [len(r.greedy.tokens) / r.greedy_s for r in records]
    s_tok = [len(r.spec.tokens) / r.spec_s for r in records]
    p_tok = [r.peer.tok_s for r in records] if peer else []
    ax.bar([i - w * (n_bars - 1) / 2 for i in x], g_tok, w, color=C_G, label="greedy")
    ax.bar([i - w * (n_bars - 1) / 2 + w for i in x], s_tok, w, color=C_S,
           label=f"speculative (γ={gamma_label(summary)})")
    if peer:
        ax.bar([i + w for i in x], p_tok, w, color=C_P, label=peer_label(records[0].peer.name))
    top = max(g_tok + s_tok + p_tok)
    for i, r in enumerate(records):
        mark = "" if r.identical else (" tie" if r.is_tie else " ≠")
        ax.text(i - w * (n_bars - 1) / 2 + w, s_tok[i] + top * 0.02, f"{r.speedup:.2f}x{mark}",
                ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(x, [f"P{r.index}" for r in records])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Throughput per prompt (label: speedup, median of {summary.repeats} repeats)")
    ax.legend(loc="upper center", fontsize=8, ncol=n_bars, frameon=False)
    ax.grid(axis="y", alpha=0.3)


def _acceptance_panel(ax, records: list[PromptRecord], summary: Summary) -> None:
    """Accept rate and alpha (left axis), tokens per round (right axis)."""
    x = list(range(len(records)))
    top = max([summary.theory_gamma] + [d for r in records for d in r.spec.drafted_per_round])
    w = 0.38

    def rate(value):  # NaN (nothing drafted) drawn as 0
        return 0 if value is None or math.isnan(value) else value

    ax.bar([i - w / 2 for i in x], [rate(r.spec.accept_rate) for r in records], w, color=C_A, label="accept rate")
    ax.bar([i + w / 2 for i in x], [rate(r.spec.alpha) for r in records], w, color=C_A, alpha=0.45, label="α (MLE)")
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("acceptance")
    ax.set_xticks(x, [f"P{r.index}" for r in records])
    ax2 = ax.twinx()
    ax2.plot(x, [r.spec.mean_tokens_per_round for r in records], "D-", color="#333333", label="tokens / round")
    ax2.axhline(top + 1, color="#333333", ls=":", lw=1)
    ax2.text(len(x) - 0.5, top + 1, f"max γ+1 = {top + 1}", ha="right", va="top", fontsize=8)
    ax2.set_ylim(0, (top + 1) * 1.35)
    ax2.set_ylabel("tokens / round")
    handles, handles2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper center", fontsize=8, ncol=3,
              frameon=False)
    ax.set_title(f"Acceptance (pooled α={fmt(summary.alpha)}, {fmt(summary.tokens_per_round)} tok/round)")
    ax.grid(axis="y", alpha=0.3)


def _trace_panel(ax, records: list[PromptRecord]) -> None:
    """A traced generation: draft vs verify time per round (the median-speedup prompt)."""
    order = sorted(range(len(records)), key=lambda i: records[i].speedup)
    pick = records[order[len(order) // 2]]
    trace = pick.spec.trace or []
    rounds = list(range(1, len(trace) + 1))
    d_ms = [t.draft_s * 1e3 for t in trace]
    v_ms = [t.verify_s * 1e3 for t in trace]
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
    ax3.plot(rounds, [t.emitted for t in trace], "o", ms=3, color="#333333", label="tokens emitted")
    ax3.set_ylim(0, (max([t.emitted for t in trace], default=1)) * 1.12 * 1.35)
    ax3.set_ylabel("tokens emitted")
    total_d, total_v = sum(d_ms), sum(v_ms)
    share = total_d / (total_d + total_v) if total_d + total_v else float("nan")
    h1, h3 = ax.get_legend_handles_labels(), ax3.get_legend_handles_labels()
    ax.legend(h1[0] + h3[0], h1[1] + h3[1], loc="upper center", fontsize=8, ncol=3, frameon=False)
    ax.set_title(f"Traced generation, P{pick.index} ({len(trace)} rounds, draft {share:.0%} of time)")
