"""`python -m spec` end to end: main([...]) on a tiny GPT-NeoX pair saved to disk and loaded
through the real loading code, plus the error paths (exit 2) and the exactness verdict (exit 1)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spec.__main__ as cli
import spec.choose
import spec.decode
import spec.models
import spec.realmodel
from spec import defaults, experiment, theory
from spec.experiment import report
from spec.models import build_gpt_neox, truncated_copy
from spec.prompts import CODE_PROMPTS, SEED_PROMPTS
from spec.experiment.records import Difference, InRun, PairInfo, Prompts, Results, Summary, Theory
from spec.experiment.report import TABLE_COLUMNS

N = 12  # new tokens per prompt: enough for several multi-token rounds, cheap on a shared CPU


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair_dirs(saved_pair):
    return saved_pair


def _prompts(tmp_path, *lines):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _results(out):
    return json.loads((out / "results.json").read_text(encoding="utf-8"))


def test_end_to_end(pair_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", str(N), "--gamma", "3",
                   "--out", str(out), "--quiet", "--threads", "1", "--repeats", "2"])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert stderr == ""  # --quiet: no progress
    header = next(line for line in stdout.splitlines() if line.startswith("#  prompt"))
    for column in TABLE_COLUMNS:
        assert column in header
    assert "Theorem 3.8" in stdout and "optimal gamma" in stdout

    res = _results(out)
    assert [r["prompt"] for r in res["prompts"]] == SEED_PROMPTS  # real checkpoints: the seed's prompts
    assert res["pair"]["source"] == "paths" and res["eos_token_id"] is None
    # which path produced the target's logits, and why: a tiny GPT-NeoX runs its own forward
    assert res["pair"]["target_logits"].startswith("transformers (the model's own forward): its linears are ")
    assert f"target's logits: {res['pair']['target_logits']}" in stdout
    assert res["summary"]["target_passes"] == {}
    assert res["options"]["max_new_tokens"] == N and res["options"]["gamma"] == 3
    assert res["machine"]["torch_threads"] == 1
    for key in ("platform", "python", "torch", "transformers", "cpu", "device"):
        assert res["machine"][key]
    for r in res["prompts"]:
        assert r["new_tokens"] == r["greedy_new_tokens"] == N  # no EOS without a tokenizer
        assert r["ids_identical"] is True and r["divergence"] is None
        assert r["greedy_tokens"] == r["spec_tokens"] and len(r["spec_tokens"]) == N
        assert math.isclose(r["speedup"], r["greedy_s"] / r["spec_s"], rel_tol=1e-9)
        assert math.isclose(r["greedy_tok_s"], N / r["greedy_s"], rel_tol=1e-9)
        assert math.isclose(r["spec_tok_s"], N / r["spec_s"], rel_tol=1e-9)
        assert len(r["trace"]) == r["rounds"] == len(r["tokens_per_round_list"])
        assert sum(t["emitted"] for t in r["trace"]) == N
        assert all(t["drafted"] <= 3 and t["accepted"] <= t["drafted"] for t in r["trace"])
        assert sum(r["accepted_per_round"]) == r["accepted"] and sum(r["drafted_per_round"]) == r["drafted"]
        assert math.isclose(r["accept_rate"], r["accepted"] / r["drafted"])
        assert math.isclose(r["tokens_per_round"], N / r["rounds"])
        assert r["prompt"][:20] in stdout
    s = res["summary"]
    assert s["gamma"] == 3 and s["all_identical"] and s["exit_status"] == 0
    assert math.isclose(s["c"], s["draft_step_s"] / s["target_step_s"], rel_tol=1e-9)
    acc = [k for r in res["prompts"] for k in r["accepted_per_round"]]
    dra = [g for r in res["prompts"] for g in r["drafted_per_round"]]
    assert math.isclose(s["alpha"], theory.alpha_from_accepted(acc, dra))
    assert math.isclose(s["predicted_speedup"], theory.expected_speedup(s["alpha"], 3, s["c"]))
    assert s["optimal_gamma"] == theory.optimal_gamma(s["alpha"], s["c"])
    assert math.isclose(s["measured_speedup"], sum(r["greedy_s"] for r in res["prompts"])
                        / sum(r["spec_s"] for r in res["prompts"]))
    png = out / "results.png"
    if report.can_plot():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "matplotlib" in stdout


def test_calibrated_gamma_peer_prompt_file_and_progress(pair_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    prompts = _prompts(tmp_path, "def f(x):\\n    return", "", "import os")
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "8", "--gamma", "calibrated",
                   "--peer", "hf", "--repeats", "1", "--prompts", prompts, "--out", str(out), "--no-plots"])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    res = _results(out)
    assert [r["prompt"] for r in res["prompts"]] == ["def f(x):\n    return", "import os"]
    cal, gamma = res["summary"]["calibration"], res["summary"]["gamma"]
    assert isinstance(gamma, int) and 1 <= gamma <= defaults.MAX_AUTO_GAMMA and cal["chosen_gamma"] == gamma
    assert cal["verify_slope"] >= 0
    assert gamma == theory.optimal_gamma(min(cal["alpha"], 0.999), cal["c"], defaults.MAX_AUTO_GAMMA,
                                         verify_slope=cal["verify_slope"], verify_fixed=cal["verify_fixed"])
    assert f"-> gamma={gamma}" in stdout
    for r in res["prompts"]:
        assert r["peer"]["ids_identical"] is True and r["peer"]["tokens"] == r["greedy_tokens"]
        assert math.isclose(r["peer"]["hf_speedup"], r["greedy_s"] / r["peer"]["hf_s"])
    assert "hf assisted s" in stdout
    assert not (out / "results.png").exists()
    assert "greedy 1/2" in stderr and "speculative 2/2" in stderr  # progress on stderr


def test_draft_impl_hf_is_recorded_and_exact(pair_dirs, tmp_path, capsys):
    """--draft-impl hf: the draft through its own forward; output and bookkeeping as with the default."""
    out = tmp_path / "out"
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "8", "--quiet",
                   "--draft-impl", "hf", "--gamma", "3", "--out", str(out), "--no-plots", "--repeats", "1"])
    assert rc == 0, capsys.readouterr().err
    res = _results(out)
    assert res["options"]["draft_impl"] == "hf" and res["summary"]["draft_impl"] == "hf"
    assert all(r["ids_identical"] for r in res["prompts"])
    s, prompts = res["summary"], res["prompts"]
    step = sum(r["greedy_s"] for r in prompts) / sum(r["greedy_new_tokens"] for r in prompts)
    trace = [t for r in prompts for t in r["trace"][1:]]
    run = s["in_run"]
    assert math.isclose(run["target_step_s"], step, rel_tol=1e-9)
    assert math.isclose(run["c"], sum(t["draft_s"] for t in trace) / sum(t["drafted"] for t in trace) / step,
                        rel_tol=1e-9)
    assert math.isclose(run["predicted_speedup"], theory.expected_speedup(s["alpha"], 3, run["c"]), rel_tol=1e-9)
    assert 0 < run["share_in_model_phases"] <= 1


def test_default_pair(tmp_path, capsys):
    """No --target/--draft: the shipped pair, or the random stand-in (said so) while it is absent."""
    out = tmp_path / "out"
    rc = cli.main(["--max-new-tokens", "4", "--out", str(out), "--quiet", "--no-plots", "--repeats", "1"])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    res = _results(out)
    assert res["pair"]["source"] in ("shipped", "random")
    assert [r["prompt"] for r in res["prompts"]] == CODE_PROMPTS
    if res["pair"]["source"] == "random":
        assert "random tiny pair" in stdout
    for r in res["prompts"]:
        assert r["ids_identical"] and 1 <= r["new_tokens"] <= 4
        assert r["new_tokens"] == 4 or r["stop_reason"] == "eos"


@pytest.mark.parametrize("argv, option", [
    (["--gamma", "0"], "--gamma"),
    (["--gamma", "many"], "--gamma"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--target-dtype", "int8"], "--target-dtype"),
    (["--draft-dtype", "fp8"], "--draft-dtype"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--peer", "vllm"], "--peer"),
    (["--draft-impl", "fast"], "--draft-impl"),
    (["--target", "somewhere"], "--target"),
    (["--no-such-option"], "--no-such-option"),
])
def test_bad_options_exit_2(argv, option, tmp_path, capsys):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert option in stderr and "Traceback" not in stderr


def test_help(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--max-new-tokens" in text and str(defaults.CPU_MAX_NEW_TOKENS) in text and "code" in text


def test_without_matplotlib_writes_json_and_says_how_to_get_plots(pair_dirs, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "out"
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "4", "--quiet",
                   "--prompts", _prompts(tmp_path, "x = 1"), "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert (out / "results.json").exists() and not (out / "results.png").exists()
    assert 'pip install "spec[plots]"' in stdout


def test_missing_weights_exit_2(tmp_path, capsys):
    """A local path that does not exist is named as missing (not looked up on the hub); a folder
    that exists but holds no weights is named as holding none."""
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["--target", missing, "--draft", missing, "--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert "--target: no such folder" in stderr and "no-such-model" in stderr and "Traceback" not in stderr
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert cli.main(["--target", str(empty), "--draft", str(empty), "--out", str(tmp_path)]) == 2
    stderr = capsys.readouterr().err
    assert "no weights" in stderr and "empty-model" in stderr and "Traceback" not in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_unavailable_exit_2(tmp_path, capsys):
    assert cli.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_prompt_file_errors_exit_2(pair_dirs, tmp_path, capsys):
    base = ["--target", pair_dirs[0], "--draft", pair_dirs[1], "--out", str(tmp_path)]
    assert cli.main(base + ["--prompts", str(tmp_path / "absent.txt")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert cli.main(base + ["--prompts", _prompts(tmp_path, "", "  ")]) == 2
    assert "no prompt" in capsys.readouterr().err


def _corrupt_second_prompt(monkeypatch, position):
    """Make the timed speculative run (trace=True) of the second prompt emit a wrong token."""
    real = spec.decode.speculative_generate
    calls = []

    def wrong(*args, **kwargs):
        result = real(*args, **kwargs)
        if kwargs.get("trace"):
            calls.append(1)
            if len(calls) == 2:
                result.tokens[position] = (result.tokens[position] + 1) % 500
        return result

    monkeypatch.setattr(spec.decode, "speculative_generate", wrong)


def test_divergence_exits_1_naming_prompt_and_position(pair_dirs, monkeypatch, tmp_path, capsys):
    _corrupt_second_prompt(monkeypatch, 3)
    out = tmp_path / "out"
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "8", "--quiet",
                   "--no-plots", "--prompts", _prompts(tmp_path, "first prompt", "second prompt"), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert rc == 1
    assert "prompt 2" in stderr and "new token 3" in stderr and "second prompt" in stderr
    assert "diverge@3" in stdout
    res = _results(out)
    assert [r["ids_identical"] for r in res["prompts"]] == [True, False]
    assert res["prompts"][1]["divergence"]["position"] == 3 and res["summary"]["exit_status"] == 1


def test_proven_tie_is_reported_and_exits_0(pair_dirs, monkeypatch, tmp_path, capsys):
    _corrupt_second_prompt(monkeypatch, 5)
    monkeypatch.setattr(experiment, "diagnose_outputs", lambda target, prompt, expected, actual: Difference(
        position=5, expected=expected[5], actual=actual[5], gap_step=1e-7, gap_block=-1e-7,
        noise=1e-6, dtype="float32", verdict="tie", message="top-2 gap within fp32 noise"))
    out = tmp_path / "out"
    rc = cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "8", "--quiet",
                   "--no-plots", "--prompts", _prompts(tmp_path, "first prompt", "second prompt"), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "TIE@5" in stdout and "numerical tie" in stdout
    assert _results(out)["summary"]["ties"] == 1


# --------------------------------------------------------------------------- issue 18: a fast, honest CLI

ROOT = Path(__file__).resolve().parents[1]


def _spec_subprocess(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_help_imports_neither_torch_nor_transformers():
    """--help answers before anything heavy is imported (measured: 0.6-0.8 s here, the same as
    `python -c pass` on this loaded box; importing torch and transformers first took 6 to 20 s)."""
    proc = _spec_subprocess("-X", "importtime", "-m", "spec", "--help")
    assert proc.returncode == 0 and "usage: spec" in proc.stdout and "calibrated" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "spec.defaults" in imported  # the check sees our own imports...
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers")}  # ...and no heavy one


def test_real_run_in_a_subprocess(pair_dirs, tmp_path):
    """`python -m spec` as a user runs it: our progress lines on stderr, no third-party progress
    bars or logging anywhere, a warnings list in results.json, the repeats recorded."""
    out = tmp_path / "out"
    proc = _spec_subprocess("-m", "spec", "--target", pair_dirs[0], "--draft", pair_dirs[1], "--max-new-tokens", "6",
                            "--gamma", "auto", "--repeats", "2", "--prompts", _prompts(tmp_path, "x = 1", "y = 2"),
                            "--out", str(out), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert "[4/4] repeat 2, greedy 2/2" in proc.stderr
    for noise in ("Loading weights", "it/s]", "%|", "[transformers]", "Warning", "Traceback"):
        assert noise not in proc.stdout + proc.stderr, noise
    res = _results(out)
    assert isinstance(res["warnings"], list) and res["summary"]["repeats"] == 2
    assert res["summary"]["gamma"] == "auto" and isinstance(res["summary"]["theory_gamma"], int)
    assert "gamma=auto (online; mostly" in proc.stdout
    for r in res["prompts"]:
        assert r["ids_identical"] and len(r["greedy_s_repeats"]) == len(r["spec_s_repeats"]) == 2
        assert r["greedy_s"] == statistics.median(r["greedy_s_repeats"])


def test_real_is_a_preset_of_the_one_pipeline(pair_dirs, tmp_path, monkeypatch, capsys):
    """`--real` and the default run go through the same steps: the same summarize, results and
    write_json make both results.json files, so they have the same keys; the preset adds its own
    figures (HF prompt lookup as a peer, the verify line). The real model is stood in for by the tiny
    target (no tokenizer: prompt bytes as ids, no EOS), so nothing is fetched."""
    target = build_gpt_neox("tiny-target", seed=0)
    monkeypatch.setattr(spec.realmodel, "load", lambda say, dtype: (target, None))
    calls = []
    for module, name in ((experiment, "summarize"), (experiment, "results"), (report, "write_json")):
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name, **k: (calls.append(_n),
                                                                                           _f(*a, **k))[1])
    common = ["--max-new-tokens", "8", "--repeats", "1", "--prompts", _prompts(tmp_path, "x = 1", "y = 2"),
              "--quiet", "--no-plots"]
    assert cli.main(["--target", pair_dirs[0], "--draft", pair_dirs[1], "--out", str(tmp_path / "a"), *common]) == 0
    assert cli.main(["--real", "--out", str(tmp_path / "b"), *common]) == 0, capsys.readouterr().err
    assert calls == ["summarize", "results", "write_json"] * 2
    default, real = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert list(real) == list(default) and list(real["prompts"][0]) == list(default["prompts"][0])
    assert set(default["summary"]) < set(real["summary"])
    assert real["pair"]["source"] == "real" and real["pair"]["draft_name"].startswith("PromptLookup(")
    assert real["summary"]["gamma"] == defaults.REAL_GAMMA["lookup"] == 8
    assert list(real["summary"]["peers"]) == ["HF prompt lookup (8, 3)"]
    assert real["summary"]["verify_slope"] >= 0 and "verify pass of g+1 tokens" in capsys.readouterr().out
    for res in (default, real):
        assert res["summary"]["all_identical"] and all(r["ids_identical"] for r in res["prompts"])
    assert [r["greedy_tokens"] for r in real["prompts"]] == [r["spec_tokens"] for r in real["prompts"]]


def test_prompt_past_the_position_limit_is_refused(pair_dirs, tmp_path, capsys):
    """tiny-target allows 2048 positions (config.max_position_embeddings): 3 prompt bytes + 2046
    new tokens = 2049 is one too many; + 2045 would fit."""
    base = ["--target", pair_dirs[0], "--draft", pair_dirs[1], "--prompts", _prompts(tmp_path, "abc"),
            "--out", str(tmp_path), "--quiet", "--no-plots"]
    assert cli.main(base + ["--max-new-tokens", "2046"]) == 2
    err = capsys.readouterr().err
    assert "prompt 1" in err and "2049 positions" in err and "limit of 2048" in err and "Traceback" not in err


def test_draft_impls_match_the_decoder():
    assert defaults.DRAFT_IMPLS == spec.choose.DRAFT_IMPLS


def _summary(**over):
    """A run's summary by hand: measured 2.0x (2 s greedy over 1 s speculative), three repeats."""
    in_run = InRun(target_step_s=0.02, c=0.06, verify_over_step=1.2, predicted_speedup=2.4,
                   measured_over_predicted=0.83, predicted_speedup_verify_costed=2.1,
                   measured_over_verify_costed=2.0 / 2.1, share_in_model_phases=0.99)
    fields = dict(gamma=5, gamma_option=5, theory_gamma=5, calibration=None, c=0.05, draft_step_s=1e-3,
                  target_step_s=2e-2, alpha=0.8, accept_rate=0.6, tokens_per_round=3.0,
                  theory=Theory(predicted_speedup=2.5, optimal_gamma=7, optimal_predicted_speedup=2.7,
                                draft_cannot_win=False),
                  speedups=[1.8, 2.2], repeat_speedups=[1.9, 2.0, 2.1], greedy_s=2.0, spec_s=1.0, in_run=in_run,
                  draft_impl="auto", threads=1, all_identical=True, ties=0, failures=0)
    fields.update(over)
    return Summary(**fields)


def test_consistent_figures_carry_no_warning():
    assert experiment.consistency_warnings(_summary()) == []


def test_each_inconsistency_is_one_warning():
    # c 0.01 from steps vs 0.06 in the runs: 6-fold, over the 2x limit.
    assert ["6.0-fold" in w for w in experiment.consistency_warnings(_summary(c=0.01))] == [True]
    # repeats 1.2x to 2.6x: a spread of 1.4, wider than the effect |2.0 - 1| = 1.0.
    [w] = experiment.consistency_warnings(_summary(repeat_speedups=[1.2, 2.0, 2.6]))
    assert "1.20x to 2.60x" in w
    # measured 2.0x against a verify-costed 1.4x: 43% above, over the 30% limit.
    run = dataclasses.replace(_summary().in_run, predicted_speedup_verify_costed=1.4,
                              measured_over_verify_costed=2.0 / 1.4)
    [w] = experiment.consistency_warnings(_summary(in_run=run))
    assert "43% above" in w


def test_warning_is_one_visible_line_of_the_report():
    summary = _summary(c=0.01)
    lines = [line for line in report.render([], summary, experiment.consistency_warnings(summary)).splitlines()
             if "WARNING" in line]
    assert len(lines) == 1 and "6.0-fold" in lines[0]


def test_draft_that_cannot_win_is_said_so():
    """alpha 0.1, c 0.5: Theorem 3.8 at gamma 1 gives (1 + 0.1) / (0.5 + 1) = 0.73x, and more
    drafting only costs more, so no gamma beats greedy."""
    th = experiment._theory(0.1, 5, 0.5)
    assert th.draft_cannot_win is True and th.optimal_predicted_speedup == pytest.approx(1.1 / 1.5)
    line = report.summary_lines(_summary(alpha=0.1, c=0.5, theory=th))[-1]
    assert "cannot win" in line and "optimal gamma: none" in line


def test_plot_title_says_how_gamma_was_chosen():
    pair = PairInfo(source="paths", target="t", draft="d", target_name="t", draft_name="d", note=None)
    base = dict(spec_version="0", created="now", pair=pair, machine={"gpu": None},
                options={"target_dtype": "fp32", "draft_dtype": "fp32", "max_new_tokens": 8},
                prompts=Prompts([], [], "seed", None), records=[], warnings=[])
    calibrated = report.figure_title(Results(**base, summary=_summary(gamma=8, gamma_option="calibrated")))
    online = report.figure_title(Results(**base, summary=_summary(gamma="auto", gamma_option="auto", theory_gamma=7)))
    assert "γ=8 (calibrated)" in calibrated and "γ=auto (online; mostly 7)" in online


@pytest.mark.parametrize("impl, draft_name", [("auto", "plain (spec.neox)"), ("plain", "plain (spec.neox)"),
                                              ("hf", "kv-cache"), ("compiled", "compiled (static cache)")])
def test_the_runs_as_line_is_the_path_spec_choose_takes(impl, draft_name):
    """The header's "runs as" names what spec.choose.runs builds (it asks spec.choose.path, no copy
    of the choice): a GPT-NeoX target on the probed kv-cache, its draft as draft_impl says."""
    target = build_gpt_neox("tiny-target", seed=0)
    draft = truncated_copy(target, num_layers=1)
    pair = spec.models.Pair(target, draft, None)
    assert experiment.runner_paths(pair, impl) == ("kv-cache", draft_name)
    if impl == "hf":   # the runner runs builds for that draft is the path named
        made = spec.choose.runs({"draft": draft}, [3, 4, 5], draft_impl=impl).runs[0]
        assert made.path == spec.choose.path(draft, "draft", impl) == "kv-cache"
