"""A pytest plugin that fails the test which leaves process-wide state changed.

A patch of a third-party global that is not undone (a monkeypatch whose undo raised half way,
an assignment with no restore) silently changes what every later test tests: with
`torch.cuda.is_available` stuck at True the GPU cases "pass" on a CPU, with spec's loader
mocked the perf suite times a stand-in. So each test's state is compared before and after it,
after all of its fixtures are torn down; a change is restored at once (the rest of the session
runs on the real thing) and reported as an error of that test, naming the attribute.

Watched: `torch.cuda.is_available`, torch's backend flags (TF32, cuDNN benchmark and
determinism, deterministic algorithms, the default dtype), and every function of spec's loaders
(spec.models) and of its transformers adapter (spec.hf). Registered by the root conftest.py.
"""

from __future__ import annotations

import pytest
import torch

import spec.hf
import spec.models


def _flags() -> dict[str, tuple]:
    """name -> (current value, restore(value)) for each watched flag."""
    b = torch.backends

    def attr(obj, name):
        return getattr(obj, name), lambda v, o=obj, n=name: setattr(o, n, v)
    return {
        "torch.cuda.is_available": attr(torch.cuda, "is_available"),
        "torch.backends.cuda.matmul.allow_tf32": attr(b.cuda.matmul, "allow_tf32"),
        "torch.backends.cudnn.allow_tf32": attr(b.cudnn, "allow_tf32"),
        "torch.backends.cudnn.benchmark": attr(b.cudnn, "benchmark"),
        "torch.backends.cudnn.deterministic": attr(b.cudnn, "deterministic"),
        "torch.are_deterministic_algorithms_enabled()": (torch.are_deterministic_algorithms_enabled(),
                                                         torch.use_deterministic_algorithms),
        "torch.get_default_dtype()": (torch.get_default_dtype(), torch.set_default_dtype),
    }


def _functions(module) -> dict[str, tuple]:
    return {f"{module.__name__}.{name}": (value, lambda v, m=module, n=name: setattr(m, n, v))
            for name, value in vars(module).items() if callable(value) and not isinstance(value, type)}


def snapshot() -> dict[str, tuple]:
    return {**_flags(), **_functions(spec.models), **_functions(spec.hf)}


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """Restores every watched value that differs, and describes each."""
    out = []
    for name, (old, restore) in before.items():
        new = after.get(name, (None,))[0]
        if new is not old and new != old:
            restore(old)
            out.append(f"{name} (was {old!r}, left as {new!r})")
    return out


@pytest.fixture(autouse=True)
def leak_guard(request):
    """Fails the test that leaves a watched global changed (module docstring)."""
    before = snapshot()
    yield
    leaked = changes(before, snapshot())
    if leaked:
        pytest.fail(f"{request.node.nodeid} left process-wide state changed (restored now): "
                    + "; ".join(leaked), pytrace=False)
