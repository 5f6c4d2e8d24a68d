"""Exact speculative decoding for Hugging Face causal LMs (Leviathan, Kalman & Matias, ICML 2023).

The names below are imported on first use, so that `python -m spec --help` does not
pay for importing torch and transformers."""

import importlib

_EXPORTS = {"Result": "spec.decode", "Round": "spec.decode", "greedy_generate": "spec.decode",
            "speculative_generate": "spec.decode", "SHIPPED_PAIR": "spec.models", "Pair": "spec.models",
            "build_gpt_neox": "spec.models", "load_pair": "spec.models",
            "PromptLookup": "spec.lookup", "TreeDraft": "spec.treedraft", "LookupTree": "spec.treedraft",
            "FirstOf": "spec.firstof", "Tree": "spec.tree", "Need": "spec.protocols",
            "DraftSource": "spec.protocols", "Step": "spec.protocols"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'spec' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
