"""The one place where a model becomes a Runner or a Drafter (spec.protocols).

`runs(roles, input_ids, ...)` takes the models by role, in Hugging Face generate's input
conventions, and returns one sequence's prompt and one object per role:

  a model            a Runner. Decoder-only target: the path spec.runner's probe found for the
                     model (kv-cache, state-snapshot, state-stepwise, recompute). A draft: the
                     path draft_impl names: "plain" (spec.neox, GPT-NeoX only), "hf" (the probed
                     path; a draft no cached path reproduces runs by recompute, since a draft
                     cannot change the output), "compiled" (hf.Cached on a StaticCache), "auto"
                     ("plain" where it applies, else "hf"). Encoder-decoder: the decoder over its
                     encoder's output (spec.seq2seq.Decoder).
  a draft source     an object that is a Drafter and not a model (spec.lookup.PromptLookup, or a
                     user's) is used as it is.

`rows(roles, input_ids, ...)` is what the decode loop runs on, for one prompt or a batch (rows
are the unit: a single prompt is a batch of one): each row's prompt, a BatchRunner per model
(spec.batch.Rows, one shared left-padded cache, where the model passes spec.batch's probe;
else spec.batch.EachRunner, one Runner from `runs` per row), and for the draft a BatchDrafter:
spec.draft.ModelDraft over the draft model's BatchRunner, or spec.batch.EachRow over a
model-free Drafter. measure and diagnose take single Runners from `runs`.

A new runner path is one class plus one line below; a new draft source needs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from spec import batch, hf, neox, parallel, runner, seq2seq
from spec.draft import ModelDraft, NoDraft, Pick
from spec.options import DraftImpl, Positions, RunnerPath
from spec.protocols import BatchDrafter, BatchRunner, Drafter, Need, Runner
from spec.validate import as_prompt, check_model, check_pair, model_device

DRAFT_IMPLS = tuple(DraftImpl)
UNCACHED = "recompute (uncached)"   # a draft no cached path reproduces: run by recompute all the same


@dataclass
class Chosen:
    prompt: torch.Tensor    # 1-D LongTensor: the decoder prompt (decoder-only: the input ids)
    runs: list              # one per role, in the roles' order: a Runner, or the draft source as given
    models: dict            # the roles that are models (not model-free drafters), by role


@dataclass
class ChosenRows:
    prompts: list[torch.Tensor]     # each row's decoder prompt, 1-D LongTensors
    target: BatchRunner             # the model that decides every token ("target", or greedy's "model")
    drafter: BatchDrafter           # ModelDraft, EachRow over a model-free Drafter, or NoDraft
    models: dict                    # the roles that are models, by role
    batched: bool                   # the input was a batch (a list of results is returned), not one prompt


def is_drafter(obj) -> bool:
    """A draft source that keeps the Drafter protocol (spec.lookup.PromptLookup, or a user's,
    a torch module included); anything else in the draft role is a draft model."""
    return isinstance(obj, Drafter)


def needs_of(draft) -> frozenset[Need]:
    """What a model-free drafter declared it needs (spec.protocols.Need); a draft model or None
    needs nothing."""
    return draft.needs if is_drafter(draft) else frozenset()


def models_of(roles: dict) -> dict:
    """The roles that are models (not model-free drafters)."""
    return {role: m for role, m in roles.items() if not is_drafter(m)}


def runs(roles: dict, input_ids=None, *, input_features=None, decoder_input_ids=None, share_encoder: bool = False,
         max_new_tokens: int | None = None, room: int = 0, draft_impl: str = "auto") -> Chosen:
    """One sequence's prompt and a Runner for each model role (a model-free drafter as it is; see
    the module docstring). room: the positions past the prompt the loop may hold (sizes the plain
    and compiled drafts' buffers); max_new_tokens: where an encoder-decoder's forced EOS goes.
    The models are not checked here: callers that take them from a user call `check` first."""
    models = models_of(roles)
    if any(seq2seq.is_encoder_decoder(m) for m in models.values()):
        if "draft" in models:
            seq2seq.check_draft_impl(draft_impl)   # the decoder runs its own forward
        prompt, encoded, masks = seq2seq.prepare(models, input_ids, input_features=input_features,
                                                 decoder_input_ids=decoder_input_ids, share_encoder=share_encoder,
                                                 max_new_tokens=max_new_tokens)
        made: dict[str, Runner] = {role: seq2seq.Decoder(m, out, masks)
                                   for (role, m), out in zip(models.items(), encoded)}
    else:
        seq2seq.refuse_inputs(input_features, decoder_input_ids, share_encoder)
        prompt = as_prompt(input_ids, model_device(next(iter(models.values()))), models)
        made = {}
        for role, model in models.items():
            path, positions = _path(model, role, draft_impl)
            if path is DraftImpl.PLAIN:
                made[role] = neox.NeoXDraft(model, prompt.numel() + room)
            elif path is DraftImpl.COMPILED:
                made[role] = hf.Cached(model, static_len=prompt.numel() + room)
            else:
                made[role] = runner.RUNNERS[RunnerPath.RECOMPUTE if path == UNCACHED else RunnerPath(path)](model,
                                                                                                     positions)
    return Chosen(prompt, [made.get(role, obj) for role, obj in roles.items()], models)


def rows(roles: dict, input_ids, attention_mask=None, *, input_features=None, decoder_input_ids=None,
         share_encoder: bool = False, max_new_tokens: int | None = None, room: int = 0, draft_impl: str = "auto",
         picks: list[Pick] | None = None) -> ChosenRows:
    """What the decode loop runs on (see the module docstring): roles are the deciding model's
    ("target", or greedy's "model") and "draft", a model, a model-free Drafter, or None for plain
    decoding (NoDraft); picks: each row's (a draft model follows its row's). Refuses, with the
    reason, what cannot be batched."""
    models = models_of({role: m for role, m in roles.items() if m is not None})
    batched = batch.is_batch(input_ids, attention_mask)
    made: dict[str, BatchRunner]
    if not batched:
        one = runs(models, input_ids, input_features=input_features, decoder_input_ids=decoder_input_ids,
                   share_encoder=share_encoder, max_new_tokens=max_new_tokens, room=room, draft_impl=draft_impl)
        prompts, made = [one.prompt], {role: batch.EachRunner([run]) for role, run in zip(models, one.runs)}
    else:
        _refuse_batch(models, draft_impl, input_features=input_features, decoder_input_ids=decoder_input_ids,
                      share_encoder=share_encoder)
        prompts = batch.prompts(input_ids, attention_mask, model_device(next(iter(models.values()))), models)
        made = {role: _rows(model, role, len(prompts), needs_of(roles.get("draft"))) for role, model in models.items()}
    drafter: BatchDrafter
    if "draft" in made:
        drafter = ModelDraft(made["draft"], picks or [Pick()] * len(prompts), [p.numel() for p in prompts],
                             **_widths(models))
    elif roles.get("draft") is not None:
        drafter = batch.EachRow(roles["draft"], len(prompts), hf.logit_width(models[next(iter(roles))]))
    else:
        drafter = NoDraft()
    target = made[next(iter(roles))]
    if Need.HIDDEN in needs_of(roles.get("draft")) and isinstance(target, batch.EachRunner):   # (`_rows` gives one)
        target.collect_hidden(roles["draft"].layers)     # each Pass then carries the rows' states there
    return ChosenRows(prompts, target, drafter, models, batched)


def _refuse_batch(models: dict, draft_impl: str, *, share_encoder: bool, **encoder_inputs) -> None:
    for name, value in encoder_inputs.items():
        if value is not None:
            raise ValueError(f"{name}: a batch of prompts is decoded by decoder-only models; encoder-decoder "
                             f"inputs go one prompt at a time")
    if share_encoder:
        raise ValueError("share_encoder=True is for an encoder-decoder pair, which decodes one prompt at a time")
    for role, model in models.items():
        if seq2seq.is_encoder_decoder(model):
            raise runner.UnsupportedModelError(f"{role}: {type(model).__name__} is an encoder-decoder model; spec "
                                               f"decodes those one prompt at a time (batches are decoder-only)")
        if parallel.is_split(model):
            raise ValueError(f"{role}: a batch of prompts needs a model whole on one device; this one is split "
                             f"({parallel.describe(model)})")
    if "draft" in models and not DraftImpl(draft_impl).batches:
        raise ValueError(f"draft_impl={draft_impl!r}: a batch runs the draft on its own forward, over a "
                         f"left-padded cache; use draft_impl='hf' or 'auto'")


def _rows(model, role: str, count: int, own: frozenset[Need] = frozenset()):
    """spec.batch.Rows where the model's solo path can share a left-padded cache across `count`
    rows, else one solo Runner per row (spec.batch.EachRunner, with the reason). A drafter that
    makes trees (`own`: its needs) shares the batch where the model passed the batched-tree probe
    (spec.batch.tree_support: each row's tree under its own 4-D mask); one that reads hidden states
    gets a runner a row (a row's states are the row's own, not a left-padded batch's)."""
    can = capabilities(model, role, "hf")
    why = can.batches
    if why is None and Need.HIDDEN in own:
        why = f"the drafter's rows run one by one ({Need.HIDDEN.value}: each row's own states)"
    if why is None and Need.TREES in own and count > 1:
        tree_why = can.batched_trees
        if tree_why is not None:
            why = f"the drafter's trees are verified row by row ({tree_why})"
    if why is None:
        return batch.Rows(model, count)
    path = RunnerPath.RECOMPUTE if can.path == UNCACHED else RunnerPath(can.path)
    return batch.EachRunner([runner.RUNNERS[path](model, can.positions) for _ in range(count)], why)


@dataclass(frozen=True)
class Capabilities:
    """What spec's probes found about a model in a role (spec.probe), read as one record: the
    path it runs on and how it counts positions (decided when the record is made), and, asked
    only when read (the probe runs once per model), why its rows cannot share a left-padded cache
    and why their trees cannot share one pass (None: they can). (Whether it scores a tree in one pass
    its KVRunner asks: runner.tree_support.)"""
    model: Any
    path: str               # a spec.runner path, DraftImpl.PLAIN / .COMPILED, or UNCACHED
    positions: Positions

    @property
    def batches(self) -> str | None:
        return batch.unbatched(self.model, self.path, self.positions)

    @property
    def batched_trees(self) -> str | None:
        return batch.tree_support(self.model)


def capabilities(model, role: str = "target", draft_impl: str = "auto") -> Capabilities:
    """The record of what `model` can do in `role` (raises what `runs` would raise)."""
    return Capabilities(model, *_path(model, role, draft_impl))


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


def _path(model, role: str, impl: str) -> tuple[str, Positions]:
    """(how `model` runs in this role, how it counts positions): DraftImpl.PLAIN or .COMPILED (a
    draft's own way), a spec.runner path (RunnerPath), or UNCACHED."""
    if role != "draft":
        try:
            return runner.verdict(model)
        except runner.UnsupportedModelError as e:
            raise runner.UnsupportedModelError(f"{role}: {e}", e.runs_uncached) from None
    if impl not in DRAFT_IMPLS:
        raise ValueError(f"draft_impl must be one of {', '.join(map(repr, map(str, DRAFT_IMPLS)))}, got {impl!r}")
    parallel.check_draft(model, impl)         # (the name as the caller gave it, for its messages)
    impl = DraftImpl(impl)
    if impl is DraftImpl.PLAIN or (impl is DraftImpl.AUTO and neox.supports(model) and not parallel.is_split(model)):
        return DraftImpl.PLAIN, Positions.EXPLICIT
    if impl is DraftImpl.COMPILED:
        return DraftImpl.COMPILED, Positions.EXPLICIT
    if not isinstance(model, PreTrainedModel):   # a wrapper (a synthetic draft): run unprobed
        return RunnerPath.KV_CACHE, Positions.EXPLICIT
    try:
        return runner.verdict(model)
    except runner.UnsupportedModelError as e:
        if e.runs_uncached:   # a draft cannot change the output, only its speed
            return UNCACHED, Positions.OWN
        raise runner.UnsupportedModelError(f"{role}: {e}", e.runs_uncached) from None


def _widths(models: dict) -> dict:
    """The ids a draft model may propose: those the target can score and the draft can embed
    again; and whether the target can emit ids the draft cannot embed (fed a stand-in)."""
    draft, target = models["draft"], models.get("target", models["draft"])
    rows = hf.vocab_rows(draft)
    return dict(width=min(hf.logit_width(draft), hf.logit_width(target), rows), rows=rows,
                clamp=hf.logit_width(target) > rows)
