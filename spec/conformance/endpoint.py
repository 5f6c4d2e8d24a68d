"""An OpenAI-compatible completions server (vLLM, llama.cpp's server, ...) as a decoder under test:
an engine that brings its own model, its own plain decoding as the reference (the same model served
without speculation) and its own logprobs as the evidence (`--impl openai:URL --reference openai:URL`).

- Prompts go to `/v1/completions` as token ids, so both servers see the same input whatever their
  tokenizer does with text.
- The new ids are read from the choice's `token_ids` (vLLM's `return_token_ids: true`) or from the
  logprobs tokens given as ids (`return_tokens_as_token_ids: true`: "token_id:123"); a server that
  gives neither is refused with that reason, since text cannot be compared token for token.
- Only loopback servers (127.0.0.1) are contacted: the kit sends many requests and trusts what comes back.
- Retries: a refused connection, or a 502/503/504 status before any body was read, is retried a few
  times with a pause (a server still starting, a busy one). Nothing else is retried: a request that
  was answered, or timed out while the server was working on it, is an error, so a retry can never
  replace one answer with another.

Dialects: the server's own API is used where the OpenAI one cannot give what the kit needs. The
dialect is read from `GET /v1/models` when the Endpoint is made (`dialect=None`): a model `owned_by`
"llamacpp" is llama.cpp's own server, `llama-server` (its /v1/completions gives no token ids); any
other answer is the OpenAI dialect above (vLLM). `Endpoint(url, dialect="openai" | "llama-server")`
skips the question. llama-server is spoken to on its native routes beside /v1:

- `POST /completion` with the prompt as a list of token ids, `n_predict`, `temperature`, `seed`,
  `ignore_eos`, `cache_prompt: false` (every request computes its prompt: no cached prefix from an
  earlier request), `return_tokens: true` (the new ids come back as `tokens`), and `top_k 0, top_p 1,
  min_p 0` unless the request names them: llama-server filters with top-k 40, top-p 0.95, min-p 0.05 by
  default, and the kit's laws are those of the OpenAI defaults (no filter). Options keep their OpenAI
  names but `repetition_penalty`, sent as llama.cpp's `repeat_penalty` (its own semantics: the last
  64 tokens). `stop_token_ids` and `min_tokens` have no counterpart: UnsupportedRequest (the kit names them
  untested). finish_reason is "stop" for `stop_type` eos or word, else "length"; usage is
  `tokens_evaluated` / `tokens_predicted`.
- Logprobs: `n_probs: K` gives, per new token, `logprob` (of the emitted token) and `top_logprobs`
  (K entries with ids), each the log of llama.cpp's float32 softmax of the target's raw logits
  (`post_sampling_probs` false: before temperature and filters), printed from float32, so the kit's
  float32-rounding bound applies as it does for vLLM. A probability of 0 comes back as float32's
  lowest value (-3.4e38), kept as it is. (llama-server 11434 reports p = 1, logprob 0 and no top
  logprobs for every token a speculative round emitted: "TODO: set result.probs" in
  server-context.cpp; the kit's logprob properties show it.)
- `POST /tokenize` (`content`), `POST /apply-template` (chat), `GET /props` (`build_info`, identity),
  `GET /metrics` (started with `--metrics`: `llamacpp:spec_decode_*`, the names vLLM uses; a plain
  llama-server exports them too, at 0, so it reads as drafting nothing).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

PREFIX = "openai:"
LOOPBACK = "127.0.0.1"
RETRY_STATUS = (502, 503, 504)


class EndpointError(RuntimeError):
    """The server is down, lists no model, answered with an error, or cannot give what the kit needs. `status`:
    the HTTP status it answered (None: no answer); `sent`: (URL, JSON body) of the request that got it."""

    def __init__(self, message: str, status: int | None = None, sent: tuple[str, dict | None] | None = None):
        super().__init__(message)
        self.status, self.sent = status, sent


class UnsupportedRequest(EndpointError):
    """The server's API has no way to ask for this option (nothing was sent): the check is untested."""


def base_url(url: str) -> str:
    """`http://127.0.0.1:PORT/v1` checked: http(s), host 127.0.0.1, a port; no trailing slash."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected a server's base URL such as http://127.0.0.1:8000/v1, got {url!r}")
    if parts.hostname != LOOPBACK:
        raise ValueError(f"only loopback servers ({LOOPBACK}) are contacted, got host {parts.hostname!r} in {url!r}")
    if parts.port is None:
        raise ValueError(f"the URL must name the port, got {url!r}")
    return url.rstrip("/")


def parse_name(name: str) -> str | None:
    """The base URL of an `openai:URL` decoder name, or None for other names."""
    return base_url(name[len(PREFIX):]) if name.startswith(PREFIX) else None


@dataclass
class Completion:
    ids: list[int]                                   # the new token ids
    finish_reason: str | None = None
    logprobs: list[float] | None = None              # the reported logprob of each new token
    top: list[dict[int, float]] | None = None        # per new token: {id: logprob} of the top ones
    text: str | None = None
    usage: dict | None = None                        # the response's usage (prompt/completion tokens)
    chunks: list[int] | None = None                  # streamed: how many new tokens each chunk carried
    seconds: float | None = None                     # how long it took, where the side times itself (llama.cpp)
    raw: dict = field(default_factory=dict, repr=False)


def _token_id(key) -> int | None:
    """'token_id:123' (return_tokens_as_token_ids) -> 123; anything else (text) -> None."""
    if isinstance(key, str) and key.startswith("token_id:") and key[9:].lstrip("-").isdigit():
        return int(key[9:])
    return None


# Speculation counters an engine exposes on GET /metrics (Prometheus text), by the name after the
# engine's prefix (vLLM "vllm:", llama.cpp's server "llamacpp:"): summed over every label set but the
# draft position. A plain server has none of them.
DRAFTS = "spec_decode_num_drafts_total"
DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
_METRIC = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*):([A-Za-z0-9_]+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]?Inf)\s*(\d+)?$')
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class Counters:
    """What an engine says it drafted: draft rounds (None where it does not count them), draft tokens
    proposed, draft tokens accepted, and accepted tokens by draft position (0 = the first proposal)."""
    drafts: int | None
    draft_tokens: int
    accepted: int
    per_position: dict[int, int] = field(default_factory=dict)

    def since(self, before: "Counters | None") -> "Counters":
        """The counts added since `before` (None: since the server started)."""
        if before is None:
            return self
        return Counters(None if self.drafts is None or before.drafts is None else self.drafts - before.drafts,
                        self.draft_tokens - before.draft_tokens, self.accepted - before.accepted,
                        {k: v - before.per_position.get(k, 0) for k, v in self.per_position.items()})

    def acceptance_by_position(self) -> list[float]:
        """Per draft position, the share of draft rounds whose proposal there was accepted."""
        if not self.drafts:
            return []
        return [self.per_position.get(k, 0) / self.drafts for k in range(max(self.per_position, default=-1) + 1)]

    def alpha(self) -> float | None:
        """Theorem 3.8's per-token acceptance fitted to the counts: a round accepts its first k proposals
        with probability alpha^k (capped at what it drafted), so alpha's maximum-likelihood estimate is
        accepted / (accepted + rounds that stopped at a rejection). Rounds that accepted everything they
        drafted stop no earlier than the last position; where the engine drafts a fixed number (a draft
        model), those are the rounds that reached the last position. None without rounds counted."""
        if not self.drafts or not self.per_position:
            return None
        last = self.per_position.get(max(self.per_position), 0)
        stopped = max(self.drafts - last, 0)
        return self.accepted / (self.accepted + stopped) if self.accepted + stopped else None

    def describe(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_by_position())
        alpha = self.alpha()
        return (f"{self.draft_tokens} draft tokens proposed, {self.accepted} accepted"
                + (f" in {self.drafts} draft rounds" if self.drafts is not None else "")
                + (f"; acceptance by position {rates}" if rates else "")
                + (f"; alpha fitted {alpha:.3f}" if alpha is not None else ""))


def parse_counters(text: str) -> Counters | None:
    """The speculation counters in a Prometheus /metrics text, or None when it has none."""
    seen: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line.strip())
        if not match:
            continue
        name, labels, value = match.group(2), match.group(3) or "", float(match.group(4))
        if name == PER_POSITION:
            position = _POSITION.search(labels)
            if position:
                per_position[int(position.group(1))] = per_position.get(int(position.group(1)), 0.0) + value
        elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            seen[name] = seen.get(name, 0.0) + value
    if DRAFT_TOKENS not in seen and ACCEPTED not in seen and DRAFTS not in seen:
        return None
    drafted = seen.get(DRAFT_TOKENS)
    if drafted is None:   # an engine that counts rounds and accepted tokens only: proposals are at least those
        drafted = max(seen.get(ACCEPTED, 0.0), seen.get(DRAFTS, 0.0))
    return Counters(int(seen[DRAFTS]) if DRAFTS in seen else None, int(drafted), int(seen.get(ACCEPTED, 0.0)),
                    {k: int(v) for k, v in sorted(per_position.items())})


DIALECTS = ("openai", "llama-server")


# llama-server: the OpenAI option names it spells its own way, and its default filters turned off
LLAMA_OPTIONS = {"repetition_penalty": "repeat_penalty"}
LLAMA_NEUTRAL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _check_prompt(prompt) -> None:
    if not prompt or not all(isinstance(t, int) for t in prompt):
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r}")


class Endpoint:
    """One server: `complete` sends token ids and reads token ids (and logprobs) back, in the server's
    dialect (`dialect`; None: read from /v1/models, see the module's docstring)."""

    def __init__(self, url: str, model: str | None = None, *, timeout: float = 120.0, retries: int = 3,
                 pause: float = 1.0, dialect: str | None = None):
        import httpx2

        if dialect not in (None, *DIALECTS):
            raise ValueError(f"dialect must be one of {DIALECTS} or None, got {dialect!r}")
        self.url = base_url(url)
        self.root = self.url.removesuffix("/v1")
        self._http = httpx2
        self.retries, self.pause = retries, pause
        self.client = httpx2.Client(timeout=httpx2.Timeout(timeout, connect=5.0), trust_env=False)
        listed = self._listed() if dialect is None or model is None else None
        self.dialect = dialect or ("llama-server" if any(m.get("owned_by") == "llamacpp" for m in listed)
                                   else "openai")
        self.model = model if model is not None else self._only_model(listed)

    def close(self):
        self.client.close()

    def _request(self, method: str, path: str, body: dict | None = None, *, native: bool = False) -> dict:
        where = f"{self.root if native else self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                response = self.client.request(method, where, json=body)
            except self._http.ConnectError as err:   # nothing reached the server: safe to retry
                if attempt == self.retries:
                    raise EndpointError(f"cannot connect to {where} (is the server running?): {err}") from None
                time.sleep(self.pause)
                continue
            except self._http.TimeoutException as err:   # it may have been working on it: never retried
                raise EndpointError(f"{method} {where} timed out: {type(err).__name__}") from None
            except self._http.HTTPError as err:
                raise EndpointError(f"{method} {where} failed: {type(err).__name__}: {err}") from None
            if response.status_code in RETRY_STATUS and attempt < self.retries:
                time.sleep(self.pause)
                continue
            if response.status_code == 422:   # the request's schema refused: fields this server does not take
                raise EndpointError(f"{method} {where} answered 422 (request refused by the server's schema; "
                                    f"the kit sends prompts as token ids and asks for ids back): {response.text[:500]}")
            if response.status_code != 200:
                raise EndpointError(f"{method} {where} answered {response.status_code}: {response.text[:500]}",
                                    response.status_code, (where, body))
            try:
                return response.json()
            except ValueError:
                raise EndpointError(f"{method} {where} answered with no JSON: {response.text[:200]!r}") from None
        raise AssertionError("unreachable")

    def _listed(self) -> list[dict]:
        data = self._request("GET", "/models").get("data")
        if not isinstance(data, list):
            raise EndpointError(f"{self.url}/models has no 'data' list")
        return [m for m in data if isinstance(m, dict)]

    def models(self) -> list[str]:
        return [m["id"] for m in self._listed() if isinstance(m.get("id"), str)]

    def _only_model(self, listed: list[dict] | None = None) -> str:
        names = [m["id"] for m in (self._listed() if listed is None else listed) if isinstance(m.get("id"), str)]
        if not names:
            raise EndpointError(f"{self.url}/models lists no model")
        if len(names) > 1:
            raise EndpointError(f"{self.url}/models lists {len(names)} models ({', '.join(names[:5])}); "
                                f"name one with --model")
        return names[0]

    def identity(self) -> str | None:
        """'OWNER VERSION' when the server says who it is (vLLM: /v1/models' owned_by and GET /version;
        llama-server: "llamacpp" and GET /props' build_info), else None; known findings are keyed on it."""
        if self.dialect == "llama-server":
            try:
                build = self._request("GET", "/props", native=True).get("build_info")
            except EndpointError:
                return None
            return f"llamacpp {build}" if isinstance(build, str) else None
        try:
            owners = {m.get("owned_by") for m in self._request("GET", "/models").get("data") or []
                      if isinstance(m, dict)}
            response = self.client.get(f"{self.url.removesuffix('/v1')}/version")
        except (EndpointError, self._http.HTTPError):
            return None
        version = response.json().get("version") if response.status_code == 200 else None
        return f"{owners.pop()} {version}" if len(owners) == 1 and isinstance(version, str) else None

    def _tokenize(self, body: dict) -> list[int] | None:
        """POST /tokenize beside /v1 (vLLM, llama.cpp): the ids, or None when the route is missing or
        answers something else."""
        root = self.url.removesuffix("/v1")
        try:
            response = self.client.post(f"{root}/tokenize", json={"model": self.model, **body})
        except self._http.HTTPError as err:
            raise EndpointError(f"POST {root}/tokenize failed: {err}") from None
        tokens = response.json().get("tokens") if response.status_code == 200 else None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    def tokenize(self, text: str) -> list[int] | None:
        """The server's own token ids for `text` (no BOS, special-token text read as text), or None
        when it has no /tokenize."""
        if self.dialect == "llama-server":
            return self._tokenize({"content": text, "add_special": False, "parse_special": False})
        return self._tokenize({"prompt": text, "add_special_tokens": False})

    def tokenize_chat(self, question: str) -> list[int] | None:
        """The ids of `question` as a user turn in the server's chat template, ready for the answer
        (vLLM: /tokenize with messages; llama-server: /apply-template, then /tokenize reading its special
        tokens), or None. An instruct model's answer ends in its EOS."""
        messages = [{"role": "user", "content": question}]
        if self.dialect == "llama-server":
            try:
                text = self._request("POST", "/apply-template", {"messages": messages}, native=True).get("prompt")
            except EndpointError:
                return None
            return self._tokenize({"content": text, "add_special": False, "parse_special": True}) or None \
                if isinstance(text, str) else None
        return self._tokenize({"messages": messages, "add_generation_prompt": True}) or None

    def _body(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None,
              logprobs: int | None, ignore_eos: bool, stop_token_ids: list[int] | None, min_tokens: int | None,
              options: dict | None) -> dict:
        _check_prompt(prompt)
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": temperature,
                "ignore_eos": ignore_eos, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "echo": False, "n": 1, "stream": False}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if min_tokens:
            body["min_tokens"] = min_tokens
        for key, value in (options or {}).items():   # sampling options sent as they are (top_k, logit_bias, ...)
            if key in body:
                raise ValueError(f"options must not repeat a named argument, got {key!r}")
            body[key] = value
        return body

    def complete(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                 logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids: list[int] | None = None,
                 min_tokens: int | None = None, options: dict | None = None) -> Completion:
        if self.dialect == "llama-server":
            body = self._llama_body(prompt, max_tokens, temperature, seed, logprobs, ignore_eos, stop_token_ids,
                                    min_tokens, options)
            return self._llama_completion(self._request("POST", "/completion", body, native=True), logprobs)
        body = self._body(prompt, max_tokens, temperature, seed, logprobs, ignore_eos, stop_token_ids, min_tokens,
                          options)
        data = self._request("POST", "/completions", body)
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise EndpointError(f"{self.url}/completions: expected one choice, got {str(data)[:300]}")
        out = self._completion(choices[0], logprobs)
        out.usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        return out

    def request(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
                logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids: list[int] | None = None,
                min_tokens: int | None = None, options: dict | None = None) -> tuple[str, str, dict]:
        """(dialect, URL, JSON body) of the request `complete` sends for these arguments (a reproduction)."""
        given = (prompt, max_tokens, temperature, seed, logprobs, ignore_eos, stop_token_ids, min_tokens, options)
        if self.dialect == "llama-server":
            return self.dialect, f"{self.root}/completion", self._llama_body(*given)
        return self.dialect, f"{self.url}/completions", self._body(*given)

    def stream(self, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
               logprobs: int | None = None, ignore_eos: bool = True, stop_token_ids: list[int] | None = None,
               min_tokens: int | None = None, options: dict | None = None) -> Completion:
        """The same request streamed (server-sent events): the chunks' ids, text and logprobs joined, the
        last finish_reason, and the usage of the final chunk (stream_options.include_usage; llama-server:
        its final chunk's counts)."""
        llama = self.dialect == "llama-server"
        body = (self._llama_body if llama else self._body)(prompt, max_tokens, temperature, seed, logprobs, ignore_eos,
                                                           stop_token_ids, min_tokens, options)
        if llama:
            body["stream"] = True
        else:
            body.update(stream=True, stream_options={"include_usage": True})
        where = f"{self.root}/completion" if llama else f"{self.url}/completions"
        parts: list[Completion] = []
        finish, usage = None, None
        try:
            with self.client.stream("POST", where, json=body) as response:
                if response.status_code != 200:
                    raise EndpointError(f"POST {where} (stream) answered {response.status_code}: "
                                        f"{response.read()[:500]!r}")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        raise EndpointError(f"POST {where} (stream) sent a chunk that is not JSON: {payload[:200]!r}")
                    if llama:   # one chunk per emitted token, then a final one (stop true) with the counts
                        part = self._llama_completion(event, logprobs)
                        if part.ids or part.text:
                            parts.append(part)
                        if event.get("stop"):
                            finish, usage = part.finish_reason, part.usage
                            break
                        continue
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        parts.append(self._completion(choice, logprobs))
                        finish = choice.get("finish_reason") or finish
        except self._http.HTTPError as err:
            raise EndpointError(f"POST {where} (stream) failed: {type(err).__name__}: {err}") from None
        joined = Completion(ids=[t for c in parts for t in c.ids], finish_reason=finish,
                            text="".join(c.text or "" for c in parts), usage=usage, chunks=[len(c.ids) for c in parts])
        if logprobs is not None:
            joined.logprobs = [v for c in parts for v in (c.logprobs or [])]
            joined.top = [row for c in parts for row in (c.top or [])]
        return joined

    def _llama_body(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None,
                    logprobs: int | None, ignore_eos: bool, stop_token_ids: list[int] | None, min_tokens: int | None,
                    options: dict | None) -> dict:
        """llama-server's native /completion request (the module's docstring: names, neutral filters)."""
        _check_prompt(prompt)
        if stop_token_ids:
            raise UnsupportedRequest("llama-server's /completion has no stop_token_ids (stop strings only)")
        if min_tokens:
            raise UnsupportedRequest("llama-server's /completion has no min_tokens")
        body = {"prompt": list(prompt), "n_predict": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos,
                "return_tokens": True, "cache_prompt": False, "stream": False}
        if logprobs is not None:
            body["n_probs"] = max(1, logprobs)
        if seed is not None:
            body["seed"] = seed
        for key, value in (options or {}).items():
            key = LLAMA_OPTIONS.get(key, key)
            if key in body:
                raise ValueError(f"options must not repeat a named argument, got {key!r}")
            body[key] = value
        return {**LLAMA_NEUTRAL, **body}

    def _llama_completion(self, data: dict, asked_logprobs: int | None) -> Completion:
        """A /completion answer, or one streamed chunk of it (usage and finish_reason on the last only)."""
        where = f"{self.root}/completion"
        if "error" in data:
            raise EndpointError(f"{where} answered an error: {str(data['error'])[:500]}")
        ids = data.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise EndpointError(f"{where} returned no `tokens` list (return_tokens): {str(data)[:300]}")
        text, final = data.get("content"), data.get("stop") is True
        out = Completion(ids=list(ids), text=text if isinstance(text, str) else None, raw=data)
        if final:
            out.finish_reason = "stop" if data.get("stop_type") in ("eos", "word") else "length"
            if isinstance(data.get("tokens_predicted"), int):
                out.usage = {"prompt_tokens": data.get("tokens_evaluated"),
                             "completion_tokens": data["tokens_predicted"]}
        if asked_logprobs is not None and ids:
            probs = data.get("completion_probabilities")
            if not isinstance(probs, list) or len(probs) != len(ids) or any(
                    not isinstance(p, dict) or p.get("id") != t or "logprob" not in p for p, t in zip(probs, ids)):
                raise EndpointError(f"{where} returned no logprob for each of the {len(ids)} new tokens "
                                    f"(completion_probabilities {str(probs)[:200]})")
            out.logprobs = [float(p["logprob"]) for p in probs]
            out.top = [{int(t["id"]): float(t["logprob"]) for t in (p.get("top_logprobs") or [])[:asked_logprobs]}
                       for p in probs]
        return out

    def _completion(self, choice: dict, asked_logprobs: int | None) -> Completion:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") if isinstance(lp, dict) else None
        ids = choice.get("token_ids")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            from_tokens = [_token_id(t) for t in tokens] if isinstance(tokens, list) else [None]
            if None in from_tokens:
                raise EndpointError(f"{self.url} returns neither `token_ids` (return_token_ids) nor logprobs tokens "
                                    f"as ids (return_tokens_as_token_ids): its output cannot be compared token "
                                    f"for token")
            ids = from_tokens
        text = choice.get("text")
        out = Completion(ids=list(ids), finish_reason=choice.get("finish_reason"),
                         text=text if isinstance(text, str) else None, raw=choice)
        if asked_logprobs is not None:
            chosen, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
            if not isinstance(chosen, list) or len(chosen) != len(ids):
                raise EndpointError(f"{self.url} returned no token_logprobs for the {len(ids)} new tokens")
            out.logprobs = [float(v) for v in chosen]
            if isinstance(tops, list) and len(tops) == len(ids):
                out.top = []
                for row in tops:
                    parsed = {_token_id(k): float(v) for k, v in (row or {}).items()}
                    if None in parsed:
                        raise EndpointError(f"{self.url}: top_logprobs keyed by text, not ids "
                                            f"(return_tokens_as_token_ids not honoured)")
                    out.top.append(parsed)
        return out


    def counters(self) -> Counters | None:
        """The server's speculation counters now (GET /metrics beside /v1), or None when it exposes
        none: no /metrics, or one without spec_decode counters (a plain server)."""
        root = self.url.removesuffix("/v1")
        try:
            response = self.client.get(f"{root}/metrics")
        except self._http.HTTPError as err:
            raise EndpointError(f"GET {root}/metrics failed: {type(err).__name__}: {err}") from None
        return parse_counters(response.text) if response.status_code == 200 else None

    def probe(self) -> None:
        """One token from a one-id prompt: refuses, with the reason, a server that does not take token-id
        prompts or gives no ids back (llama-cpp-python's server does neither)."""
        try:
            self.complete([(self.tokenize("Hello") or [0])[0]], 1)
        except EndpointError as err:
            if " answered " in str(err):   # any status: llama-cpp-python's server says 500 to an id list
                raise EndpointError(f"{self.url} refused a prompt given as token ids, which the kit needs (both "
                                    f"servers must see the same input, whatever their tokenizers do with text): "
                                    f"{err}") from None
            raise


def pair(impl) -> tuple[Endpoint, Endpoint]:
    """(the server under test, the reference server) of an `openai:URL` Impl, each probed for what the
    kit needs (token-id prompts in, token ids out)."""
    spec = Endpoint(impl.url, impl.model)
    ref = Endpoint(impl.reference, impl.model if impl.model is not None else spec.model)
    for server in (spec, ref):
        server.probe()
    return spec, ref
