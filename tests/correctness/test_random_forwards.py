"""Forwards that draw random numbers: refused up front, with the reason.

Reformer's LSH attention with no hash_seed draws new random rotations on every call, so its
forward is not a function of the ids past what one query attends to (two chunks here); a model
left in training mode with dropout on is the everyday case. No decoder can reproduce either.
(Reformer's chunk padding and its LSH layers' prefix instability: test_reformer_lengths.py.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, ReformerConfig, ReformerModelWithLMHead

from spec import greedy_generate, probe, runner
from spec.runner import UnsupportedModelError

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


def test_reformer_with_random_hashing_is_refused_up_front():
    model = reformer(("local", "lsh"), 16, None)
    with pytest.raises(UnsupportedModelError, match="its forward is not deterministic"):
        greedy_generate(model, [5, 6, 7], max_new_tokens=2)
    seeded = reformer(("local", "lsh"), 16, 0)     # deterministic, but LSH chunks are not prefix-stable
    with pytest.raises(UnsupportedModelError, match="not prefix-stable|not causal"):
        greedy_generate(seeded, [5, 6, 7], max_new_tokens=2)


def test_a_model_left_in_training_mode_with_dropout_is_refused_naming_eval():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5)).double()
    model.train()
    with pytest.raises(UnsupportedModelError, match=r"call model\.eval\(\)"):
        greedy_generate(model, [5, 6, 7], max_new_tokens=2)
    probe.forget(model)
    assert greedy_generate(model.eval(), [5, 6, 7], max_new_tokens=2).tokens == authors_greedy(
        model, torch.tensor([5, 6, 7]), 2)
