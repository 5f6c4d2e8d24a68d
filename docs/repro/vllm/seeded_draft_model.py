"""Reproduces a failure the spec conformance kit saw: property endpoint_seeded of openai:http://127.0.0.1:52423/v1.
Server: vllm 0.32.0
prompt 0, seed 11, T=1.0: the same request gave [260, 10848, 2110, 30, 198, 198, 22959, 14405] then [260, 2424, 804, 288, 6611, 260, 1743, 506] (the reference repeats its sample)
The request below (the prompt as token ids, a seed) is sent to the server under test twice, alone, one after the
other, as the kit sent it; the kit saw two different outputs (`first`, `second`), where the reference server (the
same model without speculation) repeats its sample for the same seed. Up to --attempts N pairs (default
24): the failure may be intermittent. Needs only the Python standard library. Exit status: 1 when the two
outputs of a pair differ (the failure reproduces), 0 when every pair repeated its sample, 2 when a request got
no answer. Options: --server http://HOST:PORT sends the requests there instead (the same engine on another
port), --model NAME names the model there (the "model" field of the body)."""
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

REPEAT = json.loads('{"dialect": "openai", "url": "http://127.0.0.1:52423/v1/completions", "body": {"model": "/tmp/v41/a/model", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 8, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 11}, "first": [260, 10848, 2110, 30, 198, 198, 22959, 14405], "second": [260, 2424, 804, 288, 6611, 260, 1743, 506]}')
ATTEMPTS = int(sys.argv[sys.argv.index("--attempts") + 1]) if "--attempts" in sys.argv else 24

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


print(f"POST {at(REPEAT['url'])} {json.dumps(REPEAT['body'])}")
print(f"  the kit saw {REPEAT['first']}\n  then        {REPEAT['second']}")
for attempt in range(1, ATTEMPTS + 1):
    try:
        first, second = send(REPEAT), send(REPEAT)
    except Exception as err:   # no answer: not a reproduction either way
        print(f"no verdict: the request failed: {type(err).__name__}: {err}")
        sys.exit(2)
    if first != second:
        print(f"attempt {attempt}: {first}\n  then      {second}")
        print("REPRODUCED: the same seeded request gave two samples (attempt %d of %d)" % (attempt, ATTEMPTS))
        sys.exit(1)
    print(f"attempt {attempt}: repeated {first}")
print("not reproduced: the seeded request repeated its sample in %d pairs" % ATTEMPTS)
sys.exit(0)
