"""Reproduces a failure the spec conformance kit saw: property endpoint_mixed_batch of openai:http://127.0.0.1:39699/v1.
Server: vllm 0.32.0
greedy output changes when sampled requests are in flight:
The requests below are sent to the server under test at once (one thread each), as the kit sent them (the
prompts as token ids); each greedy request (`expected` not null) gave `expected` when sent alone and must give
it again among the others. Up to 5 attempts. Needs only the Python standard library. Exit status: 1
when a greedy request differs from its output alone in some attempt (the failure reproduces), 0 when none does.
Options: --server http://HOST:PORT sends the requests there instead (the same engine on another port), and
--model NAME names the model there (the "model" field of each body)."""
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

CROWD = json.loads('[{"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 100}, "expected": null, "actual": [260, 6639, 2177, 282, 1380, 30, 8486, 14405, 1380, 3445, 2534, 253, 1743, 335, 622, 29]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [788, 253, 8101, 5610, 8195, 335, 14801, 28, 2907, 3213, 338], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 101}, "expected": null, "actual": [1022, 411, 11702, 14633, 47482, 9505, 395, 8139, 105, 494, 2972, 253, 7316, 418, 260, 26378]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 11594, 327, 253, 3468, 9678, 13027, 20521, 5909, 351], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 102}, "expected": null, "actual": [260, 20521, 2581, 30, 1626, 1464, 253, 3468, 48518, 28, 511, 260, 5749, 457, 288, 746]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [1604, 11087, 79, 7916, 24, 2110, 28, 2370, 727], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 103}, "expected": null, "actual": [472, 2049, 79, 2771, 28, 1048, 446, 216, 32, 28, 3858, 24, 2110, 43179, 25, 472]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 2536, 1463, 282, 260, 3008, 4469, 7057, 2744, 338], "max_tokens": 16, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false, "seed": 104}, "expected": null, "actual": [260, 11022, 506, 986, 29, 17632, 11022, 436, 7957, 411, 2026, 10995, 28, 441, 43272, 30]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [338, 24151, 1380, 3445, 12380, 940, 28, 837, 260, 3491, 314, 288, 3142, 253, 1678, 7616], "actual": [338, 24151, 1380, 3445, 12380, 940, 28, 837, 260, 3491, 314, 288, 3142, 253, 1678, 7616]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [788, 253, 8101, 5610, 8195, 335, 14801, 28, 2907, 3213, 338], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [260, 1205, 2106, 314, 5181, 282, 2733, 253, 1942, 282, 476, 18210, 18, 338, 416, 325], "actual": [260, 1205, 2106, 314, 5181, 282, 2733, 253, 1942, 282, 476, 18210, 18, 338, 416, 325]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 11594, 327, 253, 3468, 9678, 13027, 20521, 5909, 351], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [253, 2232, 11594, 42, 216, 33, 30, 216, 34, 12382, 282, 511, 29, 24196, 7367, 216], "actual": [253, 2232, 11594, 42, 216, 33, 30, 216, 34, 12382, 282, 511, 29, 24196, 7367, 216]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [1604, 11087, 79, 7916, 24, 2110, 28, 2370, 727], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [472, 2049, 28, 1048, 446, 216, 32, 28, 3858, 24, 2110, 25, 731, 216, 33, 472], "actual": [472, 2049, 28, 1048, 446, 216, 32, 28, 3858, 24, 2110, 27552, 25, 731, 216, 33]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 2536, 1463, 282, 260, 3008, 4469, 7057, 2744, 338], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [260, 11022, 506, 2063, 436, 5932, 8406, 411, 260, 7222, 282, 260, 4469, 7057, 506, 3385], "actual": [260, 11022, 506, 2063, 436, 5932, 8406, 411, 260, 7222, 282, 260, 6, 30, 824, 31]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 1646, 3193, 826, 24151, 284, 46164, 1380, 314], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [338, 24151, 1380, 3445, 12380, 940, 28, 837, 260, 3491, 314, 288, 3142, 253, 1678, 7616], "actual": [338, 24151, 1380, 3445, 12380, 940, 28, 837, 260, 3491, 314, 288, 3142, 253, 1678, 7616]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [788, 253, 8101, 5610, 8195, 335, 14801, 28, 2907, 3213, 338], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [260, 1205, 2106, 314, 5181, 282, 2733, 253, 1942, 282, 476, 18210, 18, 338, 416, 325], "actual": [260, 1205, 2106, 314, 5181, 282, 2733, 253, 1942, 282, 476, 18210, 18, 338, 416, 325]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 11594, 327, 253, 3468, 9678, 13027, 20521, 5909, 351], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [253, 2232, 11594, 42, 216, 33, 30, 216, 34, 12382, 282, 511, 29, 24196, 7367, 216], "actual": [253, 2232, 11594, 42, 216, 33, 30, 216, 34, 12382, 282, 511, 29, 24196, 7367, 216]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [1604, 11087, 79, 7916, 24, 2110, 28, 2370, 727], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [472, 2049, 28, 1048, 446, 216, 32, 28, 3858, 24, 2110, 25, 731, 216, 33, 472], "actual": [472, 2049, 28, 1048, 446, 216, 32, 28, 3858, 24, 2110, 0, 198, 19, 10783, 8598]}, {"dialect": "openai", "url": "http://127.0.0.1:39699/v1/completions", "body": {"model": "/tmp/h41/bt/vllm-model0", "prompt": [504, 2536, 1463, 282, 260, 3008, 4469, 7057, 2744, 338], "max_tokens": 16, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true, "return_tokens_as_token_ids": true, "echo": false, "n": 1, "stream": false}, "expected": [260, 11022, 506, 2063, 436, 5932, 8406, 411, 260, 7222, 282, 260, 4469, 7057, 506, 3385], "actual": [260, 11022, 506, 2063, 436, 5932, 8406, 411, 260, 7222, 282, 260, 6, 30, 824, 31]}]')

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


for attempt in range(1, 5 + 1):
    got, errors = [None] * len(CROWD), []

    def run(k):
        try:
            got[k] = send(CROWD[k])
        except Exception as err:   # no answer: not a reproduction either way
            errors.append(f"request {k}: {type(err).__name__}: {err}")
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(CROWD))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print("no verdict: requests failed\n  " + "\n  ".join(errors))
        sys.exit(2)
    differ = [k for k, r in enumerate(CROWD) if r["expected"] is not None and got[k] != r["expected"]]
    print(f"attempt {attempt}: {len(CROWD)} requests at once to {at(CROWD[0]['url'])}, "
          f"{len(differ)} greedy outputs differ from their output alone")
    for k in differ:
        r = CROWD[k]
        first = next((i for i, (a, b) in enumerate(zip(r["expected"], got[k])) if a != b),
                     min(len(r["expected"]), len(got[k])))
        print(f"  request {k} {json.dumps(r['body'])}\n    alone    {r['expected']}\n    together {got[k]}"
              f"\n    first difference at new token {first}")
    if differ:
        print("REPRODUCED: %d of %d greedy requests differ from their output alone (attempt %d)"
              % (len(differ), sum(r["expected"] is not None for r in CROWD), attempt))
        sys.exit(1)
print("not reproduced: every greedy request gave its output alone in %d attempts" % 5)
sys.exit(0)
