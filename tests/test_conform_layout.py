"""The conformance kit's structure, checked mechanically:

- a served-model run (`spec conform --impl openai:URL --reference openai:URL`) imports neither torch nor
  transformers: checking a server needs only the kit, pytest, hypothesis and an HTTP client (issue 41);
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from endpoint_proxy import Proxy

ROOT = Path(__file__).resolve().parents[1]

# The child runs `spec conform` as `python -m spec conform` does, then names the heavy modules it holds.
SERVED_RUN = textwrap.dedent("""
    import json, sys
    from spec.conformance import conform
    code = conform.main(sys.argv[1:])
    print("IMPORTED " + json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
    sys.exit(code)
""")


@pytest.mark.parametrize("bug, keyword, expected", [
    (None, "endpoint and not sampling_options", 0),           # every served property but the slow option laws
    ("block-token-wrong", "endpoint_greedy_exact", 1),        # a failure, its diagnosis and its --repro script
])
def test_a_served_model_run_imports_neither_torch_nor_transformers(endpoint_server, tmp_path, bug, keyword,
                                                                   expected):
    """The in-process servers (tests/endpoint_server.py) hold torch in this process; the run is a child that
    speaks to them over HTTP. Not vacuous: the child's properties must have run (passed, or failed with a
    script written), not been skipped."""
    server, reference = endpoint_server(True), endpoint_server(False)
    proxy = Proxy(server.url, bug) if bug else None
    try:
        out, folder = tmp_path / "conformance.json", tmp_path / "repro"
        argv = ["--impl", f"openai:{(proxy or server).url}", "--reference", f"openai:{reference.url}",
                "--budget", "0.25", "-k", keyword, "--out", str(out), "--repro", str(folder)]
        done = subprocess.run([sys.executable, "-c", SERVED_RUN, *argv], capture_output=True, text=True,
                              cwd=tmp_path, timeout=600, env={**_env(), "PYTHONPATH": str(ROOT)})
    finally:
        if proxy:
            proxy.stop()
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == expected, tail
    imported = [line for line in done.stdout.splitlines() if line.startswith("IMPORTED ")]
    assert imported == ["IMPORTED []"], tail
    rows = json.loads(out.read_text())["results"]
    passed = {r["property"] for r in rows if r["outcome"] == "passed"}
    if expected == 0:   # the statistics too: the first token's law at T = 1 is a chi-square
        assert {"endpoint_greedy_exact", "endpoint_stops", "endpoint_sampling_law", "endpoint_seeded"} <= passed, rows
    else:
        assert [(r["property"], r["outcome"]) for r in rows] == [(keyword, "failed")], rows
        assert len(list(folder.glob("*.py"))) == 1, tail


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
