"""The one place where a model becomes a Runner or a Drafter (spec.protocols).

`runs(roles, input_ids, ...)` takes the models by role, in Hugging Face generate's input
conventions, and returns the decode loop's prompt and one object per role:

  "target", "model"  a Runner. Decoder-only: the path spec.runner's probe found for the model
                     (kv-cache, state-snapshot, state-stepwise, recompute). Encoder-decoder: the
                     decoder over its encoder's output (spec.seq2seq.Decoder).
  "draft"            a Drafter. A model becomes a spec.draft.ModelDraft over a Runner chosen by
                     draft_impl: "plain" (spec.neox, GPT-NeoX only), "hf" (the probed path; a
                     draft no cached path reproduces runs by recompute, since a draft cannot
                     change the output), "compiled" (hf.Cached on a StaticCache), "auto" ("plain"
                     where it applies, else "hf"). An object that already is a Drafter (no model:
                     spec.lookup.PromptLookup, or any other source) is used as it is.

decode, measure and diagnose all open their models here, so a new runner path is one class
plus one line below, and a new draft source needs nothing here at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from spec import batch, hf, neox, parallel, runner, seq2seq
from spec.draft import ModelDraft, Pick
from spec.protocols import Drafter
from spec.validate import as_prompt, check_model, check_pair, model_device

DRAFT_IMPLS = ("auto", "plain", "hf", "compiled")
UNCACHED = "recompute (uncached)"   # a draft no cached path reproduces: run by recompute all the same


@dataclass
class Chosen:
    prompt: torch.Tensor    # 1-D LongTensor: the decoder prompt (decoder-only: the input ids)
    runs: list              # one per role, in the roles' order: a Runner, or a Drafter for "draft"
    models: dict            # the roles that are models (not model-free drafters), by role


def is_drafter(obj) -> bool:
    """A draft source that is not a model (spec.lookup.PromptLookup and the like)."""
    return isinstance(obj, Drafter) and not isinstance(obj, torch.nn.Module)


def models_of(roles: dict) -> dict:
    """The roles that are models (not model-free drafters)."""
    return {role: m for role, m in roles.items() if not is_drafter(m)}


def runs(roles: dict, input_ids=None, *, input_features=None, decoder_input_ids=None, share_encoder: bool = False,
         max_new_tokens: int | None = None, room: int = 0, draft_impl: str = "auto", pick: Pick = Pick()) -> Chosen:
    """The prompt and a Runner or Drafter for each role (see the module docstring). room: the
    positions past the prompt the loop may hold (sizes the plain and compiled drafts' buffers);
    max_new_tokens: where an encoder-decoder's forced EOS goes; pick: how a model draft picks.
    The models are not checked here: callers that take them from a user call `check` first."""
    models = models_of(roles)
    if any(seq2seq.is_encoder_decoder(m) for m in models.values()):
        if "draft" in models:
            seq2seq.check_draft_impl(draft_impl)   # the decoder runs its own forward
        prompt, encoded, masks = seq2seq.prepare(models, input_ids, input_features=input_features,
                                                 decoder_input_ids=decoder_input_ids, share_encoder=share_encoder,
                                                 max_new_tokens=max_new_tokens)
        made = {role: seq2seq.Decoder(m, out, masks) for (role, m), out in zip(models.items(), encoded)}
    else:
        seq2seq.refuse_inputs(input_features, decoder_input_ids, share_encoder)
        prompt = as_prompt(input_ids, model_device(next(iter(models.values()))), models)
        made = {}
        for role, model in models.items():
            path, positions = _path(model, role, draft_impl)
            if path == "plain":
                made[role] = neox.NeoXDraft(model, prompt.numel() + room)
            elif path == "compiled":
                made[role] = hf.Cached(model, static_len=prompt.numel() + room)
            else:
                made[role] = runner.RUNNERS["recompute" if path == UNCACHED else path](model, positions)
    if "draft" in made:
        made["draft"] = ModelDraft(made["draft"], pick, **_widths(models))
    return Chosen(prompt, [made.get(role, obj) for role, obj in roles.items()], models)


def batch_runs(roles: dict, input_ids, attention_mask=None, *, draft_impl: str = "auto",
               pick: Pick = Pick()) -> Chosen:
    """The batched form of `runs` (spec.batch): each row's prompt (a list); for each model a
    spec.batch.Rows where its solo path can share a left-padded cache, else a spec.batch.EachRunner
    (its rows run one after another, exact); for the draft, a spec.batch.ModelRows over those, or a
    spec.batch.EachRow for a model-free drafter. Refuses, with the reason, what cannot be batched."""
    models = models_of(roles)
    for role, model in models.items():
        if seq2seq.is_encoder_decoder(model):
            raise runner.UnsupportedModelError(f"{role}: {type(model).__name__} is an encoder-decoder model; spec "
                                               f"decodes those one prompt at a time (batches are decoder-only)")
        if parallel.is_split(model):
            raise ValueError(f"{role}: a batch of prompts needs a model whole on one device; this one is split "
                             f"({parallel.describe(model)})")
    if "draft" in models and draft_impl not in ("auto", "hf"):
        raise ValueError(f"draft_impl={draft_impl!r}: a batch runs the draft on its own forward, over a "
                         f"left-padded cache; use draft_impl='hf' or 'auto'")
    prompts = batch.prompts(input_ids, attention_mask, model_device(next(iter(models.values()))), models)
    made = {role: _rows(model, role, len(prompts)) for role, model in models.items()}
    if "draft" in made:
        made["draft"] = batch.ModelRows(made["draft"], pick, [p.numel() for p in prompts], **_widths(models))
    elif "draft" in roles:
        made["draft"] = batch.EachRow(roles["draft"], len(prompts))
    return Chosen(prompts, [made[role] for role in roles], models)


def _rows(model, role: str, rows: int):
    """spec.batch.Rows where the model's solo path can share a left-padded cache across rows, else
    one solo Runner per row (spec.batch.EachRunner, with the reason)."""
    path, positions = _path(model, role, "hf")
    why = batch.unbatched(model, path, positions)
    if why is None:
        return batch.Rows(model, rows)
    return batch.EachRunner([runner.RUNNERS[path](model, positions) for _ in range(rows)], why)


def check(roles: dict) -> None:
    """The models among `roles` are Hugging Face LMs spec can run, and a target and a draft model
    can share a tokenizer and a device (spec.validate); a model-free drafter needs no check."""
    models = models_of(roles)
    if "draft" in models and len(models) > 1:
        check_pair(models["target"], models["draft"])
    else:
        for role, model in models.items():
            check_model(model, role)


def path(model, role: str = "target", draft_impl: str = "auto") -> str:
    """The way `runs` runs `model` in `role`, named for reports: "encoder-decoder", "plain",
    "compiled", a spec.runner path, or UNCACHED; raises what `runs` would raise."""
    if seq2seq.is_encoder_decoder(model):
        return "encoder-decoder"
    return _path(model, role, draft_impl)[0]


def _path(model, role: str, impl: str) -> tuple[str, str]:
    """(how `model` runs in this role, how it counts positions): "plain", "compiled", a
    spec.runner path, or UNCACHED."""
    if role != "draft":
        try:
            return runner.verdict(model)
        except runner.UnsupportedModelError as e:
            raise runner.UnsupportedModelError(f"{role}: {e}", e.runs_uncached) from None
    if impl not in DRAFT_IMPLS:
        raise ValueError(f"draft_impl must be one of {', '.join(map(repr, DRAFT_IMPLS))}, got {impl!r}")
    parallel.check_draft(model, impl)
    if impl == "plain" or (impl == "auto" and neox.supports(model) and not parallel.is_split(model)):
        return "plain", "explicit"
    if impl == "compiled":
        return "compiled", "explicit"
    if not isinstance(model, PreTrainedModel):   # a wrapper (a synthetic draft): run unprobed
        return "kv-cache", "explicit"
    try:
        return runner.verdict(model)
    except runner.UnsupportedModelError as e:
        if e.runs_uncached:   # a draft cannot change the output, only its speed
            return UNCACHED, "own"
        raise runner.UnsupportedModelError(f"{role}: {e}", e.runs_uncached) from None


def _widths(models: dict) -> dict:
    """The ids a draft model may propose: those the target can score and the draft can embed
    again; and whether the target can emit ids the draft cannot embed (fed a stand-in)."""
    draft, target = models["draft"], models.get("target", models["draft"])
    rows = hf.vocab_rows(draft)
    return dict(width=min(hf.logit_width(draft), hf.logit_width(target), rows), rows=rows,
                clamp=hf.logit_width(target) > rows)
