"""Hypothesis strategies for the correctness suite, named for what they generate."""

from __future__ import annotations

from hypothesis import strategies as st


def token_id_prompts(vocab: int, max_len: int = 300, eos_token_id: int = 0):
    """Prompts as token-id lists: random ids, one token repeated, ids at the edges of
    the vocabulary, and the EOS id inside the prompt. Lengths from 1 to max_len."""
    edges = st.sampled_from([0, 1, vocab - 2, vocab - 1, eos_token_id])
    any_id = st.integers(0, vocab - 1)
    random_ids = st.lists(any_id, min_size=1, max_size=max_len)
    repeated = st.builds(lambda t, n: [t] * n, any_id | edges, st.integers(1, max_len))
    edgy = st.lists(edges | any_id, min_size=1, max_size=min(max_len, 40))
    return st.one_of(random_ids, repeated, edgy)


def short_token_id_prompts(vocab: int, eos_token_id: int = 0):
    return token_id_prompts(vocab, max_len=24, eos_token_id=eos_token_id)


def gammas(max_gamma: int = 16):
    """Draft lengths from 1 to max_gamma (also larger than the tokens left, by pairing with small max_new_tokens)."""
    return st.integers(1, max_gamma)


def max_new_tokens_values(max_value: int = 64):
    """1 (a single target step, nothing drafted) up to max_value."""
    return st.one_of(st.just(1), st.integers(1, max_value))


def text_prompts():
    """Prompts as text: code-like snippets and arbitrary printable text."""
    code = st.sampled_from(["def ", "import os\n", "class Foo(object):\n    def __init__(self", "for i in range(",
                            "    return ", "# comment\n", "if __name__ == '__main__':\n"])
    words = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=60)
    return st.one_of(code, words, st.builds(lambda a, b: a + b, code, words))


def short_prompts_for_tiny_vocab(vocab: int, max_len: int = 12):
    """Token-id prompts of 1..max_len ids for the architecture registry's 256-token models:
    random ids, one id repeated (recurrent states see a constant input), and the special ids
    0/1/2 and the top of the vocabulary mixed in."""
    any_id = st.integers(0, vocab - 1)
    edges = st.sampled_from([0, 1, 2, vocab - 1])
    return st.one_of(st.lists(any_id, min_size=1, max_size=max_len),
                     st.builds(lambda t, n: [t] * n, any_id, st.integers(1, max_len)),
                     st.lists(edges | any_id, min_size=1, max_size=max_len))


def max_new_tokens_crossing_window(window: int, max_value: int = 20):
    """Generation lengths from window + 1 up: even a one-token prompt then grows past a
    sliding window of `window` tokens, so some verify pass crosses the window boundary."""
    return st.integers(window + 1, max_value)


def batches_of_prompts(vocab: int, max_rows: int = 5, eos_token_id: int = 0):
    """Batches of 1 to max_rows prompts of different lengths (1 to 24 tokens), as lists of ids."""
    return st.lists(short_token_id_prompts(vocab, eos_token_id), min_size=1, max_size=max_rows)
