"""`spec conform --repro DIR`: a standalone reproduction script for each failed property of a served subject.

While the kit runs, every Violation a served property raises is recorded here with the single requests
that show it (endpoints.Case: the prompt as token ids, the request, the reference's ids and the ids the
server under test gave, the first divergence with the reference's top-2 gap) and the server's identity;
the last one of a test wins (hypothesis's shrunk counterexample). `write(DIR)` turns each into a Python
script that needs only the standard library (urllib, json): it sends the same request bodies to the same
server, prints what came back against what the reference gave, and exits 1 when the failure is still
there, 0 when the server now gives the reference's ids. `spec conform` runs each once and says whether it
reproduced. A property whose failure is a law over many samples, or a crowd of requests in flight,
carries no single request: its report line says so.
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
    side = subject.test
    requests = []
    for case in getattr(violation, "cases", ()):
        if not hasattr(side, "request"):   # an engine in process: no HTTP request to replay
            continue
        dialect, url, body = side.request(case.prompt, case.max_tokens, **case.request)
        requests.append(dict(dialect=dialect, url=url, body=body, expected=case.expected, actual=case.actual,
                             divergence=case.divergence))
    try:
        identity = subject.identity()
    except Exception as err:   # evidence only
        identity = f"unknown ({type(err).__name__})"
    RECORDED[nodeid] = dict(property=name, impl=impl.name, identity=identity, requests=requests,
                            message=str(violation).splitlines()[0][:300])


SCRIPT = '''"""Reproduces a failure the spec conformance kit saw: property {property} of {impl}.
Server: {identity}
{message}
Each request below is sent to the server under test as it was sent by the kit (the prompt as token ids);
the reference server (the same model without speculation) gave `expected`, the server under test gave
`actual`. Needs only the Python standard library. Exit status: 1 when a request still gives other ids than
the reference's (the failure reproduces), 0 when every request now gives the reference's ids."""
import json
import sys
import urllib.request

REQUESTS = json.loads({requests!r})


def new_ids(dialect, answer):
    if dialect == "llama-server":
        return answer["tokens"]
    choice = answer["choices"][0]
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


failed = 0
for number, r in enumerate(REQUESTS):
    request = urllib.request.Request(r["url"], data=json.dumps(r["body"]).encode(),
                                     headers={{"Content-Type": "application/json"}})
    with urllib.request.urlopen(request, timeout=300) as response:
        got = new_ids(r["dialect"], json.load(response))
    print(f"request {{number}}: POST {{r['url']}} {{json.dumps(r['body'])}}")
    if r["divergence"]:
        print(f"  the kit saw: {{r['divergence']}}")
    print(f"  reference {{r['expected']}}\\n  the kit saw {{r['actual']}}\\n  now        {{got}}")
    if got != r["expected"]:
        failed += 1
print("REPRODUCED: %d of %d requests differ from the reference's ids" % (failed, len(REQUESTS)) if failed
      else "not reproduced: every request gave the reference's ids")
sys.exit(1 if failed else 0)
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
        if seen is None or not seen["requests"]:
            out[nodeid] = (None, "no reproduction script: the failure is not one request (a law over samples, "
                                 "requests in flight together, or an engine in process)")
            continue
        script = folder / _file_name(nodeid)
        script.write_text(SCRIPT.format(property=seen["property"], impl=seen["impl"], identity=seen["identity"],
                                        message=seen["message"].replace('"""', "'''"),
                                        requests=json.dumps(seen["requests"])))
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
