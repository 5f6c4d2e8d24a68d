"""The kit's tree properties against the from-scratch tree decoders of spec/conformance/treedecoders.py,
given to `python -m spec conform` as a user gives one (`--impl path/to/file.py:function`), at the
default run's budget 0.25: each broken decoder fails the property that guards its class (exit 1,
that row FAIL), the correct one passes the same properties (exit 0). The kit's own controls
(spec/conformance/test_trees.py) call the same decoders in-process; this is the command line's path."""

from __future__ import annotations

import json

import pytest

import spec.__main__ as cli
from spec.conformance import treedecoders

# bug -> (-k selecting the property that must reject it, the failing row's property and case)
CAUGHT_BY = {
    "sibling_visible": ("test_tree_layout and not power", ("tree_layout", "decoy")),
    "sequential_positions": ("test_tree_layout and not power", ("tree_layout", "decoy")),
    "residual_on_draft_support": ("test_sampling_law and misses and not power",
                                  ("sampling_law", "draft support misses target mass")),
    "no_mass_removal": ("test_sampling_law and misses and not power",
                        ("sampling_law", "draft support misses target mass")),
    "shared_noise": ("test_sampling_law and bf16 and not power", ("sampling_law", "bf16 draft,fp32 target,T=0.6")),
}


def conform(name: str, keyword: str, tmp_path) -> tuple[int, dict]:
    out = tmp_path / f"{name}.json"
    code = cli.main(["conform", "--impl", f"{treedecoders.__file__}:{name}", "--budget", "0.25", "--no-shrink",
                     "-k", keyword, "--out", str(out)])
    report = json.loads(out.read_text())
    return code, {(r["property"], r["case"]): r["outcome"] for r in report["results"]}


@pytest.mark.parametrize("bug", list(CAUGHT_BY))
def test_each_broken_tree_decoder_fails_its_property_at_the_default_budget(bug, tmp_path):
    keyword, row = CAUGHT_BY[bug]
    code, outcomes = conform(bug, keyword, tmp_path)
    assert code == 1 and outcomes[row] == "failed", outcomes


def test_the_correct_tree_decoder_passes_the_same_properties(tmp_path):
    keyword = " or ".join(f"({k})" for k in sorted({k for k, _ in CAUGHT_BY.values()}))
    code, outcomes = conform("generate", keyword, tmp_path)
    assert code == 0, outcomes
    assert {row for _, row in CAUGHT_BY.values()} <= {k for k, v in outcomes.items() if v == "passed"}
