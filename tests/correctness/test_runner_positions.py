"""Every runner against the model's own cache-free forward, in every dtype it runs in, past position 256.

bf16 cannot represent every integer above 256 (its 8-bit significand rounds 257 to 256): a
position or rotary table built in the model's dtype goes wrong exactly there, and silently, since
a draft's logits cannot change the output, only the acceptance. So each runner decodes a
300-token sequence the way the loop does (a block prefill, then rounds that feed a block and
crop back to a varying depth, with the rejected tokens replaced, crossing 256), and the logits of
every pass are held to the model's own forward over the whole sequence so far, with no cache and
no spec code, in the same dtype.

Runners: spec.runner's KVRunner, SnapshotRunner, StepwiseSnapshotRunner and RecomputeRunner,
spec.hf.Cached on a StaticCache (the `compiled` draft's cache, run eagerly here: compiling takes
minutes on a CPU), spec.neox.NeoXDraft (the plain GPT-NeoX draft) and spec.seq2seq.Decoder.
"""

from __future__ import annotations

import architectures as archs
import pytest
import seq2seq_models
import torch
from oracles import relative_tolerance
from transformers.modeling_outputs import BaseModelOutput

from spec import build_gpt_neox, hf, neox, runner, seq2seq

LENGTH = 280          # positions decoded; the rounds cross 256 and end past 280
PREFILL = 240
VOCAB = 256           # every model here embeds at least this many ids
# (gamma, accepted) per round, cycled: full accepts, rejections at every depth.
ROUNDS = [(4, 1), (5, 5), (3, 0), (6, 2), (1, 1), (4, 3), (2, 0), (5, 4)]

# How far a runner's logits may stray from the cache-free forward's, relative to 1 + the largest
# logit (as the probe measures it): oracles.relative_tolerance of the least precise dtype the
# computation goes through. An fp64 model goes through fp32 here: Mamba-style mixers (Jamba,
# FalconH1) cast to fp32 inside, and HF's eager attention takes its softmax in fp32. Measured
# over every case below (CPU, torch 2.13): fp64 6.5e-7 (Jamba stepwise, 5.5 fp32 eps; the
# attention-only runners 5e-15), fp32 5.1e-6 (the Whisper decoder, 43 eps), bf16 1.4e-2 (Jamba
# stepwise, 1.8 eps; the plain draft and FalconH1 7e-3; the KV, static, recompute and Whisper
# runners bit-identical), fp16 2.2e-3 (Jamba, 2.3 eps): the bounds are 3.1e-5 (256 fp32 eps) for
# fp64 and fp32, 3.1e-2 and 3.9e-3 (4 eps) for bf16 and fp16. Faults measured the same way: the
# plain draft's rotary table built from bf16 positions 5.5e-2 in bf16 (past 256 only: 6.9e-3
# before); positions one too far after the prefill 0.86 to 1.3 (hf.step) and 0.07 to 0.09 (the
# plain draft) in every dtype; the Whisper decoder's positions off by one 1.0 to 1.4. (Every
# position shifted by one, prefill included, moves a rotary model's logits by rounding only:
# rotary attention sees relative positions.)
TOLERANCE = {dtype: relative_tolerance(torch.float32 if dtype == torch.float64 else dtype)
             for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}
# bf16 is where positions past 256 go wrong, so it runs by default; the other dtypes with --thorough.
DTYPES = [pytest.param(torch.bfloat16, id="bf16"),
          *(pytest.param(d, id=i, marks=pytest.mark.thorough)
            for d, i in ((torch.float64, "fp64"), (torch.float32, "fp32"), (torch.float16, "fp16")))]

LONG = dict(max_position_embeddings=512)


def _registry_model(name: str, dtype, **overrides):
    return archs.build(name, seed=0, dtype=dtype, overrides={**archs.OVERRIDES.get(name, {}), **overrides})


def _neox(dtype):
    # Full rotary (every head dim rotated) and non-zero biases, so a wrong table cannot hide.
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=512)
    return archs.with_biases(build_gpt_neox(shape, seed=4, dtype=dtype, rotary_pct=1.0, initializer_range=0.2))


def _static(model):
    run = hf.Cached(model)
    run.cache = hf.new_static_cache(model, 512)
    return run


class _DecoderOnly:
    """A decoder-only model: its runner and its own cache-free forward."""

    def __init__(self, model, make_runner, rows_out: str = "all"):
        self.model, self.run, self.rows_out = model, make_runner(model), rows_out

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids[None], use_cache=False).logits[0]


class _EncoderDecoder:
    """Whisper: spec's Decoder over a fixed encoder output, against the model's cache-free decoder pass."""
    rows_out = "all"

    def __init__(self, dtype):
        config_class, kwargs, model_class = seq2seq_models.FAMILIES["whisper"]
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype if dtype != torch.bfloat16 and dtype != torch.float16 else torch.float32)
        try:
            model = model_class(config_class(**dict(kwargs, max_target_positions=512, vocab_size=VOCAB,
                                                    suppress_tokens=None, begin_suppress_tokens=None)))
        finally:
            torch.set_default_dtype(default)
        self.model = seq2seq_models.sharpen(model, 0).to(dtype).eval()
        gen = torch.Generator().manual_seed(0)
        features = torch.randn(1, seq2seq_models.MEL_BINS, seq2seq_models.FRAMES, generator=gen).to(dtype)
        self.encoded = BaseModelOutput(last_hidden_state=self.model.get_encoder()(input_features=features)
                                       .last_hidden_state)
        self.run = seq2seq.Decoder(self.model, self.encoded)

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(encoder_outputs=self.encoded, decoder_input_ids=ids[None], use_cache=False).logits[0]


CASES = {
    "kv-cache": lambda dtype: _DecoderOnly(_registry_model("llama", dtype, **LONG), runner.KVRunner),
    "kv-cache static": lambda dtype: _DecoderOnly(_registry_model("llama", dtype, **LONG), _static),
    "state-snapshot": lambda dtype: _DecoderOnly(_registry_model("falcon_h1", dtype, **LONG), runner.SnapshotRunner),
    "state-stepwise": lambda dtype: _DecoderOnly(_registry_model("jamba", dtype, num_experts=1, **LONG),
                                                 runner.StepwiseSnapshotRunner),
    "recompute": lambda dtype: _DecoderOnly(_registry_model("openai-gpt", dtype, n_positions=512),
                                            runner.RecomputeRunner),
    "plain neox draft": lambda dtype: _DecoderOnly(_neox(dtype), lambda m: neox.NeoXDraft(m, 512), rows_out="last"),
    "seq2seq decoder": _EncoderDecoder,
}


def decode_like_the_loop(case) -> list[tuple[int, int, float]]:
    """(first position, last position + 1, relative logit error) of every pass."""
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(0, VOCAB, (LENGTH + 16,), generator=gen)
    run, passes = case.run, []

    def feed(end):
        start = len(run)
        keep = 1 if case.rows_out == "last" else end - start
        got = run(seq[start:end], keep=keep).double()
        want = case.reference(seq[:end])[end - keep:end].double()
        diff = torch.where(got == want, 0.0, (got - want).abs()).max()
        passes.append((start, end, float(diff / (1 + want[want.isfinite()].abs().max()))))

    feed(PREFILL)
    n, r = PREFILL + 1, 0
    while n < LENGTH:
        gamma, accepted = ROUNDS[r % len(ROUNDS)]
        seq[n:n + gamma] = torch.randint(0, VOCAB, (gamma,), generator=gen)      # the draft's proposals
        feed(n + gamma)
        n += accepted + 1
        seq[n - 1] = (seq[n - 1] + 1) % VOCAB if accepted < gamma else seq[n - 1]  # the target's own token
        run.crop(n - 1)
        assert len(run) <= n - 1
        r += 1
    return passes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_runner_matches_the_models_own_forward_past_256(name, dtype):
    with torch.inference_mode():
        passes = decode_like_the_loop(CASES[name](dtype))
    assert passes[-1][1] > LENGTH and any(s < 256 < e for s, e, _ in passes)
    start, end, err = max(passes, key=lambda p: p[2])
    assert err <= TOLERANCE[dtype], (f"{name} in {dtype}: logits of positions {start}..{end - 1} stray "
                                     f"{err:.2e} from the model's own forward (tolerance {TOLERANCE[dtype]:.1e})")


def test_a_rotary_table_from_bf16_positions_is_caught():
    """The fault this module is for: the plain draft's rotary table computed from positions held
    in bf16 (257 becomes 256) instead of fp32 and cast, as HF builds it."""
    case = CASES["plain neox draft"](torch.bfloat16)
    draft = case.run
    rotary = case.model.gpt_neox.rotary_emb
    positions = torch.arange(draft.max_len, dtype=torch.bfloat16).float()
    emb = torch.cat([positions[:, None] * rotary.inv_freq.float()] * 2, dim=-1)
    draft.cos = emb.cos().to(torch.bfloat16)[:, None, None, :]
    draft.sin = emb.sin().to(torch.bfloat16)[:, None, None, :]
    with torch.inference_mode():
        passes = decode_like_the_loop(case)
    assert max(err for _, end, err in passes if end <= 256) <= TOLERANCE[torch.bfloat16]
    assert max(err for _, end, err in passes if end > 257) > TOLERANCE[torch.bfloat16]
