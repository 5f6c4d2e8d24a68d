"""The small target/draft pair shipped in spec/assets/pair (made by `python recipes/train_pair.py`).

Loads both models the way a user would (AutoModelForCausalLM / AutoTokenizer from the
package folder, fp32, eager attention) and checks the properties the rest of the project
relies on: an exact byte-level tokenizer, one EOS/BOS id, Pythia-style padded logit widths
that differ, and a draft that agrees with the target often. Thresholds sit well below the
values in RECIPE.json, so the tests are deterministic but still mean something.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

PAIR = Path(str(importlib.resources.files("spec").joinpath("assets", "pair")))
EOS_ID = 0

# Not from the standard library, so neither the tokenizer nor the models saw it.
SNIPPET = '''\
class Inventory:
    """Keep track of items and their counts."""

    def __init__(self, items=None):
        self.items = dict(items or {})

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must be non-negative")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def remove(self, name, count=1):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] <= 0:
            del self.items[name]

    def __len__(self):
        return len(self.items)

    def __repr__(self):
        return f"{self.__class__.__name__}({self.items!r})"
'''

ROUND_TRIP = [
    SNIPPET,
    "import os\nimport sys\n\n\ndef main(argv=None):\n\treturn 0\r\n",
    "x = {'a': [1, 2.5e-3, None], \"b\": b'\\x00\\xff'}  # comment\n",
    "s = 'caf\u00e9 \u6f22\u5b57 \U0001f642 \u200b'\n    \n\n   trailing   ",
    "",
    " ",
    "<|endoftext|> inside text",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(PAIR / "target")


@pytest.fixture(scope="module")
def pair():
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", **kw).eval()
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", **kw).eval()
    return target, draft


@pytest.fixture(scope="module")
def recipe():
    return json.loads((PAIR / "RECIPE.json").read_text())


def rows(model) -> int:
    return model.get_input_embeddings().num_embeddings


def test_files_and_size_budget():
    for name in ("target", "draft"):
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (PAIR / name / f).is_file(), f"{name}/{f}"
    # Both folders carry the same tokenizer.
    assert (PAIR / "target" / "tokenizer.json").read_bytes() == (PAIR / "draft" / "tokenizer.json").read_bytes()
    total = sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file())
    assert total <= 32 * 2**20, f"shipped pair is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trip_is_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids  # no BOS/EOS added implicitly


def test_both_folders_load_the_same_tokenizer(tok):
    other = AutoTokenizer.from_pretrained(PAIR / "draft")
    assert len(other) == len(tok)
    assert other.encode(SNIPPET) == tok.encode(SNIPPET)


def test_special_token_ids_agree(tok, pair):
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == EOS_ID
    assert tok.convert_ids_to_tokens(EOS_ID) == "<|endoftext|>"
    for model in pair:
        assert model.config.eos_token_id == model.config.bos_token_id == EOS_ID
        assert model.generation_config.eos_token_id == EOS_ID
        assert model.generation_config.bos_token_id == EOS_ID


def test_padded_widths_differ_like_pythia(tok, pair):
    target, draft = pair
    n = len(tok)
    for model in pair:
        assert model.config.vocab_size == rows(model) == model.get_output_embeddings().out_features
        assert rows(model) % 128 == 0
        assert not model.config.tie_word_embeddings
    assert n <= rows(draft) < rows(target)


def test_pythia_style_architecture(pair):
    target, draft = pair
    for model in pair:
        cfg = model.config
        assert cfg.model_type == "gpt_neox"
        assert cfg.use_parallel_residual
        assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(draft) < n_params(target)


def test_recipe_records_the_run(recipe, tok, pair):
    target, draft = pair
    assert recipe["tokenizer"]["len"] == len(tok)
    assert recipe["target"]["vocab_size"] == rows(target)
    assert recipe["draft"]["vocab_size"] == rows(draft)
    assert recipe["eval"]["alpha_greedy"] >= 0.6
    assert recipe["corpus"]["files_heldout"] > 0


@torch.inference_mode()
def test_teacher_forced_on_held_out_snippet(tok, pair):
    target, draft = pair
    ids = torch.tensor([tok.encode(SNIPPET)])
    lt = target(input_ids=ids).logits[0]
    ld = draft(input_ids=ids).logits[0]
    # Neither model ever prefers a padding row.
    assert lt.argmax(-1).max().item() < len(tok)
    assert ld.argmax(-1).max().item() < len(tok)
    # Both have learned something (uniform over 4000 tokens would be ~8.3 nats).
    y = ids[0, 1:]
    loss_t = torch.nn.functional.cross_entropy(lt[:-1], y).item()
    loss_d = torch.nn.functional.cross_entropy(ld[:-1], y).item()
    assert loss_t < 3.5, loss_t
    assert loss_d < 4.5, loss_d
    agree = (lt.argmax(-1) == ld.argmax(-1)).float().mean().item()
    assert agree >= 0.45, agree


@torch.inference_mode()
def test_greedy_generate_is_non_trivial(tok, pair):
    target, draft = pair
    prompt = "    def __init__(self"
    enc = tok(prompt, return_tensors="pt")
    outs = {}
    for name, model in (("target", target), ("draft", draft)):
        out = model.generate(**enc, do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=EOS_ID)
        new = out[0, enc["input_ids"].shape[1] :]
        assert len(new) == 24
        assert new.max().item() < len(tok)
        text = tok.decode(new)
        assert text.strip(), name
        assert len(set(new.tolist())) >= 2, (name, text)  # not one token repeated (4 distinct when made)
        outs[name] = new
    # The target's greedy tokens, scored by the draft: it predicts a fair share of them.
    full = torch.cat([enc["input_ids"][0], outs["target"]])[None]
    ld = draft(input_ids=full[:, :-1]).logits[0, enc["input_ids"].shape[1] - 1 :]
    agree = (ld.argmax(-1) == outs["target"]).float().mean().item()
    assert agree >= 0.3, agree
