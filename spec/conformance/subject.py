"""What a served or engine property needs from anything under test: the Subject protocol and its adapters.

A property of spec/conformance/test_endpoint.py (greedy_exact, stops, concurrency, mixed_batch, logprobs,
seeded, greedy_options, ...; the checks are spec/conformance/endpoints.py) compares one decoder with
speculation against the same model decoded without it, and judges a divergence by the reference's own
scores. So a Subject is two Sides and what the verdict needs:

  subject.test, subject.reference   Sides: `complete(prompt ids, max_tokens, *, temperature, seed,
                                    logprobs, ignore_eos, stop_token_ids, min_tokens, options)` -> a
                                    Completion (ids, and where the side has them logprobs, top logprobs,
                                    finish_reason, text, usage); `stream(...)` the same streamed;
                                    `tokenize(text)`, `tokenize_chat(question)` (None: cannot);
                                    `counters()`, `identity()`. A side that cannot do what a request asks
                                    raises UnsupportedRequest (nothing sent): the check is named untested.
  subject.generate(prompt, n, **kw)            the ids of one request to the side under test
  subject.generate_many(requests)              several at once (None when the subject decodes one
                                               request at a time: concurrency properties are untested)
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
spec/conformance/endpoint.py) and `engine_subject(engine, ...)` (llama.cpp in process,
spec/conformance/llamacpp.py: its speculative decoding against its own plain decoding, its own logits).
Nothing here imports torch: a served-model run needs neither torch nor transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from spec.conformance.endpoint import Completion, Counters, UnsupportedRequest
from spec.diagnose import Scores


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
    concurrent: bool = True              # requests may be in flight together (a server); False: one at a time
    kind: str = "server"                 # "server" or "engine", for the reasons a property gives
    closers: list = field(default_factory=list, repr=False)
    control: Side | None = None          # the same speculative engine in its batch-invariant mode (--control)

    def generate(self, prompt: list[int], n: int, **kwargs) -> list[int]:
        return self.test.complete(list(prompt), n, **kwargs).ids

    def generate_many(self, requests: list[tuple[list[int], int, dict]]) -> list[list[int]] | None:
        """Each (prompt, n, keywords) sent at once; None when the subject takes one request at a time."""
        if not self.concurrent:
            return None
        from spec.conformance.endpoints import concurrently
        return concurrently([lambda r=r: self.generate(r[0], r[1], **r[2]) for r in requests], len(requests))

    def scores(self, context: list[int], noise: float, token: int | None = None) -> Scores:
        own = getattr(self.reference, "scores", None)
        return own(list(context), noise, token) if own is not None else logprob_scores(self.reference, context, noise)

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
    if getattr(impl, "control", None):
        control = endpoint.Endpoint(impl.control, spec.model)
        control.probe()
    ids = [ref.tokenize(text) for text in SEED_PROMPTS]
    return Subject(impl.name, spec, ref, lambda prompts, n: endpoints.measure_noise(ref, prompts, n),
                   seed_prompts=ids if all(ids) else None,
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
        prompt = list(prompt)
        if temperature == 0.0:
            ids = (self.engine.greedy(prompt, max_tokens)[0] if self.drafter is None else
                   self.engine.speculative(prompt, max_tokens, draft=self.drafter, gamma=self.gamma,
                                           draft_path=self.draft_path)[0])
        else:
            sampler = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, **(options or {}))
            ids = self.engine.sample(prompt, max_tokens, seed=0 if seed is None else seed, sampler=sampler,
                                     draft=self.drafter, gamma=self.gamma, draft_path=self.draft_path)
        out = Completion(ids=list(ids))
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
                   seed_prompts: list[list[int]] | None = None) -> Subject:
    """llama.cpp's speculative decoding (`drafter`, `gamma`, `draft_path`) against its own plain decoding
    of the same model file; the noise: its logits in one-token passes against blocks of 2 and gamma+1
    (Engine.noise) over the prompts' greedy continuations. One request at a time (one child process)."""
    test, ref = EngineSide(engine, drafter, gamma, draft_path), EngineSide(engine, None, gamma)

    def noise(prompts, n):
        return engine.noise([list(p) + ref.complete(p, n).ids for p in prompts], widths=(2, gamma + 1))
    return Subject(name, test, ref, noise, seed_prompts=seed_prompts, concurrent=False, kind="engine")
