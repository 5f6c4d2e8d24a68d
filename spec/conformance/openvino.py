"""OpenVINO GenAI (PyPI `openvino-genai`) as a decoder under test: its `LLMPipeline` on the CPU, plain
greedy and speculative (a draft model, or prompt lookup), on token-id inputs.

OpenVINO GenAI pins its own transformers and torch (through optimum-intel, which exports the model to
OpenVINO IR), so it lives in a virtual environment of its own and runs here in a child process of that
environment's python, named by SPEC_OPENVINO_PYTHON (recipes/openvino_setup.sh makes one), as the kit
runs vLLM from SPEC_VLLM_PYTHON. The child speaks JSON lines: one request a line in, one answer a line
(prefixed "@@") out.

- `python()`: (SPEC_OPENVINO_PYTHON, None) or (None, why not), for skips.
- `export(python, src, out, weight_format)`: `optimum-cli export openvino` of a transformers folder
  (fp32 for the target, int8/int4 weight compression for a draft), once: an existing export is kept.
- `Pipeline(python, target, mode=..., draft=...)`: mode "plain" (its own greedy, the reference),
  "draft" (`draft_model=`) or "lookup" (`prompt_lookup=True`). `generate(ids, n, k)` returns a `Run`:
  the new tokens (EOS ignored, exactly n), the seconds the generate call took, and the pipeline's own
  counters, which is how a check proves that drafting happened: `steps`, its generation steps (the
  length of `perf_metrics.raw_metrics.m_new_token_times`, one target pass each: n for plain greedy,
  fewer when drafts were accepted), and with a draft model `drafted` and `accepted`
  (`extended_perf_metrics`, `SDPerModelsPerfMetrics`; prompt lookup returns none, so None there).

`precision="f32"` sets INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION to f32: on a CPU with bf16
(avx512_bf16, AMX) the plugin otherwise computes in bf16 and stores the KV cache in u8, which is
OpenVINO's default but not the fp32 model the tie diagnosis recomputes. `precision=None` keeps the
plugin's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

WORKER = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    import openvino as ov
    import openvino_genai as g
    target, mode, draft, precision, threads = sys.argv[1:6]
    props = {}
    if precision != "default":
        props.update(INFERENCE_PRECISION_HINT=precision, KV_CACHE_PRECISION=precision)
    if threads != "0":
        props["INFERENCE_NUM_THREADS"] = int(threads)
    extra = {}
    if mode == "draft":
        extra["draft_model"] = g.draft_model(draft, "CPU", **props)
    elif mode == "lookup":
        extra["prompt_lookup"] = True
    pipe = g.LLMPipeline(target, "CPU", **props, **extra)
    def run(ids, n, k, ngram):
        cfg = g.GenerationConfig()
        cfg.max_new_tokens = n
        cfg.min_new_tokens = n
        cfg.ignore_eos = True
        cfg.do_sample = False
        if mode != "plain":
            cfg.num_assistant_tokens = k
        if mode == "lookup":
            cfg.max_ngram_size = ngram
        t0 = time.perf_counter()
        out = pipe.generate(ov.Tensor(np.array([ids], dtype=np.int64)), cfg)
        s = time.perf_counter() - t0
        r = {"tokens": [int(t) for t in out.tokens[0]], "s": s, "drafted": None, "accepted": None,
             "steps": len(out.perf_metrics.raw_metrics.m_new_token_times)}
        m = out.extended_perf_metrics
        if m is not None and hasattr(m, "get_num_draft_tokens"):
            r["drafted"], r["accepted"] = int(m.get_num_draft_tokens()), int(m.get_num_accepted_tokens())
        return r
    run([1, 2, 3], 2, 2, 2)
    print("@@" + json.dumps({"ready": True, "openvino_genai": g.__version__, "openvino": ov.__version__}),
          flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            print("@@" + json.dumps(run(req["ids"], req["n"], req.get("k", 5), req.get("ngram", 3))), flush=True)
        except Exception as err:
            print("@@" + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
''')


def python() -> tuple[str | None, str | None]:
    """(SPEC_OPENVINO_PYTHON, None) or (None, why OpenVINO GenAI cannot run here)."""
    path = os.environ.get("SPEC_OPENVINO_PYTHON")
    if not path:
        return None, ("SPEC_OPENVINO_PYTHON is not set (a venv with openvino-genai and optimum-intel: "
                      "recipes/openvino_setup.sh; docs/CONFORMANCE.md, OpenVINO GenAI)")
    if not Path(path).is_file():
        return None, f"SPEC_OPENVINO_PYTHON={path} is not a file"
    return path, None


def export(python: str, src: Path, out: Path, weight_format: str = "fp32") -> Path:
    """`optimum-cli export openvino` of the transformers folder `src` into `out` (kept if already there).
    int4 is group-wise with group size 64: the default 128 does not divide SmolLM2's 576-wide hidden size
    (nncf's InvalidGroupSizeError)."""
    if (out / "openvino_model.xml").exists():
        return out
    cli = Path(python).parent / "optimum-cli"
    group = ["--group-size", "64"] if weight_format == "int4" else []
    cmd = [str(cli), "export", "openvino", "--model", str(src), "--task", "text-generation-with-past",
           "--weight-format", weight_format, *group, str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "openvino_model.xml").exists():
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
    return out


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    drafted: int | None      # draft tokens offered for verification (None: the pipeline reports none)
    accepted: int | None     # of those, accepted by the target
    steps: int               # generation steps (one target pass each): n for plain greedy, fewer when
                             # drafts were accepted (the one counter prompt lookup reports)


class Pipeline:
    """One `openvino_genai.LLMPipeline` in a child process of `python`."""

    def __init__(self, python: str, target: Path, *, mode: str = "plain", draft: Path | None = None,
                 precision: str | None = "f32", threads: int = 0):
        if mode not in ("plain", "draft", "lookup"):
            raise ValueError(f"mode {mode!r}: plain, draft or lookup")
        if mode == "draft" and draft is None:
            raise ValueError("mode 'draft' needs draft=")
        self.mode = mode
        self.proc = subprocess.Popen(
            [python, "-c", WORKER, str(target), mode, str(draft or ""), precision or "default", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.versions = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                answer = json.loads(line[2:])
                if "error" in answer:
                    raise RuntimeError(f"OpenVINO GenAI ({self.mode}): {answer['error']}")
                return answer
        raise RuntimeError(f"OpenVINO GenAI worker ({self.mode}) exited (code {self.proc.wait()})")

    def generate(self, ids: list[int], n: int, k: int = 5, ngram: int = 3) -> Run:
        """n new tokens after `ids`, greedy; k draft tokens a round (draft and lookup modes)."""
        self.proc.stdin.write(json.dumps({"ids": list(ids), "n": n, "k": k, "ngram": ngram}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return Run(r["tokens"], r["s"], r["drafted"], r["accepted"], r["steps"])

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def models(python: str, draft_format: str = "int8", say=print) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct (spec.realmodel's fp32 folder) exported to OpenVINO IR once, into the cache
    beside it: (the fp32 target, a `draft_format` weight-compressed copy as the draft)."""
    from spec import realmodel
    root = realmodel.fp32_dir().parent / "openvino"
    src = realmodel.export_folder(realmodel.fp32_dir(), root / "src")
    out = []
    for fmt in ("fp32", draft_format):
        if not (root / fmt / "openvino_model.xml").exists():
            say(f"exporting {realmodel.NAME} to OpenVINO IR ({fmt}) once, into {root / fmt} (about a minute)")
        out.append(export(python, src, root / fmt, fmt))
    return out[0], out[1]
