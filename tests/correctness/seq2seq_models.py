"""Tiny seeded encoder-decoder models for the suite, and the references they are checked against.

Each family is built from a small config with seeded weights in fp64, then "sharpened":
random init at the families' default std gives near-uniform logits and one repeated
token (BART's decoder emits EOS forever), which tests nothing. Every matrix is redrawn at
std 1.5/sqrt(fan_in), so greedy outputs vary with the encoder input.

References, written without spec's runners or caches:
  - cache_free_greedy: the full decoder over the whole decoder sequence, the encoder output
    computed once by the model's own encoder, no cache, at every step.
  - hf_generate: the model's own generate(do_sample=False) with a fresh GenerationConfig.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import transformers as T
from transformers import GenerationConfig

VOCAB = 96
MEL_BINS, FRAMES = 8, 32  # Whisper: max_source_positions = FRAMES / 2

_BART_LIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=160,
                  vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
_T5_LIKE = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB, pad_token_id=0,
                eos_token_id=1, decoder_start_token_id=0)

# family: (config class, config kwargs, model class). Token-mask options the families' real
# checkpoints set (forced_eos for BART-like, begin_suppress / suppress for Whisper, forced_bos
# for M2M100's target-language token) are set here too, so the masks are part of every check.
FAMILIES = {
    "t5": (T.T5Config, dict(_T5_LIKE), T.T5ForConditionalGeneration),
    "bart": (T.BartConfig, dict(_BART_LIKE, forced_eos_token_id=2), T.BartForConditionalGeneration),
    "whisper": (T.WhisperConfig, dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                      num_mel_bins=MEL_BINS, max_source_positions=FRAMES // 2,
                                      max_target_positions=160, vocab_size=VOCAB, pad_token_id=1, bos_token_id=0,
                                      eos_token_id=2, decoder_start_token_id=3, suppress_tokens=[5, 6],
                                      begin_suppress_tokens=[7, 2]),
                T.WhisperForConditionalGeneration),
    "marian": (T.MarianConfig, dict(_BART_LIKE, decoder_start_token_id=1, forced_eos_token_id=2),
               T.MarianMTModel),
    "pegasus": (T.PegasusConfig, dict(_BART_LIKE, decoder_start_token_id=0), T.PegasusForConditionalGeneration),
    "mbart": (T.MBartConfig, dict(_BART_LIKE, forced_eos_token_id=2), T.MBartForConditionalGeneration),
    "m2m_100": (T.M2M100Config, dict(_BART_LIKE), T.M2M100ForConditionalGeneration),
    "blenderbot-small": (T.BlenderbotSmallConfig, dict(_BART_LIKE, decoder_start_token_id=0),
                         T.BlenderbotSmallForConditionalGeneration),
}
CORE = ("t5", "bart", "whisper")
# Set on the generation_config (where real checkpoints keep them): M2M100 forces the target
# language's token first.
GENERATION = {"m2m_100": {"forced_bos_token_id": 9}}


GAIN = 3.0


def sharpen(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * GAIN / math.sqrt(p.shape[-1]))
    return model


@functools.cache
def build(family: str, seed: int = 0):
    """The family's tiny target in fp64 (the draft builders below copy it)."""
    config_class, kwargs, model_class = FAMILIES[family]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        model = model_class(config_class(**kwargs))
    finally:
        torch.set_default_dtype(default)
    model = sharpen(model, seed).eval()
    model.generation_config.eos_token_id = None  # an EOS only where a test passes one (docs/FACTS.md: HF harness traps)
    for key, value in GENERATION.get(family, {}).items():
        setattr(model.generation_config, key, value)
    return model


def perturbed(model, noise: float, seed: int):
    """A draft: a copy of `model` with seeded noise on every weight (its own encoder too)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * noise * p.std())
    return draft


NOISE = 0.02


@functools.cache
def draft_for(family: str):
    """The family's draft: the target perturbed (encoder and decoder), fp64, partial agreement."""
    return perturbed(build(family), noise=NOISE, seed=101)


@functools.cache
def distil_whisper_draft():
    """A distil-Whisper-style draft: the target's encoder, a one-layer decoder made from the
    target's first decoder layer with noise. Its own encoder equals the target's, so it may
    share the target's encoder output (share_encoder=True)."""
    target = build("whisper")
    draft = copy.deepcopy(target)
    draft.model.decoder.layers = draft.model.decoder.layers[:1]
    draft.config.decoder_layers = 1
    noisy = perturbed(draft.model.decoder, noise=0.2, seed=102)
    draft.model.decoder = noisy
    draft.proj_out.weight = draft.model.decoder.embed_tokens.weight  # keep the tie the copy broke
    return draft


def encoder_inputs(family: str, tokens: list[int] | None = None, seed: int = 0) -> dict:
    """Keyword arguments for spec: token ids for text families, seeded features for Whisper."""
    if family == "whisper":
        gen = torch.Generator().manual_seed(seed)
        return {"input_ids": None, "input_features": torch.randn(MEL_BINS, FRAMES, generator=gen,
                                                                 dtype=torch.float64)}
    return {"input_ids": list(tokens)}


def _hf_inputs(model, inputs: dict) -> dict:
    if inputs.get("input_features") is not None:
        return {"input_features": inputs["input_features"].reshape(1, MEL_BINS, FRAMES).to(model.dtype)}
    ids = torch.tensor([inputs["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def encoder_output(model, inputs: dict):
    """The model's own encoder on the inputs (no spec code)."""
    enc = model.get_encoder()
    with torch.no_grad():
        if inputs.get("input_features") is not None:
            return enc(input_features=_hf_inputs(model, inputs)["input_features"])
        return enc(**_hf_inputs(model, inputs))


@torch.no_grad()
def cache_free_greedy(model, encoder_out, prompt: list[int], max_new_tokens: int, eos=None,
                      mask=None) -> list[int]:
    """Greedy decoding by a full decoder pass over the whole decoder sequence at each step.
    mask(logits_row, position) applies the generation config's token masks (see token_mask)."""
    seq = list(prompt)
    enc_mask = torch.ones(encoder_out.last_hidden_state.shape[:2], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(encoder_outputs=encoder_out, attention_mask=enc_mask, decoder_input_ids=torch.tensor([seq]),
                       use_cache=False).logits[0, -1]
        if mask is not None:
            logits = mask(logits.clone(), len(seq))
        seq.append(int(logits.argmax()))
        if eos is not None and seq[-1] == eos:
            break
    return seq[len(prompt):]


def token_mask(model, prompt_len: int, max_new_tokens: int):
    """HF's SuppressTokens / SuppressTokensAtBegin / ForcedBOS / ForcedEOS processors, as they act
    on one logit row predicting decoder position `position` (written from HF's documented rules)."""
    gen = model.generation_config

    def mask(logits, position):
        for t in gen.suppress_tokens or ():
            logits[t] = -math.inf
        if position == prompt_len:
            for t in gen.begin_suppress_tokens or ():
                logits[t] = -math.inf
        if position == 1:  # ForcedBOSTokenLogitsProcessor: cur_len == 1
            if gen.forced_bos_token_id is not None:
                logits[torch.arange(logits.numel()) != gen.forced_bos_token_id] = -math.inf
        if position == prompt_len + max_new_tokens - 1 and gen.forced_eos_token_id is not None:
            logits[torch.arange(logits.numel()) != gen.forced_eos_token_id] = -math.inf
        return logits
    return mask


def decoder_start(model, family: str) -> list[int]:
    """What HF generate starts the decoder from, for these tiny configs (no Whisper language tokens)."""
    return [model.config.decoder_start_token_id]


@torch.no_grad()
def hf_generate(model, inputs: dict, max_new_tokens: int, eos=None, decoder_input_ids=None) -> list[int]:
    """New tokens of model.generate(do_sample=False): a fresh GenerationConfig, the model's own
    generation_config filling what it leaves unset (its token masks)."""
    cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=eos,
                           pad_token_id=eos if eos is not None else 1)
    kwargs = _hf_inputs(model, inputs)
    if decoder_input_ids is not None:
        kwargs["decoder_input_ids"] = torch.tensor([decoder_input_ids])
    out = model.generate(**kwargs, generation_config=cfg)
    if model.config.model_type == "whisper":
        # Whisper's generate returns the new tokens only, less the EOS it stopped at.
        tokens = out[0].tolist()
        return tokens + [eos] if eos is not None and len(tokens) < max_new_tokens else tokens
    start = len(decoder_input_ids) if decoder_input_ids is not None else 1
    return out[0, start:].tolist()


def save_t5_benchmark_pair(out, *, gain: float = 1.5, damp: float = 0.1, seed: int = 0) -> None:
    """The T5 pair of docs/log/benchmarks.md, saved to out/target and out/draft with the shipped pair's
    tokenizer (4000 tokens, EOS 0). Random weights agree with nothing, so the agreement is built in:
    the target (4+4 layers, d_model 256, 8.4M parameters) has its decoder layers 2-4 damped (their
    attention and MLP output projections scaled by `damp`), and the draft is the target with the
    decoder cut to its first layer (same encoder, 5.2M parameters)."""
    import shutil
    from pathlib import Path

    global GAIN
    out = Path(out)
    config = T.T5Config(vocab_size=4000, d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4,
                        num_heads=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    saved, GAIN = GAIN, gain
    try:
        target = sharpen(T.T5ForConditionalGeneration(config), seed).eval()
    finally:
        GAIN = saved
    with torch.no_grad():
        for block in target.decoder.block[1:]:
            for layer in block.layer:
                for name, p in layer.named_parameters():
                    if name.endswith(("o.weight", "wo.weight")):
                        p.mul_(damp)
    draft = copy.deepcopy(target)
    draft.decoder.block = draft.decoder.block[:1]
    draft.config.num_decoder_layers = 1
    tokenizer = Path(__file__).resolve().parents[2] / "spec" / "assets" / "pair" / "target"
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = 0
        model.save_pretrained(out / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / f, out / name / f)


if __name__ == "__main__":  # python tests/correctness/seq2seq_models.py OUT_DIR
    import sys
    save_t5_benchmark_pair(sys.argv[1])
