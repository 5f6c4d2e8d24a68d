"""The prepared GPU check: run once on a machine with a CUDA GPU, within about 8 minutes.

    python recipes/gpu_check.py [--out gpu_check.json] [--budget 420] [--rehearse] [-k EXPR]

1. Prints the hardware: GPU name(s) and memory, CUDA, torch and transformers versions, the TF32
   flags, whether accelerate is there (the device-map cases need it).
2. Runs the suite's GPU cases (every test with the gpu marker: tests/perf/test_gpu_speed.py, the
   device-map splits) in one pytest session in this process, cheapest first: the pythia shapes
   with random weights (no download; the real pythia pair only where its weights are local, see
   --target/--draft in conftest.py), the device-map splits, then the real pair and the split
   target where they can run. Each case that would start after --budget seconds is skipped with
   that reason, so the run ends in time and says what it left out.
3. Writes one JSON (--out: the hardware, each case's outcome, seconds, skip or failure reason and
   the numbers it reported) after every case, so a run cut short keeps what it measured, and
   prints a short table.

--rehearse (automatic without CUDA) runs the same cases' CPU rehearsals instead (conftest.py's
gpu_device: tiny shapes, thresholds reported, not asserted): the whole script end to end in
seconds; tests/test_gpu_check.py runs it that way in the default suite. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a source checkout run as `python recipes/gpu_check.py`
    sys.path.insert(0, str(ROOT))

from spec import clock  # noqa: E402
from spec.experiment.report import machine_info  # noqa: E402

# Cheapest and most informative first: with no local pythia weights the synthetic shapes are the
# measurement; the real pair loads 47 GB and the split target needs 2+ GPUs.
ORDER = ("test_pythia_shapes_synthetic_draft_speedup", "test_a_target_split_on_gpus_decodes_exactly",
         "test_seed_experiment_speedup", "test_seed_pair_batch_sweep", "test_tensor_parallel_target_speedup")
SHOWN = ("measured_speedup", "predicted_speedup", "predicted_speedup_verify_costed", "alpha", "c", "floor")


def gpu_case_files() -> list[str]:
    """The test modules that hold GPU cases (a gpu_device parameter or a gpu marker): collecting
    only these keeps the check's start short; the Recorder then keeps only the GPU cases in them."""
    return sorted(str(p) for p in (ROOT / "tests").rglob("test_*.py")
                  if "gpu_device" in (text := p.read_text(encoding="utf-8")) or "mark.gpu" in text)


def _flag(path: str):
    """A torch.backends flag by dotted path, or None where this torch has no such flag."""
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def hardware() -> dict:
    info = machine_info("cuda" if torch.cuda.is_available() else "cpu")
    info["accelerate"] = importlib.util.find_spec("accelerate") is not None
    info["tf32"] = {"cuda.matmul.allow_tf32": _flag("cuda.matmul.allow_tf32"),
                    "cudnn.allow_tf32": _flag("cudnn.allow_tf32"),
                    "float32_matmul_precision": torch.get_float32_matmul_precision()}
    info["gpus"] = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        info["gpus"].append({"index": index, "name": props.name, "memory_gib": round(total / 2**30, 1),
                             "free_gib": round(free / 2**30, 1), "capability": f"{props.major}.{props.minor}"})
    return info


class Recorder:
    """A pytest plugin: keeps the GPU cases (or their rehearsals), orders them, skips what would
    start past the budget, and records each case's outcome and reported numbers."""

    def __init__(self, *, rehearse: bool, budget_s: float, write):
        self.rehearse, self.budget_s, self.write = rehearse, budget_s, write
        self.start = clock.now()
        self.cases: dict[str, dict] = {}

    def _wanted(self, item) -> bool:
        callspec = getattr(item, "callspec", None)
        device = callspec.params.get("gpu_device") if callspec is not None else None
        if self.rehearse:
            return device == "cpu"
        return item.get_closest_marker("gpu") is not None

    @staticmethod
    def _rank(item) -> int:
        name = item.originalname if hasattr(item, "originalname") else item.name
        return ORDER.index(name) if name in ORDER else len(ORDER)

    def pytest_collection_modifyitems(self, config, items):
        keep = sorted((i for i in items if self._wanted(i)), key=self._rank)
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep

    def pytest_runtest_setup(self, item):
        spent = clock.now() - self.start
        if spent > self.budget_s:
            pytest.skip(f"gpu_check: {spent:.0f} s spent, past the --budget of {self.budget_s:.0f} s")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        case = self.cases.setdefault(item.nodeid, {"case": item.nodeid, "outcome": None, "seconds": 0.0})
        case["seconds"] = round(case["seconds"] + report.duration, 2)
        bench = item.funcargs.get("benchmark") if hasattr(item, "funcargs") else None
        if bench is not None and getattr(bench, "extra_info", None):
            case["reported"] = dict(bench.extra_info)
        if report.capstdout:
            case["stdout_tail"] = report.capstdout[-1500:]
        if report.failed:
            case["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            case["reason"] = str(report.longrepr)[-3000:]
        elif report.skipped and case["outcome"] is None:
            case["outcome"] = "skipped"
            case["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.when == "call" and report.passed:
            case["outcome"] = "passed"
        if report.when == "teardown":
            self.write()


def table(cases: list[dict]) -> str:
    lines = [f"{'case':<66} {'outcome':<8} {'s':>7}  numbers"]
    for case in cases:
        numbers = case.get("reported", {})
        shown = " ".join(f"{k}={numbers[k]}" for k in SHOWN if numbers.get(k) is not None)
        if "sweep" in numbers:
            shown = " ".join(f"B{row['batch']}:{row['speedup']}x" for row in numbers["sweep"])
        if case["outcome"] != "passed" and case.get("reason"):
            shown = " | ".join(filter(None, [case["reason"].strip().splitlines()[-1][:100], shown]))
        name = case["case"].rsplit("/", 1)[-1].replace(".py::", "::")
        lines.append(f"{name:<66} {case['outcome'] or '?':<8} {case['seconds']:>7.1f}  {shown}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON written (default %(default)s)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which no further case starts (default %(default)s: ends within ~8 min)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the cases' CPU rehearsals instead (automatic when there is no CUDA device)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression to narrow the cases")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the run changes into the checkout
    rehearse = args.rehearse or not torch.cuda.is_available()
    info = hardware()
    print(f"gpu_check: {'REHEARSAL on CPU (no GPU numbers)' if rehearse else 'GPU run'}")
    print(json.dumps(info, indent=1))

    result = {"mode": "rehearsal" if rehearse else "gpu", "hardware": info, "budget_s": args.budget, "cases": []}

    def write():
        result["cases"] = list(recorder.cases.values())
        result["elapsed_s"] = round(clock.now() - recorder.start, 1)
        args.out.write_text(json.dumps(result, indent=1, default=str))

    recorder = Recorder(rehearse=rehearse, budget_s=args.budget, write=write)
    pytest_args = ["-p", "no:cacheprovider", "-q", "-rfEs", "--rootdir", str(ROOT), "-c", str(ROOT / "pytest.ini"),
                   "-W", "ignore::pytest.PytestAssertRewriteWarning", *gpu_case_files()]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    old_cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result["exit_status"] = int(pytest.main(pytest_args, plugins=[recorder]))
    finally:
        os.chdir(old_cwd)
    write()
    print("\n" + table(result["cases"]))
    print(f"\ngpu_check: exit {result['exit_status']}, {result['elapsed_s']} s; wrote {args.out.resolve()}")
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
