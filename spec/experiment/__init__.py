"""The seed experiment, step by step: what `python -m spec` runs.

Each step is one function of explicit arguments that returns the loaded pair or typed records
(spec/experiment/records.py); spec/experiment/report.py renders the records and spec/__main__.py, the only reader of
the command line, parses options, calls the steps in order and prints. The steps:

  setup      seed, threads, transformers' own logging silenced, the output folder
  load       the target and its draft: a draft model (the shipped pair, the seeded stand-in, or
             paths), or a draft source: `--real` (SmolLM2-135M-Instruct with prompt lookup or its
             own Q4_1 GGUF, spec.realmodel) and `--draft FILE.gguf` (spec.cpu.qdraft or llama.cpp) are this step's presets
  prompts    the prompt texts and their token ids, checked against the models' limits
  costs      warm-up, then c from interleaved one-token steps of draft and target (a draft
             source: the verify pass's cost line instead)
  gamma      the gamma to run: fixed, calibrated once, or the online controller
  peers      what is timed beside ours: HF assisted generation, or HF prompt lookup for a draft source
  time_runs  greedy, speculative (and the peers) alternating, repeated
  compare    per-prompt records: speedups, acceptance, exactness (diagnosed if not)
  summarize  pooled alpha, Theorem 3.8 next to the measured speedup, the peers, warnings
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from spec import choose, clock, decode, defaults, hf, hfref, models, parallel, seq2seq, theory, validate
from spec.cpu import executor
from spec.diagnose import first_difference
from spec.experiment import measure
from spec.experiment.records import (Calibration, Difference, InRun, PairInfo, Peer, PeerSummary, PromptRecord,
                                     Prompts, Results, Summary, Theory, VerifyFit, peer_label)
from spec.options import GammaMode
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


class UsageError(Exception):
    """A problem the user can fix (missing weights, unusable device, bad prompt file): exit 2."""


# --------------------------------------------------------------------------- setup and load


def setup(*, seed: int, threads: int | None, out: Path) -> None:
    """Seed, thread count (None: torch's own) and quiet third-party output; the output folder
    exists afterwards."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading bars would land in the middle of the report
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out: cannot create {str(out)!r}: {err}") from None


def check_device(device: str) -> None:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available on this machine")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_paths(target: str | None, draft: str | None) -> None:
    """A missing local path is named as missing, not looked up as a hub id (spec.models.looks_local)."""
    for option, name in (("--target", target), ("--draft", draft)):
        if name is not None and models.looks_local(name) and not Path(name).expanduser().exists():
            if name.lower().endswith(".gguf"):
                raise UsageError(f"{option}: no such GGUF file {name!r}")
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


def _stand_in(*, seed: int, device: str, target_dtype: str, draft_dtype: str, say) -> tuple[models.Pair, PairInfo]:
    say(f"shipped pair not found at {models.SHIPPED_PAIR}: building a seeded random tiny pair instead")
    td, dd = DTYPES[target_dtype], DTYPES[draft_dtype]
    if device.startswith("cuda") and td == torch.float32:  # as load_pair does: TF32 flips near-ties
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    target = models.build_gpt_neox("tiny-target", seed=seed, dtype=td, device=device)
    draft = models.build_gpt_neox("tiny-draft", seed=seed + 1, dtype=dd, device=device)
    info = PairInfo(source="random", target=None, draft=None,
                    target_name="random tiny-target", draft_name="random tiny-draft",
                    note=f"shipped pair not found at {models.SHIPPED_PAIR}; seeded random tiny pair "
                         f"(build_gpt_neox 'tiny-target'/'tiny-draft', seed {seed}) used instead: "
                         "timings and acceptance say nothing about a trained pair")
    return models.Pair(target, draft, None), info


def _from_paths(target: str | None, draft: str | None, *, device: str, target_dtype: str, draft_dtype: str,
                tp: int, say) -> tuple[models.Pair, PairInfo]:
    t_path = target or str(models.SHIPPED_PAIR / "target")
    d_path = draft or str(models.SHIPPED_PAIR / "draft")
    shipped = _is_shipped(t_path) and _is_shipped(d_path)
    say(f"loading target {t_path} ({target_dtype}) and draft {d_path} ({draft_dtype}) on {device}")
    try:
        pair = models.load_pair(t_path, d_path, device=device, target_dtype=DTYPES[target_dtype],
                                draft_dtype=DTYPES[draft_dtype], tp_size=tp)
    except (FileNotFoundError, ValueError, OSError, ImportError) as err:
        raise UsageError(str(err)) from None
    info = PairInfo(source="shipped" if shipped else "paths", target=t_path, draft=d_path,
                    target_name="shipped target" if shipped else _short_name(t_path),
                    draft_name="shipped draft" if shipped else _short_name(d_path), note=None)
    return pair, info


def is_gguf(draft: str | None) -> bool:
    return draft is not None and draft.lower().endswith(".gguf")


# --real's drafts (prompt lookup, or SmolLM2's own Q4_1 GGUF on spec.cpu.qdraft's kernel, else llama.cpp);
# each one's gamma is spec.defaults.REAL_GAMMA's.
REAL_DRAFTS = ("lookup", "q4")
LOOKUP_PEER = "spec prompt lookup"   # our prompt lookup, timed beside a GGUF draft


def default_gamma(pair_info: PairInfo) -> int:
    """The gamma a draft source runs at when none is asked (a draft model's is spec.defaults.DEFAULT_GAMMA)."""
    return defaults.REAL_GAMMA["lookup" if pair_info.draft == "lookup" else "q4"]


def _sourced(target: str | None, draft: str | None, *, real: bool, target_dtype: str,
             notice) -> tuple[models.Pair, PairInfo]:
    """The presets whose draft is a source, not a model: `real` (SmolLM2-135M-Instruct, fetched and
    converted on first use with `notice` saying so, drafted by prompt lookup or "q4", its own Q4_1
    GGUF), or the target at `target` drafted by the GGUF file `draft` (spec.gguf_draft: spec.cpu.qdraft's kernel, else llama.cpp)."""
    from spec import realmodel
    from spec.lookup import PromptLookup

    option = "--real" if real else "--target"
    try:
        if real:
            model, tok = realmodel.load(notice, dtype=DTYPES[target_dtype])
        else:
            model, tok = models.load_model(target, dtype=DTYPES[target_dtype], role="target")
            if tok is None:
                raise ValueError(f"{target} has no tokenizer; a GGUF draft is checked against the target's")
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        raise UsageError(f"{option}: {err}") from None
    kind = (draft or "lookup") if real else draft
    try:
        if kind == "lookup":
            source, runs_as = PromptLookup(), "model-free"
        else:
            from spec.gguf_draft import GGUFDraft
            gguf = realmodel.fetch(notice) if kind == "q4" else Path(kind)
            source = GGUFDraft(gguf, model, tok, threads=torch.get_num_threads())
            runs_as = "spec.cpu.qdraft" if source.engine_name == "native" else "llama.cpp"
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        raise UsageError(f"--draft {kind}: {err}") from None
    where = str(realmodel.fp32_dir()) if real else target
    info = PairInfo(source="real" if real else "paths", target=where, draft=kind,
                    target_name=realmodel.NAME if real else _short_name(target), draft_name=repr(source),
                    note=None, draft_path=runs_as)
    return models.Pair(model, source, tok), info


def load(target: str | None, draft: str | None, *, real: bool = False, device: str = "cpu",
         target_dtype: str = "fp32", draft_dtype: str = "fp32", tp: int = 1, seed: int = 0,
         draft_impl: str = "auto", peer: str | None = None, features: list | None = None,
         say=lambda msg: None, notice=lambda msg: None) -> tuple[models.Pair, PairInfo]:
    """The pair (target and draft: folders, hub ids, or None for the shipped pair; with `real`,
    SmolLM2-135M-Instruct and draft "lookup" or "q4"; a draft FILE.gguf runs in llama.cpp) and a
    description of it; raises UsageError for anything the user can fix. notice: what is said
    even when progress is not (a one-time download)."""
    check_device(device)
    if real or is_gguf(draft):
        if device != "cpu" or tp > 1:
            raise UsageError(f"{'--real' if real else '--draft FILE.gguf'}: runs on the CPU, unsplit (a draft "
                             "source beside a one-thread target)")
        check_paths(None if real else target, None if real else draft)
        pair, info = _sourced(target, draft, real=real, target_dtype=target_dtype, notice=notice)
        return pair, _described(pair, info, draft_impl, peer, features)
    check_paths(target, draft)
    shipped_present = all((models.SHIPPED_PAIR / role / "config.json").exists() for role in ("target", "draft"))
    if target is None and not shipped_present:
        if tp > 1:
            raise UsageError(f"--tp {tp}: the seeded stand-in pair cannot be split; pass --target/--draft")
        pair, info = _stand_in(seed=seed, device=device, target_dtype=target_dtype, draft_dtype=draft_dtype, say=say)
    else:
        pair, info = _from_paths(target, draft, device=device, target_dtype=target_dtype, draft_dtype=draft_dtype,
                                 tp=tp, say=say)
    return pair, _described(pair, info, draft_impl, peer, features)


def _described(pair: models.Pair, info: PairInfo, draft_impl: str, peer, features) -> PairInfo:
    """`info` completed with how each model runs and its size, once the options are known to suit it."""
    if (why := refusal(pair.target, peer, features)) is not None:
        raise UsageError(why)
    info.target_split = parallel.describe(pair.target)  # whole, tensor parallel, or a device map
    target_path, draft_path = runner_paths(pair, draft_impl)
    info.target_path, info.draft_path = target_path, info.draft_path or draft_path
    info.target_logits = executor.describe(pair.target)
    info.target_params = sum(p.numel() for p in pair.target.parameters())
    info.draft_params = 0 if choose.is_drafter(pair.draft) else sum(p.numel() for p in pair.draft.parameters())
    info.tokenizer = pair.tokenizer is not None
    return info


def refusal(target, peer: str | None, features=None) -> str | None:
    """Why `python -m spec` cannot run this target with these options, or None when it can."""
    if not seq2seq.is_encoder_decoder(target):
        return "--features: the target is decoder-only; its prompts are text (--prompts)" if features else None
    takes_features = seq2seq.encodes_features(target)
    if takes_features and not features:
        return (f"{type(target).__name__} encodes audio features: give a features file per prompt, "
                "--features FILE.pt or FILE.npy ([num_mel_bins, frames])")
    if features and not takes_features:
        return f"--features: {type(target).__name__} encodes token ids; give text prompts (--prompts)"
    if peer is not None:
        return "--peer hf: the HF assisted-generation peer is run for decoder-only pairs only"
    return None


# The report's words for the ways spec.choose runs a model (a spec.runner path is named as it is).
PATH_NAMES = {"encoder-decoder": "encoder-decoder (decoder kv-cache)", "plain": "plain (spec.neox)",
              "compiled": "compiled (static cache)",
              choose.UNCACHED: "recompute (no cached path reproduces it; a draft cannot change the output)"}


def runner_paths(pair: models.Pair, draft_impl: str) -> tuple[str, str]:
    """How each model is run and rolled back, as spec.choose will run it: a model spec cannot
    decode exactly is refused here, before any timing."""
    from spec.runner import UnsupportedModelError

    names = []
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        if choose.is_drafter(model):   # a draft source runs as itself
            names.append("")
            continue
        try:
            path = choose.path(model, role, draft_impl)
        except UnsupportedModelError as err:
            raise UsageError(f"--{err}") from None   # "--target: ..." (choose names the role)
        names.append(PATH_NAMES.get(path, path))
    return names[0], names[1]


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


def _models(pair: models.Pair) -> dict:
    """The pair's models by role: a draft source is not one."""
    return {"target": pair.target, **({} if choose.is_drafter(pair.draft) else {"draft": pair.draft})}


def encode(prompt: str, pair: models.Pair, index: int, chat: bool = False, name: str | None = None) -> list[int]:
    """A prompt's token ids (the tokenizer's, or without one its UTF-8 bytes); name: what an error calls it
    (default "prompt {index}")."""
    name = name or f"prompt {index}"
    rows = min(hf.vocab_rows(m) for m in _models(pair).values())
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
        raise UsageError(f"{name}: no tokens")
    if max(ids) >= rows:
        raise UsageError(f"{name}: token id {max(ids)} is outside the models' vocabulary [0, {rows})")
    return ids


def load_features(path) -> torch.Tensor:
    """A log-mel features file (--features): a tensor saved with torch.save (.pt) or numpy.save (.npy)."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            import numpy as np
            value = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever makes the file unreadable, the user fixes it
        raise UsageError(f"--features: cannot read {str(path)!r}: {err}") from None
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise UsageError(f"--features: {str(path)!r} must hold one floating-point tensor [num_mel_bins, frames]")
    return value


def feature_prompts(paths) -> tuple[list[str], str, list[torch.Tensor]]:
    """(prompt names, prompt-set name, features tensors), one prompt a file."""
    return [str(p) for p in paths], "features files", [load_features(p) for p in paths]


def prompts(pair: models.Pair, source: str, *, prompt_file: Path | None = None, features: list | None = None,
            chat: bool = False, ignore_eos: bool = False, max_new_tokens: int) -> Prompts:
    """The prompts to run (from prompt_file, else the set that suits the pair's `source`; for an
    encoder-decoder pair on audio, one features file each), refused up front if any of them with
    max_new_tokens runs past the target's or the draft's position limit."""
    if prompt_file is not None:
        texts, prompt_set = read_prompts(prompt_file), str(prompt_file)
    elif source in ("shipped", "random"):
        texts, prompt_set = CODE_PROMPTS, "code (shipped pair)"
    else:
        texts, prompt_set = SEED_PROMPTS, "seed"
    if features:  # encoder-decoder pairs on audio features (spec.seq2seq): each file is one prompt
        texts, prompt_set, ids = feature_prompts(features)
        return Prompts(list(texts), ids, prompt_set, eos_id(pair, ignore_eos))
    return encoded(pair, texts, prompt_set, chat=chat, ignore_eos=ignore_eos, max_new_tokens=max_new_tokens)


def eos_id(pair: models.Pair, ignore_eos: bool) -> int | None:
    """The id decoding stops at: the tokenizer's EOS, or None (ignore_eos, or no tokenizer)."""
    return None if ignore_eos or pair.tokenizer is None else pair.tokenizer.eos_token_id


def encoded(pair: models.Pair, texts: list[str], prompt_set: str, *, chat: bool = False, ignore_eos: bool = False,
            max_new_tokens: int, names: list[str] | None = None) -> Prompts:
    """`texts` as token ids (chat: each a user turn in the tokenizer's chat template), refused up front if
    any of them with max_new_tokens runs past the target's or the draft's position limit. names: what an
    error calls each prompt (default "prompt 1", "prompt 2", ...)."""
    names = names or [f"prompt {i}" for i in range(1, len(texts) + 1)]
    ids = [encode(p, pair, i, chat, name) for i, (p, name) in enumerate(zip(texts, names), 1)]
    for name, row in zip(names, ids):
        try:
            validate.check_positions(len(row), max_new_tokens, _models(pair))
        except ValueError as err:
            raise UsageError(f"{name}: {err}") from None
    return Prompts(list(texts), ids, prompt_set, eos_id(pair, ignore_eos))


# --------------------------------------------------------------------------- costs and gamma


def _spec(target, draft, ids, gamma, max_new_tokens, eos, draft_impl, trace=False):
    return decode.speculative_generate(target, draft, ids, gamma=gamma, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos, trace=trace, draft_impl=draft_impl)


def costs(pair: models.Pair, ps: Prompts, *, gamma, max_new_tokens: int, draft_impl: str = "auto",
          say=lambda msg: None) -> measure.Costs:
    """Warm-up (allocator, kernels, lazy initialisation), then c from one-token steps; for a draft
    source, which has no model step to time, the verify pass's cost line instead (its c comes
    from the timed runs)."""
    say("warm-up")
    first, eos, n = ps.ids[0], ps.eos, max_new_tokens
    decode.greedy_generate(pair.target, first, max_new_tokens=min(8, n), eos_token_id=eos)
    warm_gamma = gamma if isinstance(gamma, int) else defaults.CALIBRATION_GAMMA
    _spec(pair.target, pair.draft, first, warm_gamma, min(16, n), eos, draft_impl)
    if choose.is_drafter(pair.draft):
        say("timing verify passes of 1 to 17 tokens (the verify line)")
        return measure.Costs(None, None, measure.verify_line(pair.target, first, max_gamma=16))
    say("measuring c (cached one-token steps of draft and target)")
    return measure.cost_ratio(pair.target, pair.draft, first, draft_impl=draft_impl)


def choose_gamma(pair: models.Pair, ps: Prompts, cost: measure.Costs, *, gamma, max_new_tokens: int,
                 draft_impl: str = "auto", say=lambda msg: None) -> tuple[int | str, Calibration | None]:
    """(gamma to run, calibration record or None). gamma "calibrated": Theorem 3.8's optimum
    for alpha from a short run at CALIBRATION_GAMMA and the measured c and verify slope,
    chosen once. "auto": the API's online controller, re-chosen every round. A number: itself."""
    if gamma != GammaMode.CALIBRATED:
        return gamma, None
    if cost.c is None:
        raise UsageError("--gamma calibrated: needs a draft model's step cost; a draft source runs at a number "
                         "or 'auto'")
    g0, n0, top = defaults.CALIBRATION_GAMMA, defaults.CALIBRATION_TOKENS, defaults.MAX_AUTO_GAMMA
    say(f"calibrating gamma: {n0} tokens at gamma={g0} on prompt 1")
    cal = _spec(pair.target, pair.draft, ps.ids[0], g0, min(n0, max_new_tokens), ps.eos, draft_impl)
    alpha = cal.alpha if cal.drafted else 0.0
    say("measuring the verify pass's cost per drafted token")
    line = measure.verify_line(pair.target, ps.ids[0], max_gamma=top)
    chosen = theory.optimal_gamma(min(alpha, 0.999), cost.c, top, verify_slope=line.slope, verify_fixed=line.fixed)
    chosen = parallel.from_rank_zero(pair.target, chosen)  # a split target's ranks timed apart: one gamma for all
    return chosen, Calibration(tokens=len(cal.tokens), gamma=g0, alpha=alpha, c=cost.c, verify_slope=line.slope,
                               verify_fixed=line.fixed, chosen_gamma=chosen, max_gamma=top)


# --------------------------------------------------------------------------- timing


@dataclass
class Timings:
    """One prompt's timed runs, one (output, wall seconds) per repeat for each decoder."""
    greedy: list = field(default_factory=list)     # (decode.Result, s)
    spec: list = field(default_factory=list)       # (decode.Result, s), traced
    peers: dict = field(default_factory=dict)      # peer name -> [(tokens, s)]


def peer_gamma(gamma) -> int:
    """The HF peer's gamma: the run's, or the calibration gamma under the online controller
    (HF's own schedule is not ours)."""
    return gamma if isinstance(gamma, int) else defaults.CALIBRATION_GAMMA


def assisted_peer(pair: models.Pair, ps: Prompts, gamma, max_new_tokens: int, say=lambda msg: None) -> dict:
    """{"hf_assisted": ids -> new tokens}: HF assisted generation at the run's gamma (the calibration
    gamma under the online controller), warmed up on the first prompt."""
    say("HF assisted generation: warm-up")
    assistant, g = hfref.assistant_for(pair.target, pair.draft), peer_gamma(gamma)

    def run(ids, n=max_new_tokens):
        return hfref.hf_assisted(pair.target, assistant, torch.tensor(ids), g, n, ps.eos)

    run(ps.ids[0], min(16, max_new_tokens))
    return {"hf_assisted": run}


def lookup_peers(target, settings, *, max_new_tokens: int, eos) -> tuple[dict, dict]:
    """({name: ids -> new tokens}, {name: setting}): HF prompt lookup at each setting
    (prompt_lookup_num_tokens, max_matching_ngram_size)."""
    runs, named = {}, {}
    for num_tokens, max_ngram in settings:
        name = f"HF prompt lookup ({num_tokens}, {max_ngram})"
        runs[name] = functools.partial(hfref.hf_prompt_lookup, target, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos, num_tokens=num_tokens, max_ngram=max_ngram)
        named[name] = (num_tokens, max_ngram)
    return runs, named


def source_peers(pair: models.Pair, pair_info: PairInfo, ps: Prompts, gamma, max_new_tokens: int,
                 say=lambda msg: None) -> tuple[dict, dict]:
    """What a draft source is timed beside: HF prompt lookup at our gamma and n-gram, and beside a
    GGUF draft also at HF's own default (10, 2) and our prompt lookup at its gamma, so that the
    draft meets the best of them. ({name: ids -> new tokens}, {name: setting}), warmed up."""
    from spec.lookup import PromptLookup

    ours = (gamma if isinstance(gamma, int) else 10, PromptLookup().max_ngram)
    lookup = pair_info.draft == "lookup"
    runs, settings = lookup_peers(pair.target, [ours] if lookup or ours == (10, 2) else [ours, (10, 2)],
                                  max_new_tokens=max_new_tokens, eos=ps.eos)
    if not lookup:
        runs[LOOKUP_PEER] = functools.partial(_lookup_tokens, pair.target, gamma=defaults.REAL_GAMMA["lookup"],
                                              max_new_tokens=max_new_tokens, eos=ps.eos)
    say("HF prompt lookup: warm-up")
    hfref.hf_prompt_lookup(pair.target, torch.tensor(ps.ids[0]), 4)
    return runs, settings


def _lookup_tokens(target, ids, *, gamma: int, max_new_tokens: int, eos) -> list[int]:
    from spec.lookup import PromptLookup
    return decode.speculative_generate(target, PromptLookup(), ids, gamma=gamma, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos).tokens


def peers(pair: models.Pair, pair_info: PairInfo, ps: Prompts, gamma, peer: str | None, max_new_tokens: int,
          say=lambda msg: None) -> tuple[dict, dict]:
    """The peers timed beside ours and their settings: a draft source's (source_peers), or with
    peer "hf" HF assisted generation (assisted_peer), or none."""
    if choose.is_drafter(pair.draft):
        return source_peers(pair, pair_info, ps, gamma, max_new_tokens, say)
    return (assisted_peer(pair, ps, gamma, max_new_tokens, say) if peer == "hf" else {}), {}


def time_runs(target, draft, prompt_ids: list, *, gamma, max_new_tokens: int, eos, repeats: int, device: str,
              draft_impl: str = "auto", peers: dict[str, Callable] | None = None,
              say=lambda msg: None) -> list[Timings]:
    """Per prompt, every repeat of greedy, speculative (traced) and each peer (name -> a function of
    the prompt's ids that returns the new tokens). They alternate prompt by prompt, and the repeats
    go round all prompts again, so a shared machine's drift hits every method alike."""
    peers = peers or {}
    runs = [Timings(peers={name: [] for name in peers}) for _ in prompt_ids]
    n, total = max_new_tokens, repeats * len(prompt_ids)
    for rep in range(repeats):
        for i, ids in enumerate(prompt_ids):
            run = runs[i]
            run.greedy.append(clock.timed(lambda: decode.greedy_generate(
                target, ids, max_new_tokens=n, eos_token_id=eos), device))
            run.spec.append(clock.timed(lambda: _spec(target, draft, ids, gamma, n, eos, draft_impl, trace=True),
                                        device))
            for name, fn in peers.items():
                run.peers[name].append(clock.timed(lambda: fn(ids), device))
            say(_progress_line(rep * len(prompt_ids) + i + 1, total, i + 1, len(prompt_ids), rep + 1, run))
    return runs


def _progress_line(done: int, total: int, prompt: int, prompts: int, rep: int, run: Timings) -> str:
    (g, g_s), (s, s_s) = run.greedy[-1], run.spec[-1]
    line = (f"[{done}/{total}] repeat {rep}, greedy {prompt}/{prompts}: {len(g.tokens)} tokens in {g_s:.2f}s, "
            f"speculative {prompt}/{prompts}: {len(s.tokens)} tokens in {s_s:.2f}s, "
            f"{s.mean_tokens_per_round:.2f} tokens/round")
    for name, samples in run.peers.items():
        toks, p_s = samples[-1]
        line += f", {peer_label(name)} {prompt}/{prompts}: {len(toks)} tokens in {p_s:.2f}s"
    return line


# --------------------------------------------------------------------------- compare


def diagnose_outputs(target, prompt_ids, expected, actual) -> Difference:
    """spec.diagnose's verdict on where and why two outputs differ; a position-only record
    (verdict "unknown") when it finds none."""
    from spec.diagnose import diagnose

    position = first_difference(expected, actual)
    div = diagnose(target, prompt_ids, expected, actual)
    if div is None:
        return Difference(position=position,
                          expected=expected[position] if position is not None and position < len(expected) else None,
                          actual=actual[position] if position is not None and position < len(actual) else None,
                          verdict="unknown",
                          message=f"outputs differ at new token {position}; spec.diagnose found no divergence")
    return Difference(position=div.position, expected=div.expected, actual=div.actual, verdict=div.verdict,
                      message=str(div), gap_step=div.gap_step, gap_block=div.gap_block, noise=div.noise,
                      dtype=div.dtype)


def record(index: int, prompt: str | None, ids, run: Timings, target, tokenizer=None, *,
           peer_settings: dict | None = None, say=lambda msg: None) -> PromptRecord:
    """One prompt's record: the speculative run's acceptance and trace are those of a repeat
    that differs from greedy, if any, else the first ("trace_repeat"); a difference is diagnosed.
    peer_settings: a peer's setting by name, kept with its runs."""
    g = run.greedy[0][0]
    kept = next((k for k, (r, _) in enumerate(run.spec) if r.tokens != g.tokens), 0)
    s = run.spec[kept][0]
    divergence = None
    if s.tokens != g.tokens:
        say(f"prompt {index}: speculative output differs from greedy, diagnosing")
        divergence = diagnose_outputs(target, ids, g.tokens, s.tokens)
    peers = [Peer(name, samples[0][0], [t for _, t in samples], all(t == g.tokens for t, _ in samples),
                  (peer_settings or {}).get(name)) for name, samples in run.peers.items()]
    return PromptRecord(index=index, prompt=prompt, prompt_tokens=len(ids), greedy=g, spec=s,
                        greedy_times=[t for _, t in run.greedy], spec_times=[t for _, t in run.spec],
                        trace_repeat=kept, divergence=divergence,
                        text=tokenizer.decode(s.tokens) if tokenizer is not None else None, peers=peers)


def compare(pair: models.Pair, ps: Prompts, runs: list[Timings], settings: dict | None = None,
            say=lambda msg: None) -> list[PromptRecord]:
    """The per-prompt records, in prompt order; settings: each peer's, by name."""
    return [record(i, text, ids, run, pair.target, pair.tokenizer, peer_settings=settings, say=say)
            for i, (text, ids, run) in enumerate(zip(ps.texts, ps.ids, runs), 1)]


# --------------------------------------------------------------------------- summary


def pooled(records: list[PromptRecord]) -> tuple[float | None, float | None, float]:
    """(alpha, accepted/drafted, tokens per round) over every round of every prompt's
    speculative run; alpha and the rate are None when nothing was drafted."""
    acc = [k for r in records for k in r.spec.accepted_per_round]
    dra = [g for r in records for g in r.spec.drafted_per_round]
    alpha = theory.alpha_from_accepted(acc, dra) if sum(dra) else None
    rate = sum(acc) / sum(dra) if sum(dra) else None
    return alpha, rate, sum(len(r.spec.tokens) for r in records) / sum(len(r.spec.rounds) for r in records)


def theory_gamma(gamma, records: list[PromptRecord]) -> int:
    """The gamma the theory is evaluated at: the fixed one, or for the online controller
    the draft length it chose most often (the last, clipped round of each prompt left out)."""
    if isinstance(gamma, int):
        return gamma
    counts = Counter(g for r in records for g in r.spec.drafted_per_round[:-1] if g > 0)
    return counts.most_common(1)[0][0] if counts else defaults.CALIBRATION_GAMMA


def in_run(records: list[PromptRecord], alpha: float | None, gamma: int, measured: float) -> InRun | None:
    """c and the verify pass's cost from the timed runs themselves, not from separate step
    timings: this box's speed drifts by tens of percent within seconds, and these figures
    come from the same interleaved runs as the speedup. The target step is greedy's time
    per token; the draft's cost is its phase time per drafted token (catch-up included);
    the verify cost is the mean verify phase of full-gamma rounds (the prefill round left out)."""
    trace = [t for r in records for t in (r.spec.trace or [])[1:]]
    full = [t.verify_s for t in trace if t.drafted == gamma]
    drafted = sum(t.drafted for t in trace)
    if alpha is None or not full or not drafted:
        return None
    step = sum(r.greedy_s for r in records) / sum(len(r.greedy.tokens) for r in records)
    c = sum(t.draft_s for t in trace) / drafted / step
    verify = statistics.fmean(full) / step
    predicted = theory.expected_speedup(alpha, gamma, c)
    costed = theory.expected_tokens_per_round(alpha, gamma) / (gamma * c + verify)
    wall = sum(r.spec_times[r.trace_repeat] for r in records)  # the repeat the traces come from
    phases = sum(t.draft_s + t.verify_s for r in records for t in (r.spec.trace or []))
    return InRun(target_step_s=step, c=c, verify_over_step=verify, predicted_speedup=predicted,
                 measured_over_predicted=measured / predicted, predicted_speedup_verify_costed=costed,
                 measured_over_verify_costed=measured / costed, share_in_model_phases=phases / wall)


def repeat_speedups(records: list[PromptRecord]) -> list[float]:
    """Total greedy time / total speculative time, one figure per repeat."""
    return [sum(r.greedy_times[k] for r in records) / sum(r.spec_times[k] for r in records)
            for k in range(len(records[0].greedy_times))]


def _theory(alpha, gamma: int, c: float) -> Theory:
    """Theorem 3.8 at the run's gamma and at its own optimum; whether any gamma can win."""
    if alpha is None or c is None:
        return Theory()
    best = theory.optimal_gamma(alpha, c)
    best_speedup = theory.expected_speedup(alpha, best, c)
    return Theory(predicted_tokens_per_round=theory.expected_tokens_per_round(alpha, gamma),
                  predicted_speedup=theory.expected_speedup(alpha, gamma, c), optimal_gamma=best,
                  optimal_predicted_speedup=best_speedup, draft_cannot_win=best_speedup <= 1.0)


def peer_summaries(records: list[PromptRecord]) -> dict[str, PeerSummary]:
    """Each peer by name. Speed ratios only over prompts where the peer produced greedy's tokens:
    other output is other work."""
    out = {}
    for name in [p.name for p in records[0].peers]:
        runs = [(r, p) for r in records for p in r.peers if p.name == name]
        same = [(r, p) for r, p in runs if p.identical]
        total = sum(p.s for _, p in same)
        out[name] = PeerSummary(compared_prompts=len(same),
                                speedup=sum(r.greedy_s for r, _ in same) / total if same else None,
                                ours_vs=total / sum(r.spec_s for r, _ in same) if same else None,
                                setting=runs[0][1].setting)
    return out


def _target_step(records: list[PromptRecord]) -> float:
    """Greedy's time per token: the target step the figures are priced in."""
    return sum(r.greedy_s for r in records) / sum(len(r.greedy.tokens) for r in records)


def runs_c(records: list[PromptRecord]) -> float | None:
    """c from the timed runs: draft time per drafted token over the target step (None: nothing drafted)."""
    drafted = sum(r.spec.drafted for r in records)
    return sum(t.draft_s for r in records for t in r.spec.trace or []) / drafted / _target_step(records) \
        if drafted else None


def predicted_speedup(records: list[PromptRecord], fixed: float, slope: float) -> float:
    """Greedy time over the speculative time the verify line predicts for the rounds as they ran:
    a round drafting g >= 1 tokens costs fixed + slope * g target steps (one step if g = 0), and
    the draft phases cost what they cost (timed)."""
    step = _target_step(records)
    spec = sum(sum(t.draft_s for t in r.spec.trace or [])
               + step * sum((fixed + slope * g) if g else 1.0 for g in r.spec.drafted_per_round) for r in records)
    return sum(r.greedy_s for r in records) / spec


def verify_fit(records: list[PromptRecord], line: measure.VerifyLine | None) -> VerifyFit | None:
    if line is None:
        return None
    return VerifyFit(fixed=line.fixed, slope=line.slope, measured=line.measured,
                     predicted_speedup=predicted_speedup(records, line.fixed, line.slope),
                     predicted_speedup_flat=predicted_speedup(records, 1.0, 0.0))


def summarize(records: list[PromptRecord], gamma, calibration: Calibration | None, cost: measure.Costs, *,
              gamma_option, draft_impl: str = "auto", peer_gamma: int | None = None, target=None) -> Summary:
    """The pooled figures; peer_gamma: HF assisted generation's gamma, None when it did not run.
    A draft source's c (cost.c None) is the timed runs' (runs_c). target: the model whose passes by path
    (spec.cpu.executor.passes) the summary keeps."""
    alpha, rate, per_round = pooled(records)
    g_th = theory_gamma(gamma, records)
    c = cost.c if cost.c is not None else runs_c(records)
    total_g, total_s = sum(r.greedy_s for r in records), sum(r.spec_s for r in records)
    ties = sum(1 for r in records if r.is_tie)
    drafted = [g for r in records for g in r.spec.drafted_per_round]
    return Summary(
        gamma=gamma, gamma_option=gamma_option, theory_gamma=g_th, calibration=calibration, c=c,
        draft_step_s=cost.draft_step_s, target_step_s=cost.target_step_s, alpha=alpha, accept_rate=rate,
        tokens_per_round=per_round, theory=_theory(alpha, g_th, c), speedups=[r.speedup for r in records],
        repeat_speedups=repeat_speedups(records), greedy_s=total_g, spec_s=total_s,
        in_run=in_run(records, alpha, g_th, total_g / total_s), draft_impl=draft_impl,
        threads=torch.get_num_threads(), all_identical=all(r.identical for r in records), ties=ties,
        failures=sum(1 for r in records if not r.identical) - ties, peers=peer_summaries(records),
        peer_gamma=peer_gamma, rounds_drafting_nothing=sum(g == 0 for g in drafted) / len(drafted),
        verify=verify_fit(records, cost.verify), target_passes=executor.passes(target) if target is not None else {})


def consistency_warnings(summary: Summary) -> list[str]:
    """The run's own figures checked against each other; each disagreement is one line."""
    out = []
    s, r = summary, summary.in_run
    if r is not None and s.draft_step_s is not None and s.c > 0 and r.c > 0:
        ratio = max(s.c, r.c) / min(s.c, r.c)
        if ratio > defaults.C_DISAGREEMENT:
            out.append(f"the two estimates of c disagree {ratio:.1f}-fold ({s.c:.3f} from one-token "
                       f"steps, {r.c:.3f} from the timed runs): the draft costs more inside the decode loop "
                       "than in a bare step, or the machine's load changed; Theorem 3.8 from either c is uncertain")
    effect = abs(s.measured_speedup - 1.0)
    if s.repeats > 1 and s.repeat_spread > effect:
        lo, hi = min(s.repeat_speedups), max(s.repeat_speedups)
        out.append(f"the speedup varied from {lo:.2f}x to {hi:.2f}x between repeats, more than its distance "
                   f"from 1x ({s.measured_speedup:.2f}x): the timings are noise")
    if r is not None:
        off = r.measured_over_verify_costed - 1.0
        if abs(off) > defaults.PREDICTION_MISMATCH:
            out.append(f"measured speedup {s.measured_speedup:.2f}x is {abs(off):.0%} "
                       f"{'above' if off > 0 else 'below'} the verify-costed prediction "
                       f"{r.predicted_speedup_verify_costed:.2f}x: time went somewhere the model does not price")
    return out


def results(options: dict, pair_info: PairInfo, ps: Prompts, records: list[PromptRecord], summary: Summary,
            machine: dict) -> Results:
    """Everything results.json holds; options: the command line's, as parsed."""
    from spec import __version__

    return Results(spec_version=__version__, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), options=options,
                   pair=pair_info, machine=machine, prompts=ps, records=records, summary=summary,
                   warnings=consistency_warnings(summary))
