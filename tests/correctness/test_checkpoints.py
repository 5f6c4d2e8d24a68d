"""Loading checkpoints as users have them: error hints that fit what was given, GGUF files
without the `gguf` extra, and chat-template prompts (spec.models)."""

from __future__ import annotations

import importlib.util

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spec.models import encode_prompt, load_model, load_pair


def test_missing_local_path_is_named_as_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file or folder .*nowhere.* does not exist"):
        load_pair(tmp_path / "nowhere", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"target: .*no such GGUF file .*model\.gguf"):
        load_model(tmp_path / "model.gguf", role="target")


def test_folder_without_weights_says_what_it_lacks(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no loadable model \(no weights found\): a folder needs config.json"):
        load_model(tmp_path, role="target")


def test_unknown_hub_id_says_it_is_neither_path_nor_cached():
    with pytest.raises(FileNotFoundError, match=r"no local path, and no hub id in the local cache"):
        load_model("EleutherAI/pythia-does-not-exist", role="draft")


def test_gguf_without_the_extra_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # never read: the check comes first
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"GGUF file; reading it needs the gguf package: pip install 'spec\[gguf\]'"):
        load_model(path, role="target")


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer with a chat template written here, so the expected ids follow by hand."""
    words = ["<s>", "</s>", "[user]", "[bot]", "hello", "there", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}[{{ m.role | replace('assistant', 'bot') }}] {{ m.content }} "
                          "{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}")
    return fast


def test_chat_prompt_is_wrapped_in_the_template(word_tokenizer):
    assert encode_prompt(word_tokenizer, "hello there") == [4, 5]
    # "[user] hello there [bot]": role marker, the words, then the assistant's turn opened
    assert encode_prompt(word_tokenizer, "hello there", chat=True) == [2, 4, 5, 3]


def test_chat_without_a_template_is_refused(word_tokenizer):
    word_tokenizer = __import__("copy").deepcopy(word_tokenizer)
    word_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(word_tokenizer, "hello", chat=True)


def test_cli_chat_on_a_tokenizer_without_template_exits_2(tmp_path, capsys):
    import spec.__main__ as cli
    assert cli.main(["--chat", "--max-new-tokens", "2", "--out", str(tmp_path), "--quiet", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "--chat" in err and "no chat template" in err and "Traceback" not in err


def test_cli_gguf_target_without_the_extra_exits_2(tmp_path, monkeypatch, capsys):
    import spec.__main__ as cli
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    assert cli.main(["--target", str(path), "--draft", str(path), "--out", str(tmp_path), "--quiet"]) == 2
    assert "spec[gguf]" in capsys.readouterr().err
