"""The helpers around the loop, value by value: spec.validate's checks at their boundaries
(single EOS id vs a list, bools refused, top_p at 1, the padding gap at its limit),
spec.models' builders (seeded, dtype, noise level, truncation), and spec.experiment.report's table,
cells and JSON (expected strings written out by hand)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from oracles import assert_logits_close

from spec import build_gpt_neox, clock, experiment, validate
from spec.experiment import report
from spec.models import SHAPES, gpt_neox_config, perturbed_copy, truncated_copy
from spec.experiment.records import Difference, InRun, Peer, PeerSummary, PromptRecord, Summary, Theory

# --- spec.validate -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow():
    return build_gpt_neox("tiny-draft", seed=2)  # 512 wide


def test_stop_ids_single_list_and_none(target, narrow):
    models = {"target": target, "draft": narrow}
    assert validate.stop_ids(None, models) == frozenset()
    assert validate.stop_ids(7, models) == frozenset({7})
    assert validate.stop_ids(0, models) == frozenset({0})
    assert validate.stop_ids([3, 9, 3], models) == frozenset({3, 9})
    assert validate.stop_ids((5,), models) == frozenset({5})
    assert validate.stop_ids([], models) == frozenset()
    assert validate.stop_ids([511], models) == frozenset({511})   # last id both models score


@pytest.mark.parametrize("eos, error, match", [
    (512, ValueError, r"eos_token_id 512 is outside the vocabulary \[0, 512\)"),       # narrower model's width
    ([4, 600], ValueError, r"eos_token_id 600 is outside the vocabulary \[0, 512\)"),
    (-1, ValueError, r"eos_token_id -1 is outside the vocabulary \[0, 512\)"),
    (True, TypeError, "eos_token_id must be None, an int or a list of ints, got True"),
    ([1, True], TypeError, r"eos_token_id must be None, an int or a list of ints, got \[1, True\]"),
    ("2", TypeError, "eos_token_id must be None, an int or a list of ints, got '2'"),
    ([1.0], TypeError, r"got \[1.0\]"),
])
def test_stop_ids_refusals(target, narrow, eos, error, match):
    with pytest.raises(error, match=match):
        validate.stop_ids(eos, {"target": target, "draft": narrow})


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=1), dict(max_new_tokens=1, gamma=1), dict(max_new_tokens=3, gamma="auto"),
    dict(max_new_tokens=1, temperature=1e-6), dict(max_new_tokens=1, temperature=2),
    dict(max_new_tokens=1, top_k=1), dict(max_new_tokens=1, top_p=1.0), dict(max_new_tokens=1, top_p=1),
    dict(max_new_tokens=1, top_p=1e-9)])
def test_check_options_accepts_the_limits(kwargs):
    validate.check_options(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer >= 1, got 2.0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=1, gamma=True), "gamma must be an integer >= 1 or 'auto', got True"),
    (dict(max_new_tokens=1, gamma=0), "gamma must be an integer >= 1 or 'auto', got 0"),
    (dict(max_new_tokens=1, temperature=-1.0), "temperature must be a number > 0, got -1.0"),
    (dict(max_new_tokens=1, temperature="hot"), "temperature must be a number > 0, got 'hot'"),
    (dict(max_new_tokens=1, temperature=float("nan")), "temperature must be a number > 0, got nan"),
    (dict(max_new_tokens=1, top_k=2.0), "top_k must be None or an integer >= 1, got 2.0"),
    (dict(max_new_tokens=1, top_k=0), "top_k must be None or an integer >= 1, got 0"),
    (dict(max_new_tokens=1, top_p=0.0), r"top_p must be None or a number in \(0, 1\], got 0.0"),
    (dict(max_new_tokens=1, top_p=1.0001), r"top_p must be None or a number in \(0, 1\], got 1.0001"),
    (dict(max_new_tokens=1, top_p="0.5"), r"top_p must be None or a number in \(0, 1\], got '0.5'"),
])
def test_check_options_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate.check_options(**kwargs)


def test_as_prompt_forms(target):
    models = {"target": target}
    want = torch.tensor([4, 5, 639])
    for ids in ([4, 5, 639], (4, 5, 639), torch.tensor([4, 5, 639]), torch.tensor([[4, 5, 639]]),
                torch.tensor([4, 5, 639], dtype=torch.int32)):
        got = validate.as_prompt(ids, torch.device("cpu"), models)
        assert got.dtype == torch.long and torch.equal(got, want)
    with pytest.raises(TypeError, match="input_ids as a list must hold ints only"):
        validate.as_prompt([1, True], torch.device("cpu"), models)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype torch.bool"):
        validate.as_prompt(torch.tensor([True]), torch.device("cpu"), models)
    with pytest.raises(ValueError, match=r"input_ids must be 1-D or \(1, n\), got shape \(\)"):
        validate.as_prompt(torch.tensor(3), torch.device("cpu"), models)
    with pytest.raises(ValueError, match=r"token id -2, outside the target's vocabulary \[0, 640\)"):
        validate.as_prompt([3, -2, 700], torch.device("cpu"), models)


def test_padding_gap_limit():
    """Logit widths 1024 apart still share a tokenizer (padding); 1025 apart do not."""
    base = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    a = build_gpt_neox(dict(base, vocab_size=100), seed=0)
    validate.check_pair(a, build_gpt_neox(dict(base, vocab_size=100 + 1024), seed=0))
    with pytest.raises(ValueError, match=r"logit widths 100 and 1125 differ by more than embedding padding \(1024\)"):
        validate.check_pair(a, build_gpt_neox(dict(base, vocab_size=100 + 1025), seed=0))


def test_special_ids_must_agree_but_may_be_missing(target):
    base = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=512)
    validate.check_pair(target, build_gpt_neox(base, seed=0, bos_token_id=None, eos_token_id=None))
    with pytest.raises(ValueError, match="config.bos_token_id is 0 for the target and 5 for the draft"):
        validate.check_pair(target, build_gpt_neox(base, seed=0, bos_token_id=5))


def test_check_model_names_the_role():
    with pytest.raises(TypeError, match="target must be a Hugging Face causal LM .* got Linear"):
        validate.check_model(torch.nn.Linear(2, 2), "target")
    validate.check_model(build_gpt_neox("tiny-draft"), "draft")


# --- spec.models ------------------------------------------------------------------------------


def test_gpt_neox_config_has_the_pythia_defaults_and_overrides():
    cfg = gpt_neox_config("tiny-target", rotary_pct=1.0)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size,
            cfg.vocab_size) == (64, 3, 4, 256, 640)
    rotary = getattr(cfg, "rope_parameters", None) or {}  # 5.24 keeps rotary_pct there; 5.17 as an attribute
    assert rotary.get("partial_rotary_factor", getattr(cfg, "rotary_pct", None)) == 1.0
    assert cfg.use_parallel_residual is True and cfg.tie_word_embeddings is False
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_id) == (2048, 0, 0)
    assert SHAPES["pythia-12b"]["vocab_size"] == 50688 and SHAPES["pythia-410m"]["vocab_size"] == 50304
    assert gpt_neox_config(dict(SHAPES["tiny-draft"])).vocab_size == 512
    # and nothing else: the same config spelled out by hand
    by_hand = transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                         intermediate_size=256, vocab_size=640, rotary_pct=0.25,
                                         use_parallel_residual=True, tie_word_embeddings=False,
                                         max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    assert gpt_neox_config("tiny-target").to_dict() == by_hand.to_dict()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_build_gpt_neox_is_seeded_in_its_dtype_and_leaves_the_default_alone(dtype):
    default = torch.get_default_dtype()
    a = build_gpt_neox("tiny-draft", seed=5, dtype=dtype)
    b = build_gpt_neox("tiny-draft", seed=5, dtype=dtype)
    c = build_gpt_neox("tiny-draft", seed=6, dtype=dtype)
    assert torch.get_default_dtype() == default
    assert {p.dtype for p in a.parameters()} == {dtype} and not a.training
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.get_output_embeddings().weight, c.get_output_embeddings().weight)


def test_fp64_build_has_fp64_precision_not_rounded_fp32():
    """Built in fp64 directly: the weights are not fp32 values cast up."""
    w = build_gpt_neox("tiny-draft", seed=5, dtype=torch.float64).get_output_embeddings().weight
    assert not torch.equal(w, w.float().double())


def test_perturbed_copy_noise_is_relative_to_each_tensor(target):
    draft = perturbed_copy(target, noise=0.1, seed=3)
    again = perturbed_copy(target, noise=0.1, seed=3)
    for (name, p), d, e in zip(target.named_parameters(), draft.parameters(), again.parameters()):
        assert torch.equal(d, e)
        if p.numel() > 1 and float(p.detach().std()) > 0:
            ratio = float((d - p).detach().std() / p.detach().std())
            assert 0.08 < ratio < 0.12, (name, ratio)
        elif p.numel() == 1:
            assert torch.equal(d, p)
    assert draft.get_output_embeddings().weight.dtype == torch.float64
    assert perturbed_copy(target, noise=0.0, seed=1).state_dict().keys() == target.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(perturbed_copy(target, noise=0.0).parameters(), target.parameters()))
    half = perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)
    assert {p.dtype for p in half.parameters()} == {torch.float32}


def test_perturbed_copy_by_its_documented_rule():
    """Each tensor of more than one element gets seeded fp64 Gaussian noise times noise times
    its own std; a one-element tensor (no std) is left alone."""
    toy = torch.nn.Module()
    toy.scalar = torch.nn.Parameter(torch.tensor([3.0], dtype=torch.float64))
    toy.pair = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    toy.w = torch.nn.Parameter(torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 1.0]], dtype=torch.float64))
    out = perturbed_copy(toy, noise=0.5, seed=9)
    gen = torch.Generator().manual_seed(9)
    z_pair = torch.randn(2, generator=gen, dtype=torch.float64)
    z_w = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    assert torch.equal(out.scalar, toy.scalar)
    # (the std is taken in fp32, so the match is to fp32's rounding)
    assert_logits_close(out.pair, toy.pair + z_pair * 0.5 * toy.pair.detach().std(), torch.float32)
    assert_logits_close(out.w, toy.w + z_w * 0.5 * toy.w.detach().std(), torch.float32)


def test_truncated_copy_is_the_first_layers(target):
    short = truncated_copy(target, num_layers=2, dtype=torch.float32)
    assert len(short.gpt_neox.layers) == 2 == short.config.num_hidden_layers
    assert len(target.gpt_neox.layers) == 3 and target.config.num_hidden_layers == 3
    assert {p.dtype for p in short.parameters()} == {torch.float32}
    assert torch.equal(short.gpt_neox.layers[1].mlp.dense_h_to_4h.weight,
                       target.gpt_neox.layers[1].mlp.dense_h_to_4h.weight.float())
    assert truncated_copy(target, num_layers=1).get_output_embeddings().weight.dtype == torch.float64


# --- spec.experiment.report ------------------------------------------------------------------------------


def test_short_prompt_escapes_and_cuts():
    assert report.short_prompt("a\nb\tc\\d") == "a\\nb\\tc\\\\d"
    assert report.short_prompt("x" * 44) == "x" * 44
    assert report.short_prompt("x" * 45) == "x" * 44 + "..."
    assert report.short_prompt("abcdef", width=3) == "abc..."


def test_fmt_cells():
    assert report.fmt(None) == "-" and report.fmt(float("nan")) == "-"
    assert report.fmt(1.23456) == "1.23" and report.fmt(1.23456, 1) == "1.2" and report.fmt(7) == "7"


GREEDY = list(range(10, 74))   # 64 new tokens


def record(i=1, spec_tokens=GREEDY, divergence=None, peer=None):
    """A prompt's record by hand: greedy 2.0 s, speculative 1.0 s, each 64 tokens; a speculative run's
    acceptance stands in for a decode.Result's (accept rate 0.5, alpha 0.75, 3.25 tokens a round)."""
    spec = types.SimpleNamespace(tokens=list(spec_tokens), accept_rate=0.5, alpha=0.75, mean_tokens_per_round=3.25)
    peer = peer or Peer("hf_assisted", tokens=[10, 99] + GREEDY[2:], times=[1.5], identical=False)
    return PromptRecord(index=i, prompt="Hello\nworld", prompt_tokens=3, greedy=types.SimpleNamespace(tokens=GREEDY),
                        spec=spec, greedy_times=[2.0], spec_times=[1.0], trace_repeat=0, divergence=divergence,
                        peers=[peer])


def _differs(verdict, position):
    return Difference(position=position, expected=1, actual=2, verdict=verdict, message="")


@pytest.mark.parametrize("spec_tokens, divergence, cell", [
    (GREEDY, None, "YES"),
    (GREEDY[:7], _differs("tie", 7), "TIE@7"),
    (GREEDY[:3], _differs("bug", 3), "NO (diverge@3)"),
    (GREEDY[:3], None, "NO (diverge@?)"),
])
def test_identical_cell(spec_tokens, divergence, cell):
    assert report.identical_cell(record(spec_tokens=spec_tokens, divergence=divergence)) == cell


def test_format_table_aligns_by_hand():
    table = report.format_table(["#", "name", "x"], [["1", "ab", "3.5"], ["10", "c", "12.25"]])
    assert table.split("\n") == [
        " #  name      x",
        "--  ----  -----",
        " 1  ab      3.5",
        "10  c     12.25",
    ]
    assert report.format_table(["a", "bb"], []) == "a  bb\n-  --"
    assert report.format_table(["a", "b"], [["x", "y"]], left=frozenset({0, 1})) == "a  b\n-  -\nx  y"


def test_results_and_peer_tables_by_hand():
    rows = report.results_table([record()]).split("\n")
    assert rows[0].split() == ["#", "prompt", "new", "tokens", "greedy", "s", "spec", "s", "greedy", "tok/s", "spec",
                               "tok/s", "speedup", "accept", "rate", "alpha", "tok/round", "IDs", "identical"]
    assert rows[2].split() == ["1", "Hello\\nworld", "64", "2.00", "1.00", "32.0", "64.0", "2.00x", "0.50", "0.75",
                               "3.2", "YES"]
    # 64 tokens in 12.25 s: 5.2 tok/s, 2.0 / 12.25 = 0.16x greedy's speed, ours 12.25 / 1.0 = 12.25x its
    same = Peer("hf_assisted", tokens=GREEDY, times=[12.0, 12.25, 13.0], identical=True)
    peer = report.peer_table([record(), record(2, peer=same)])
    cells = [[c for c in re.split(r"\s{2,}", line.strip())] for line in peer.split("\n")]
    assert cells[0] == ["#", "hf assisted s", "hf tok/s", "hf speedup", "ours vs hf", "hf IDs identical"]
    # a peer whose output is not greedy's did other work: no speed ratio, and the reason instead
    assert cells[2] == ["1", "1.50", "42.7", "-", "-", "NO: differs at new token 1 (99 vs greedy's 11)"]
    assert cells[3] == ["2", "12.25", "5.2", "0.16x", "12.25x", "YES"]


def summary(**over):
    """A summary by hand: measured 1.25x (1.25 s greedy over 1.0 s speculative), one repeat."""
    fields = dict(gamma=5, gamma_option=5, theory_gamma=5, calibration=None, c=0.25, draft_step_s=0.0125,
                  target_step_s=0.05, alpha=0.8, accept_rate=0.6, tokens_per_round=3.36,
                  theory=Theory(predicted_speedup=1.5, optimal_gamma=4, optimal_predicted_speedup=1.6,
                                draft_cannot_win=False),
                  speedups=[1.1, 1.4], repeat_speedups=[1.25], greedy_s=1.25, spec_s=1.0, in_run=None,
                  draft_impl="auto", threads=1, all_identical=True, ties=0, failures=0)
    return Summary(**{**fields, **over})


def test_summary_lines_by_hand():
    s = summary()
    lines = report.summary_lines(s)
    assert lines[0] == ("c (draft step / target step): 0.250  (12.50 ms / 50.00 ms, median cached one-token step)")
    assert lines[1] == ("alpha (pooled, per-token acceptance MLE): 0.800   accept rate (accepted/drafted): 0.600"
                        "   tokens/round: 3.36")
    assert lines[2] == ("speedup at gamma=5: predicted 1.50x (Theorem 3.8), measured 1.25x (total greedy s / total "
                        "spec s; per prompt 1.10x to 1.40x)")
    assert lines[3] == "optimal gamma for the measured alpha and c: 4 (predicted 1.60x)"
    assert len(lines) == 4
    s = summary(theory=Theory(predicted_speedup=1.5), in_run=InRun(
        target_step_s=0.05, c=0.2, verify_over_step=1.25, predicted_speedup=1.8, measured_over_predicted=0.7,
        predicted_speedup_verify_costed=1.5, measured_over_verify_costed=0.9, share_in_model_phases=0.955))
    lines = report.summary_lines(s)
    assert lines[3] == ("  from the timed runs themselves: c = 0.200 (draft time per drafted token / greedy time per "
                        "token), a 6-token verify pass = 1.25 target steps")
    assert lines[4] == ("  Theorem 3.8 with that c: 1.80x (measured/predicted 0.70); it assumes a verify pass costs "
                        "one step, and priced at its measured cost: 1.50x (0.90)")
    assert lines[5] == "  share of speculative time inside the draft and verify phases: 95.5%"
    assert lines[6] == "optimal gamma: - (no alpha measured)"


def test_summary_json_keeps_its_keys_and_derives_its_figures():
    """results.json's summary: the keys it had as a dict, in order, with the derived figures."""
    out = summary(repeat_speedups=[1.2, 1.3], peers={"hf_assisted": PeerSummary(2, 1.5, 0.8)}, peer_gamma=5,
                  failures=1).to_json()
    assert list(out) == [
        "gamma", "gamma_option", "theory_gamma", "calibration", "c", "draft_step_s", "target_step_s", "alpha",
        "accept_rate", "tokens_per_round", "predicted_tokens_per_round", "predicted_speedup", "optimal_gamma",
        "optimal_predicted_speedup", "draft_cannot_win", "measured_speedup", "mean_speedup", "speedup_min",
        "speedup_max", "repeats", "repeat_speedups", "repeat_spread", "greedy_s", "spec_s", "in_run", "draft_impl",
        "threads", "all_identical", "ties", "failures", "hf_compared_prompts", "hf_speedup", "ours_vs_hf",
        "peer_gamma", "exit_status", "rounds_drafting_nothing", "target_passes", "peers"]
    assert out["measured_speedup"] == 1.25 and out["mean_speedup"] == pytest.approx(1.25)
    assert out["repeats"] == 2 and out["repeat_spread"] == pytest.approx(0.1) and out["exit_status"] == 1
    assert "hf_speedup" not in summary().to_json() and summary().to_json()["exit_status"] == 0


@dataclasses.dataclass
class _Point:
    x: float
    where: Path


def test_jsonable_and_write_json(tmp_path):
    data = {"a": float("nan"), "b": [1, 2.5, float("inf"), -float("inf")], 3: _Point(0.5, Path("/tmp/x")),
            "t": (True, None, "s"), "other": torch.float32}
    want = {"a": None, "b": [1, 2.5, None, None], "3": {"x": 0.5, "where": "/tmp/x"}, "t": [True, None, "s"],
            "other": "torch.float32"}
    assert report.jsonable(data) == want
    out = tmp_path / "r.json"
    report.write_json(out, data)
    text = out.read_text(encoding="utf-8")
    assert json.loads(text) == want and text.endswith("}\n") and "\n \"a\": null" in text
    assert report.jsonable(_Point) == str(_Point)  # a dataclass type is not an instance


def test_machine_info_names_the_gpu_it_runs_on(monkeypatch):
    """On a CUDA device, the GPU's name at that index (CUDA faked here); on the CPU, none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"FakeGPU-{index}")
    assert report.machine_info("cpu")["gpu"] is None
    assert report.machine_info("cuda")["gpu"] == "FakeGPU-0"
    assert report.machine_info("cuda:1")["gpu"] == "FakeGPU-1"
    assert report.machine_info(torch.device("cuda", 2))["gpu"] == "FakeGPU-2"


def test_machine_info_keys_and_values():
    info = report.machine_info("cpu")
    assert info["device"] == "cpu" and info["gpu"] is None and info["torch"] == torch.__version__
    assert info["torch_threads"] == torch.get_num_threads() and isinstance(info["cpu"], str) and info["cpu"]
    assert set(info) == {"platform", "python", "torch", "transformers", "cpu", "cpu_count", "torch_threads", "gpu",
                         "cuda", "device"}
    assert info["python"] == platform.python_version() and info["transformers"] == transformers.__version__
    assert info["platform"] == platform.platform() and info["cuda"] == torch.version.cuda
    assert info["cpu_count"] == os.cpu_count()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.lower().startswith("model name")]
    if names:
        assert info["cpu"] == names[0]


# --- spec.models.load_pair: offline loading from folders ------------------------------------------


@pytest.fixture(scope="module")
def pair_folders(tmp_path_factory):
    """Tiny target and draft saved as a user would have them: weights, and a copied tokenizer."""
    from spec.models import SHIPPED_PAIR
    root = tmp_path_factory.mktemp("pair")
    for role, shape, seed in (("target", "tiny-target", 1), ("draft", "tiny-draft", 2)):
        build_gpt_neox(shape, seed=seed).save_pretrained(root / role)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / role / name).write_bytes((SHIPPED_PAIR / "target" / name).read_bytes())
    build_gpt_neox("tiny-draft", seed=2).save_pretrained(root / "weights-only")
    return root


def test_load_pair_from_folders_in_the_asked_dtypes(pair_folders):
    from spec import load_pair
    pair = load_pair(pair_folders / "target", pair_folders / "draft", target_dtype=torch.float64,
                     draft_dtype=torch.bfloat16)
    assert {p.dtype for p in pair.target.parameters()} == {torch.float64}
    assert {p.dtype for p in pair.draft.parameters()} == {torch.bfloat16}
    assert not pair.target.training and not pair.draft.training
    assert str(next(pair.target.parameters()).device) == "cpu"
    ref = build_gpt_neox("tiny-target", seed=1)
    assert torch.equal(pair.target.get_output_embeddings().weight.float(), ref.get_output_embeddings().weight)
    assert pair.tokenizer is not None and pair.tokenizer("def f():")["input_ids"]
    assert load_pair(str(pair_folders / "target"), str(pair_folders / "draft")).target.dtype == torch.float32


def test_load_pair_weights_only_folder_has_no_tokenizer(pair_folders):
    from spec import load_pair
    pair = load_pair(pair_folders / "weights-only", pair_folders / "draft")
    assert pair.tokenizer is None
    pair = load_pair(pair_folders / "target", pair_folders / "weights-only")  # the draft's tokenizer is not needed
    assert pair.tokenizer is not None


def test_load_pair_refuses_different_vocabularies(pair_folders, tmp_path):
    import shutil

    from spec import load_pair
    other = tmp_path / "other"
    shutil.copytree(pair_folders / "draft", other)
    tok = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_renamed"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    with pytest.raises(ValueError, match="target and draft cannot share a tokenizer: .* have different vocabularies"):
        load_pair(pair_folders / "target", other)


def test_load_pair_device_errors(pair_folders):
    from spec import load_pair
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda:0': CUDA is not available on this machine"):
            load_pair(pair_folders / "target", pair_folders / "draft", device="cuda:0")
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        load_pair(pair_folders / "target", pair_folders / "draft", device="tpu")


def test_load_pair_names_the_missing_role(pair_folders, tmp_path):
    from spec import load_pair
    with pytest.raises(FileNotFoundError, match=r"^draft: no weights for '.*nothing' on this machine"):
        load_pair(pair_folders / "target", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"^target: no weights for 'org/no-such-model' on this machine.*"
                                                r"hf download org/no-such-model"):
        load_pair("org/no-such-model", pair_folders / "draft")


def test_compile_step_options(monkeypatch):
    """The compiled draft: static shapes, graph breaks allowed, CUDA graphs only on a GPU."""
    from spec import hf
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    model = build_gpt_neox("tiny-draft")
    assert hf.compile_step(model) == model.forward
    assert seen == dict(mode="default", dynamic=False, fullgraph=False)

    class OnCuda:  # stands in for a model whose weights are on a GPU (none is needed to check the mode)
        forward = object()

        def parameters(self):
            yield types.SimpleNamespace(device=torch.device("cuda", 0))
    assert hf.compile_step(OnCuda()) is OnCuda.forward
    assert seen == dict(mode="reduce-overhead", dynamic=False, fullgraph=False)


# --- the one clock (spec.clock) and the Whisper features files the CLI reads (spec.seq2seq) ---
def test_timed_reads_the_clock_after_syncing_the_device_on_both_sides(monkeypatch):
    ticks, synced = iter([10.0, 12.5]), []
    monkeypatch.setattr(clock.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(clock, "sync", synced.append)
    assert clock.timed(lambda: "out", device="cuda:1") == ("out", 2.5)
    assert synced == ["cuda:1", "cuda:1"]


def test_sync_waits_only_for_cuda(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    clock.sync(None), clock.sync("cpu"), clock.sync(torch.device("cpu"))
    assert waited == []
    clock.sync("cuda:0")
    assert waited == [torch.device("cuda:0")]


class NotATensor:
    pass


def test_features_files_are_read_as_float_tensors(tmp_path):
    feats = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save(feats, tmp_path / "a.pt")
    np.save(tmp_path / "b.npy", feats.double().numpy())
    names, label, tensors = experiment.feature_prompts([tmp_path / "a.pt", tmp_path / "b.npy"])
    assert names == [str(tmp_path / "a.pt"), str(tmp_path / "b.npy")] and label == "features files"
    assert torch.equal(tensors[0], feats) and tensors[1].dtype == torch.float64
    assert torch.equal(tensors[1], feats.double()) and tensors[0].device.type == "cpu"


def test_features_files_that_are_not_one_float_tensor_are_refused(tmp_path):
    cases = {"ints.pt": torch.arange(4), "list.pt": [1.0, 2.0]}
    for name, value in cases.items():
        torch.save(value, tmp_path / name)
        with pytest.raises(experiment.UsageError) as info:
            experiment.load_features(tmp_path / name)
        assert str(info.value) == (f"--features: {str(tmp_path / name)!r} must hold one floating-point tensor "
                                   "[num_mel_bins, frames]")
    # a pickled object: refused as torch.load(weights_only=True) refuses it, not unpickled
    torch.save(NotATensor(), tmp_path / "obj.pt")
    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read '.*obj\.pt': Weights only load failed"):
        experiment.load_features(tmp_path / "obj.pt")
    np.save(tmp_path / "obj.npy", np.array([NotATensor()], dtype=object), allow_pickle=True)
    with pytest.raises(experiment.UsageError,
                       match=r"cannot read '.*obj\.npy': Object arrays cannot be loaded when allow_pickle=False"):
        experiment.load_features(tmp_path / "obj.npy")


def test_feature_prompts_name_the_option_of_an_unreadable_file(tmp_path):
    with pytest.raises(experiment.UsageError, match=r"^--features: cannot read '.*missing\.pt': "):
        experiment.feature_prompts([tmp_path / "missing.pt"])
