"""recipes/gpu_check.py, the prepared GPU check, run end to end in rehearsal (on CPU, tiny shapes):
the hardware it prints, the cases it picks and orders, the JSON and the table it writes. Two
rehearsals are left to tests/perf/test_gpu_speed.py, to keep this cheap: the tensor-parallel one
(two torchrun ranks, ~15 s) and the seed experiment (the batch sweep runs the same real-pair fixture)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpu_check.py"
REHEARSED = {"test_pythia_shapes_synthetic_draft_speedup[rehearsal]",
             "test_a_target_split_on_gpus_decodes_exactly[rehearsal-two-gpus]",
             "test_a_target_split_on_gpus_decodes_exactly[rehearsal-cpu-offload]",
             "test_seed_pair_batch_sweep[rehearsal]"}
LEFT_OUT = "not tensor_parallel and not seed_experiment"


def _recipe():
    spec = importlib.util.spec_from_file_location("gpu_check", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    pytest.importorskip("accelerate", reason="the device-map cases need accelerate (the gguf extra)")
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(RECIPE), "--rehearse", "-k", LEFT_OUT, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_gpu_check_runs_every_rehearsal_and_writes_its_report(rehearsed):
    result, stdout = rehearsed
    assert result["mode"] == "rehearsal" and result["exit_status"] == 0
    hw = result["hardware"]
    assert hw["torch"] and hw["transformers"] and "cuda.matmul.allow_tf32" in hw["tf32"] and hw["gpus"] == []
    cases = {c["case"].rsplit("::", 1)[-1]: c for c in result["cases"]}
    assert set(cases) == REHEARSED
    assert all(c["outcome"] == "passed" for c in cases.values()), cases
    # Cheapest first: the synthetic shapes are what a GPU without the pythia weights measures.
    assert result["cases"][0]["case"].endswith("test_pythia_shapes_synthetic_draft_speedup[rehearsal]")
    numbers = cases["test_pythia_shapes_synthetic_draft_speedup[rehearsal]"]["reported"]
    assert numbers["rehearsal"] is True and numbers["measured_speedup"] > 0 and numbers["predicted_speedup"] > 0
    assert isinstance(numbers["gate_problems"], list)
    assert [row["batch"] for row in cases["test_seed_pair_batch_sweep[rehearsal]"]["reported"]["sweep"]] == [1, 2]
    assert "REHEARSAL on CPU" in stdout and "test_seed_pair_batch_sweep[rehearsal]" in stdout.split("outcome")[-1]


def test_a_case_that_would_start_past_the_budget_is_skipped_with_the_reason():
    recorder = _recipe().Recorder(rehearse=True, budget_s=-1.0, write=lambda: None)
    with pytest.raises(pytest.skip.Exception, match=r"gpu_check: .* past the --budget of -1 s"):
        recorder.pytest_runtest_setup(item=None)


def test_the_table_gives_a_skipped_or_failed_case_its_reason_beside_its_numbers():
    rows = _recipe().table([
        {"case": "tests/perf/test_gpu_speed.py::test_seed_experiment_speedup[gpu]", "outcome": "skipped",
         "seconds": 1.0, "reason": "no local weights for the real pair: pythia-12b"},
        {"case": "tests/perf/test_gpu_speed.py::test_pythia_shapes_synthetic_draft_speedup[gpu]", "outcome": "failed",
         "seconds": 90.0, "reason": "Traceback ...\nAssertionError: speedup 0.70x below the floor 0.8x",
         "reported": {"measured_speedup": 0.7, "alpha": 0.8}},
    ]).splitlines()
    assert rows[1].startswith("test_gpu_speed::test_seed_experiment_speedup[gpu]") and "skipped" in rows[1]
    assert rows[1].endswith("no local weights for the real pair: pythia-12b")
    assert rows[2].endswith("AssertionError: speedup 0.70x below the floor 0.8x | measured_speedup=0.7 alpha=0.8")


CASES_BY_MARKER = """
import pytest


@pytest.mark.gpu
def test_marked_with_no_gpu_in_its_name():
    pass


@pytest.mark.parametrize("gpu_device", [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda0"),
                                        pytest.param("cpu", id="gpu")])
def test_device(gpu_device):        # [cuda0] is marked; [gpu] is only named so
    pass


@pytest.mark.parametrize("gpu_device", ["cuda"], ids=["gpu"])
def test_on_cuda_and_named_gpu_but_unmarked(gpu_device):
    pass


def test_plain():
    pass
"""


def test_on_a_gpu_machine_the_cases_are_the_gpu_marked_ones_whatever_their_ids(pytester):
    """With CUDA (rehearse=False) the recipe runs what `pytest -m gpu` selects: a case carrying the gpu
    marker, whatever its id or parameters, and no case that only has "gpu" in its id or a cuda
    gpu_device parameter. Collected here on any machine, no GPU needed."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    pytester.makepyfile(test_cases=CASES_BY_MARKER)
    marked = ["test_marked_with_no_gpu_in_its_name", "test_device[cuda0]"]
    by_marker = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", "-m", "gpu")
    assert [i.name for i in by_marker.getcalls("pytest_collection_finish")[0].session.items] == marked
    recorder = _recipe().Recorder(rehearse=False, budget_s=1e9, write=lambda: None)
    picked = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", plugins=[recorder])
    assert [i.name for i in picked.getcalls("pytest_collection_finish")[0].session.items] == marked
