"""A small OpenAI-compatible completions server over spec itself, in a thread of the test process, so the
endpoint adapter (spec/conformance/endpoint.py) and every endpoint property (spec/conformance/endpoints.py) run in
the default pytest without vLLM.

It serves the kit's seeded tiny Llama (kit.zoo("llama"): fp64 target, its 10%-noise copy as the draft;
or pair="small", the kit's 4-token pair, for sampling laws):
`speculative=False` decodes with spec.greedy_generate (the reference: plain greedy, or ancestral
sampling), `speculative=True` with spec.speculative_generate (gamma 4, the draft model). `bug=` makes it
a broken endpoint with one class of bug a serving engine has shipped (BUGS), the negative controls.
Routes: GET /v1/models, POST /v1/completions (token-id prompts; vLLM's fields: return_token_ids,
return_tokens_as_token_ids, ignore_eos, stop_token_ids, min_tokens, seed, logprobs), POST /tokenize.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from spec.conformance import kit
from spec.decode import greedy_generate, speculative_generate

MODEL = "kit-tiny-llama"
GAMMA = 4
UNSUPPORTED = {"presence_penalty", "frequency_penalty"}    # refused with 400, as a server refuses what it lacks
UNSUPPORTED_SPECULATIVE = {"min_p"}                          # refused by the speculative server only (as vLLM does)
BUGS = {
    "greedy-unverified": "emits the draft's greedy tokens after the first 3, unverified",
    "max-tokens+1": "returns one token more than max_tokens",
    "eos-ignored": "does not stop at the model's EOS (ignore_eos false)",
    "stop-ids-ignored": "ignores stop_token_ids",
    "min-tokens-ignored": "stops at a stop id before min_tokens",
    "batch-shape": "changes the last token when other requests are in flight",
    "draft-logprobs": "reports the draft model's logprobs, not the target's",
    "sampler-law": "samples at 1.5x the requested temperature",
    "no-token-ids": "returns text only: neither token_ids nor ids as logprobs tokens",
}


class _Listener(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog of 128, not 5: the kit sends up to 20 requests at once, and
    on a loaded box a full accept queue reset a connection (endpoint_mixed_batch failed with ECONNRESET)."""
    request_queue_size = 128
    daemon_threads = True


@dataclass
class Gathering:
    """Server.held_together's barrier: `parties` requests, `joined` so far, `full` once all were in flight."""
    parties: int
    timeout: float
    joined: int = 0
    full: bool = False
    closed: bool = False
    deadline: float = 0.0


class Server:
    def __init__(self, speculative: bool, bug: str | None = None, pair: str = "llama", max_logprobs: int = 640):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)}, got {bug!r}")
        if pair == "llama":
            models = kit.zoo("llama")
            self.target, self.draft, self.eos = models["target"], models["partial"], models["eos"]
        elif pair == "small":   # the kit's 4-token pair: a first-token law a few hundred samples can see
            (self.target, self.draft), self.eos = kit.small_pair(), None
        else:
            raise ValueError(f"pair must be 'llama' or 'small', got {pair!r}")
        self.speculative, self.bug, self.max_logprobs = speculative, bug, max_logprobs
        self.owner, self.version = "spec", None       # what GET /v1/models and /version say it is
        # speculation counters (GET /metrics): what its speculative runs drafted and accepted; a test may
        # switch the speculation off (`speculating`: decode greedily, as an engine that fell back would)
        # or the report of it (`reports_speculation`)
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_position: dict[int, int] = {}
        self.speculating, self.reports_speculation = speculative, True
        self.lock = threading.Lock()          # one decode at a time (torch runs one thread here)
        self.in_flight = 0
        # in_flight changes under the decoding lock (a request's count waits behind a decode in progress, as
        # the proxy's controls have always seen it); a gathering's members wait on them, the lock released
        self.arrivals = threading.Condition(self.lock)
        self.gathering: Gathering | None = None
        self.httpd = _Listener(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def count(self, rounds) -> None:
        """Adds a speculative run's rounds to the speculation counters /metrics reports (vLLM's names)."""
        for r in rounds:
            if r.drafted:
                self.drafts += 1
                self.draft_tokens += r.drafted
                self.accepted += r.accepted
                for i in range(r.drafted):
                    self.per_position[i] = self.per_position.get(i, 0) + (i < r.accepted)

    def metrics(self) -> str:
        """GET /metrics: Prometheus text; the speculation counters only on a speculative server, as vLLM."""
        lines = [f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.in_flight}']
        if self.speculative and self.reports_speculation:
            label = f'engine="0",model_name="{MODEL}"'
            lines += [f"vllm:spec_decode_num_drafts_total{{{label}}} {float(self.drafts)}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {float(self.draft_tokens)}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {float(self.accepted)}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{k}"}} {float(v)}'
                      for k, v in sorted(self.per_position.items())]
        return "\n".join(lines) + "\n"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    @contextlib.contextmanager
    def held_together(self, parties: int, timeout: float = 60.0):
        """While open, the next `parties` completion requests are each held on arrival until all of
        them are in flight (a barrier; `timeout` seconds at most, counted from the first), then
        decoded as requests that were in flight together. So a test's concurrent requests overlap
        whatever the load on the machine: left to the scheduler, a request can finish before the
        next one arrives, and a loaded box made the batch-shape control pass half the time. Yields
        the Gathering (`joined`: how many arrived, `full`: whether all did in time)."""
        gathering = Gathering(parties, timeout)
        with self.arrivals:
            if self.gathering is not None:
                raise RuntimeError("one gathering at a time")
            self.gathering = gathering
        try:
            yield gathering
        finally:
            with self.arrivals:
                self.gathering = None
                gathering.closed = True
                self.arrivals.notify_all()

    def arrive(self) -> bool:
        """A completion request is in flight: hold it while a gathering it joins fills; whether it was
        crowded (other requests in flight beside it)."""
        with self.arrivals:
            self.in_flight += 1
            self.arrivals.notify_all()
            gathering = self.gathering
            if gathering is None or gathering.joined >= gathering.parties:
                return self.in_flight > 1
            gathering.joined += 1
            gathering.deadline = gathering.deadline or time.monotonic() + gathering.timeout
            while gathering.joined < gathering.parties and not gathering.closed:
                left = gathering.deadline - time.monotonic()
                if left <= 0:
                    break
                self.arrivals.wait(left)
            gathering.full = gathering.joined >= gathering.parties
            return gathering.full or self.in_flight > 1

    def leave(self) -> None:
        with self.arrivals:
            self.in_flight -= 1
            self.arrivals.notify_all()

    # --- decoding -------------------------------------------------------------------------

    def complete(self, body: dict, crowded: bool) -> dict:
        prompt, n = body["prompt"], int(body.get("max_tokens", 16))
        vocab = self.target.config.vocab_size
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt)):
            raise ValueError(f"prompt must be a list of token ids in [0, {vocab})")
        temperature = float(body.get("temperature", 1.0))
        refused = sorted(set(body) & (UNSUPPORTED | (UNSUPPORTED_SPECULATIVE if self.speculative else set())))
        if refused:
            raise ValueError(f"this server does not take {', '.join(refused)}")
        stops = [] if body.get("ignore_eos") or self.bug == "eos-ignored" or self.eos is None else [self.eos]
        if self.bug != "stop-ids-ignored":
            stops += list(body.get("stop_token_ids") or [])
        min_tokens = None if self.bug == "min-tokens-ignored" else body.get("min_tokens")
        if self.bug == "max-tokens+1":
            n += 1
        options = dict(max_new_tokens=n, eos_token_id=stops or None, min_new_tokens=min_tokens or None,
                       **{k: body[k] for k in ("top_k", "top_p", "min_p", "repetition_penalty") if body.get(k)})
        if body.get("logit_bias"):
            options["sequence_bias"] = {(int(t),): float(v) for t, v in body["logit_bias"].items()}
        if temperature > 0:
            seed = body.get("seed")
            generator = torch.Generator().manual_seed(int(seed) if seed is not None else 0)
            t = temperature * 1.5 if self.bug == "sampler-law" else temperature
            options.update(do_sample=True, temperature=t, generator=generator)
        if self.speculative and self.speculating:
            result = speculative_generate(self.target, self.draft, prompt, gamma=GAMMA, **options)
            blocks = [r.emitted for r in result.rounds]
            self.count(result.rounds)
        else:
            result = greedy_generate(self.target, prompt, **options)
            blocks = [1] * len(result.tokens)
        tokens = result.tokens
        if self.bug == "greedy-unverified" and len(tokens) > 3:
            tokens = tokens[:3] + greedy_generate(self.draft, prompt + tokens[:3], max_new_tokens=len(tokens) - 3).tokens
        if self.bug == "batch-shape" and crowded and tokens:
            tokens[-1] = (tokens[-1] + 1) % self.target.config.vocab_size
        finish = "length" if len(tokens) >= n else "stop"
        text = "".join(f" {t}" for t in tokens)
        for stop in body.get("stop") or []:      # stop strings: the output ends at the token that completes one
            at = text.find(stop)
            if at >= 0:
                keep = next(i for i in range(len(tokens) + 1) if len("".join(f" {t}" for t in tokens[:i])) >= at + len(stop))
                tokens, text, finish = tokens[:keep], text[:at], "stop"
        chunks, start = [], 0
        for size in blocks:                      # streamed: one chunk per decoding step (a speculative round)
            if start < len(tokens):
                chunks.append(tokens[start:start + size])
            start += size
        return dict(prompt=prompt, tokens=tokens, text=text, finish=finish, chunks=chunks, logprobs=body.get("logprobs"))

    def response(self, out: dict) -> dict:
        choice = {"index": 0, "text": out["text"], "finish_reason": out["finish"]}
        if self.bug != "no-token-ids":
            choice["token_ids"] = out["tokens"]
        k = out["logprobs"]
        if k is not None:
            choice["logprobs"] = self._logprobs(out["prompt"], out["tokens"], min(int(k), self.max_logprobs),
                                                as_ids=self.bug != "no-token-ids")
        usage = {"prompt_tokens": len(out["prompt"]), "completion_tokens": len(out["tokens"]),
                 "total_tokens": len(out["prompt"]) + len(out["tokens"])}
        return {"id": "cmpl-0", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": usage}

    def stream_events(self, out: dict) -> list[dict]:
        """Server-sent events for a streamed request: a chunk per decoding step, then the usage."""
        events, done = [], 0
        for i, chunk in enumerate(out["chunks"]):
            upto = lambda m: min(len(out["text"]), len("".join(f" {t}" for t in out["tokens"][:m])))  # noqa: E731
            piece = dict(out, tokens=chunk, text=out["text"][upto(done):upto(done + len(chunk))],
                         finish=out["finish"] if i == len(out["chunks"]) - 1 else None,
                         prompt=out["prompt"] + out["tokens"][:done])
            done += len(chunk)
            events.append({k: v for k, v in self.response(piece).items() if k != "usage"})
        if not out["chunks"]:
            events.append({k: v for k, v in self.response(out).items() if k != "usage"})
        events.append({"id": "cmpl-0", "object": "text_completion", "model": MODEL, "choices": [],
                       "usage": self.response(out)["usage"]})
        return events

    def _logprobs(self, prompt, tokens, k, as_ids: bool) -> dict:
        """The raw (unprocessed) log-softmax of each new position, as vLLM reports by default."""
        model = self.draft if self.bug == "draft-logprobs" else self.target
        if not tokens:
            return {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
        logp = torch.log_softmax(logits, -1)
        name = (lambda t: f"token_id:{t}") if as_ids else str
        chosen = [float(logp[i, t]) for i, t in enumerate(tokens)]
        top = []
        for i in range(len(tokens)):
            values, ids = logp[i].topk(k) if k > 0 else (torch.empty(0), torch.empty(0, dtype=torch.long))
            top.append({name(int(t)): float(v) for v, t in zip(values, ids)})
        return {"tokens": [name(t) for t in tokens], "token_logprobs": chosen, "top_logprobs": top}


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def send_events(handler: BaseHTTPRequestHandler, events: list[dict]) -> None:
    """Server-sent events, then [DONE]; HTTP/1.0, so the body ends when the connection closes."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    for event in events:
        handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
    handler.wfile.write(b"data: [DONE]\n\n")


def _handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):   # quiet
            pass

        def _send(self, status: int, payload: dict):
            send_json(self, status, payload)

        def _send_events(self, events: list[dict]):
            send_events(self, events)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": server.owner}]})
            elif self.path == "/metrics":
                body = server.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/version" and server.version:
                self._send(200, {"version": server.version})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/tokenize":   # a stand-in tokenizer: bytes folded into the tiny vocabulary
                self._send(200, {"tokens": [b % server.target.config.vocab_size
                                             for b in str(body.get("prompt", "")).encode()][:48]})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            crowded = server.arrive()
            try:
                with server.lock:
                    status, out = 200, server.complete(body, crowded)
            except (ValueError, KeyError, TypeError) as err:
                status, out = 400, {"error": {"message": str(err)}}
            finally:   # before the answer goes out: the client's next request must not count this one
                server.leave()
            if status == 200 and body.get("stream"):
                self._send_events(server.stream_events(out))
            else:
                self._send(status, server.response(out) if status == 200 else out)

    return Handler
