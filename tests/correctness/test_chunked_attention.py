"""Models whose forward pads its input to a chunk length, or draws random numbers.

Reformer pads every input to a multiple of its attention chunk length; given position_ids, its
padding path fails for inputs that need padding past the first chunk (transformers 5.25:
"upper bound and lower bound inconsistent with step sign"). Its LSH attention with no hash_seed
draws new random rotations on every call, so its forward is not a function of the ids past what
one query attends to (two chunks here). spec must decode the first exactly at every prompt length
(positions chosen by a probe that crosses the chunk length) and refuse the second up front, like
any model left in training mode with dropout on.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, ReformerConfig, ReformerModelWithLMHead

from spec import greedy_generate, runner, speculative_generate
from spec.runner import UnsupportedModelError

NEW = 6


def reformer(layers: tuple[str, ...], chunk: int, hash_seed: int | None, seed: int = 0):
    torch.manual_seed(seed)
    config = ReformerConfig(is_decoder=True, attn_layers=list(layers), axial_pos_shape=[16, 16],
                            axial_pos_embds_dim=[32, 32], local_attn_chunk_length=chunk, lsh_attn_chunk_length=chunk,
                            max_position_embeddings=256, vocab_size=320, hidden_size=64, num_attention_heads=2,
                            attention_head_size=32, feed_forward_size=128, num_hashes=1, num_buckets=4,
                            hash_seed=hash_seed)
    return ReformerModelWithLMHead(config).double().eval()


def authors_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding by the model's own forward, called as its authors call it: ids only."""
    seq, out = ids.tolist(), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layers, chunk, hash_seed", [(("local", "lsh"), 16, 0), (("lsh", "local"), 8, 3)],
                         ids=["local+lsh chunk 16", "lsh+local chunk 8"])
def test_reformer_is_exact_at_every_prompt_length(layers, chunk, hash_seed):
    model = reformer(layers, chunk, hash_seed)
    draft = reformer(("local",), chunk, 0, seed=1)
    assert runner.verdict(model)[1] == "own"     # its own positions: given any, its padding path fails
    for length in range(1, 65):
        ids = torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(length))
        expected = authors_greedy(model, ids, NEW)
        assert greedy_generate(model, ids, max_new_tokens=NEW).tokens == expected, f"prompt of {length}"
        if length % 7 == 0:
            assert speculative_generate(model, draft, ids, gamma=3, max_new_tokens=NEW).tokens == expected, \
                f"prompt of {length}"


def test_reformer_with_random_hashing_is_refused_up_front():
    model = reformer(("local", "lsh"), 16, None)
    with pytest.raises(UnsupportedModelError, match="its forward is not deterministic"):
        greedy_generate(model, [5, 6, 7], max_new_tokens=2)


def test_a_model_left_in_training_mode_with_dropout_is_refused_naming_eval():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5)).double()
    model.train()
    with pytest.raises(UnsupportedModelError, match=r"call model\.eval\(\)"):
        greedy_generate(model, [5, 6, 7], max_new_tokens=2)
    runner.forget(model)
    assert greedy_generate(model.eval(), [5, 6, 7], max_new_tokens=2).tokens == authors_greedy(
        model, torch.tensor([5, 6, 7]), 2)
