"""Loading checkpoints as users have them: error hints that fit what was given, GGUF files
without the `gguf` extra, and chat-template prompts (spec.models)."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spec.models import encode_prompt, load_model, load_pair


def gguf_extra(monkeypatch, *, missing: tuple[str, ...]) -> None:
    """The `gguf` extra's packages as these tests need them, whatever is installed: the ones in
    `missing` not found, the others found (a stand-in spec; the loader only asks whether they
    exist). So the tests pin the messages with and without the extra on any environment."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in ("gguf", "accelerate"):
            return None if name in missing else importlib.machinery.ModuleSpec(name, None)
        return real(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


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
    gguf_extra(monkeypatch, missing=("gguf",))
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
    gguf_extra(monkeypatch, missing=("gguf",))
    assert cli.main(["--target", str(path), "--draft", str(path), "--out", str(tmp_path), "--quiet"]) == 2
    assert "spec[gguf]" in capsys.readouterr().err


# --- what counts as a path, and what the loaders pass on (pinned by hand) -------------------

@pytest.mark.parametrize("text, local", [
    ("/abs/model", True), ("/model", True), ("./model", True), ("../model", True), ("~/model", True), (".hidden", True),
    ("model.gguf", True), ("Model.GGUF", True), ("a/b/c", True), ("dir\\model", True),
    ("org/name", False), ("name", False), ("org/name.bin", False), ("gguf", False)])
def test_what_looks_like_a_path(text, local):
    """A missing path is named as a missing path; a hub id ('org/name', 'name') is looked up in the
    cache instead. (On POSIX os.sep is '/', so its own clause adds nothing here.)"""
    from spec.models import looks_local
    assert looks_local(text) is local


@pytest.mark.parametrize("missing, words", [(("gguf",), "the gguf package: "),
                                            (("accelerate",), "the accelerate package: "),
                                            (("gguf", "accelerate"), "the gguf and accelerate packages: ")])
def test_gguf_hint_names_each_missing_package(tmp_path, monkeypatch, missing, words):
    from spec.models import GGUF_HINT
    gguf_extra(monkeypatch, missing=missing)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ImportError) as info:
        load_model(path, role="draft")
    assert str(info.value) == f"draft: {str(path)!r} is a GGUF file; reading it needs {words}{GGUF_HINT}"


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, word_tokenizer):
    """A seeded tiny GPT-NeoX saved with a tokenizer, and a copy of the weights alone."""
    from spec.models import build_gpt_neox
    root = tmp_path_factory.mktemp("saved")
    model = build_gpt_neox("tiny-draft", seed=3)
    model.save_pretrained(root / "with-tokenizer")
    word_tokenizer.save_pretrained(root / "with-tokenizer")
    model.save_pretrained(root / "weights-only")
    return root, model


def test_load_model_passes_dtype_device_and_finds_the_tokenizer(saved_model):
    import torch
    root, model = saved_model
    loaded, tok = load_model(root / "with-tokenizer", dtype=torch.float64, device="cpu")
    assert next(loaded.parameters()).dtype == torch.float64 and not loaded.training
    assert next(loaded.parameters()).device.type == "cpu"
    assert tok is not None and tok.convert_tokens_to_ids("hello") == 4
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model.double()(ids).logits)
    model.float()
    assert load_model(root / "weights-only")[1] is None  # no tokenizer files: None, not an empty one


def test_load_model_names_its_role_in_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^model: no weights for "):
        load_model(tmp_path / "missing")


def test_encode_prompt_adds_special_tokens_once(word_tokenizer):
    """Raw text gets the tokenizer's special tokens; a chat prompt gets the template's alone (the
    rendered template already holds them)."""
    import copy

    from tokenizers.processors import TemplateProcessing
    tok = copy.deepcopy(word_tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert encode_prompt(tok, "hello there") == [0, 4, 5]
    assert encode_prompt(tok, "hello there", chat=True) == [2, 4, 5, 3]


def test_chat_refusal_says_what_is_missing():
    class NoTemplate:  # a tokenizer-like object with no chat_template attribute at all
        def encode(self, text):
            return [1]
    with pytest.raises(ValueError) as info:
        encode_prompt(NoTemplate(), "hi", chat=True)
    assert str(info.value) == "chat=True: this tokenizer has no chat template (an instruction-tuned model's has one)"


# --- what the loaders ask transformers for (spied: offline always, the GGUF file named) ------

class Spy:
    def __init__(self, answer):
        self.calls, self.answer = [], answer

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.answer


def test_tokenizers_are_loaded_offline_from_what_was_given(tmp_path, monkeypatch, saved_model):
    import spec.models as sm
    spy = Spy("tok")
    monkeypatch.setattr(sm.AutoTokenizer, "from_pretrained", spy)
    assert sm._tokenizer(str(tmp_path / "m.gguf")) == "tok"
    assert spy.calls[-1] == ((str(tmp_path),), {"gguf_file": "m.gguf", "local_files_only": True})
    root, _ = saved_model
    assert sm._tokenizer(str(root / "with-tokenizer")) == "tok"
    assert spy.calls[-1] == ((str(root / "with-tokenizer"),), {"local_files_only": True})
    assert sm._tokenizer("org/cached-id") == "tok"
    assert spy.calls[-1] == (("org/cached-id",), {"local_files_only": True})
    n = len(spy.calls)
    assert sm._tokenizer(str(root / "weights-only")) is None and len(spy.calls) == n  # not even asked
    for name in ("tokenizer.json", "tokenizer_config.json"):  # either file makes a folder a tokenizer's
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text("{}")
        assert sm._tokenizer(str(folder)) == "tok" and spy.calls[-1][0] == (str(folder),)


def test_load_pair_turns_tf32_off_for_an_fp32_target_on_cuda(monkeypatch, saved_model):
    import torch

    import spec.models as sm
    root, model = saved_model
    devices = []
    monkeypatch.setattr(sm, "_load", lambda name, role, dtype, device, tp_size=None: devices.append((role, device)) or model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # The TF32 flags are properties of torch's backend modules, not attributes in their __dict__:
    # monkeypatch (pytest >= 9.2) would undo them with delattr, which they refuse, and abandon the
    # rest of its undo. They are set and put back by hand.
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [flag.allow_tf32 for flag in flags]
    try:
        for flag in flags:
            flag.allow_tf32 = True
        _load_pair_on_devices(sm, root, devices)
    finally:
        for flag, value in zip(flags, saved):
            flag.allow_tf32 = value


def _load_pair_on_devices(sm, root, devices):
    import torch
    sm.load_pair(root / "with-tokenizer", root / "with-tokenizer", device="cuda:1", target_dtype=torch.bfloat16)
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    sm.load_pair(root / "with-tokenizer", root / "with-tokenizer", device="cuda:1")
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    # The target is asked for the device; the draft goes where the target's weights landed (a
    # split target's shard lies on its rank's device), which for this stand-in is the CPU.
    assert devices[-2:] == [("target", "cuda:1"), ("draft", "cpu")]
    for device in ("mps", "xpu", "xpu:0", "cpu"):
        sm.load_pair(root / "with-tokenizer", root / "with-tokenizer", device=device)
        assert devices[-2:] == [("target", device), ("draft", "cpu")]
    with pytest.raises(ValueError, match=r"^device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'$"):
        sm.load_pair(root / "with-tokenizer", root / "with-tokenizer", device="tpu")


def test_gguf_weights_are_loaded_offline_in_the_dtype_asked(tmp_path, monkeypatch, saved_model):
    import torch

    import spec.models as sm
    _, model = saved_model
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    spy = Spy(model)
    gguf_extra(monkeypatch, missing=())      # from_pretrained is spied: the packages are never used
    monkeypatch.setattr(sm.AutoModelForCausalLM, "from_pretrained", spy)
    assert sm._load(str(path), "target", torch.float64, "cpu") is model
    assert spy.calls == [((str(tmp_path),), {"gguf_file": "m.gguf", "dtype": torch.float64, "local_files_only": True})]

    def unreadable(*args, **kwargs):
        raise OSError("bad magic")
    monkeypatch.setattr(sm.AutoModelForCausalLM, "from_pretrained", unreadable)
    with pytest.raises(ValueError) as info:
        sm._load(str(path), "draft", torch.float32, "cpu")
    assert str(info.value) == f"draft: cannot load the GGUF file {str(path)!r}: OSError: bad magic"


def test_folders_and_hub_ids_are_loaded_offline_in_the_dtype_asked(monkeypatch, saved_model):
    import torch

    import spec.models as sm
    root, model = saved_model
    spy = Spy(model)
    monkeypatch.setattr(sm.AutoModelForCausalLM, "from_pretrained", spy)
    sm._load(str(root / "with-tokenizer"), "target", torch.float64, "cpu")
    assert spy.calls[-1] == ((str(root / "with-tokenizer"),), {"dtype": torch.float64, "local_files_only": True})
    monkeypatch.setattr(sm.AutoConfig, "from_pretrained", Spy(model.config))
    sm._load("org/cached-id", "target", torch.bfloat16, "cpu")
    assert spy.calls[-1] == (("org/cached-id",), {"dtype": torch.bfloat16, "local_files_only": True})


def test_a_home_relative_path_is_expanded(monkeypatch, saved_model):
    root, model = saved_model
    monkeypatch.setenv("HOME", str(root))
    loaded, tok = load_model("~/with-tokenizer")
    assert tok is not None
    import torch
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_load_errors_carry_the_underlying_error_type(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_model(tmp_path, role="draft")   # a folder with no config.json
    assert str(info.value).startswith(f"draft: {str(tmp_path)!r} holds no loadable model (no weights found)")
    assert "a .gguf file. (ValueError: " in str(info.value) or "a .gguf file. (OSError: " in str(info.value)
    with pytest.raises(FileNotFoundError) as info:
        load_model("org/surely-not-cached", role="target")
    assert "copy the cache here. (OSError: " in str(info.value)


def test_seeded_models_are_the_fp32_ones_cast():
    """build_gpt_neox builds in fp32 or fp64 and casts half precision afterwards: the same seed gives
    the same weights (rounded) in every dtype, and the default seed is 0."""
    import torch

    from spec.models import build_gpt_neox
    ref = build_gpt_neox("tiny-draft", seed=0)
    assert torch.equal(build_gpt_neox("tiny-draft").gpt_neox.embed_in.weight, ref.gpt_neox.embed_in.weight)
    for dtype in (torch.bfloat16, torch.float16):
        half = build_gpt_neox("tiny-draft", seed=0, dtype=dtype)
        for (name, a), (_, b) in zip(half.state_dict().items(), ref.state_dict().items()):
            assert a.dtype == (dtype if b.is_floating_point() else b.dtype), name
            assert torch.equal(a, b.to(a.dtype)), name
    assert torch.get_default_dtype() == torch.float32
