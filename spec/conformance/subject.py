"""What every property needs from anything under test: the Subject protocol, its capabilities and its adapters.

A property compares one decoder with speculation against the same model decoded without it, and judges a
divergence by the reference's own scores. Greedy exactness and the sampling law are each written once, over
this protocol (spec/conformance/checks.py); the served and engine properties (spec/conformance/test_endpoint.py,
the checks in spec/conformance/endpoints.py), llama.cpp's own (test_engine.py) and the kit's in-process ones
(test_greedy.py, test_sampling_law.py, ...) all run them on a Subject. So a Subject is two Sides, what it can
take part in, and what the verdict needs:

  subject.test, subject.reference   Sides: `complete(prompt ids, max_tokens, *, temperature, seed,
                                    logprobs, ignore_eos, stop_token_ids, min_tokens, options)` -> a
                                    Completion (ids, and where the side has them logprobs, top logprobs,
                                    finish_reason, text, usage, seconds); `stream(...)` the same streamed;
                                    `tokenize(text)`, `tokenize_chat(question)` (None: cannot);
                                    `counters()`, `identity()`. A side that cannot do what a request asks
                                    raises UnsupportedRequest (nothing sent): the check is named untested.
  subject.caps                      its SubjectCapabilities, declared once where it is made: the draft it takes,
                                    sampling, the optional keywords, a batch of prompts, the engine,
                                    requests in flight together (never looked up later)
  subject.generate(prompt, n, **kw)            the ids of one request to the side under test
  subject.generate_many(requests)              several at once (None when the subject decodes one
                                               request at a time: concurrency properties are untested)
  subject.judge(prompt, expected, actual, noise)   the first divergence of `actual` from the reference's
                                               `expected` and its verdict, tie or bug (spec.diagnose.judge), or None
  subject.scores(context, noise, token)        the reference's top-2 gap after `context` (spec.diagnose.
                                               Scores), for the tie-or-bug verdict
  subject.noise(prompts, n)                    the subject's measured noise: a server's logprobs alone vs
                                               among concurrent requests; llama.cpp's logits in a one-token
                                               vs a block pass
  subject.identity()                           engine, version, settings (known findings are keyed on it)
  subject.counters()                           drafted / accepted / per position since the start (endpoint.
                                               Counters), None where the engine counts nothing
  subject.seed_prompts                         the seed prompts as the subject's token ids
  subject.control                              a Side: the same speculative engine in its deterministic /
                                               batch-invariant mode (--control), or None; a failed crowd
                                               property replays its crowd there (endpoints.control_verdict)

Adapters: `endpoint_subject(impl)` (a server under test and its reference, both dialects of
spec/conformance/endpoint.py), `engine_subject(engine, ...)` (llama.cpp in process,
spec/conformance/llamacpp.py: its speculative decoding against its own plain decoding, its own logits) and
`decoder_subject(impl, target, draft, ...)` (an in-process decoder, spec/conformance/impls.py: spec, HF
assisted, any module:function, on one pair of the kit's Hugging Face models, against the target's own
greedy decoding). Nothing here imports torch: a served-model run needs neither torch nor transformers.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from spec.conformance.endpoint import Completion, Counters, UnsupportedRequest
from spec.diagnose import Divergence, Scores, first_difference, judge
from spec.options import Verdict

# --- capabilities ------------------------------------------------------------------------------------

DRAFT_KINDS = ("model", "none", "any")
OPTION_KWARGS = ("repetition_penalty", "no_repeat_ngram_size", "min_p", "min_new_tokens", "sequence_bias",
                 "bad_words_ids")
DECLARED = "conformance_"    # the prefix of the attributes a user's callable declares its capabilities with
USER_DECLARES = ("draft", "sampling", "options", "batch")   # conformance_draft, ... (impls' docstring)


@dataclass(frozen=True, kw_only=True)
class SubjectCapabilities:
    """What a subject can take part in, declared once where it is made: the properties read these fields
    (a property a subject cannot take part in is skipped with the reason), never an optional attribute."""
    draft: str = "model"             # "model" (needs a draft model), "none" (model-free: draft always None), "any"
    sampling: bool = True            # False: greedy-only
    options: frozenset = frozenset()  # the optional keywords it takes (OPTION_KWARGS)
    batch: bool = False              # takes a list of prompts, one list of new ids back per prompt
    engine: str | None = None        # an engine that runs its own models ("llama-cpp", "openai"), not the kit's
    concurrent: bool = False         # requests may be in flight together (a server)


SERVED = SubjectCapabilities(draft="any", engine="openai", concurrent=True)
ENGINE = SubjectCapabilities(draft="any", engine="llama-cpp")


def options_taken(fn) -> frozenset:
    """The optional keywords (OPTION_KWARGS) `fn`'s signature names; all of them if it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return frozenset(OPTION_KWARGS)
    return frozenset(k for k in OPTION_KWARGS if k in params)


def declared(fn, name: str) -> SubjectCapabilities:
    """The capabilities a user's callable declares with its `conformance_*` attributes (conformance_draft,
    conformance_sampling, conformance_options, conformance_batch; see spec/conformance/impls.py), read here
    and nowhere else. A bad value, or a conformance_* attribute the kit does not know (a typo would
    otherwise be silently ignored), is a ValueError naming the attribute."""
    given = {attr[len(DECLARED):]: getattr(fn, attr) for attr in dir(fn) if attr.startswith(DECLARED)}
    unknown = sorted(set(given) - set(USER_DECLARES))
    if unknown:
        raise ValueError(f"{name}: unknown attribute {', '.join(DECLARED + k for k in unknown)} (a decoder declares "
                         f"{', '.join(DECLARED + k for k in USER_DECLARES)})")
    draft = given.get("draft", "model")
    if draft not in DRAFT_KINDS:
        raise ValueError(f"{name}: conformance_draft must be one of {DRAFT_KINDS}, got {draft!r}")
    for flag in ("sampling", "batch"):
        if flag in given and not isinstance(given[flag], bool):
            raise ValueError(f"{name}: conformance_{flag} must be True or False, got {given[flag]!r}")
    options = given.get("options")
    if options is not None and (isinstance(options, (str, bytes)) or not all(o in OPTION_KWARGS for o in options)):
        raise ValueError(f"{name}: conformance_options must be a collection of {OPTION_KWARGS}, got {options!r}")
    return SubjectCapabilities(draft=draft, sampling=given.get("sampling", True), batch=given.get("batch", False),
                        options=options_taken(fn) if options is None else frozenset(options))


# --- the protocol --------------------------------------------------------------------------------------

class Crashed(RuntimeError):
    """The subject died during a request (llama.cpp's child process, by a signal): the message is the
    verdict; the property fails with it (never an error that stops the run)."""


@runtime_checkable
class Side(Protocol):
    """One decoder of a Subject: the one under test, or its reference."""

    def complete(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids: list[int] | None = None,
                 min_tokens: int | None = None, options: dict | None = None) -> Completion: ...

    def stream(self, prompt: list[int], max_tokens: int, **kwargs) -> Completion: ...

    def tokenize(self, text: str) -> list[int] | None: ...

    def tokenize_chat(self, question: str) -> list[int] | None: ...

    def counters(self) -> Counters | None: ...

    def identity(self) -> str | None: ...


def logprob_scores(side, context: list[int], noise: float) -> Scores:
    """The top-2 gap of a side's reported logprobs after `context` (a server's reference)."""
    top = side.complete(list(context), 1, logprobs=2).top
    values = sorted(top[0].values(), reverse=True) if top else []
    return Scores(values[0] - values[1] if len(values) >= 2 else math.inf, noise)


@dataclass
class Subject:
    """A decoder with speculation (`test`) and the same model without it (`reference`); see the module."""
    name: str
    test: Side
    reference: Side
    measure_noise: Callable[[list[list[int]], int], float]
    seed_prompts: list[list[int]] | None = None
    caps: SubjectCapabilities = SERVED
    scale: str = "logprob"               # what the reference's gaps are of: "logprob" (a server), "logit" (an engine)
    called: str = "reference"            # what a divergence calls the reference's output ("greedy": an engine's own)
    own_scores: Callable | None = None   # the reference's top-2 gap from its own logits (scores' signature);
                                         # None: from the logprobs it reports (logprob_scores)
    closers: list = field(default_factory=list, repr=False)
    control: Side | None = None          # the same speculative engine in its batch-invariant mode (--control)

    @property
    def concurrent(self) -> bool:
        return self.caps.concurrent

    def generate(self, prompt: list[int], n: int, **kwargs) -> list[int]:
        return self.test.complete(list(prompt), n, **kwargs).ids

    def generate_many(self, requests: list[tuple[list[int], int, dict]], workers: int | None = None
                      ) -> list[list[int]] | None:
        """Each (prompt, n, keywords) sent at once (at most `workers` in flight, default all); None when the
        subject takes one request at a time."""
        if not self.concurrent:
            return None
        from spec.conformance.endpoints import concurrently
        return concurrently([lambda r=r: self.generate(r[0], r[1], **r[2]) for r in requests],
                            workers or len(requests))

    def scores(self, context: list[int], noise: float, token: int | None = None) -> Scores:
        if self.own_scores is not None:
            return self.own_scores(list(context), noise, token)
        return logprob_scores(self.reference, context, noise)

    def judge(self, prompt: list[int], expected: list[int], actual: list[int], noise: float) -> Divergence | None:
        """The first divergence of `actual` from the reference's `expected` (spec.diagnose.judge): a tie where
        the reference's top-2 gap after the same prefix (scores: a server's logprobs, an engine's logits) is
        within the measured `noise`."""
        return judge(expected, actual, lambda i: self.scores(list(prompt) + list(expected[:i]), noise,
                                                             actual[i] if i < len(actual) else None),
                     noise=noise, reference=self.called, scale=self.scale)

    def noise(self, prompts: list[list[int]], n: int) -> float:
        return self.measure_noise(prompts, n)

    def identity(self) -> str | None:
        return self.test.identity()

    def counters(self) -> Counters | None:
        return self.test.counters()

    def close(self) -> None:
        for close in self.closers:
            close()
        self.closers.clear()


# --- adapters ------------------------------------------------------------------------------------------

def endpoint_subject(impl) -> Subject:
    """The server under test and its reference of an `openai:URL` Impl (either dialect), each probed for
    what the kit needs (token-id prompts in, token ids out); the noise measured on the reference (its
    logprobs alone vs among concurrent requests)."""
    from spec.conformance import endpoint, endpoints
    from spec.prompts import SEED_PROMPTS

    spec, ref = endpoint.pair(impl)
    control = None
    if impl.control:
        control = endpoint.Endpoint(impl.control, spec.model)
        control.probe()
    ids = [ref.tokenize(text) for text in SEED_PROMPTS]
    return Subject(impl.name, spec, ref, lambda prompts, n: endpoints.measure_noise(ref, prompts, n),
                   seed_prompts=ids if all(ids) else None, caps=impl,
                   closers=[spec.close, ref.close] + ([control.close] if control else []), control=control)


def servers_subject(spec, ref, name: str = "server", control=None) -> Subject:
    """Two Endpoints (or anything with their `complete`) as a Subject: `spec` under test, `ref` the reference,
    `control` the same engine in its batch-invariant mode or None; the noise measured on the reference (no seed
    prompts: the caller gives prompts)."""
    from spec.conformance import endpoints
    return Subject(name, spec, ref, lambda prompts, n: endpoints.measure_noise(ref, prompts, n), control=control)


class EngineSide:
    """llama.cpp in process (spec.conformance.llamacpp.Engine) as one side of a Subject: its own plain
    decoding (`drafter` None: the reference) or its speculative decoding (prompt lookup, or a draft model
    at `draft_path`). Greedy at temperature 0, else the engine's own sampler chain seeded with `seed`
    (top_k, top_p and min_p may come as options; no filter otherwise). What llama-cpp-python's generate
    has no way to ask (stop ids, min_tokens, EOS stops, penalties, logit bias, stop strings, streaming)
    raises UnsupportedRequest. Logprobs: the reference's are the engine's own logits (log-softmax of its
    one-token passes); the speculative side reports none (llama-cpp-python's generate gives tokens only),
    so the logprob properties are untested for it, not passed."""

    FILTERS = ("top_k", "top_p", "min_p")

    def __init__(self, engine, drafter: str | None, gamma: int, draft_path=None):
        self.engine, self.drafter, self.gamma, self.draft_path = engine, drafter, gamma, draft_path

    def complete(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids: list[int] | None = None,
                 min_tokens: int | None = None, options: dict | None = None) -> Completion:
        if stop_token_ids or min_tokens:
            raise UnsupportedRequest("llama-cpp-python's generate has no stop_token_ids or min_tokens")
        if not ignore_eos:
            raise UnsupportedRequest("the kit runs llama-cpp-python's generate for max_tokens (no EOS stop)")
        other = sorted(set(options or {}) - set(self.FILTERS))
        if other:
            raise UnsupportedRequest(f"the kit sends llama.cpp only top_k, top_p and min_p, not {', '.join(other)}")
        if logprobs is not None and self.drafter is not None:
            raise UnsupportedRequest("llama-cpp-python's speculative generate reports no logprobs")
        prompt, seconds = list(prompt), None
        if temperature == 0.0:
            ids, seconds = (self.engine.greedy(prompt, max_tokens) if self.drafter is None else
                            self.engine.speculative(prompt, max_tokens, draft=self.drafter, gamma=self.gamma,
                                                    draft_path=self.draft_path))
        else:
            sampler = {**dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0), **(options or {})}
            ids = self.engine.sample(prompt, max_tokens, seed=0 if seed is None else seed, sampler=sampler,
                                     draft=self.drafter, gamma=self.gamma, draft_path=self.draft_path)
        out = Completion(ids=list(ids), seconds=seconds)
        if logprobs is not None and ids:
            import numpy as np
            rows = self.engine.logits(prompt + out.ids[:-1])[len(prompt) - 1:]
            logp = rows - rows.max(-1, keepdims=True)
            logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
            out.logprobs = [float(row[t]) for row, t in zip(logp, out.ids)]
            out.top = [{int(t): float(row[t]) for t in np.argsort(-row, kind="stable")[:max(1, logprobs)]}
                       for row in logp]
        return out

    def stream(self, prompt, max_tokens, **kwargs) -> Completion:
        raise UnsupportedRequest("llama-cpp-python's generate in process has no streamed response")

    def tokenize(self, text: str) -> list[int] | None:
        return self.engine.tokenize(text)

    def tokenize_chat(self, question: str) -> list[int] | None:
        return None

    def counters(self) -> Counters | None:
        """What the engine's drafter proposed and had accepted (spec.conformance.llamacpp counts them per
        round); the plain side drafts nothing."""
        return self.engine.counters() if self.drafter is not None else None

    def identity(self) -> str | None:
        drafted = (f"{self.drafter} gamma {self.gamma}" + (f" ({self.draft_path})" if self.draft_path else "")
                   if self.drafter else "plain")
        return f"llama-cpp-python {self.engine.version}, {self.engine.path.name}, {drafted}"

    def scores(self, context: list[int], noise: float, token: int | None = None) -> Scores:
        """The engine's greedy top-2 logit gap after `context`, and which of its block passes give `token`."""
        gap, _ = self.engine.top2(context)
        replay = self.engine.replay(context, token, self.gamma) if token is not None else None
        return Scores(gap, noise, replay=replay)


def engine_subject(engine, name: str, *, drafter: str = "draft-model", gamma: int, draft_path=None,
                   seed_prompts: list[list[int]] | None = None, caps: SubjectCapabilities = ENGINE,
                   called: str = "reference") -> Subject:
    """llama.cpp's speculative decoding (`drafter`, `gamma`, `draft_path`) against its own plain decoding
    of the same model file; the noise: its logits in one-token passes against blocks of 2 and gamma+1
    (Engine.noise) over the prompts' greedy continuations; a divergence judged by its own logits. One
    request at a time (one child process). `called`: what a divergence calls the plain output."""
    test, ref = EngineSide(engine, drafter, gamma, draft_path), EngineSide(engine, None, gamma)

    def noise(prompts, n):
        return engine.noise([list(p) + ref.complete(p, n).ids for p in prompts], widths=(2, gamma + 1))
    return Subject(name, test, ref, noise, seed_prompts=seed_prompts, caps=caps, scale="logit", called=called,
                   own_scores=ref.scores)


# --- in-process decoders ---------------------------------------------------------------------------------

class InProcessSide:
    """What an in-process side has not: a stream, a tokenizer, counters; its identity is its name."""
    name: str

    def stream(self, prompt, max_tokens, **kwargs) -> Completion:
        raise UnsupportedRequest(f"{self.name} runs in process: no streamed response")

    def tokenize(self, text: str) -> list[int] | None:
        return None

    def tokenize_chat(self, question: str) -> list[int] | None:
        return None

    def counters(self) -> Counters | None:
        return None

    def identity(self) -> str | None:
        return self.name


class DecoderSide(InProcessSide):
    """An in-process decoder under test (spec.conformance.impls.Impl: spec, HF assisted, any module:function) on
    one (target, draft) pair of the kit's Hugging Face models, drafting `gamma` tokens a round, as a Side.
    Greedy at temperature 0; else sampled at `temperature` with a torch.Generator seeded `seed`, or with
    seed None the side's own `generator` (the kit's laws draw their samples one after another from one).
    `options`: the callable's own keywords, HF's names (top_k, top_p, min_p, repetition_penalty, ...,
    eos_token_id); `stop_token_ids` is its eos_token_id as given (an int or a list). What the callable cannot
    take (a draft of the wrong kind, sampling for a greedy-only one, an option it refuses or raises
    NotImplementedError for) raises UnsupportedRequest with the reason; token ids only (no logprobs)."""

    def __init__(self, impl, target, draft, gamma: int, generator=None):
        self.impl, self.target, self.draft, self.gamma, self.generator = impl, target, draft, gamma, generator
        self.name = impl.name

    def complete(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids=None,
                 min_tokens: int | None = None, options: dict | None = None) -> Completion:
        name = self.name
        if logprobs is not None or min_tokens or not ignore_eos:
            raise UnsupportedRequest(f"{name} runs in process: token ids only, EOS and min_new_tokens as its "
                                     f"own keywords (eos_token_id, min_new_tokens)")
        reason = self.impl.takes_draft(self.draft)
        if reason:
            raise UnsupportedRequest(reason)
        keywords = {"eos_token_id": stop_token_ids, **(options or {})}
        if temperature:
            import torch
            keywords.update(do_sample=True, temperature=temperature,
                            generator=self.generator if seed is None else torch.Generator().manual_seed(seed))
        try:
            ids = self.impl(self.target, self.draft, list(prompt), gamma=self.gamma, max_new_tokens=max_tokens,
                            **keywords)
        except NotImplementedError as err:
            raise UnsupportedRequest(f"{name} does not support this: {err}") from None
        return Completion(ids=ids)


class FunctionSide(InProcessSide):
    """A reference in process: `greedy(prompt tuple, max_tokens, keywords)` -> the ids (the target's own
    greedy decoding, or HF's generate with the same options; the kit caches them), greedy only."""

    def __init__(self, greedy: Callable[[tuple, int, dict], list[int]], name: str):
        self.greedy, self.name = greedy, name

    def complete(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids=None,
                 min_tokens: int | None = None, options: dict | None = None) -> Completion:
        if temperature or logprobs is not None or min_tokens or not ignore_eos:
            raise UnsupportedRequest(f"{self.name} is a greedy reference: token ids only")
        return Completion(ids=list(self.greedy(tuple(prompt), max_tokens,
                                               {"eos_token_id": stop_token_ids, **(options or {})})))


@dataclass
class DecoderSubject(Subject):
    """An in-process decoder against its reference (decoder_subject). The kit's targets are fp64, so any
    divergence is a bug: `judge` names the first one (the kit's message adds spec.diagnose's evidence)."""
    target: object = None

    def judge(self, prompt: list[int], expected: list[int], actual: list[int], noise: float) -> Divergence | None:
        i = first_difference(expected, actual)
        if i is None:
            return None
        return Divergence(i, expected[i] if i < len(expected) else None, actual[i] if i < len(actual) else None,
                          Verdict.BUG, reference=self.called)


def _no_reference(prompt: tuple, n: int, keywords: dict) -> list[int]:
    raise UnsupportedRequest("no reference decoding: the law is the target's exact one")


def decoder_subject(impl, target, draft, *, gamma: int,
                    reference: Callable[[tuple, int, dict], list[int]] | None = None,
                    called: str = "greedy", generator=None) -> DecoderSubject:
    """An in-process decoder (an Impl, whose capabilities it carries) with `draft` on `target`, drafting `gamma`
    a round (sampling from `generator` where a request has no seed), against `reference` (FunctionSide's
    `greedy`; `called` names it; None for the sampling law, whose reference is the exact law). One request at
    a time."""
    return DecoderSubject(impl.name, DecoderSide(impl, target, draft, gamma, generator),
                          FunctionSide(reference or _no_reference, called), lambda prompts, n: math.nan, caps=impl,
                          scale="logit", called=called, target=target)
