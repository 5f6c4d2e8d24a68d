"""Encoder-decoder models (T5, BART, Whisper, Marian, Pegasus, mBART, M2M100, ...) in the decode loop.

The decode loop in spec.decode talks to a model through a Runner (spec.protocols): `run(ids,
keep=k)` feeds ids after the positions the runner's cache holds and returns logits [k, vocab]
(all rows for keep=0), `run.crop(keep)` forgets positions from `keep` on, `len(run)` is the
number of cached positions. For an encoder-decoder model that runner is `Decoder` below: the
encoder runs once, in `prepare` (spec.choose builds the Decoders), and every call runs the DECODER only, attending to the fixed
encoder output. Speculation and rollback then concern the decoder alone:

  - the cache is an EncoderDecoderCache, built as transformers' generate() builds it. Its
    self-attention half grows with the decoder sequence and is cropped on rejection; its
    cross-attention half (keys and values of the encoder output) is filled on the first call
    and never changes, so it is never cropped.
  - decoder positions are passed explicitly where the forward takes them (Whisper's
    decoder_position_ids); elsewhere the model reads them from the cache length, which
    after a crop is exactly the kept prefix.

`prepare` turns the user's inputs, in HF generate's conventions, into the decoder prompt and
one encoder output per model: `input_ids` is the encoder input (T5, BART, ...), Whisper takes
`input_features`; the decoder starts from the model's decoder_start_token_id (Whisper: its
init tokens, as WhisperForConditionalGeneration.generate builds them) unless
`decoder_input_ids` are given. The draft runs its own encoder on the same inputs, or with
share_encoder=True attends to the target's encoder output (a distil-Whisper draft, whose
encoder is a copy of the target's: it saves the draft's encoder pass).

Token masks from the target's generation_config that HF generate applies to every greedy
step of these models are applied to the logits here, for target and draft alike, so the
greedy output equals HF generate's: suppress_tokens and one-token bad_words_ids (every
position), begin_suppress_tokens (the first new token), forced_bos_token_id (decoder position 1,
as HF forces it whatever the prompt's length) and forced_eos_token_id (the last new token at
max_new_tokens). Multi-token bad_words_ids are refused: HF generate bans those sequences, spec
does not. Other processors (no_repeat_ngram_size, repetition_penalty, min_length, beams) are
not applied, exactly as for decoder-only models: spec decodes the model's own argmax.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from spec import hf
from spec.validate import as_prompt, check_ids_fit

# Families whose decoder runs exactly in this loop: each is checked against a cache-free
# reference and HF generate in tests/correctness/test_encoder_decoder.py. Others are refused.
TEXT_FAMILIES = ("t5", "bart", "mbart", "marian", "pegasus", "m2m_100", "blenderbot-small")
SPEECH_FAMILIES = ("whisper",)
SUPPORTED = TEXT_FAMILIES + SPEECH_FAMILIES


def is_encoder_decoder(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def check_supported(model, name: str) -> None:
    kind = getattr(model.config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ValueError(f"{name}: encoder-decoder family {kind!r} ({type(model).__name__}) is not supported; "
                         f"spec runs {', '.join(SUPPORTED)} (each checked exact against HF generate)")
    if not hasattr(model, "get_encoder") or getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise TypeError(f"{name} must be an encoder-decoder model with an LM head (e.g. AutoModelForSeq2SeqLM); "
                        f"{type(model).__name__} has none")
    config = getattr(model, "generation_config", None)
    if config is not None and getattr(config, "return_timestamps", False):
        raise ValueError(f"{name}: generation_config.return_timestamps is set; Whisper timestamp decoding "
                         "is not supported (set it to False)")


def check_pair(target, draft) -> None:
    """The draft's decoder must start where the target's does and speak its vocabulary."""
    for model, name in ((target, "target"), (draft, "draft")):
        if not is_encoder_decoder(model):
            raise ValueError(f"{name} is a decoder-only model but the "
                             f"{'draft' if name == 'target' else 'target'} is encoder-decoder: "
                             "both must be encoder-decoder models")
        check_supported(model, name)
    t, d = _start_token(target), _start_token(draft)
    if t != d:
        raise ValueError(f"target and draft decoders start from different tokens: decoder_start_token_id is {t} "
                         f"for the target and {d} for the draft")
    tv, dv = hf.logit_width(target), hf.logit_width(draft)
    if tv != dv:
        raise ValueError(f"target and draft vocabularies differ: logit widths {tv} and {dv} (encoder-decoder "
                         "pairs must share one vocabulary)")


def _start_token(model) -> int | None:
    gen = getattr(model, "generation_config", None)
    start = getattr(gen, "decoder_start_token_id", None) if gen is not None else None
    return start if start is not None else getattr(model.config, "decoder_start_token_id", None)


# --------------------------------------------------------------------------- inputs


def _encoder_kwarg(model) -> str:
    return "input_features" if "input_features" in hf.forward_params(type(model.get_encoder())) else "input_ids"


def _features(value, model, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise TypeError("input_features must be a floating-point tensor [num_mel_bins, frames] or "
                        f"[1, num_mel_bins, frames], got {getattr(value, 'dtype', type(value).__name__)}")
    if value.dim() == 2:
        value = value[None]
    if value.dim() != 3 or value.shape[0] != 1:
        raise ValueError(f"input_features must be [num_mel_bins, frames] or [1, num_mel_bins, frames] (batch 1), "
                         f"got shape {tuple(value.shape)}")
    bins, frames = model.config.num_mel_bins, 2 * model.config.max_source_positions
    if tuple(value.shape[1:]) != (bins, frames):
        raise ValueError(f"input_features must be [{bins}, {frames}] for this model (num_mel_bins, "
                         f"2 x max_source_positions), got {list(value.shape[1:])}; longer audio is not supported")
    return value.to(device=device, dtype=next(model.parameters()).dtype)


def encode(model, input_ids=None, input_features=None, *, name: str = "model") -> BaseModelOutput:
    """The encoder's output for one input sequence (run once per model)."""
    device = next(model.parameters()).device
    if _encoder_kwarg(model) == "input_features":
        if input_features is None and isinstance(input_ids, torch.Tensor) and input_ids.dtype.is_floating_point:
            input_ids, input_features = None, input_ids  # features given positionally (as the CLI does)
        if input_features is None:
            raise ValueError(f"{name} ({type(model).__name__}) takes input_features (log-mel spectrogram), "
                             "not input_ids, as its encoder input: pass input_features=")
        if input_ids is not None:
            raise ValueError(f"{name} ({type(model).__name__}) encodes input_features; input_ids is not used "
                             "(give the decoder prompt as decoder_input_ids=)")
        out = model.get_encoder()(input_features=_features(input_features, model, device))
    else:
        if input_features is not None:
            raise ValueError(f"{name} ({type(model).__name__}) encodes token ids: pass input_ids=, "
                             "not input_features=")
        if input_ids is None:
            raise ValueError(f"{name} ({type(model).__name__}) needs input_ids (the encoder input)")
        ids = as_prompt(input_ids, device, {name: model})
        out = model.get_encoder()(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None])
    return BaseModelOutput(last_hidden_state=out.last_hidden_state)


def decoder_prompt(model, decoder_input_ids=None, *, name: str = "model") -> list[int]:
    """The decoder's first tokens: decoder_input_ids if given, else what HF generate starts from."""
    if decoder_input_ids is not None:
        return as_prompt(decoder_input_ids, "cpu", {}, arg="decoder_input_ids").tolist()
    start = _start_token(model)
    if start is None:
        raise ValueError(f"{name} has no decoder_start_token_id in its config or generation_config: "
                         "pass decoder_input_ids=")
    if model.config.model_type in SPEECH_FAMILIES:
        return _whisper_init_tokens(model, start, name)
    return [start]


def _whisper_init_tokens(model, start: int, name: str) -> list[int]:
    """WhisperForConditionalGeneration.generate's init tokens for what spec supports: the start
    token, forced_decoder_ids' leading run, then <|notimestamps|> where the config has one.
    Language detection and task/language flags need inputs spec does not pass: refused."""
    gen = model.generation_config
    if getattr(gen, "task", None) is not None or getattr(gen, "language", None) is not None:
        raise ValueError(f"{name}: generation_config.task / language are set; spec does not build Whisper's "
                         "language and task tokens: pass the whole decoder prompt as decoder_input_ids= "
                         "(e.g. [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>])")
    tokens = [start]
    forced = getattr(gen, "forced_decoder_ids", None) or getattr(model.config, "forced_decoder_ids", None)
    if forced and hasattr(gen, "lang_to_id") and any(i == 1 and t is None for i, t in forced):
        forced = None  # the language left open: HF generate detects it (refused below)
    if forced:
        forced = sorted((int(i), t) for i, t in forced)
        for position, (i, token) in enumerate(forced, 1):
            if i != position or token is None:
                raise ValueError(f"{name}: forced_decoder_ids {forced} do not follow Whisper's prompt pattern "
                                 "(one token for each index 1, 2, ...): pass decoder_input_ids=")
            tokens.append(int(token))
    if hasattr(gen, "lang_to_id") and len(tokens) < 2:
        raise ValueError(f"{name}: a multilingual Whisper without a language: HF generate would detect it with "
                         "an extra pass; pass the decoder prompt as decoder_input_ids= "
                         "(e.g. [<|startoftranscript|>, <|en|>, <|transcribe|>, <|notimestamps|>])")
    no_ts = getattr(gen, "no_timestamps_token_id", None)
    if no_ts is not None and tokens[-1] != no_ts:
        tokens.append(no_ts)
    return tokens


# --------------------------------------------------------------------------- the decoder runner


@dataclass(frozen=True)
class TokenMasks:
    """Logit masks HF generate applies in greedy decoding (see the module docstring), by the
    decoder position of the token a logit row predicts."""
    suppress: tuple[int, ...] = ()        # never emitted (suppress_tokens, one-token bad_words_ids)
    begin_suppress: tuple[int, ...] = ()  # not emitted as the first new token
    forced_bos: int | None = None         # the only token allowed at decoder position 1
    forced_eos: int | None = None         # the only token allowed last (at max_new_tokens)
    begin_at: int = 1                     # position of the first new token: the prompt's length
    end_at: int | None = None             # position of the last new token

    @classmethod
    def of(cls, model, prompt_len: int, max_new_tokens: int | None = None) -> "TokenMasks":
        gen = getattr(model, "generation_config", None)
        if gen is None:
            return cls(begin_at=prompt_len)
        ids = lambda v: tuple(int(t) for t in (v or ()))  # noqa: E731
        words = getattr(gen, "bad_words_ids", None) or ()
        if any(len(w) > 1 for w in words):
            raise ValueError(f"{type(model).__name__}: generation_config.bad_words_ids holds multi-token entries "
                             f"({[list(w) for w in words if len(w) > 1]}); HF generate bans those sequences and "
                             "spec does not, so the outputs could differ: keep one-token entries only")
        bad = [w[0] for w in words if len(w) == 1]
        one = lambda v: int(v) if v is not None else None  # noqa: E731
        return cls(ids(getattr(gen, "suppress_tokens", None)) + ids(bad),
                   ids(getattr(gen, "begin_suppress_tokens", None)),
                   one(getattr(gen, "forced_bos_token_id", None)), one(getattr(gen, "forced_eos_token_id", None)),
                   prompt_len, prompt_len + max_new_tokens - 1 if max_new_tokens else None)

    def apply(self, logits: torch.Tensor, first_pos: int) -> torch.Tensor:
        """logits[i] predicts the token at decoder position first_pos + i + 1."""
        if not (self.suppress or self.begin_suppress or self.forced_bos is not None or self.forced_eos is not None):
            return logits
        logits = logits.clone()
        width = logits.shape[-1]
        if self.suppress:
            logits[:, [t for t in self.suppress if t < width]] = -float("inf")

        def row(position):
            i = position - 1 - first_pos
            return i if 0 <= i < logits.shape[0] else None

        def force(i, token):
            keep = logits[i, token].clone()
            logits[i] = -float("inf")
            logits[i, token] = keep

        first = row(self.begin_at)
        if first is not None and self.begin_suppress:
            logits[first, [t for t in self.begin_suppress if t < width]] = -float("inf")
        bos = row(1)  # HF forces BOS when the decoder holds one token, whatever the prompt's length
        if bos is not None and self.forced_bos is not None:
            force(bos, self.forced_bos)
        last = row(self.end_at) if self.end_at is not None else None
        if last is not None and self.forced_eos is not None:
            force(last, self.forced_eos)
        return logits


# Each model's decoder text config, keyed weakly (nothing is stored on the model).
_DECODER_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def new_cache(model) -> EncoderDecoderCache:
    """As transformers' generate() builds it: a DynamicCache for the decoder's self-attention,
    one for its cross-attention, both configured from the decoder's text config. Where that
    config miscounts the decoder's layers (T5 with num_decoder_layers != num_layers: HF
    generate itself fails there in 5.24), config-free caches that grow a layer per use."""
    config = _DECODER_CONFIGS.get(model)
    if config is None:  # get_text_config deep-copies: a few ms, once per model rather than per call
        config = _DECODER_CONFIGS[model] = model.config.get_text_config(decoder=True)
    layers = getattr(model.config, "num_decoder_layers", None) or getattr(model.config, "decoder_layers", None)
    if layers is not None and layers != getattr(config, "num_hidden_layers", layers):
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))


class Decoder:
    """An encoder-decoder model's decoder with its cache, over a fixed encoder output.
    A Runner (spec.protocols): `run(ids, keep)`, `run.crop(keep)`, `len(run)`."""

    def __init__(self, model, encoder_outputs: BaseModelOutput, masks: TokenMasks = TokenMasks()):
        self.model, self.encoder_outputs, self.masks = model, encoder_outputs, masks
        self.cache = new_cache(model)
        self.positions = "decoder_position_ids" in hf.forward_params(type(model))
        self.cache_kwarg = hf.cache_kwarg(model) or "past_key_values"
        self.encoder_mask = torch.ones(encoder_outputs.last_hidden_state.shape[:2], dtype=torch.long,
                                       device=encoder_outputs.last_hidden_state.device)

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        start = len(self)
        kwargs = {self.cache_kwarg: self.cache}
        if self.positions:
            kwargs["decoder_position_ids"] = torch.arange(start, start + ids.numel(), device=ids.device)[None]
        out = self.model(encoder_outputs=self.encoder_outputs, attention_mask=self.encoder_mask,
                         decoder_input_ids=ids[None], use_cache=True, **kwargs)
        logits = out.logits[0] if keep == 0 else out.logits[0, -keep:]
        return self.masks.apply(logits, start + ids.numel() - logits.shape[0])

    def crop(self, keep: int) -> None:
        hf.crop(self.cache.self_attention_cache, keep)  # the cross-attention half never changes

    def __len__(self) -> int:
        return hf.cache_len(self.cache.self_attention_cache)


# --------------------------------------------------------------------------- the decode loop's entry


def _check_shared(target, draft, encoder_outputs) -> None:
    width = encoder_outputs.last_hidden_state.shape[-1]
    d_model = getattr(draft.config, "d_model", None) or getattr(draft.config, "hidden_size", None)
    if d_model != width:
        raise ValueError(f"share_encoder=True: the target's encoder output is {width} wide but the draft's decoder "
                         f"attends to {d_model}-wide states; the draft cannot reuse the target's encoder")
    if draft.config.model_type != target.config.model_type:
        raise ValueError(f"share_encoder=True needs one family: target is {target.config.model_type!r}, "
                         f"draft is {draft.config.model_type!r}")


def prepare(models: dict, input_ids=None, *, input_features=None, decoder_input_ids=None, share_encoder: bool = False,
            max_new_tokens: int | None = None) -> tuple[torch.Tensor, list[BaseModelOutput], TokenMasks]:
    """The decoder prompt (1-D LongTensor), each model's encoder output (in order) and the token
    masks every decoder applies: what spec.choose builds one Decoder runner per model from.

    models: {"target": model} (greedy) or {"target": target, "draft": draft}."""
    names = list(models)
    target = models[names[0]]
    if len(models) > 1:
        check_pair(target, models[names[1]])
    else:
        check_supported(target, names[0])
    if share_encoder and len(models) < 2:
        raise ValueError("share_encoder=True needs a draft")
    if not isinstance(share_encoder, bool):
        raise TypeError(f"share_encoder must be True or False, got {share_encoder!r}")
    device = next(target.parameters()).device
    prompt = torch.tensor(decoder_prompt(target, decoder_input_ids, name=names[0]), dtype=torch.long, device=device)
    check_ids_fit(prompt, "decoder_input_ids" if decoder_input_ids is not None else "the decoder prompt", models)
    masks = TokenMasks.of(target, prompt.numel(), max_new_tokens)
    target_out = encode(target, input_ids, input_features, name=names[0])
    outputs = [target_out]
    for name in names[1:]:
        if share_encoder:
            _check_shared(target, models[name], target_out)
            out = BaseModelOutput(last_hidden_state=target_out.last_hidden_state.to(
                next(models[name].parameters()).dtype))
        else:
            out = encode(models[name], input_ids, input_features, name=name)
        outputs.append(out)
    return prompt, outputs, masks


def check_draft_impl(draft_impl: str) -> None:
    if draft_impl not in ("auto", "hf"):
        raise ValueError(f"draft_impl={draft_impl!r} is for decoder-only drafts; an encoder-decoder draft runs "
                         "its own forward: use 'auto' or 'hf'")


def refuse_inputs(input_features=None, decoder_input_ids=None, share_encoder=False) -> None:
    """For decoder-only models: encoder-decoder inputs make no sense there."""
    for arg, value in (("input_features", input_features), ("decoder_input_ids", decoder_input_ids)):
        if value is not None:
            raise ValueError(f"{arg} is for encoder-decoder models; this model is decoder-only "
                             "(pass its prompt as input_ids)")
    if share_encoder:
        raise ValueError("share_encoder=True is for encoder-decoder pairs; these models are decoder-only")


# --------------------------------------------------------------------------- loading


def auto_class(config):
    """The Auto class that loads an encoder-decoder checkpoint with its LM head."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    return AutoModelForSpeechSeq2Seq if config.model_type in SPEECH_FAMILIES else AutoModelForSeq2SeqLM


def encodes_features(model) -> bool:
    """Whether the model's encoder reads audio features (Whisper's input_features), not token ids."""
    return _encoder_kwarg(model) == "input_features"
