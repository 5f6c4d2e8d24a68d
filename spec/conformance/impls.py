"""Speculative decoders under test: the interface the conformance kit drives, its adapters, the loader.

A decoder under test is a callable

    generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id, do_sample,
             temperature, top_k, top_p, generator) -> list[int]

that returns the new token ids (prompt excluded). `target` is a Hugging Face causal LM,
`draft` another one or None (model-free drafting, e.g. prompt lookup), `input_ids` a list of
ints, `eos_token_id` None (no EOS stop: never fall back to the model config's EOS), an int or a
list of ints, `generator` a seeded torch.Generator the callable may use or ignore. Optional
keywords with HF's names and semantics, `repetition_penalty`, `no_repeat_ngram_size`, `min_p`,
`min_new_tokens`, `sequence_bias` ({tuple of ids: bias}) and `bad_words_ids` ([[ids], ...]), are
passed only when a test uses them and only to callables that take them (by name, or **kwargs);
a property that needs an option the callable does not take is skipped with that reason.

What a callable can take part in, it declares with attributes on it, read once when it is loaded
(spec.conformance.subject.declared: a bad value, or a conformance_* name the kit does not know, is an error
naming the attribute) into the Impl's SubjectCapabilities, which the properties read:
  conformance_draft     "model" (needs a draft model; the default), "none" (model-free: draft is
                        always None) or "any" (either)
  conformance_sampling  False for a greedy-only decoder (default True)
  conformance_options   the optional keywords it takes (default: those its signature names; all
                        of them if it takes **kwargs)
  conformance_batch     True if it also takes a batch: input_ids a list of prompts (lists of ints),
                        returning one list of new ids per prompt, in order (default False)
A callable may also raise NotImplementedError("why") for an option it does not support: the test
is then skipped with that reason, not failed.

Adapters: `openai:URL` (a served model: an OpenAI-compatible server with speculation, compared with
`--reference openai:URL`, the same model served without; see spec/conformance/endpoint.py), `llama-cpp` (an engine: its own GGUF models, its own greedy reference and logits; see
spec/conformance/llamacpp.py), `spec` (spec.speculative_generate; spec.PromptLookup when draft is None), `spec-tree`
(the same with tree drafts: spec.TreeDraft, or spec.LookupTree when draft is None), `hf-assisted`
(HF assisted generation with the draft as assistant model), `hf-prompt-lookup` (HF prompt lookup
decoding, no draft model), and any callable named `module:function` or `path/to/file.py:function`.

torch, transformers and spec's decoders are imported only where a Hugging Face model is driven (the
adapters' calls, a tensor returned): loading `openai:URL` imports neither, so a served-model run needs
neither installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from spec.conformance.subject import DRAFT_KINDS, OPTION_KWARGS, SERVED, SubjectCapabilities, declared  # noqa: F401


@dataclass(frozen=True)
class Impl(SubjectCapabilities):
    """A decoder under test: its name, its callable, and what it can take part in (its SubjectCapabilities, declared
    once: by the adapter, or by a user's callable's conformance_* attributes, read by `declared`)."""
    name: str
    generate: Callable
    model: str | None = None       # --model: the engine's model file
    url: str | None = None         # openai:URL: the server under test (spec/conformance/endpoint.py)
    reference: str | None = None   # openai:URL: the same model served without speculation
    control: str | None = None     # openai:URL: the same speculative engine in its batch-invariant mode

    def takes_draft(self, draft) -> str | None:
        """None if this decoder can run with `draft` (a model or None), else why not."""
        if draft is None and self.draft == "model":
            return f"{self.name} needs a draft model (conformance_draft = 'model'); model-free drafting not tested"
        if draft is not None and self.draft == "none":
            return f"{self.name} drafts without a model (conformance_draft = 'none'); model drafts not tested"
        return None

    def __call__(self, target, draft, input_ids, *, gamma: int, max_new_tokens: int, eos_token_id=None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator=None, **processors) -> list[int]:
        if do_sample and not self.sampling:
            raise NotImplementedError(f"{self.name} is greedy-only (conformance_sampling = False)")
        extra = {k: v for k, v in processors.items() if v is not None}
        missing = sorted(set(extra) - self.options)
        if missing:
            raise NotImplementedError(f"{self.name} does not take {', '.join(missing)} (not in its signature)")
        out = self.generate(target, None if self.draft == "none" else draft, _ids(input_ids), gamma=gamma,
                            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=do_sample,
                            temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, **extra)
        if _is_batch(input_ids):
            if not isinstance(out, (list, tuple)) or len(out) != len(input_ids):
                raise TypeError(f"{self.name} must return one list of new ids per prompt of a batch "
                                f"({len(input_ids)}), got {type(out).__name__}")
            return [self._tokens(row) for row in out]
        return self._tokens(out)

    def _tokens(self, out) -> list[int]:
        torch = sys.modules.get("torch")     # a tensor exists only once torch is imported
        if torch is not None and isinstance(out, torch.Tensor):
            out = out.reshape(-1).tolist()
        if not isinstance(out, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
            raise TypeError(f"{self.name} must return the new token ids as a list of ints, got {type(out).__name__}")
        return list(out)


def _is_batch(input_ids) -> bool:
    return bool(input_ids) and all(isinstance(row, (list, tuple)) for row in input_ids)


def _ids(input_ids) -> list:
    return [list(row) for row in input_ids] if _is_batch(input_ids) else list(input_ids)


# --- spec ----------------------------------------------------------------------------------

def spec_generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None, do_sample=False,
                  temperature=1.0, top_k=None, top_p=None, generator=None, repetition_penalty=None,
                  no_repeat_ngram_size=None, min_p=None, min_new_tokens=None, sequence_bias=None,
                  bad_words_ids=None) -> list[int]:
    from spec.decode import speculative_generate
    from spec.lookup import PromptLookup

    draft = PromptLookup() if draft is None else draft  # model-free: spec's own prompt lookup
    out = speculative_generate(target, draft, input_ids, gamma=gamma, max_new_tokens=max_new_tokens,
                                eos_token_id=eos_token_id, do_sample=do_sample, temperature=temperature,
                                top_k=top_k, top_p=top_p, generator=generator,
                                repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                min_p=min_p, min_new_tokens=min_new_tokens, sequence_bias=sequence_bias,
                                bad_words_ids=bad_words_ids)
    return [r.tokens for r in out] if isinstance(out, list) else out.tokens   # a batch: one list a prompt




def spec_tree_generate(target, draft, input_ids, *, gamma, max_new_tokens, **options) -> list[int]:
    """spec with tree drafts (spec.treedraft): the draft model as a TreeDraft (two branches a level,
    up to 2 * gamma nodes, gamma deep), or without one a LookupTree: the reference decoder that
    verifies trees, for the kit's black-box properties (which hold for any engine that uses trees)."""
    from spec.treedraft import LookupTree, TreeDraft

    tree = LookupTree() if draft is None else TreeDraft(draft, branches=2, nodes=2 * gamma)
    return spec_generate(target, tree, input_ids, gamma=gamma, max_new_tokens=max_new_tokens, **options)




# --- Hugging Face generate() -----------------------------------------------------------------

_assistants: dict = {}


def dropping(option: str) -> Impl:
    """spec with `option` silently dropped: a negative control (a decoder that ignores an option it accepts)."""
    def generate(target, draft, input_ids, **kwargs):
        kwargs.pop(option, None)
        return spec_generate(target, draft, input_ids, **kwargs)
    return Impl(f"spec without {option}", generate, draft="any", options=frozenset({option}))


def _assistant(target, draft):
    """hfref.assistant_for, made once per (target, draft): widening the head deep-copies the draft."""
    from spec import hfref

    key = (id(target), id(draft))
    if key not in _assistants or _assistants[key][0] is not draft:
        _assistants[key] = (draft, target, hfref.assistant_for(target, draft))
    return _assistants[key][2]


def _hf_options(options: dict) -> dict:
    """The kit's optional keywords (OPTION_KWARGS), refused by name if any other comes."""
    unknown = sorted(set(options) - set(OPTION_KWARGS))
    if unknown:
        raise TypeError(f"unexpected options {unknown}; the HF adapters take {', '.join(OPTION_KWARGS)}")
    return options


def hf_assisted_generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None, do_sample=False,
                         temperature=1.0, top_k=None, top_p=None, generator=None, **options) -> list[int]:
    """HF assisted generation: `draft` as assistant_model, gamma draft tokens a round
    (constant schedule, confidence threshold 0: set on the assistant's generation_config,
    the only place HF reads them)."""
    if draft is None:
        raise NotImplementedError("hf-assisted needs a draft model")
    from spec import hfref
    return hfref.hf_generate(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                       assistant=_assistant(target, draft), gamma=gamma, **_hf_options(options))


def hf_prompt_lookup_generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None,
                              do_sample=False, temperature=1.0, top_k=None, top_p=None, generator=None,
                              **options) -> list[int]:
    """HF prompt lookup decoding: gamma = prompt_lookup_num_tokens (n-grams of up to 2 matched)."""
    from spec import hfref
    return hfref.hf_generate(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                       do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
                       prompt_lookup_num_tokens=gamma, **_hf_options(options))



def _engine(runs: str, properties: str):
    """The --impl entry of an engine that runs its own models, not the kit's Hugging Face ones: every
    property of the kit's models skips with that reason; its own properties are in `properties`."""
    def generate(target, draft, input_ids, **options):
        raise NotImplementedError(f"{runs}, not the kit's Hugging Face models; its properties are {properties}")
    return generate


llama_cpp_generate = _engine("llama-cpp runs its own GGUF models",
                             "engine_* (spec/conformance/test_engine.py, spec/conformance/llamacpp.py)")
endpoint_generate = _engine("an openai:URL server runs its own model",
                            "endpoint_* (spec/conformance/test_endpoint.py, spec/conformance/endpoint.py)")

# name -> (the callable, its capabilities, declared here; a user's callable declares its own)
BUILTIN = {
    "spec": (spec_generate, SubjectCapabilities(draft="any", batch=True, options=frozenset(OPTION_KWARGS))),
    "spec-tree": (spec_tree_generate, SubjectCapabilities(draft="any", batch=True, options=frozenset(OPTION_KWARGS))),
    "hf-assisted": (hf_assisted_generate, SubjectCapabilities(options=frozenset(OPTION_KWARGS))),
    "hf-prompt-lookup": (hf_prompt_lookup_generate, SubjectCapabilities(draft="none", options=frozenset(OPTION_KWARGS))),
    "llama-cpp": (llama_cpp_generate, SubjectCapabilities(draft="any", engine="llama-cpp", options=frozenset(OPTION_KWARGS))),
}


# --- loading ---------------------------------------------------------------------------------

def _load_callable(ref: str) -> Callable:
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"--impl must be one of {', '.join(BUILTIN)}, or module:function, or "
                         f"path/to/file.py:function; got {ref!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"--impl {ref!r}: no file {path}")
        spec_ = importlib.util.spec_from_file_location(f"_impl_under_test_{abs(hash(str(path)))}", path)
        module = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ValueError(f"--impl {ref!r}: cannot import module {where!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--impl {ref!r}: {where} has no callable {attr!r}")
    return fn


def made(name: str, generate: Callable, caps: SubjectCapabilities | None = None, **where) -> Impl:
    """The Impl of `generate` named `name`, with `caps`, or, for a user's callable, the capabilities it
    declares (subject.declared). `where`: an engine's model file, a server's URLs."""
    caps = declared(generate, name) if caps is None else caps
    return Impl(name, generate, **{f.name: getattr(caps, f.name) for f in fields(SubjectCapabilities)}, **where)


def load(name: str, model: str | None = None, reference: str | None = None, control: str | None = None) -> Impl:
    """The decoder under test named `name`: a built-in adapter, openai:URL (a served model, compared
    with the server at `reference`, openai:URL; `model` the served model's name, default the one the
    server lists) or module:function / file.py:function.
    `model`: a model file for the engine adapters that take one (llama-cpp); refused for the others.
    `control` (openai:URL only): the same speculative engine started in its deterministic / batch-invariant
    mode, which a failed crowd property replays its crowd against (bug, or batch-shape effect)."""
    from spec.conformance import endpoint
    url = endpoint.parse_name(name)
    if url is not None:
        if reference is None:
            raise ValueError(f"{name} needs --reference openai:URL, the same model served without speculation")
        ref = endpoint.parse_name(reference)
        if ref is None:
            raise ValueError(f"--reference must be openai:URL, got {reference!r}")
        ctl = None
        if control is not None:
            ctl = endpoint.parse_name(control)
            if ctl is None:
                raise ValueError(f"--control must be openai:URL (the same speculative engine in its deterministic / "
                                 f"batch-invariant mode), got {control!r}")
        return made(name, endpoint_generate, SERVED, model=model, url=url, reference=ref, control=ctl)
    if reference is not None:
        raise ValueError(f"--reference: only an openai:URL decoder takes a reference server, not {name}")
    if control is not None:
        raise ValueError(f"--control: only an openai:URL decoder takes a control server, not {name}")
    fn, caps = BUILTIN[name] if name in BUILTIN else (_load_callable(name), None)
    impl = made(name, fn, caps)
    if model is not None and impl.engine is None:
        raise ValueError(f"--model: {name} takes no model file (its models are the kit's; only llama-cpp takes one)")
    if model is not None and not Path(model).expanduser().is_file():
        raise ValueError(f"--model: no file {model}")
    return impl if model is None else dataclasses.replace(impl, model=str(Path(model).expanduser().resolve()))
