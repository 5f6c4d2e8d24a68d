"""Argument checks shared by the decoders: every error names the argument and what was expected."""

from __future__ import annotations

import torch

from spec import hf
from spec.options import GammaMode
from spec.runner import UnsupportedModelError, unembeddable_head, unsupported_head

# Pythia pads its embeddings to different widths (pythia-410m 50304 rows, pythia-12b 50688
# for one 50277-token tokenizer). Widths further apart than this are different vocabularies.
MAX_PADDING_GAP = 1024


def check_model(model, name: str) -> None:
    if name == "draft" and callable(getattr(model, "draft", None)) and not hasattr(model, "config"):
        missing = [m for m in ("needs", "layers", "begin", "observe", "process", "__len__") if not hasattr(model, m)]
        raise TypeError(f"draft: {type(model).__name__} has a `draft` method but not {', '.join(map(repr, missing))} "
                        f"of the Drafter protocol (spec.protocols); subclass spec.DraftSource, which has them all "
                        f"(`needs = frozenset()`, `layers = (-1,)`, a `process(step)` that does nothing), or "
                        f"declare them")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"{name} must be a Hugging Face causal LM (a torch.nn.Module with a config), "
                        f"got {type(model).__name__}")
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise TypeError(f"{name} must have a causal-LM head (e.g. AutoModelForCausalLM); "
                        f"{type(model).__name__} has no output embeddings")
    why = unsupported_head(model)
    if why is None and name != "draft":
        why = unembeddable_head(model)
    if why is not None:
        raise UnsupportedModelError(f"{name}: {type(model).__name__} cannot be decoded exactly by spec: {why}")


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def check_pair(target, draft) -> None:
    """Same device, and a tokenizer they can share (special ids agree, widths differ only by padding)."""
    check_model(target, "target")
    check_model(draft, "draft")
    td, dd = model_device(target), model_device(draft)
    if td != dd:
        raise ValueError(f"target and draft must be on the same device, got target on {td} and draft on {dd}")
    for key in ("bos_token_id", "eos_token_id"):
        t, d = getattr(target.config, key, None), getattr(draft.config, key, None)
        if t is not None and d is not None and t != d:
            raise ValueError(f"target and draft cannot share a tokenizer: config.{key} is {t} for the target "
                             f"and {d} for the draft")
    tw, dw = hf.logit_width(target), hf.logit_width(draft)
    if abs(tw - dw) > MAX_PADDING_GAP:
        raise ValueError(f"target and draft cannot share a tokenizer: logit widths {tw} and {dw} differ by more "
                         f"than embedding padding ({MAX_PADDING_GAP})")


def as_prompt(input_ids, device: torch.device, models: dict, arg: str = "input_ids") -> torch.Tensor:
    """A 1-D LongTensor on `device` from a list of ints, a 1-D tensor or a (1, n) tensor, every id
    one each of `models` can embed; errors name `arg` (input_ids, decoder_input_ids, ...)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype in (torch.bool,) or input_ids.dtype.is_floating_point or input_ids.is_complex():
            raise TypeError(f"{arg} must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"{arg} must be 1-D or (1, n): batch size {input_ids.shape[0]} is not supported")
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"{arg} must be 1-D or (1, n), got shape {tuple(input_ids.shape)}")
        ids = input_ids.reshape(-1).to(device=device, dtype=torch.long)
    elif isinstance(input_ids, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise TypeError(f"{arg} as a list must hold ints only")
        ids = torch.tensor(list(input_ids), dtype=torch.long, device=device)
    else:
        raise TypeError(f"{arg} must be a LongTensor or a list of ints, got {type(input_ids).__name__}")
    if ids.numel() == 0:
        raise ValueError(f"{arg} is empty: the prompt needs at least one token")
    check_ids_fit(ids, arg, models)
    return ids


def check_ids_fit(ids: torch.Tensor, arg: str, models: dict) -> None:
    """Every id in `ids` is a row of each model's input embedding."""
    lo, hi = int(ids.min()), int(ids.max())
    for name, model in models.items():
        rows = hf.vocab_rows(model)
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{arg} holds token id {bad}, outside the {name}'s vocabulary [0, {rows})")


def stop_ids(eos_token_id, models: dict) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if isinstance(ids, (list, tuple, set, frozenset)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        width = min(hf.logit_width(m) for m in models.values())
        for t in ids:
            if not 0 <= t < width:
                raise ValueError(f"eos_token_id {t} is outside the vocabulary [0, {width})")
        return frozenset(ids)
    raise TypeError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}")


def check_options(*, max_new_tokens, gamma=None, temperature=1.0, top_k=None, top_p=None, min_p=None) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if gamma is not None and gamma != GammaMode.AUTO and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
        raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1):
        raise ValueError(f"min_p must be None or a number in [0, 1], got {min_p!r}")


def position_limit(model) -> int | None:
    """The longest sequence `model` is configured for (config.max_position_embeddings), if it says."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(prompt_len: int, max_new_tokens: int, models: dict) -> None:
    """Refuse a prompt that, with max_new_tokens, runs past a model's position limit: past
    it, position embeddings are out of range or never trained, and the output is wrong."""
    for name, model in models.items():
        limit = position_limit(model)
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{prompt_len + max_new_tokens} positions exceeds the {name}'s limit of {limit} "
                             f"(config.max_position_embeddings); shorten the prompt or lower max_new_tokens")
