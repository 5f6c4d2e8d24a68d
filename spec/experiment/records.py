"""The experiment's results as typed records: what spec.experiment measures, spec.experiment.report renders
and results.json holds.

A record keeps what was measured (the decoders' Results, the wall times of every repeat) and
derives its figures from that, as properties, so the table, the summary and the JSON file all read
one number. `to_json()` gives each record's keys in results.json, unchanged since the records were
dicts (users and tests read them). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spec.decode import Result


def _finite(x):
    """NaN (an undefined rate) as None, the way results.json writes it."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass
class Prompts:
    """The prompts to run: their texts (or feature-file names), the ids (or features tensors)
    decoded, the set's name, and the EOS id decoding stops at (None: none)."""
    texts: list[str]
    ids: list
    name: str                      # results.json's "prompt_set"
    eos: int | None


@dataclass
class PairInfo:
    """What was loaded: results.json's "pair"."""
    source: str                    # "shipped", "paths" or "random" (the seeded stand-in)
    target: str | None             # the folder or hub id given (None for the stand-in)
    draft: str | None
    target_name: str               # short names for the report
    draft_name: str
    note: str | None               # said before the run (the stand-in's caveat)
    target_split: str = "whole"    # spec.parallel.describe
    target_path: str = ""          # how each model runs (spec.choose)
    draft_path: str = ""
    target_params: int = 0
    draft_params: int = 0
    tokenizer: bool = False
    target_logits: str = ""        # which path produces the target's logits, and why (spec.cpu.executor.describe)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Difference:
    """Where and why a speculative output is not greedy's: spec.diagnose's verdict ("tie" or
    "bug"), or "unknown" (position only) when it finds no divergence."""
    position: int | None
    expected: int | None
    actual: int | None
    verdict: str
    message: str
    gap_step: float | None = None
    gap_block: float | None = None
    noise: float | None = None
    dtype: str | None = None

    def to_json(self) -> dict:
        out = {"position": self.position, "expected": self.expected, "actual": self.actual}
        if self.verdict != "unknown":
            out.update(gap_step=self.gap_step, gap_block=self.gap_block, noise=self.noise, dtype=self.dtype)
        return {**out, "verdict": self.verdict, "message": self.message}


PEER_LABELS = {"hf_assisted": "HF assisted"}   # a peer's words in the progress lines, the report and the figure


def peer_label(name: str) -> str:
    return PEER_LABELS.get(name, name)


@dataclass
class Peer:
    """A peer decoder's runs of one prompt (HF assisted generation, HF prompt lookup)."""
    name: str
    tokens: list[int]              # the first repeat's new tokens
    times: list[float]             # wall seconds, one per repeat
    identical: bool                # every repeat produced greedy's tokens
    setting: tuple | None = None   # HF prompt lookup: (num_tokens, max_ngram)

    @property
    def s(self) -> float:
        return statistics.median(self.times)

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.s


@dataclass
class PromptRecord:
    """One prompt's runs: greedy and speculative (and any peer) over the repeats."""
    index: int                     # 1-based
    prompt: str | None
    prompt_tokens: int
    greedy: Result                 # the first repeat's (greedy is deterministic)
    spec: Result                   # the repeat the trace comes from: one that differs from greedy, if any
    greedy_times: list[float]      # wall seconds, one per repeat
    spec_times: list[float]
    trace_repeat: int              # which repeat `spec` is
    divergence: Difference | None = None
    text: str | None = None        # the speculative output decoded, where there is a tokenizer
    peers: list[Peer] = field(default_factory=list)

    @property
    def greedy_s(self) -> float:
        return statistics.median(self.greedy_times)

    @property
    def spec_s(self) -> float:
        return statistics.median(self.spec_times)

    @property
    def speedup(self) -> float:
        return self.greedy_s / self.spec_s

    @property
    def identical(self) -> bool:
        return self.greedy.tokens == self.spec.tokens

    @property
    def is_tie(self) -> bool:
        return not self.identical and self.divergence is not None and self.divergence.verdict == "tie"

    @property
    def peer(self) -> Peer | None:
        return self.peers[0] if self.peers else None

    def peer_json(self, p: Peer) -> dict:
        return {"name": p.name, "hf_s": p.s, "hf_tok_s": p.tok_s, "hf_speedup": self.greedy_s / p.s,
                "ours_vs_hf": p.s / self.spec_s, "ids_identical": p.identical, "new_tokens": len(p.tokens),
                "tokens": p.tokens, "hf_s_repeats": p.times, "setting": p.setting}

    def to_json(self) -> dict:
        g, s = self.greedy, self.spec
        return {
            "index": self.index, "prompt": self.prompt, "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(s.tokens), "greedy_new_tokens": len(g.tokens),
            "greedy_s": self.greedy_s, "spec_s": self.spec_s,
            "greedy_tok_s": len(g.tokens) / self.greedy_s, "spec_tok_s": len(s.tokens) / self.spec_s,
            "speedup": self.speedup, "greedy_s_repeats": self.greedy_times, "spec_s_repeats": self.spec_times,
            "accept_rate": _finite(s.accept_rate), "alpha": _finite(s.alpha),
            "tokens_per_round": s.mean_tokens_per_round, "rounds": len(s.rounds),
            "drafted": s.drafted, "accepted": s.accepted,
            "ids_identical": self.identical, "divergence": self.divergence and self.divergence.to_json(),
            "stop_reason": s.stop_reason, "greedy_stop_reason": g.stop_reason,
            "greedy_tokens": g.tokens, "spec_tokens": s.tokens, "text": self.text,
            "drafted_per_round": s.drafted_per_round, "accepted_per_round": s.accepted_per_round,
            "tokens_per_round_list": s.tokens_per_round,
            "trace": [_round_json(r) for r in s.trace or []], "trace_repeat": self.trace_repeat,
            "peer": self.peer_json(self.peer) if self.peer else None,
            "peers": [self.peer_json(p) for p in self.peers],
        }


def _round_json(r) -> dict:
    return dict(drafted=r.drafted, accepted=r.accepted, emitted=r.emitted, draft_s=r.draft_s, verify_s=r.verify_s,
                target_cache=r.target_cache, draft_cache=r.draft_cache)


@dataclass
class Calibration:
    """--gamma calibrated: the short run and the costs gamma was chosen from (Theorem 3.8)."""
    tokens: int
    gamma: int
    alpha: float
    c: float
    verify_slope: float
    verify_fixed: float
    chosen_gamma: int
    max_gamma: int


@dataclass
class InRun:
    """c and the verify pass's cost from the timed runs themselves, and Theorem 3.8 with them."""
    target_step_s: float
    c: float
    verify_over_step: float
    predicted_speedup: float
    measured_over_predicted: float
    predicted_speedup_verify_costed: float
    measured_over_verify_costed: float
    share_in_model_phases: float


@dataclass
class Theory:
    """Theorem 3.8 at the run's gamma and at its own optimum (all None without an alpha)."""
    predicted_tokens_per_round: float | None = None
    predicted_speedup: float | None = None
    optimal_gamma: int | None = None
    optimal_predicted_speedup: float | None = None
    draft_cannot_win: bool | None = None


@dataclass
class PeerSummary:
    """A peer (HF assisted generation, HF prompt lookup, ...) over the prompts where its output is
    greedy's (elsewhere it did other work, so its time is not comparable)."""
    compared_prompts: int
    speedup: float | None          # over our greedy
    ours_vs: float | None          # our speculative speed over its speed
    setting: tuple | None = None   # HF prompt lookup: (num_tokens, max_ngram)


@dataclass
class VerifyFit:
    """The verify pass's measured cost line (spec.experiment.measure.VerifyLine: fixed + slope * g
    one-token target steps) and the speedup it predicts from the rounds as they were drafted."""
    fixed: float
    slope: float
    measured: dict                 # g -> a (g+1)-token pass in one-token steps
    predicted_speedup: float       # with that verify cost
    predicted_speedup_flat: float  # if a pass cost one step (Theorem 3.8's assumption)


@dataclass
class Summary:
    """The run's pooled figures: results.json's "summary"."""
    gamma: int | str               # as run: a number, or "auto"
    gamma_option: int | str        # as asked: a number, "auto" or "calibrated"
    theory_gamma: int              # the gamma Theorem 3.8 is evaluated at
    calibration: Calibration | None
    c: float | None                # from one-token steps; for a draft source, from the timed runs
    draft_step_s: float | None     # None: a draft source (no draft model step to time)
    target_step_s: float | None
    alpha: float | None
    accept_rate: float | None
    tokens_per_round: float
    theory: Theory
    speedups: list[float]          # per prompt
    repeat_speedups: list[float]   # total greedy s / total speculative s, per repeat
    greedy_s: float
    spec_s: float
    in_run: InRun | None
    draft_impl: str
    threads: int
    all_identical: bool
    ties: int
    failures: int
    peers: dict[str, PeerSummary] = field(default_factory=dict)   # by name, in the order they ran
    peer_gamma: int | None = None  # HF assisted generation's gamma, when it ran
    rounds_drafting_nothing: float | None = None
    verify: VerifyFit | None = None
    # the target's passes by the path that produced their logits (kernel, oneDNN, transformers: those its
    # spec.cpu.executor ran, and "declined": why calls went to the model's own forward); {}: no executor
    target_passes: dict = field(default_factory=dict)

    @property
    def peer(self) -> PeerSummary | None:
        """The first peer (the one the report's flat "hf_*" keys describe)."""
        return next(iter(self.peers.values()), None)

    @property
    def measured_speedup(self) -> float:
        return self.greedy_s / self.spec_s

    @property
    def repeats(self) -> int:
        return len(self.repeat_speedups)

    @property
    def repeat_spread(self) -> float:
        return max(self.repeat_speedups) - min(self.repeat_speedups)

    @property
    def exit_status(self) -> int:
        return 1 if self.failures else 0

    def to_json(self) -> dict:
        out = {"gamma": self.gamma, "gamma_option": self.gamma_option, "theory_gamma": self.theory_gamma,
               "calibration": self.calibration and dataclasses.asdict(self.calibration), "c": self.c,
               "draft_step_s": self.draft_step_s, "target_step_s": self.target_step_s, "alpha": self.alpha,
               "accept_rate": self.accept_rate, "tokens_per_round": self.tokens_per_round,
               **dataclasses.asdict(self.theory),
               "measured_speedup": self.measured_speedup, "mean_speedup": statistics.fmean(self.speedups),
               "speedup_min": min(self.speedups), "speedup_max": max(self.speedups),
               "repeats": self.repeats, "repeat_speedups": self.repeat_speedups, "repeat_spread": self.repeat_spread,
               "greedy_s": self.greedy_s, "spec_s": self.spec_s,
               "in_run": self.in_run and dataclasses.asdict(self.in_run),
               "draft_impl": self.draft_impl, "threads": self.threads, "all_identical": self.all_identical,
               "ties": self.ties, "failures": self.failures}
        if self.peer is not None:
            out.update(hf_compared_prompts=self.peer.compared_prompts, hf_speedup=self.peer.speedup,
                       ours_vs_hf=self.peer.ours_vs, peer_gamma=self.peer_gamma)
        out["exit_status"] = self.exit_status
        out["rounds_drafting_nothing"] = self.rounds_drafting_nothing
        out["target_passes"] = self.target_passes
        if self.peers:
            out["peers"] = {name: dataclasses.asdict(p) for name, p in self.peers.items()}
        if self.verify is not None:
            v = self.verify
            out.update(verify_fixed=v.fixed, verify_slope=v.slope, verify_measured=v.measured,
                       predicted_speedup_verify_line=v.predicted_speedup,
                       predicted_speedup_flat_verify=v.predicted_speedup_flat)
        return out


@dataclass
class Results:
    """Everything results.json holds."""
    spec_version: str
    created: str
    options: dict                  # the command line's options, as parsed
    pair: PairInfo
    machine: dict
    prompts: Prompts
    records: list[PromptRecord]
    summary: Summary
    warnings: list[str]

    def to_json(self) -> dict:
        return {"spec_version": self.spec_version, "created": self.created, "options": self.options,
                "pair": self.pair.to_json(), "machine": self.machine, "prompt_set": self.prompts.name,
                "eos_token_id": self.prompts.eos, "prompts": [r.to_json() for r in self.records],
                "summary": self.summary.to_json(), "warnings": self.warnings}
