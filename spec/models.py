"""Getting models: real checkpoints offline, and GPT-NeoX models built from config.

Real weights are loaded with `from_pretrained` from a local folder or the local
hub cache only (nothing is downloaded). For tests and timing where no weights
exist, `build_gpt_neox` makes a GPT-NeoX of a Pythia shape (or a scaled-down
one) from config with seeded random weights.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

from spec import hf
from spec.validate import check_pair

SHIPPED_PAIR = Path(str(resources.files("spec") / "assets" / "pair"))

# Pythia: one 50277-token tokenizer, embeddings padded to different widths.
PYTHIA_TOKENIZER_SIZE = 50277
SHAPES = {
    "pythia-12b": dict(hidden_size=5120, num_hidden_layers=36, num_attention_heads=40,
                       intermediate_size=20480, vocab_size=50688),
    "pythia-410m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, vocab_size=50304),
    # Scaled down, same family, logit widths differing the way the real pair's do:
    # a 500-token "tokenizer", draft padded to 512 rows, target to 640.
    "tiny-target": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=256, vocab_size=640),
    "tiny-draft": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=128, vocab_size=512),
}
TINY_TOKENIZER_SIZE = 500


def gpt_neox_config(shape: str | dict, **overrides) -> GPTNeoXConfig:
    dims = dict(rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
                max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    dims.update(SHAPES[shape] if isinstance(shape, str) else shape)
    dims.update(overrides)
    return GPTNeoXConfig(**dims)


def build_gpt_neox(shape: str | dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", **overrides) -> GPTNeoXForCausalLM:
    """A GPT-NeoX with seeded random weights, built directly on `device` in `dtype`."""
    config = gpt_neox_config(shape, **overrides)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype) if dtype.is_floating_point and dtype != torch.bfloat16 \
            and dtype != torch.float16 else None
        with torch.device(device):
            model = GPTNeoXForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def perturbed_copy(model, *, noise: float, seed: int = 0, dtype: torch.dtype | None = None):
    """A draft derived from `model`: the same weights plus seeded Gaussian noise
    (relative to each tensor's std), so that it agrees with the model only partly."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p) * noise * p.float().std())
    return draft.to(dtype) if dtype is not None else draft


def truncated_copy(model, *, num_layers: int, dtype: torch.dtype | None = None):
    """A draft derived from `model` by keeping its first `num_layers` layers."""
    draft = copy.deepcopy(model)
    draft.gpt_neox.layers = draft.gpt_neox.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft.to(dtype) if dtype is not None else draft


@dataclass
class Pair:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any           # a transformers tokenizer, or None


GGUF_HINT = "pip install 'spec[gguf]' (the gguf and accelerate packages)"


def _gguf(name_or_path: str) -> tuple[str, str] | None:
    """(folder, file name) for a path to a .gguf file, else None."""
    if not str(name_or_path).lower().endswith(".gguf"):
        return None
    path = Path(name_or_path).expanduser()
    return str(path.parent), path.name


def looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id ("org/name"): what a missing one should be called."""
    text = str(name_or_path)
    return (text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf") or text.count("/") > 1
            or "\\" in text or os.sep != "/" and os.sep in text)


def _check_gguf_support(role: str, name_or_path: str) -> None:
    from importlib.util import find_spec
    missing = [m for m in ("gguf", "accelerate") if find_spec(m) is None]
    if missing:
        raise ImportError(f"{role}: {name_or_path!r} is a GGUF file; reading it needs the "
                          f"{' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: {GGUF_HINT}")


def _check_tp(role: str, name_or_path: str, tp_size: int, config) -> None:
    """A tensor-parallel load needs torchrun's process group and a plan transformers has for the model."""
    if _gguf(name_or_path):
        raise ValueError(f"{role}: tp_size={tp_size}: a GGUF file cannot be loaded split; convert it to a folder")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < tp_size or world % tp_size:
        raise ValueError(f"{role}: tp_size={tp_size} needs {tp_size} processes (a multiple of it) started by "
                         f"`torchrun --nproc-per-node {tp_size}`; this process group has {world} (WORLD_SIZE)")
    if not hf.has_tp_plan(config):
        raise ValueError(f"{role}: {getattr(config, 'model_type', '?')!r} models cannot be split with "
                         f"tp_size={tp_size}: transformers has no tensor-parallel plan for them (no "
                         f"base_model_tp_plan in the config); load it whole, or across devices with a device_map")


def _load(name_or_path: str, role: str, dtype: torch.dtype, device: str, tp_size: int | None = None):
    local = Path(name_or_path).expanduser()
    if not local.exists() and looks_local(name_or_path):
        raise FileNotFoundError(f"{role}: no weights for {name_or_path!r} on this machine: no such "
                                f"{'GGUF file' if _gguf(name_or_path) else 'file or folder'} ({str(local)!r} "
                                f"does not exist)")
    if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1):
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    tp = tp_size if tp_size is not None and tp_size > 1 else None     # the processes to split over
    if tp and _gguf(name_or_path):
        _check_tp(role, name_or_path, tp, None)
    gguf = _gguf(name_or_path)
    if gguf is not None:
        _check_gguf_support(role, name_or_path)
        try:  # GGUF weights are dequantized to `dtype` as they load (about 20 s for a 135M model)
            model = AutoModelForCausalLM.from_pretrained(gguf[0], gguf_file=gguf[1], dtype=dtype,
                                                         local_files_only=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"{role}: cannot load the GGUF file {str(local)!r}: {type(err).__name__}: {err}") \
                from None
        return model.to(device).eval()
    source = str(local) if local.exists() else name_or_path
    try:
        auto = AutoModelForCausalLM
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        if getattr(config, "is_encoder_decoder", False):  # T5, BART, Whisper, ...: spec.seq2seq
            from spec.seq2seq import auto_class
            auto = auto_class(config)
        if tp:  # split over the torchrun group (spec.parallel); each rank holds its share of every layer
            _check_tp(role, name_or_path, tp, config)
            return auto.from_pretrained(source, dtype=dtype, local_files_only=True,
                                        **hf.tensor_parallel_kwargs(tp)).eval()
        model = auto.from_pretrained(source, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        if tp and isinstance(err, ValueError):  # ours (_check_tp) as it is; transformers' with the role
            raise (err if str(err).startswith(f"{role}: ") else
                   ValueError(f"{role}: cannot split {source!r} over {tp_size} processes: {err}")) from None
        if local.exists():
            raise FileNotFoundError(
                f"{role}: {str(local)!r} holds no loadable model (no weights found): a folder needs config.json "
                f"and weights "
                f"(*.safetensors or pytorch_model.bin), or pass a .gguf file. ({type(err).__name__}: {err})"
            ) from None
        raise FileNotFoundError(
            f"{role}: no weights for {name_or_path!r} on this machine: it is no local path, and no hub id "
            f"in the local cache. spec loads offline only: pass a local folder with config.json and weights "
            f"or a .gguf file, or fetch the hub id into the cache on a connected machine "
            f"(e.g. `hf download {name_or_path}`) and copy the cache here. ({type(err).__name__}: {err})"
        ) from None
    return model.to(device).eval()


def _tokenizer(name_or_path: str):
    gguf = _gguf(name_or_path)
    if gguf is not None:
        try:
            return AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1], local_files_only=True)
        except (OSError, ValueError):
            return None
    local = Path(name_or_path).expanduser()
    if local.is_dir() and not any((local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None  # a weights-only folder: AutoTokenizer would hand back an empty tokenizer
    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None


def load_model(name_or_path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
               role: str = "model", tp_size: int | None = None):
    """One model and its tokenizer (None if it has none), offline: a local folder, a .gguf file
    or a cached hub id. For a target alone, e.g. with the model-free spec.PromptLookup draft.

    tp_size=N (under `torchrun --nproc-per-node N`): the model split over the N processes by
    transformers' tensor parallelism (spec.parallel); each rank gets its share, on the rank's device."""
    name_or_path = str(name_or_path)
    return _load(name_or_path, role, dtype, str(device), tp_size), _tokenizer(name_or_path)


def encode_prompt(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of `text`; chat=True wraps it as one user turn in the tokenizer's chat
    template, ending where the assistant's answer begins."""
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True: this tokenizer has no chat template (an instruction-tuned model's has one)")
    wrapped = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
    return list(tokenizer.encode(wrapped, add_special_tokens=False))


def load_pair(target: str | os.PathLike = SHIPPED_PAIR / "target", draft: str | os.PathLike = SHIPPED_PAIR / "draft",
              *, device: str = "cpu", target_dtype: torch.dtype = torch.float32,
              draft_dtype: torch.dtype = torch.float32, tp_size: int | None = None) -> Pair:
    """Load a target/draft pair offline from local folders, .gguf files (dequantized to the
    dtype; needs the `gguf` extra) or cached hub ids.

    TF32 is turned off when the target is fp32 on CUDA: TF32 rounding flips
    near-tie argmaxes between the one-token and the block-verify matmul shapes.

    tp_size=N (under `torchrun --nproc-per-node N`): the target is split over the N processes by
    tensor parallelism, the draft replicated whole on every rank, on the rank's device (spec.parallel)."""
    target, draft = str(target), str(draft)
    device = str(device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this machine")
        if target_dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    elif device not in ("cpu", "mps") and not device.startswith("xpu"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    loaded = _load(target, "target", target_dtype, device, tp_size)
    # A split target's shard lies on its rank's device (cuda:LOCAL_RANK); the draft goes beside it.
    pair = Pair(loaded, _load(draft, "draft", draft_dtype, str(next(loaded.parameters()).device)), _tokenizer(target))
    check_pair(pair.target, pair.draft)
    draft_tok = _tokenizer(draft)
    if pair.tokenizer is not None and draft_tok is not None and pair.tokenizer.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"target and draft cannot share a tokenizer: {target!r} and {draft!r} have different vocabularies")
    return pair
