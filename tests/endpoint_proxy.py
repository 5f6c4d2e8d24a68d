"""A proxy in front of any OpenAI-compatible completions server (ours in-process, or vLLM) that injects one
class of bug serving engines have shipped with speculative decoding: the negative controls of the
endpoint properties against a real engine. The upstream does the decoding; the proxy changes the request
it forwards or the response it returns.

    proxy = Proxy("http://127.0.0.1:8712/v1", "penalties-ignored"); proxy.url ...; proxy.stop()
"""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from endpoint_server import send_events, send_json

# name -> (what the engine does wrong, the property that must reject it)
BUGS = {
    "max-tokens+1": ("returns one token more than max_tokens", "endpoint_stops"),
    "drop-last-token": ("drops the last token of a full-length output", "endpoint_greedy_exact"),
    "block-token-wrong": ("the 5th new token (inside the first accepted block) is another one",
                          "endpoint_greedy_exact"),
    "stop-ids-ignored": ("ignores stop_token_ids", "endpoint_stops"),
    "min-tokens-ignored": ("ignores min_tokens", "endpoint_stops"),
    "eos-ignored": ("does not stop at EOS", "endpoint_stops"),
    "stop-strings-ignored": ("ignores stop strings", "endpoint_greedy_options"),
    "penalties-ignored": ("drops repetition/presence/frequency penalties", "endpoint_greedy_options"),
    "logit-bias-ignored": ("drops logit_bias", "endpoint_greedy_options"),
    "filters-ignored": ("drops top_k/top_p/min_p", "endpoint_sampling_options"),
    "temperature-off": ("samples at 1.5x the requested temperature", "endpoint_sampling_law"),
    "seed-ignored": ("draws a fresh seed for every request", "endpoint_seeded"),
    "seed-position": ("adds the request's position in the batch (the requests in flight when it arrived) to its "
                      "seed", "endpoint_seeded_batch"),
    "batch-shape": ("changes the last token when other requests are in flight", "endpoint_concurrency"),
    "sampled-neighbour": ("changes a greedy request's last token while a sampled request is in flight (vLLM 0.32.0 "
                          "CPU with ngram does worse: docs/CONFORMANCE.md)", "endpoint_mixed_batch"),
    "penalised-neighbour": ("changes a greedy request's last token while a penalised request (repetition, presence or "
                            "frequency penalty) is in flight, and only then", "endpoint_companions[penalised]"),
    "logprobs-shifted": ("reports each token's logprob at the next position", "endpoint_logprobs"),
    "logprobs-processed": ("reports logprobs after temperature (logprob / T)", "endpoint_sampled_logprobs"),
    "finish-length": ("says finish_reason 'length' whatever stopped it", "endpoint_fields"),
    "usage-drafted": ("counts drafted tokens in usage.completion_tokens", "endpoint_fields"),
    "text-last-piece": ("leaves the last token's text out of `text`", "endpoint_fields"),
    "top-k-kills": ("a request with top_k at T > 0 kills the engine: answered 500, and so is every later completion "
                    "request (vLLM 0.32.0 CPU under speculation: docs/CONFORMANCE.md)", "endpoint_sampling_options"),
    "stream-drops-blocks": ("streams only the last token of a multi-token step", "endpoint_streaming"),
}


class _Listener(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog of 128, not 5: the kit sends up to 20 requests at once, and
    on a loaded box a full accept queue reset a connection (endpoint_mixed_batch failed with ECONNRESET)."""
    request_queue_size = 128
    daemon_threads = True


def _request(bug: str, body: dict) -> dict:
    body = dict(body)
    if bug == "max-tokens+1":
        body["max_tokens"] = body.get("max_tokens", 16) + 1
    elif bug == "stop-ids-ignored":
        body.pop("stop_token_ids", None)
    elif bug == "min-tokens-ignored":
        body.pop("min_tokens", None)
    elif bug == "eos-ignored":
        body["ignore_eos"] = True
    elif bug == "stop-strings-ignored":
        body.pop("stop", None)
    elif bug == "penalties-ignored":
        for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            body.pop(key, None)
    elif bug == "logit-bias-ignored":
        body.pop("logit_bias", None)
    elif bug == "filters-ignored":
        for key in ("top_k", "top_p", "min_p"):
            body.pop(key, None)
    elif bug == "temperature-off" and body.get("temperature"):
        body["temperature"] = body["temperature"] * 1.5
    elif bug == "seed-ignored" and "seed" in body:
        body["seed"] = random.randrange(2 ** 31)
    return body


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def _choice(bug: str, choice: dict, body: dict, crowded: bool, sampled: bool = False, penalised: bool = False) -> None:
    ids = choice.get("token_ids")
    lp = choice.get("logprobs") or None
    if bug == "drop-last-token" and ids and len(ids) == body.get("max_tokens"):
        del ids[-1]
        if lp:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                del lp[key][-1]
    elif bug == "block-token-wrong" and ids and len(ids) > 4:
        prompt = body["prompt"]
        ids[4] = next((t for t in prompt + [0, 1] if t != ids[4]))
        if lp:
            lp["tokens"][4] = f"token_id:{ids[4]}"
    elif (bug == "batch-shape" and crowded or (bug == "sampled-neighbour" and sampled or
                                               bug == "penalised-neighbour" and penalised)
          and not body.get("temperature")) and ids:
        ids[-1] = next((t for t in body["prompt"] + [0, 1] if t != ids[-1]))
    elif bug == "logprobs-shifted" and lp and lp.get("token_logprobs"):
        values = lp["token_logprobs"]
        lp["token_logprobs"] = values[1:] + values[-1:]
    elif bug == "logprobs-processed" and lp and lp.get("token_logprobs") and body.get("temperature"):
        lp["token_logprobs"] = [v / body["temperature"] for v in lp["token_logprobs"]]
    elif bug == "finish-length":
        choice["finish_reason"] = "length"
    elif bug == "text-last-piece" and ids and isinstance(choice.get("text"), str) and len(ids) > 1:
        choice["text"] = choice["text"][:-1]


class Proxy:
    def __init__(self, upstream: str, bug: str | None):
        import httpx2
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)}, got {bug!r}")
        self.upstream, self.bug = upstream.rstrip("/"), bug
        self.root = self.upstream.removesuffix("/v1")
        self.client = httpx2.Client(timeout=httpx2.Timeout(300.0, connect=5.0), trust_env=False)
        self.lock = threading.Lock()
        self.in_flight: list[dict] = []          # the completion requests in flight: each one's company
        self.dead = False                        # top-k-kills: the engine died; every completion answers 500
        self.httpd = _Listener(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()

    def completions(self, body: dict, company: dict):
        """(status, JSON answer) or (200, the list of stream events). `company`: whether another request,
        whether a sampled one and whether a penalised one, was in flight at any moment while this one was (set
        on arrival, by this one's and by later ones': not read off the clock, so a control does not depend on timing)."""
        if self.bug == "top-k-kills" and body.get("top_k") and body.get("temperature"):
            self.dead = True
        if self.dead:
            return 500, {"error": {"message": "EngineCore encountered an issue (the engine is dead)", "code": 500}}
        sent = _request(self.bug, body)
        if self.bug == "seed-position" and "seed" in sent:
            sent["seed"] += company["position"]
        if not body.get("stream"):
            response = self.client.post(f"{self.upstream}/completions", json=sent)
            answer = response.json()
            if response.status_code == 200:
                for choice in answer.get("choices") or []:
                    _choice(self.bug, choice, body, company["crowded"], company["sampled"], company["penalised"])
                if self.bug == "usage-drafted" and isinstance(answer.get("usage"), dict):
                    answer["usage"]["completion_tokens"] += 2
            return response.status_code, answer
        events = []
        with self.client.stream("POST", f"{self.upstream}/completions", json=sent) as response:
            if response.status_code != 200:
                return response.status_code, json.loads(response.read() or b"{}")
            for line in response.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    for choice in event.get("choices") or []:
                        ids = choice.get("token_ids")
                        if self.bug == "stream-drops-blocks" and ids and len(ids) > 1:
                            choice["token_ids"] = ids[-1:]
                    events.append(event)
        return 200, events


def _handler(proxy: Proxy):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, payload):
            if isinstance(payload, list):      # stream events
                send_events(self, payload)
            else:
                send_json(self, status, payload)

        def do_GET(self):
            response = proxy.client.get(f"{proxy.root}{self.path}")
            if self.path == "/metrics":          # Prometheus text, passed through (the upstream's counters)
                body = response.content
                self.send_response(response.status_code)
                self.send_header("Content-Type", response.headers.get("content-type", "text/plain"))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self._send(response.status_code, response.json())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/completions":
                response = proxy.client.post(f"{proxy.root}{self.path}", json=body)
                self._send(response.status_code, response.json())
                return
            sampling = bool(body.get("temperature"))
            penalising = any(body.get(k) for k in PENALTIES)
            with proxy.lock:
                company = {"crowded": bool(proxy.in_flight), "sampled": any(c["sampling"] for c in proxy.in_flight),
                           "penalised": any(c["penalising"] for c in proxy.in_flight),
                           "sampling": sampling, "penalising": penalising, "position": len(proxy.in_flight)}
                for other in proxy.in_flight:
                    other["crowded"] = True
                    other["sampled"] = other["sampled"] or sampling
                    other["penalised"] = other["penalised"] or penalising
                proxy.in_flight.append(company)
            try:
                status, answer = proxy.completions(body, company)
            finally:
                with proxy.lock:
                    proxy.in_flight.remove(company)
            self._send(status, answer)

    return Handler
