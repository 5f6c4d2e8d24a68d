"""`spec conform --repro DIR`: a standalone reproduction script for each failed property of a served subject.

While the kit runs, every Violation a served property raises is recorded here with the single requests
that show it (endpoints.Case: the prompt as token ids, the request, the reference's ids and the ids the
server under test gave, the first divergence with the reference's top-2 gap) and the server's identity;
the last one of a test wins (hypothesis's shrunk counterexample). `write(DIR)` turns each into a Python
script that needs only the standard library (urllib, json): it sends the same request bodies to the same
server, prints what came back against what the reference gave, and exits 1 when the failure is still
there, 0 when the server now gives the reference's ids. A failure that shows only among requests in flight
together (endpoints.Crowd: concurrency, mixed_batch) gets a script that sends them at once, in threads, up
to ATTEMPTS times (a scheduler need not batch them alike every time), and exits 1 when a greedy request
differs from what it gave alone in any attempt. A seeded request that gave two samples when sent twice
alone (endpoints.Repeat: endpoint_seeded) gets a script that sends it twice, up to REPEAT_ATTEMPTS times (the
vLLM ngram one is intermittent), and exits 1 when the two differ. A request that took the server down (a 5xx,
endpoints.Crash), or a known crash the kit does not send (KNOWN_CRASHES, an expected failure), gets a script
that sends it and then a plain greedy request, and exits 1 when the server answered 5xx or nothing. `spec
conform` runs each once and says whether it reproduced, but for a known crash, which it does not rerun (it would
leave the user's server dead). A property whose failure is a law over many samples carries no request: its
report line says so.
Every script takes `--server http://HOST:PORT` to send its requests to another address than the kit's run
(the same engine started again on another port) and `--model NAME` for the served model's name there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

RECORDED: dict[str, dict] = {}   # pytest node id -> {property, impl, identity, requests}


def record(name: str, impl, subject, violation) -> None:
    """Keep `violation`'s single requests (as bodies for the side under test) for the running test."""
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", name).rsplit(" (", 1)[0]
    from spec.conformance.endpoints import Crash, Repeat
    side = subject.test
    requests, crowd, repeat, crash = [], None, None, None
    for case in getattr(violation, "cases", ()):
        if not hasattr(side, "request"):   # an engine in process: no HTTP request to replay
            continue
        if isinstance(case, Repeat):       # one request sent twice alone, two outputs
            dialect, url, body = side.request(case.prompt, case.max_tokens, **case.request)
            repeat = dict(dialect=dialect, url=url, body=body, first=case.first, second=case.second)
            continue
        if isinstance(case, Crash):        # a request that took the server down, sent or known
            dialect, url, body = side.request(case.prompt, case.max_tokens, **case.request) if case.sent is None \
                else (side.dialect, *case.sent)
            prompt = case.prompt if case.prompt is not None else body.get("prompt")
            _, probe_url, probe = side.request(list(prompt), 4)
            crash = dict(dialect=dialect, url=url, body=body, probe=dict(dialect=dialect, url=probe_url, body=probe),
                         reason=case.reason, sent=case.sent is not None)
            continue
        if hasattr(case, "requests"):      # endpoints.Crowd: requests that fail only together
            crowd = []
            for (prompt, n, keywords), expected, actual in zip(case.requests, case.expected, case.actual):
                dialect, url, body = side.request(prompt, n, **keywords)
                crowd.append(dict(dialect=dialect, url=url, body=body, expected=expected, actual=actual))
            continue
        dialect, url, body = side.request(case.prompt, case.max_tokens, **case.request)
        requests.append(dict(dialect=dialect, url=url, body=body, expected=case.expected, actual=case.actual,
                             divergence=case.divergence))
    try:
        identity = subject.identity()
    except Exception as err:   # evidence only
        identity = f"unknown ({type(err).__name__})"
    RECORDED[nodeid] = dict(property=name, impl=impl.name, identity=identity, requests=requests, crowd=crowd,
                            repeat=repeat, crash=crash, message=str(violation).splitlines()[0][:300])


SCRIPT = '''"""Reproduces a failure the spec conformance kit saw: property {property} of {impl}.
Server: {identity}
{message}
Each request below is sent to the server under test as it was sent by the kit (the prompt as token ids);
the reference server (the same model without speculation) gave `expected`, the server under test gave
`actual`. Needs only the Python standard library. Exit status: 1 when a request still gives other ids than
the reference's (the failure reproduces), 0 when every request now gives the reference's ids."""
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

REQUESTS = json.loads({requests!r})
{common}

failed = 0
for number, r in enumerate(REQUESTS):
    got = send(r)
    print(f"request {{number}}: POST {{at(r['url'])}} {{json.dumps(body_of(r))}}")
    if r["divergence"]:
        print(f"  the kit saw: {{r['divergence']}}")
    print(f"  reference {{r['expected']}}\\n  the kit saw {{r['actual']}}\\n  now        {{got}}")
    if got != r["expected"]:
        failed += 1
print("REPRODUCED: %d of %d requests differ from the reference's ids" % (failed, len(REQUESTS)) if failed
      else "not reproduced: every request gave the reference's ids")
sys.exit(1 if failed else 0)
'''

COMMON = '''
SERVER = sys.argv[sys.argv.index("--server") + 1] if "--server" in sys.argv else None
MODEL = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else None


def at(url):
    """The recorded URL, at --server's scheme, host and port when given."""
    if not SERVER:
        return url
    new, old = urllib.parse.urlsplit(SERVER), urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((new.scheme, new.netloc, old.path, old.query, old.fragment))


def body_of(r):
    """The JSON body sent for request r: the recorded one, its "model" replaced by --model when given."""
    return dict(r["body"], model=MODEL) if MODEL and "model" in r["body"] else r["body"]


def send(r, tries=4):
    """The new ids the server gives for request r. A connection refused or reset before an answer (a busy
    listen queue) is retried, as the kit retries it; an answered request never is."""
    body = body_of(r)
    request = urllib.request.Request(at(r["url"]), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return new_ids(r["dialect"], json.load(response))
        except (ConnectionError, urllib.error.URLError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(err, urllib.error.HTTPError) or not isinstance(reason, ConnectionError) \
                    or attempt == tries - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def new_ids(dialect, answer):
    if dialect == "llama-server":
        return answer["tokens"]
    choice = answer["choices"][0]
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
'''

ATTEMPTS = 5     # a crowd is sent at most this many times: whether an engine batches it alike varies

CROWD_SCRIPT = '''"""Reproduces a failure the spec conformance kit saw: property {property} of {impl}.
Server: {identity}
{message}
The requests below are sent to the server under test at once (one thread each), as the kit sent them (the
prompts as token ids); each greedy request (`expected` not null) gave `expected` when sent alone and must give
it again among the others. Up to {attempts} attempts. Needs only the Python standard library. Exit status: 1
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

CROWD = json.loads({crowd!r})
{common}

for attempt in range(1, {attempts} + 1):
    got, errors = [None] * len(CROWD), []

    def run(k):
        try:
            got[k] = send(CROWD[k])
        except Exception as err:   # no answer: not a reproduction either way
            errors.append(f"request {{k}}: {{type(err).__name__}}: {{err}}")
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(CROWD))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print("no verdict: requests failed\\n  " + "\\n  ".join(errors))
        sys.exit(2)
    differ = [k for k, r in enumerate(CROWD) if r["expected"] is not None and got[k] != r["expected"]]
    print(f"attempt {{attempt}}: {{len(CROWD)}} requests at once to {{at(CROWD[0]['url'])}}, "
          f"{{len(differ)}} greedy outputs differ from their output alone")
    for k in differ:
        r = CROWD[k]
        first = next((i for i, (a, b) in enumerate(zip(r["expected"], got[k])) if a != b),
                     min(len(r["expected"]), len(got[k])))
        print(f"  request {{k}} {{json.dumps(body_of(r))}}\\n    alone    {{r['expected']}}\\n    together {{got[k]}}"
              f"\\n    first difference at new token {{first}}")
    if differ:
        print("REPRODUCED: %d of %d greedy requests differ from their output alone (attempt %d)"
              % (len(differ), sum(r["expected"] is not None for r in CROWD), attempt))
        sys.exit(1)
print("not reproduced: every greedy request gave its output alone in %d attempts" % {attempts})
sys.exit(0)
'''


REPEAT_ATTEMPTS = 24   # a seeded request is sent twice at most this many times (vLLM ngram: 1 pair in 12)

REPEAT_SCRIPT = '''"""Reproduces a failure the spec conformance kit saw: property {property} of {impl}.
Server: {identity}
{message}
The request below (the prompt as token ids, a seed) is sent to the server under test twice, alone, one after the
other, as the kit sent it; the kit saw two different outputs (`first`, `second`), where the reference server (the
same model without speculation) repeats its sample for the same seed. Up to --attempts N pairs (default
{attempts}): the failure may be intermittent. Needs only the Python standard library. Exit status: 1 when the two
outputs of a pair differ (the failure reproduces), 0 when every pair repeated its sample, 2 when a request got
no answer. Options: --server http://HOST:PORT sends the requests there instead (the same engine on another
port), --model NAME names the model there (the "model" field of the body)."""
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

REPEAT = json.loads({repeat!r})
ATTEMPTS = int(sys.argv[sys.argv.index("--attempts") + 1]) if "--attempts" in sys.argv else {attempts}
{common}

print(f"POST {{at(REPEAT['url'])}} {{json.dumps(body_of(REPEAT))}}")
print(f"  the kit saw {{REPEAT['first']}}\\n  then        {{REPEAT['second']}}")
for attempt in range(1, ATTEMPTS + 1):
    try:
        first, second = send(REPEAT), send(REPEAT)
    except Exception as err:   # no answer: not a reproduction either way
        print(f"no verdict: the request failed: {{type(err).__name__}}: {{err}}")
        sys.exit(2)
    if first != second:
        print(f"attempt {{attempt}}: {{first}}\\n  then      {{second}}")
        print("REPRODUCED: the same seeded request gave two samples (attempt %d of %d)" % (attempt, ATTEMPTS))
        sys.exit(1)
    print(f"attempt {{attempt}}: repeated {{first}}")
print("not reproduced: the seeded request repeated its sample in %d pairs" % ATTEMPTS)
sys.exit(0)
'''

CRASH_SCRIPT = '''"""Reproduces a failure the spec conformance kit saw: property {property} of {impl}.
Server: {identity}
{message}
{why}
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

CRASH = json.loads({crash!r})
{common}

def post(r):
    """(HTTP status or None for no answer, the new ids or what came back instead)."""
    request = urllib.request.Request(at(r["url"]), data=json.dumps(body_of(r)).encode(),
                                     headers={{"Content-Type": "application/json"}})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, new_ids(r["dialect"], json.load(response))
    except urllib.error.HTTPError as err:
        return err.code, err.read()[:300].decode(errors="replace")
    except (OSError, ValueError) as err:   # refused, reset, timed out: no answer
        return None, f"{{type(err).__name__}}: {{err}}"


dead = False
for what, r in (("the request", CRASH), ("then a plain greedy request", CRASH["probe"])):
    status, got = post(r)
    print(f"{{what}}: POST {{at(r['url'])}} {{json.dumps(body_of(r))}}\\n  answered {{status}}: {{got}}")
    dead = dead or status is None or status >= 500
    time.sleep(1.0)
print("REPRODUCED: the server answered 5xx or nothing" if dead else "not reproduced: both requests were answered")
sys.exit(1 if dead else 0)
'''


def _file_name(nodeid: str) -> str:
    name = nodeid.split("::")[-1].removeprefix("test_")
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120] + ".py"


def write(folder: Path, failed_nodeids) -> dict[str, tuple[Path | None, str]]:
    """For each failed node id: (the script, what rerunning it once said), or (None, why there is none)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for nodeid in failed_nodeids:
        seen = RECORDED.get(nodeid)
        if seen is None or not (seen["requests"] or seen.get("crowd") or seen.get("repeat") or seen.get("crash")):
            out[nodeid] = (None, "no reproduction script: the failure is no request that can be replayed (a law "
                                 "over samples, or an engine in process)")
            continue
        script = folder / _file_name(nodeid)
        said = dict(property=seen["property"], impl=seen["impl"], identity=seen["identity"], common=COMMON,
                    message=seen["message"].replace('"""', "'''"))
        if seen.get("crash"):
            crash = seen["crash"]
            why = ("The kit sent it and the server answered 5xx or nothing." if crash["sent"] else
                   "A known crash: the kit did not send it (KNOWN_CRASHES).") + \
                (f" {crash['reason']}" if crash["reason"] else "")
            script.write_text(CRASH_SCRIPT.format(crash=json.dumps(crash), why=why.replace('"""', "'''"), **said))
        elif seen.get("repeat"):
            script.write_text(REPEAT_SCRIPT.format(repeat=json.dumps(seen["repeat"]), attempts=REPEAT_ATTEMPTS, **said))
        elif seen["requests"]:
            script.write_text(SCRIPT.format(requests=json.dumps(seen["requests"]), **said))
        else:
            script.write_text(CROWD_SCRIPT.format(crowd=json.dumps(seen["crowd"]), attempts=ATTEMPTS, **said))
        if seen.get("crash") and not seen["crash"]["sent"]:
            out[nodeid] = (script, f"{script}: not rerun (a known crash: it would leave the server dead; run it "
                                   f"against a server you can restart)")
        else:
            out[nodeid] = (script, rerun(script))
    return out


def rerun(script: Path) -> str:
    """Run the script once: whether the failure reproduced."""
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return f"{script}: rerun timed out"
    if done.returncode == 1 and "REPRODUCED" in done.stdout:   # exit 1 alone could be a traceback
        return f"{script}: reproduces (exit 1)"
    if done.returncode == 0:
        return f"{script}: did not reproduce on rerun (exit 0)"
    return f"{script}: rerun failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-300:]}"
