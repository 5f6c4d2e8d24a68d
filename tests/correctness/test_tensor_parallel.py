"""A target split across processes by tensor parallelism is decoded exactly (issue 27).

Two processes on CPU (`torchrun --nproc-per-node 2`, gloo) load each tiny seeded target split in
two through spec.models.load_model(tp_size=2) (transformers' DistributedConfig, its own plan for
the architecture), a draft whole on each rank, and run spec.speculative_generate on every rank
(tests/correctness/tp_worker.py). Every rank's output must equal this process's single-process
greedy decoding of the same target, and its cache-free greedy reference, for every prompt and
gamma; a sampled run with the same seed must give the same tokens on every rank; and the calls a
split target cannot run (gamma="auto", ranks given different prompts or random streams, a split
draft on the compiled forward) are refused with the reason, on every rank, instead of hanging.

Families: Llama (full attention), Mistral (sliding window of 8 tokens, crossed by every
prompt plus 24 tokens), Mixtral (mixture of experts with a sliding window; fp32: its expert
matmul takes no fp64). One torchrun launch for all three: about 30 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import architectures
from oracles import cache_free_greedy
from spec import greedy_generate
from spec.models import load_model, perturbed_copy

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
NEW_TOKENS = 24
GAMMAS = [1, 3, 5]
CASES = {"llama": "fp64", "mistral": "fp64", "mixtral": "fp32"}

pytestmark = pytest.mark.slow


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, architectures.VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 14)]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Saves the targets and drafts, runs the worker on 2 ranks; per rank, what it decoded."""
    root = tmp_path_factory.mktemp("tp")
    cases = []
    for i, (name, dtype) in enumerate(CASES.items()):
        target = architectures.build(name, seed=i, dtype=torch.float64 if dtype == "fp64" else torch.float32)
        target.save_pretrained(root / name / "target")
        perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32).save_pretrained(root / name / "draft")
        cases.append({"name": name, "dtype": dtype, "target": str(root / name / "target"),
                      "draft": str(root / name / "draft"), "prompts": _prompts(i), "gammas": GAMMAS,
                      "new_tokens": NEW_TOKENS})
    (root / "prompts.txt").write_text("def add(a, b):\nThe cat sat\n")
    cli = ["--target", cases[0]["target"], "--draft", cases[0]["draft"], "--tp", "2", "--target-dtype", "fp64",
           "--gamma", "calibrated", "--max-new-tokens", "12", "--repeats", "1", "--prompts", str(root / "prompts.txt")]
    job = root / "job.json"
    job.write_text(json.dumps({"cases": cases, "cli": cli}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(job), str(root)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}", pytrace=False)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return cases, ranks


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_equals_single_process_greedy(tp_run, name):
    cases, ranks = tp_run
    case = next(c for c in cases if c["name"] == name)
    target, _ = load_model(case["target"], dtype=torch.float64 if case["dtype"] == "fp64" else torch.float32)
    for p, prompt in enumerate(case["prompts"]):
        expected = greedy_generate(target, prompt, max_new_tokens=NEW_TOKENS).tokens
        assert expected == cache_free_greedy(target, prompt, NEW_TOKENS), f"{name}: the reference itself"
        for rank, got in enumerate(ranks):
            assert got[name]["greedy"][p] == expected, f"{name} rank {rank} prompt {p}: split greedy_generate"
            for gamma in GAMMAS:
                assert got[name]["speculative"][f"{p}/{gamma}"] == expected, \
                    f"{name} rank {rank} prompt {p} gamma {gamma}: speculative output differs from greedy"
    assert ranks[0][name]["split"].startswith("tensor parallel over 2 processes (gloo")


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_with_one_seed_gives_the_same_tokens_on_every_rank(tp_run, name):
    _, ranks = tp_run
    sampled = [r[name]["sampled"] for r in ranks]
    assert all(len(tokens) == NEW_TOKENS for tokens in sampled[0])
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("call, reason", [
    ("gamma auto", "gamma='auto' with a tensor-parallel target"),
    ("prompt differs", "input_ids differs between the 2 ranks"),
    ("seed differs", "generator (random state) differs between the 2 ranks"),
    ("split draft compiled", "draft_impl='compiled': the draft is split"),
])
def test_what_a_split_target_cannot_run_is_refused_on_every_rank(tp_run, call, reason):
    _, ranks = tp_run
    for rank, got in enumerate(ranks):
        message = got["llama"]["refused"][call]
        assert message is not None and reason in message, f"rank {rank}: {call}: {message}"


def test_a_model_without_a_plan_is_refused_before_loading(tmp_path, monkeypatch):
    architectures.build("gpt2", seed=0).save_pretrained(tmp_path / "gpt2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="'gpt2' models cannot be split .* transformers has no tensor-parallel plan"):
        load_model(tmp_path / "gpt2", role="target", tp_size=2)


def test_tp_size_outside_torchrun_is_refused(tmp_path, monkeypatch):
    architectures.build("llama", seed=0).save_pretrained(tmp_path / "llama")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"target: tp_size=2 needs 2 processes .* `torchrun --nproc-per-node 2`"):
        load_model(tmp_path / "llama", role="target", tp_size=2)
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        load_model(tmp_path / "llama", tp_size=0)


def test_the_cli_splits_the_target_and_only_rank_zero_reports(tp_run, tmp_path_factory):
    """`torchrun --nproc-per-node 2 -m spec --tp 2 ...`: both ranks decode, rank 0 prints the report
    (which says how the target is split) and writes results.json, rank 1 prints nothing."""
    cases, ranks = tp_run
    zero, one = ranks[0]["cli"], ranks[1]["cli"]
    assert zero["status"] == one["status"] == 0, zero["stderr"][-2000:] + one["stderr"][-2000:]
    assert "target split: tensor parallel over 2 processes (gloo; transformers' plan for LlamaForCausalLM)" \
        in zero["stdout"]
    assert "gamma=calibrated" in zero["stdout"] and "IDs identical" in zero["stdout"]
    assert one["stdout"] == "" and one["stderr"] == ""
    results = json.loads((Path(cases[0]["target"]).parents[1] / "cli" / "results.json").read_text())
    assert results["pair"]["target_split"].startswith("tensor parallel over 2 processes")
    assert results["summary"]["failures"] == 0 and all(p["ids_identical"] for p in results["prompts"])


@pytest.mark.parametrize("argv, why", [
    (["--gamma", "auto"], "not with --gamma auto: each rank would time its own passes"),
    (["--real"], "not with --real"),
    (["--target", "t", "--draft", "d", "--peer", "hf"], "not with --peer"),
])
def test_the_cli_refuses_tp_with_what_ranks_cannot_share(capsys, argv, why):
    from spec.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--tp", "2", *argv])
    assert f"argument --tp: {why}" in capsys.readouterr().err
