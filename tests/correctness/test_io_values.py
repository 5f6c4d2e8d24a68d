"""Small pieces with exact answers, pinned by hand: the one clock (spec.clock) and the Whisper
features files the CLI reads (spec.seq2seq.load_features / feature_prompts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec import clock, seq2seq


def test_timed_reads_the_clock_after_syncing_the_device_on_both_sides(monkeypatch):
    ticks, synced = iter([10.0, 12.5]), []
    monkeypatch.setattr(clock.time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(clock, "sync", synced.append)
    assert clock.timed(lambda: "out", device="cuda:1") == ("out", 2.5)
    assert synced == ["cuda:1", "cuda:1"]


def test_sync_waits_only_for_cuda(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    clock.sync(None), clock.sync("cpu"), clock.sync(torch.device("cpu"))
    assert waited == []
    clock.sync("cuda:0")
    assert waited == [torch.device("cuda:0")]


class NotATensor:
    pass


def test_features_files_are_read_as_float_tensors(tmp_path):
    feats = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save(feats, tmp_path / "a.pt")
    np.save(tmp_path / "b.npy", feats.double().numpy())
    names, label, tensors = seq2seq.feature_prompts([tmp_path / "a.pt", tmp_path / "b.npy"])
    assert names == [str(tmp_path / "a.pt"), str(tmp_path / "b.npy")] and label == "features files"
    assert torch.equal(tensors[0], feats) and tensors[1].dtype == torch.float64
    assert torch.equal(tensors[1], feats.double()) and tensors[0].device.type == "cpu"


def test_features_files_that_are_not_one_float_tensor_are_refused(tmp_path):
    cases = {"ints.pt": torch.arange(4), "list.pt": [1.0, 2.0]}
    for name, value in cases.items():
        torch.save(value, tmp_path / name)
        with pytest.raises(ValueError) as info:
            seq2seq.load_features(tmp_path / name)
        assert str(info.value) == (f"--features: {str(tmp_path / name)!r} must hold one floating-point tensor "
                                   "[num_mel_bins, frames]")
    # a pickled object: refused as torch.load(weights_only=True) refuses it, not unpickled
    torch.save(NotATensor(), tmp_path / "obj.pt")
    with pytest.raises(ValueError, match=r"^--features: cannot read '.*obj\.pt': Weights only load failed"):
        seq2seq.load_features(tmp_path / "obj.pt")
    np.save(tmp_path / "obj.npy", np.array([NotATensor()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"cannot read '.*obj\.npy': Object arrays cannot be loaded when allow_pickle=False"):
        seq2seq.load_features(tmp_path / "obj.npy")


def test_feature_prompts_raise_the_callers_error_type(tmp_path):
    class UsageError(Exception):
        pass
    with pytest.raises(UsageError, match=r"^--features: cannot read '.*missing\.pt': "):
        seq2seq.feature_prompts([tmp_path / "missing.pt"], error=UsageError)
