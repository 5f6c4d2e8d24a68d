"""Reformer at every prompt length 1-64: exact or refused up front, never a crash inside transformers.

Reformer pads its input to a multiple of its chunk length once the sequence is longer than a
chunk, and that padding path fails when `position_ids` is given (transformers 5.25:
"upper bound and lower bound inconsistent with step sign"). The probe's own sequence (12 tokens)
can be shorter than a chunk (16) or a multiple of one (6, or local 4 with LSH 6: 12), so it
never reached the padding and chose 0-based positions, and decoding crashed from 12-token
prompts on. spec.positions now also checks positions over a prime length past every chunk.
Each config is held to the model's own forward called as its authors call it (ids only).
"""

from __future__ import annotations

import functools

import pytest
import torch

from spec import runner
from spec.decode import greedy_generate, speculative_generate

NEW = 3
VOCAB = 64

# (attention layers, local chunk, LSH chunk, verdict): chunks longer than the probe, shorter than
# it, dividing it, and the transformers default LSH chunk (64) beside a short local one. LSH layers
# hash and chunk the padded sequence, so a prefix's logits change with what follows: no verify pass
# can be exact there, and the probe refuses them.
CONFIGS = [(("local", "local"), 16, 16, "exact"), (("local", "local"), 8, 64, "exact"),
           (("local", "local"), 6, 6, "exact"), (("local", "lsh"), 16, 16, "refused"),
           (("lsh", "local"), 6, 4, "refused"), (("local", "lsh"), 16, 64, "refused")]


@functools.lru_cache(maxsize=None)
def _reformer(layers, local_chunk, lsh_chunk):
    from transformers import ReformerConfig, ReformerModelWithLMHead
    torch.manual_seed(0)
    cfg = ReformerConfig(is_decoder=True, attn_layers=list(layers), axial_pos_shape=[16, 16],
                         axial_pos_embds_dim=[16, 16], hidden_size=32, feed_forward_size=32,
                         num_attention_heads=2, attention_head_size=16, vocab_size=VOCAB,
                         local_attn_chunk_length=local_chunk, lsh_attn_chunk_length=lsh_chunk,
                         max_position_embeddings=256, num_hashes=1, num_buckets=4, hash_seed=0,
                         pad_token_id=0, eos_token_id=1)
    return ReformerModelWithLMHead(cfg).double().eval()


def _own_greedy(model, ids: torch.Tensor) -> list[int]:
    seq = ids[None]
    with torch.inference_mode():
        for _ in range(NEW):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, ids.numel():].tolist()


@pytest.mark.parametrize("layers,local_chunk,lsh_chunk,verdict", CONFIGS)
def test_reformer_is_exact_or_refused_at_every_prompt_length(layers, local_chunk, lsh_chunk, verdict):
    model = _reformer(layers, local_chunk, lsh_chunk)
    if verdict == "refused":
        with pytest.raises(runner.UnsupportedModelError, match="not prefix-stable|not causal"):
            runner.verdict(model)
        with pytest.raises(runner.UnsupportedModelError):
            greedy_generate(model, torch.arange(2, 20)[None], max_new_tokens=NEW)
        return
    assert runner.verdict(model) == ("recompute", "own")
    gen = torch.Generator().manual_seed(local_chunk * 100 + lsh_chunk)
    for length in range(1, 65):
        ids = torch.randint(2, VOCAB, (length,), generator=gen)
        want = _own_greedy(model, ids)
        assert greedy_generate(model, ids[None], max_new_tokens=NEW).tokens == want, length
        if length in (1, 12, 15, 17, 33, 62):   # either side of the chunks
            got = speculative_generate(model, model, ids[None], gamma=3, max_new_tokens=NEW).tokens
            assert got == want, length
