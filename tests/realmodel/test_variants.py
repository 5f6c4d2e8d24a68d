"""Every variant of the native library below the one this CPU picks (which the rest of the suite runs),
forced in turn (SPEC_NATIVE_ISA), through exactness on the real model: SmolLM2-135M's fp32 target (its
passes on the fp32 kernel where the variant has one: AVX2+FMA and AVX-512F) drafted by its own Q4_1 GGUF on
spec.cpu.qdraft (the plain-C kernel below the VNNI variant): speculative output equal to greedy, the paths
taken being the ones the variant names. In one subprocess, the model loaded once and its packed passes
and probes made again for each variant."""

from __future__ import annotations

import json
import subprocess
import sys

import nativecheck
import pytest

from spec import realmodel

pytestmark = pytest.mark.realmodel

SCRIPT = r"""
import json, os, sys, torch
torch.set_num_threads(1)
from spec import greedy_generate, probe, realmodel, speculative_generate
from spec.cpu import executor, native
from spec.gguf_draft import GGUFDraft
model, tok = realmodel.load(say=lambda msg: None)
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids[0].tolist()   # short: the plain-C draft is slow
want = greedy_generate(model, ids, max_new_tokens=10).tokens
for isa in map(int, sys.argv[1:]):
    os.environ["SPEC_NATIVE_ISA"] = str(isa)
    probe._MEMO.get(model, {}).pop("executor", None)      # (the executor's probes: again for this variant)
    draft = GGUFDraft(realmodel.gguf_path(), model, tok, engine="native")
    got = speculative_generate(model, draft, ids, gamma=4, max_new_tokens=10)
    print(json.dumps({"isa": native.isa(), "kernel": executor.executor_for(model).most > 0, "equal": got.tokens == want,
                      "accepted": got.accepted, "engine": draft.engine_name, "draft_isa": draft.run.model.isa}))
"""


def test_each_variant_below_the_best_decodes_the_real_model_exactly():
    if not realmodel.converted():
        pytest.skip("SmolLM2-135M-Instruct is not in the cache (`python -m spec.realmodel`)")
    best = nativecheck.require_library().spec_native_isa()
    if best == 0:
        pytest.skip("this CPU runs the plain-C variant only (the rest of the suite runs it)")
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, range(best))], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    outs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [o["isa"] for o in outs] == list(range(best)) == [o["draft_isa"] for o in outs], outs
    for o in outs:
        assert o["equal"] and o["accepted"] > 0 and o["engine"] == "native", o
        assert o["kernel"] is (o["isa"] >= 1), o          # the plain-C variant leaves the target on oneDNN
