"""spec.parallel's checks in one process: what a split model is, how it is described, and what a
tensor-parallel call refuses when its ranks disagree.

test_tensor_parallel.py runs the real thing under torchrun (two processes, gloo, ~30 s); this module
pins the same decisions without launching anything: the rank group is faked where spec.parallel
calls torch.distributed (all_gather_object, broadcast_object_list), so every refusal is checked
word for word and a rank that sends something else is simulated exactly. The models are stand-ins
holding only what spec.hf reads (`_tp_size`, `hf_device_map`).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
import torch.distributed as dist

from spec import parallel


class _Mesh:
    """transformers' device mesh, as far as spec.hf reads it: the group of its "tp" dimension."""
    mesh_dim_names = ("tp",)

    def get_group(self, name=None):
        return f"group {name}"


def _tp(size=2):
    return NS(_tp_size=size, _device_mesh=_Mesh())


def _mapped(placement):
    return NS(hf_device_map=placement)


def test_a_model_is_split_by_tensor_parallelism_or_a_device_map_over_several_devices():
    assert parallel._devices(_mapped({"a": 0, "b": 1, "c": "cpu", "d": "disk", "e": 1})) == \
        ["cpu", "cuda:0", "cuda:1", "disk"]
    assert parallel._devices(NS()) == []
    assert parallel.is_split(_tp(2)) and parallel.is_split(_tp(4))
    assert not parallel.is_split(_tp(1)) and not parallel.is_split(NS())
    assert parallel.is_split(_mapped({"a": "cpu", "b": "disk"}))
    assert not parallel.is_split(_mapped({"a": "cpu", "b": "cpu"}))       # one device: not a split


def test_describe(monkeypatch):
    assert parallel.describe(torch.nn.Linear(2, 2)) == "whole on cpu"
    one_device = torch.nn.Linear(2, 2)
    one_device.hf_device_map = {"a": "cpu", "b": "cpu"}
    assert parallel.describe(one_device) == "whole on cpu"
    assert parallel.describe(_mapped({"a": "cpu", "b": "disk", "c": "cpu"})) == "device_map over cpu, disk (3 parts)"
    assert parallel.describe(_tp(2)) == \
        "tensor parallel over 2 processes (?; transformers' plan for SimpleNamespace)"   # no process group yet
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group: f"gloo of {group}")
    assert parallel.describe(_tp(3)) == \
        "tensor parallel over 3 processes (gloo of group tp; transformers' plan for SimpleNamespace)"


def test_the_random_state_is_the_generators_or_the_default_one():
    seeded = [torch.Generator().manual_seed(s) for s in (7, 7, 8)]
    states = [parallel._random_state(g, torch.device("cpu")) for g in seeded]
    assert states[0] == states[1] != states[2] and len(states[0]) == 16
    with torch.random.fork_rng():                       # the suite's own stream is left as it was
        torch.manual_seed(5)
        default = parallel._random_state(None, torch.device("cpu"))
        assert default == parallel._random_state(torch.Generator().manual_seed(5), torch.device("cpu"))
        torch.rand(1)                                   # the default stream moved on
        assert parallel._random_state(None, torch.device("cpu")) != default


def test_a_split_draft_runs_on_its_own_forward_only():
    split = _mapped({"a": "cpu", "b": "disk"})
    for impl in ("plain", "compiled"):
        with pytest.raises(ValueError) as info:
            parallel.check_draft(split, impl)
        assert str(info.value) == (f"draft_impl={impl!r}: the draft is split (device_map over cpu, disk (2 parts)), "
                                   "and that forward reads its weights as whole tensors on one device; use "
                                   "draft_impl='hf' or 'auto'")
        with pytest.raises(ValueError, match="the draft is split"):
            parallel.check(NS(), split, draft_impl=impl, prompt=torch.tensor([1]))
        assert parallel.check_draft(NS(), impl) is None
    for impl in ("hf", "auto"):
        assert parallel.check_draft(split, impl) is None
    assert parallel.check(NS(), split, prompt=torch.tensor([1])) is None            # draft_impl "auto" by default


class _Ranks:
    """The other ranks of a faked group: what each sends to all_gather_object is this rank's call
    with `theirs` applied; broadcast_object_list hands out rank 0's `zero`."""

    def __init__(self, monkeypatch, size=2, theirs=None, zero=None):
        self.sent, self.broadcast = [], []

        def world_size(group=None):
            assert group == "group tp", group           # the target's own group, not the default one
            return size
        monkeypatch.setattr(dist, "get_world_size", world_size)

        def gather(everyone, mine, group=None):
            assert group == "group tp", group
            self.sent.append(mine)
            everyone[:] = [mine] + [{**mine, **(theirs or {})} for _ in range(size - 1)]
        monkeypatch.setattr(dist, "all_gather_object", gather)

        def broadcast(box, src=None, group=None):
            assert group == "group tp", group
            self.broadcast.append(src)
            box[0] = zero
        monkeypatch.setattr(dist, "broadcast_object_list", broadcast)

        def global_rank(group, rank):
            assert group == "group tp", group
            return 10 + rank
        monkeypatch.setattr(dist, "get_global_rank", global_rank)


def test_a_whole_target_is_not_compared_across_ranks(monkeypatch):
    ranks = _Ranks(monkeypatch, theirs={"gamma": 9})
    assert parallel.check(_tp(1), gamma="auto", prompt=torch.tensor([1, 2]), do_sample=True) is None
    assert ranks.sent == []
    assert parallel.from_rank_zero(_tp(1), "mine") == "mine" and ranks.broadcast == []


def test_ranks_that_agree_pass_and_every_option_is_compared(monkeypatch):
    ranks = _Ranks(monkeypatch)
    assert parallel.check(_tp(2), gamma=4, prompt=torch.tensor([1, 2, 3]), max_new_tokens=8, eos_token_id=None) is None
    assert ranks.sent == [{"input_ids": [1, 2, 3], "gamma": 4, "max_new_tokens": 8, "eos_token_id": None}]
    assert parallel.check(_tp(2), gamma=4, prompt=torch.tensor([1]), do_sample=True,
                          generator=torch.Generator().manual_seed(3)) is None
    assert ranks.sent[-1]["generator (random state)"] == \
        parallel._random_state(torch.Generator().manual_seed(3), torch.device("cpu"))
    assert parallel.check(_tp(2), gamma=4, prompt=torch.tensor([1]), do_sample=False) is None
    assert "generator (random state)" not in ranks.sent[-1]              # greedy: the random stream is not read
    with torch.random.fork_rng():
        torch.manual_seed(3)                            # no generator: torch's default stream is compared
        assert parallel.check(_tp(2), gamma=4, prompt=torch.tensor([1]), do_sample=True) is None
    assert ranks.sent[-1]["generator (random state)"] == ranks.sent[-3]["generator (random state)"]


@pytest.mark.parametrize(("theirs", "message"), [
    ({"input_ids": [1, 2, 4]}, "input_ids differs between the 2 ranks of the tensor-parallel target (rank values: "
                               "['[1, 2, 3]', '[1, 2, 4]']): every rank must decode the same call"),
    ({"gamma": 5}, "gamma differs between the 2 ranks of the tensor-parallel target (rank values: ['4', '5']): "
                   "every rank must decode the same call"),
    ({"temperature": 0.5}, "temperature differs between the 2 ranks of the tensor-parallel target (rank values: "
                           "['1.0', '0.5']): every rank must decode the same call"),
    ({"generator (random state)": "x"}, "generator (random state) differs between the 2 ranks of the tensor-parallel "
                                        "target (rank values: [\"'%s'\", \"'x'\"]): every rank must decode the same "
                                        "call, with a generator seeded the same on every rank"),
])
def test_a_call_the_ranks_disagree_on_is_refused_naming_what_differs(monkeypatch, theirs, message):
    _Ranks(monkeypatch, theirs=theirs)
    generator = torch.Generator().manual_seed(1)
    state = parallel._random_state(generator, torch.device("cpu"))
    with pytest.raises(ValueError) as info:
        parallel.check(_tp(2), gamma=4, prompt=torch.tensor([1, 2, 3]), do_sample=True, temperature=1.0,
                       generator=generator)
    assert str(info.value) == message.replace("%s", state)


def test_a_long_value_is_shortened_in_the_refusal(monkeypatch):
    _Ranks(monkeypatch, size=3, theirs={"input_ids": list(range(100, 130))})
    with pytest.raises(ValueError) as info:
        parallel.check(_tp(3), gamma=2, prompt=torch.arange(30))
    short = repr(list(range(100, 130)))[:37] + "..."
    assert str(info.value) == (f"input_ids differs between the 3 ranks of the tensor-parallel target (rank values: "
                               f"['{repr(list(range(30)))[:37]}...', '{short}', '{short}']): every rank must decode "
                               "the same call")
    assert parallel._short("x" * 38) == repr("x" * 38)                 # 40 characters: kept whole
    assert parallel._short("x" * 39) == repr("x" * 39)[:37] + "..."


def test_gamma_auto_is_refused_for_a_tensor_parallel_target(monkeypatch):
    ranks = _Ranks(monkeypatch)
    with pytest.raises(ValueError) as info:
        parallel.check(_tp(2), gamma="auto", prompt=torch.tensor([1]))
    assert str(info.value) == ("gamma='auto' with a tensor-parallel target (tensor parallel over 2 processes (?; "
                               "transformers' plan for SimpleNamespace)): each rank would time its own passes and "
                               "choose its own gamma, and the ranks' passes must match; pass a fixed gamma")
    assert ranks.sent == []                                              # refused before any collective


def test_from_rank_zero_takes_rank_zeros_value(monkeypatch):
    ranks = _Ranks(monkeypatch, zero=6)
    assert parallel.from_rank_zero(_tp(2), 3) == 6
    assert ranks.broadcast == [10]                                       # the group's rank 0, as a global rank
