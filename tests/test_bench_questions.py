"""`python -m spec bench --questions FILE.jsonl` end to end: question files the tests write (two categories, a few
questions), in process on a tiny GPT-NeoX pair saved to disk, and over HTTP against the in-process servers
(tests/endpoint_server.py); the bad inputs (exit 2) and the verdicts (a broken decoder: exit 1)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spec.decode
import spec.realmodel
from spec import experiment, theory
from spec.bench import cli, questions, table
from spec.experiment.records import Difference
from spec.models import SHIPPED_PAIR, build_gpt_neox

ROOT = Path(__file__).resolve().parents[1]
N = 10   # new tokens per question: several rounds, cheap on a shared CPU
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now a limerick."]},
    {"question_id": 82, "category": "writing", "turns": ["Describe a harbour at dawn."]},
    {"question_id": 201, "category": "math_reasoning", "turns": ["What is 17 * 3? Explain."]},
    {"question_id": 202, "category": "math_reasoning", "turns": ["Solve x + 4 = 9."]},
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair_dirs(saved_pair):
    return ["--target", saved_pair[0], "--draft", saved_pair[1]]


def _file(tmp_path, rows, name="question.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(path)


def _bench(tmp_path, *argv) -> tuple[int, dict | None]:
    out = tmp_path / "out"
    rc = cli.main([*argv, "--out", str(out)])
    path = out / "bench.json"
    return rc, json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _run(pair_dirs, tmp_path, *extra, rows=QUESTIONS):
    return _bench(tmp_path, "--questions", _file(tmp_path, rows), *pair_dirs, "--max-new-tokens", str(N),
                  "--gamma", "3", "--quiet", *extra)


# --------------------------------------------------------------------------- in process


def test_in_process_table_and_json(pair_dirs, tmp_path, capsys):
    rc, res = _run(pair_dirs, tmp_path)
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    header = next(line for line in stdout.splitlines() if line.startswith("category"))
    for column in ("prompts", "identical", "tok/round", "greedy tok/s", "spec tok/s", "speedup", "alpha", "Thm 3.8"):
        assert column in header
    assert "chat template: none (the model has no tokenizer" in stdout
    assert [c["category"] for c in res["categories"]] == ["writing", "math_reasoning", "all"]
    assert res["verdict"] == {"prompts": 4, "identical": 4, "ties": 0, "failures": 0, "exit_status": 0}
    assert [q["question_id"] for q in res["questions"]] == [81, 82, 201, 202]
    for q in res["questions"]:
        assert q["ids_identical"] and q["greedy_tokens"] == q["spec_tokens"] and len(q["spec_tokens"]) == N
        assert q["verdict"] is None and math.isclose(q["tokens_per_round"], N / q["rounds"])
    th = res["theory"]
    for cat in res["categories"]:
        qs = [q for q in res["questions"] if cat["category"] in ("all", q["category"])]
        assert cat["prompts"] == cat["identical"] == len(qs)
        assert math.isclose(cat["speedup"], sum(q["greedy_s"] for q in qs) / sum(q["spec_s"] for q in qs))
        assert math.isclose(cat["spec_tok_s"], sum(len(q["spec_tokens"]) for q in qs) / sum(q["spec_s"] for q in qs))
        assert math.isclose(cat["tokens_per_round"], N * len(qs) / sum(q["rounds"] for q in qs))
        alpha = theory.alpha_from_accepted([k for q in qs for k in q["accepted_per_round"]],
                                           [g for q in qs for g in q["drafted_per_round"]])
        assert math.isclose(cat["alpha"], alpha)
        assert math.isclose(cat["predicted_speedup"], theory.expected_speedup_costed(
            alpha, 3, th["c"], verify_fixed=th["verify_over_step"]))
    assert res["categories"][-1]["alpha"] == pytest.approx(th["alpha"])   # all: the run's pooled alpha


def test_limit_categories_and_merged_mt_bench(pair_dirs, tmp_path, capsys):
    rows = QUESTIONS + [{"question_id": 83, "category": "roleplay", "turns": ["Pretend to be a pirate."],
                         "reference": ["Arr."]}]   # keys beyond the three (Spec-Bench's "reference") are left alone
    rc, res = _run(pair_dirs, tmp_path, "--merge-mt-bench", "--categories", "mt_bench", "--limit", "2", rows=rows)
    assert rc == 0, capsys.readouterr().err
    assert [c["category"] for c in res["categories"]] == ["mt_bench", "all"]
    assert [(q["question_id"], q["category"], q["group"]) for q in res["questions"]] == [
        (81, "writing", "mt_bench"), (82, "writing", "mt_bench")]
    assert res["options"]["limit"] == 2 and res["options"]["categories"] == ["mt_bench"]
    assert not set(cli.UNTAKEN) & set(res["options"])


def _tamper(monkeypatch, *, call: int, position: int) -> None:
    """The `call`-th timed speculative run (trace=True) emits a wrong token at new token `position`."""
    real, calls = spec.decode.speculative_generate, []

    def tampered(*args, **kwargs):
        result = real(*args, **kwargs)
        if kwargs.get("trace"):
            calls.append(1)
            if len(calls) == call:
                result.tokens[position] = (result.tokens[position] + 1) % 500
        return result
    monkeypatch.setattr(spec.decode, "speculative_generate", tampered)


def test_a_broken_decoder_is_a_bug_and_exits_1(pair_dirs, tmp_path, monkeypatch, capsys):
    """The timed speculative run of the second question emits a wrong token: that question is not identical,
    spec.diagnose calls it a bug (fp32 target, a token far from any tie), and the command exits 1."""
    _tamper(monkeypatch, call=2, position=3)
    rc, res = _run(pair_dirs, tmp_path)
    stdout, stderr = capsys.readouterr()
    assert rc == 1
    assert "FAIL: question 82 (line 2), writing" in stderr and "new token 3" in stderr
    assert "1/2, 1 BUG" in stdout and "3/4, 1 BUG" in stdout
    assert res["verdict"]["failures"] == 1 and res["verdict"]["exit_status"] == 1
    bad = res["questions"][1]
    assert bad["ids_identical"] is False and bad["verdict"] == "bug" and bad["greedy_tokens"] != bad["spec_tokens"]


def test_a_proven_tie_is_named_and_exits_0(pair_dirs, tmp_path, monkeypatch, capsys):
    _tamper(monkeypatch, call=3, position=5)
    monkeypatch.setattr(experiment, "diagnose_outputs", lambda target, prompt, expected, actual: Difference(
        position=5, expected=expected[5], actual=actual[5], verdict="tie", message="top-2 gap within fp32 noise"))
    rc, res = _run(pair_dirs, tmp_path)
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "1/2, 1 tie" in stdout and "question 201 (line 3), math_reasoning: differs from greedy, a proven" in stdout
    assert res["verdict"] == {"prompts": 4, "identical": 3, "ties": 1, "failures": 0, "exit_status": 0}


def test_real_preset_with_its_draft_source(tmp_path, monkeypatch, capsys):
    """--real (prompt lookup) runs through the same steps; the real model is stood in for by the tiny target."""
    target = build_gpt_neox("tiny-target", seed=0)
    monkeypatch.setattr(spec.realmodel, "load", lambda say, dtype: (target, None))
    rows = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in enumerate(
        [("qa", "a b a b a b a b"), ("rag", "x = 1; x = 1; x = 1;")])]
    rc, res = _bench(tmp_path, "--questions", _file(tmp_path, rows), "--real", "--max-new-tokens", "8", "--quiet")
    assert rc == 0, capsys.readouterr().err
    assert res["pair"]["source"] == "real" and res["theory"]["gamma"] == 8
    assert all(q["ids_identical"] for q in res["questions"])


@pytest.mark.skipif(not (SHIPPED_PAIR / "target" / "config.json").exists(), reason="no shipped pair")
def test_the_chat_template_wraps_the_first_turn(tmp_path, monkeypatch, capsys):
    """A tokenizer with a chat template gets each first turn as a user turn in it (the shipped pair's has none:
    one is given here); --plain feeds the text as it is."""
    template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<assistant>"
    load = experiment.load

    def with_template(*args, **kwargs):
        pair, info = load(*args, **kwargs)
        pair.tokenizer.chat_template = template
        return pair, info

    monkeypatch.setattr(experiment, "load", with_template)
    rows = QUESTIONS[1:3]
    rc, res = _bench(tmp_path, "--questions", _file(tmp_path, rows), "--max-new-tokens", "4", "--quiet")
    stdout = capsys.readouterr().out
    assert rc == 0 and "chat template: the tokenizer's" in stdout and res["chat_template"] is True
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHIPPED_PAIR / "target")
    wrapped = [len(tok.encode(f"<user>{r['turns'][0]}</user><assistant>", add_special_tokens=False)) for r in rows]
    assert [q["prompt_tokens"] for q in res["questions"]] == wrapped
    rc, res = _bench(tmp_path, "--questions", _file(tmp_path, rows), "--max-new-tokens", "4", "--quiet", "--plain")
    assert rc == 0 and "chat template: none (--plain)" in capsys.readouterr().out
    assert [q["prompt_tokens"] for q in res["questions"]] == [len(tok.encode(r["turns"][0])) for r in rows]


# --------------------------------------------------------------------------- identity is the ids' equality


def _outcome(greedy, out, verdict=None):
    q = questions.Question(1, "qa", ("q",), 1, "qa")
    return table.Outcome(q, 3, greedy, out, 1.0, 0.5, verdict=verdict)


def test_an_outcome_is_identical_only_when_the_ids_are():
    assert _outcome([1, 2, 3], [1, 2, 3]).identical
    for out in ([1, 2], [1, 2, 3, 4], [1, 2, 4], []):
        o = _outcome([1, 2, 3], out)
        assert not o.identical and o.failed   # not diagnosed: a failure, never a pass
    assert _outcome([1, 2, 3], [1, 2, 4], "tie").tie and not _outcome([1, 2, 3], [1, 2, 3], "tie").tie
    assert _outcome([1, 2, 3], [1, 2, 4], "unknown").failed
    cats = table.categories([_outcome([1], [1]), _outcome([1], [2], "bug")])
    assert table.verdict(cats) == {"prompts": 2, "identical": 1, "ties": 0, "failures": 1, "exit_status": 1}


def test_zero_prompts_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="vacuous"):
        table.categories([])
    with pytest.raises(questions.QuestionError, match="no question selected"):
        questions.select([], categories=None)


# --------------------------------------------------------------------------- bad input: exit 2


@pytest.mark.parametrize("rows, says", [
    (["{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\"hi\"]}", "{not json"], ["line 2", "not valid JSON"]),
    ([{"question_id": 1, "category": "qa"}], ["line 1", "missing key 'turns'"]),
    ([{"question_id": 1, "turns": ["hi"]}], ["line 1", "missing key 'category'"]),
    ([{"category": "qa", "turns": ["hi"]}], ["line 1", "missing key 'question_id'"]),
    ([QUESTIONS[0], "", {"question_id": 2, "category": "qa", "turns": "hi"}], ["line 3", "'turns' must be a non-empty"]),
    ([{"question_id": 1, "category": "qa", "turns": []}], ["line 1", "'turns'"]),
    ([{"question_id": 1, "category": "qa", "turns": [" "]}], ["line 1", "empty turn"]),
    ([{"question_id": True, "category": "qa", "turns": ["hi"]}], ["line 1", "'question_id'"]),
    ([{"question_id": 1, "category": "", "turns": ["hi"]}], ["line 1", "'category'"]),
    (["[1, 2]"], ["line 1", "expected a JSON object"]),
    ([QUESTIONS[0], QUESTIONS[0]], ["line 2", "repeats line 1"]),
    (["", "  "], ["holds no question"]),
])
def test_a_bad_question_file_names_the_file_line_and_key(rows, says, tmp_path, capsys):
    path = _file(tmp_path, rows)
    assert cli.main(["--questions", path, "--out", str(tmp_path / "out")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("spec bench: error: --questions: ") and path in stderr and "Traceback" not in stderr
    for text in says:
        assert text in stderr


def test_a_missing_file_an_unknown_category_and_a_bad_out_exit_2(tmp_path, capsys):
    assert cli.main(["--questions", str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    path = _file(tmp_path, QUESTIONS)
    assert cli.main(["--questions", path, "--categories", "writing,coding"]) == 2
    assert "--categories: no question in 'coding'; the file has writing, math_reasoning" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert cli.main(["--questions", path, "--out", str(tmp_path / "a-file")]) == 2
    assert "--out: cannot create" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    ([], "--questions"),
    (["--limit", "0"], "--limit"),
    (["--categories", ","], "--categories"),
    (["--impl", "openai:http://127.0.0.1:1/v1"], "--impl/--reference"),
    (["--impl", "http://127.0.0.1:1/v1", "--reference", "openai:http://127.0.0.1:2/v1"], "--impl"),
    (["--impl", "openai:http://10.0.0.1:1/v1", "--reference", "openai:http://127.0.0.1:2/v1"], "loopback"),
    (["--impl", "openai:http://127.0.0.1:1/v1", "--reference", "openai:http://127.0.0.1:2/v1", "--real"], "--real"),
    (["--impl", "openai:http://127.0.0.1:1/v1", "--reference", "openai:http://127.0.0.1:2/v1", "--gamma", "4"],
     "--gamma"),
    (["--model", "m"], "--model"),
    (["--tp", "2"], "--tp"),
    (["--target", "t"], "--target/--draft"),
])
def test_bad_options_exit_2(argv, says, tmp_path, capsys):
    full = argv if not argv else ["--questions", "q.jsonl", *argv]
    assert cli.main(full) == 2
    stderr = capsys.readouterr().err
    assert says in stderr and "Traceback" not in stderr


def _subprocess(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_help_is_fast_and_says_what_each_column_means():
    proc = _subprocess("-X", "importtime", "-m", "spec", "bench", "--help")
    assert proc.returncode == 0 and "usage: spec bench" in proc.stdout
    for words in ("chat template", "tok/round", "mean accepted tokens", "Thm 3.8", "exit status", "--questions"):
        assert words in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "spec.bench.questions" in imported   # the check sees our own imports (import_module's are not logged)
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers")}


# --------------------------------------------------------------------------- over HTTP


def _served(tmp_path, impl_url, ref_url, rows=QUESTIONS, *extra):
    return _bench(tmp_path, "--questions", _file(tmp_path, rows), "--impl", f"openai:{impl_url}",
                  "--reference", f"openai:{ref_url}", "--max-new-tokens", str(N), "--quiet", *extra)


def test_served_identity_speedup_and_rounds(endpoint_server, tmp_path, capsys):
    rc, res = _served(tmp_path, endpoint_server(True).url, endpoint_server(False).url)
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "reference tok/s" in stdout and "impl tok/s" in stdout and "Thm 3.8" not in stdout
    assert res["mode"] == "served" and res["verdict"]["identical"] == 4
    for q in res["questions"]:
        assert q["ids_identical"] and q["greedy_tokens"] == q["spec_tokens"]
        assert q["tokens_per_round"] is not None and 1 <= q["tokens_per_round"] <= 5   # gamma 4: at most 5
    every = res["categories"][-1]
    assert math.isclose(every["speedup"], sum(q["greedy_s"] for q in res["questions"])
                        / sum(q["spec_s"] for q in res["questions"]))


def test_a_served_bug_is_diagnosed_and_exits_1(endpoint_server, tmp_path, capsys):
    """A proxy changes the 5th new token of every answer (inside the first accepted block): each question
    differs, the reference's logprobs call it a bug, exit 1."""
    from endpoint_proxy import Proxy
    proxy = Proxy(endpoint_server(True).url, "block-token-wrong")
    try:
        rc, res = _served(tmp_path, proxy.url, endpoint_server(False).url)
    finally:
        proxy.stop()
    stderr = capsys.readouterr().err
    assert rc == 1 and "FAIL: question 81 (line 1), writing" in stderr and "new token 4" in stderr
    assert res["verdict"]["failures"] == 4
    assert all(q["verdict"] == "bug" and q["greedy_tokens"][4] != q["spec_tokens"][4] for q in res["questions"])


def test_an_unreachable_server_exits_2(endpoint_server, tmp_path, capsys):
    rc, _ = _served(tmp_path, endpoint_server(True).url, "http://127.0.0.1:9/v1")
    assert rc == 2 and "cannot connect" in capsys.readouterr().err


SERVED_RUN = ("import sys; from spec.bench import cli; code = cli.main(sys.argv[1:]); "
              "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")


def test_a_served_run_imports_neither_torch_nor_transformers(endpoint_server, tmp_path):
    path = _file(tmp_path, QUESTIONS[:2])
    proc = _subprocess("-c", SERVED_RUN, "--questions", path, "--impl", f"openai:{endpoint_server(True).url}",
                       "--reference", f"openai:{endpoint_server(False).url}", "--max-new-tokens", "6",
                       "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "2/2" in proc.stdout
