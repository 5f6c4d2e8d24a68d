"""Exact speculative decoding for Hugging Face causal LMs (Leviathan, Kalman & Matias, ICML 2023)."""

from spec.decode import Result, Round, greedy_generate, speculative_generate
from spec.lookup import PromptLookup
from spec.models import SHIPPED_PAIR, Pair, build_gpt_neox, load_pair

__all__ = ["Result", "Round", "greedy_generate", "speculative_generate", "SHIPPED_PAIR", "Pair",
           "build_gpt_neox", "load_pair", "PromptLookup"]
__version__ = "0.1.0"
