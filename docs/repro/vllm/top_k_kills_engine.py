"""Reproduces a failure the spec conformance kit saw: property endpoint_sampling_options of openai:http://127.0.0.1:52423/v1.
Server: vllm 0.32.0
known crash, not sent by the kit (KNOWN_CRASHES): the request below took this engine down
A known crash: the kit did not send it (KNOWN_CRASHES). vLLM 0.32.0 (CPU) with speculative decoding (ngram or draft_model): a request with top_k at T > 0 whose step has no draft tokens kills the EngineCore (RuntimeError: max() of an empty tensor in apply_top_k_only, from the rejection sampler); every later request answers 500 until a restart. The plain server serves it. docs/CONFORMANCE.md has the request
The request below (the prompt as token ids) is sent to the server under test, then a plain greedy request on the
same prompt. WARNING: where it reproduces, the server is left dead (restart it). Needs only the Python standard
library. Exit status: 1 when the server answered either request with a 5xx or not at all (the failure reproduces),
0 when both were answered. Options: --server http://HOST:PORT sends the requests there instead (the same engine
on another port), --model NAME names the model there (the "model" field of each body)."""
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

CRASH = json.loads('{"dialect": "openai", "url": "http://127.0.0.1:52423/v1/completions", "body": {"model": "/tmp/v41/a/model", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 4, "temperature": 0.9, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 5000, "top_k": 2}, "probe": {"dialect": "openai", "url": "http://127.0.0.1:52423/v1/completions", "body": {"model": "/tmp/v41/a/model", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 4, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}}, "reason": "vLLM 0.32.0 (CPU) with speculative decoding (ngram or draft_model): a request with top_k at T > 0 whose step has no draft tokens kills the EngineCore (RuntimeError: max() of an empty tensor in apply_top_k_only, from the rejection sampler); every later request answers 500 until a restart. The plain server serves it. docs/CONFORMANCE.md has the request", "sent": false}')

SERVER = sys.argv[sys.argv.index("--server") + 1] if "--server" in sys.argv else None
MODEL = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else None


def at(url):
    """The recorded URL, at --server's scheme, host and port when given."""
    if not SERVER:
        return url
    new, old = urllib.parse.urlsplit(SERVER), urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((new.scheme, new.netloc, old.path, old.query, old.fragment))


def send(r, tries=4):
    """The new ids the server gives for request r. A connection refused or reset before an answer (a busy
    listen queue) is retried, as the kit retries it; an answered request never is."""
    body = dict(r["body"], model=MODEL) if MODEL and "model" in r["body"] else r["body"]
    request = urllib.request.Request(at(r["url"]), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return new_ids(r["dialect"], json.load(response))
        except (ConnectionError, urllib.error.URLError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(err, urllib.error.HTTPError) or not isinstance(reason, ConnectionError)                     or attempt == tries - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def new_ids(dialect, answer):
    if dialect == "llama-server":
        return answer["tokens"]
    choice = answer["choices"][0]
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def post(r):
    """(HTTP status or None for no answer, the new ids or what came back instead)."""
    body = dict(r["body"], model=MODEL) if MODEL and "model" in r["body"] else r["body"]
    request = urllib.request.Request(at(r["url"]), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, new_ids(r["dialect"], json.load(response))
    except urllib.error.HTTPError as err:
        return err.code, err.read()[:300].decode(errors="replace")
    except (OSError, ValueError) as err:   # refused, reset, timed out: no answer
        return None, f"{type(err).__name__}: {err}"


dead = False
for what, r in (("the request", CRASH), ("then a plain greedy request", CRASH["probe"])):
    status, got = post(r)
    print(f"{what}: POST {at(r['url'])} {json.dumps(r['body'])}\n  answered {status}: {got}")
    dead = dead or status is None or status >= 500
    time.sleep(1.0)
print("REPRODUCED: the server answered 5xx or nothing" if dead else "not reproduced: both requests were answered")
sys.exit(1 if dead else 0)
