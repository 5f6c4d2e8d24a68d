"""A prompt that, with max_new_tokens, would run past a model's position limit
(config.max_position_embeddings) is refused up front by both decoders, naming the numbers."""

from __future__ import annotations

import pytest

from spec import build_gpt_neox, greedy_generate, speculative_generate


@pytest.fixture(scope="module")
def short_pair():
    """Tiny models configured for 16 positions: the target allows 16, the draft only 12."""
    return build_gpt_neox("tiny-target", seed=1, max_position_embeddings=16), \
        build_gpt_neox("tiny-draft", seed=2, max_position_embeddings=12)


def test_greedy_refuses_past_the_limit(short_pair):
    target, _ = short_pair
    assert len(greedy_generate(target, list(range(10)), max_new_tokens=6).tokens) == 6  # 10 + 6 = 16: fits
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(7\) = 17 positions exceeds "
                                         r"the model's limit of 16"):
        greedy_generate(target, list(range(10)), max_new_tokens=7)


def test_speculative_names_the_model_whose_limit_is_passed(short_pair):
    target, draft = short_pair
    assert len(speculative_generate(target, draft, list(range(8)), gamma=3, max_new_tokens=4).tokens) == 4  # 12
    with pytest.raises(ValueError, match=r"= 13 positions exceeds the draft's limit of 12"):
        speculative_generate(target, draft, list(range(8)), gamma=3, max_new_tokens=5)
