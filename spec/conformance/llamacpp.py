"""llama.cpp (through llama-cpp-python, the `llama` extra) as a decoder under test: an engine that
brings its own models (GGUF files), its own non-speculative reference and its own logits.

- `Engine(path)`: one GGUF model. `greedy` is the engine's own plain greedy decoding (the reference
  the speculative runs are compared with, token for token); `speculative` is llama-cpp-python's
  speculative decoding (`Llama(draft_model=...)`) with prompt lookup (`LlamaPromptLookupDecoding`)
  or a draft model (`ModelDraft`: a second GGUF run greedily, gamma tokens a round).
- `noise`: the engine's own numerical noise, the largest difference between the logits of one
  position computed in a one-token pass and in a multi-token pass (the pass shapes speculative
  decoding uses), measured per model file (so per quantization and dtype).
- `diagnose`: the first divergence from the engine's greedy output, as a tie (the greedy top-2 gap
  there is within the measured noise) or a bug, and which of the engine's own pass shapes (a block
  of 1 to gamma+1 tokens ending there) gives the token the speculative run emitted.
- `sample` and `sampler_law`: the engine's own sampling (plain or speculative, seeded) and the law
  its sampler chain draws from, computed from the engine's own logits, so that the sampling law is
  checked against llama.cpp's numbers and its semantics, not PyTorch's.
- `dequantized_gguf`: the same weights at higher precision, written with the `gguf` package: every
  tensor of a quantized GGUF dequantized to f32 (or f16, norms kept f32), the metadata copied. These
  are exactly the weights `spec.realmodel` dequantizes for transformers, so the engine's f32 run
  and PyTorch's fp32 run are of the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec import clock

PIN = "0.3.36"   # the llama-cpp-python version the findings in docs/CONFORMANCE.md were measured with


def available() -> str | None:
    """None when llama-cpp-python can be imported, else why not (for skips)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return f"llama-cpp-python is not installed (pip install 'spec[llama]'): {err}"
    return None


def dequantized_gguf(src: Path, dst: Path, dtype: str = "f32") -> Path:
    """Write `src` (any GGUF llama.cpp reads) with every tensor dequantized to `dtype` ("f32" or
    "f16"; 1-D tensors, the norms, stay f32 as llama.cpp's converter keeps them)."""
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = Path(dst).with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if dtype == "f16" and data.ndim > 1:
            data = data.astype(np.float16)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return Path(dst)


class ModelDraft:
    """A llama-cpp-python draft model: a second GGUF model proposes `gamma` greedy tokens a round
    (its KV cache reused across rounds through llama-cpp-python's prefix matching)."""

    def __init__(self, path: Path, gamma: int, threads: int = 1, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.gamma = gamma
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)

    def __call__(self, input_ids, /, **kwargs):
        out = []
        for token in self.llm.generate(list(int(t) for t in input_ids), top_k=1, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(token)
            if len(out) == self.gamma:
                break
        return np.array(out, dtype=np.intc)


def _model_draft_class():
    """ModelDraft as a LlamaDraftModel (made here: llama_cpp is an optional import)."""
    from llama_cpp.llama_speculative import LlamaDraftModel
    return type("ModelDraft", (ModelDraft, LlamaDraftModel), {})


GREEDY = dict(top_k=1, temp=0.0)


def sampler_law(logits: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution llama.cpp's sampler chain draws from, on one row of the engine's own logits, in
    float64. The chain as llama-cpp-python 0.3.36 builds it (`Llama._init_sampler`): top-k (k <= 0: off),
    typical (off at 1), top-p, min-p, temperature, then the draw. So, unlike HF, top-p and min-p act on
    the distribution at temperature 1, before the temperature; top-p keeps the smallest prefix of the
    sorted tokens whose mass (renormalised over what top-k kept) reaches top_p; min-p keeps the tokens
    at least min_p times as likely as the most likely one."""
    z = np.asarray(logits, dtype=np.float64)
    kept = np.argsort(-z, kind="stable")
    if 0 < top_k < len(z):
        kept = kept[:top_k]
    if top_p < 1.0:
        p = np.exp(z[kept] - z[kept[0]])
        cum = np.cumsum(p / p.sum())
        kept = kept[:int(np.searchsorted(cum, top_p)) + 1]
    if min_p > 0.0:
        kept = kept[z[kept] >= z[kept[0]] + np.log(min_p)]
    w = np.exp((z[kept] - z[kept[0]]) / temp)
    out = np.zeros(len(z))
    out[kept] = w / w.sum()
    return out


@dataclass
class Divergence:
    position: int
    expected: int
    actual: int
    gap: float            # the engine's greedy top-2 gap there, one-token pass
    noise: float          # the engine's measured one-token vs block noise for this model
    replay: list[int]     # block widths whose last row's argmax is the emitted token
    verdict: str          # "tie" or "BUG"

    def __str__(self) -> str:
        shapes = (f"the engine's own block pass of width {self.replay} gives {self.actual}" if self.replay
                  else f"no block pass of width 1..gamma+1 gives {self.actual}")
        return (f"first divergence at new token {self.position}: greedy {self.expected}, got {self.actual}; "
                f"top-2 gap {self.gap:.3g} vs noise {self.noise:.3g}: {self.verdict}; {shapes}")


class Engine:
    """One GGUF model in llama.cpp at `threads` threads."""

    def __init__(self, path, threads: int = 1, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.path, self.threads, self.n_ctx = Path(path), threads, n_ctx
        common = dict(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.plain = Llama(**common)                      # the engine's normal configuration
        self.scorer = Llama(**common, logits_all=True)    # every position's logits
        self._common = common
        self._noise: dict = {}

    def close(self):
        """Free the llama.cpp models now (at interpreter exit llama_cpp may already be gone)."""
        spec = getattr(self, "_spec", None)
        for llm in (self.plain, self.scorer, spec, getattr(getattr(spec, "draft_model", None), "llm", None)):
            if llm is not None:
                llm.close()
        self._spec = None

    def tokenize(self, text: str) -> list[int]:
        return self.plain.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def _run(self, llm, prompt, n, sampler=GREEDY) -> tuple[list[int], float]:
        llm.reset()

        def decode():
            out = []
            for token in llm.generate(list(prompt), **sampler, typical_p=1.0, repeat_penalty=1.0, reset=True):
                out.append(int(token))
                if len(out) == n:
                    break
            return out
        return clock.timed(decode)

    def greedy(self, prompt, n: int) -> tuple[list[int], float]:
        """The engine's own plain greedy decoding: n new tokens and the seconds it took."""
        return self._run(self.plain, prompt, n)

    def speculative(self, prompt, n: int, *, draft: str = "prompt-lookup", gamma: int = 8,
                    draft_path=None) -> tuple[list[int], float]:
        """llama-cpp-python's speculative greedy decoding: prompt lookup (max n-gram 3, `gamma`
        tokens) or a draft model (`draft_path`, default the target's own file)."""
        return self._run(self._speculative(draft, gamma, draft_path), prompt, n)

    def _speculative(self, draft, gamma, draft_path):
        """The Llama with `draft_model` set (one at a time: rebuilt when the drafter changes)."""
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        key = (draft, gamma, str(draft_path))
        if getattr(self, "_spec_key", None) != key:
            drafter = (LlamaPromptLookupDecoding(num_pred_tokens=gamma, max_ngram_size=3) if draft == "prompt-lookup"
                       else _model_draft_class()(draft_path or self.path, gamma, self.threads, self.n_ctx))
            self._spec, self._spec_key = Llama(**self._common, draft_model=drafter), key
        return self._spec

    def sample(self, prompt, n: int, *, seed: int, sampler: dict, draft: str | None = None, gamma: int = 2,
               draft_path=None) -> list[int]:
        """n tokens sampled by the engine's own sampler chain (`sampler`: temp, top_k, top_p, min_p, as
        llama-cpp-python takes them), seeded with `seed`: plain decoding (draft None) or speculative
        ("prompt-lookup" or "draft-model", as in `speculative`). llama-cpp-python draws every position
        from its own row of the target's logits and keeps a draft while it equals the draw."""
        llm = self.plain if draft is None else self._speculative(draft, gamma, draft_path)
        llm.set_seed(seed)   # its dist sampler is made from this seed at each generate()
        return self._run(llm, prompt, n, sampler)[0]

    def logits(self, tokens, block: int | None = None) -> np.ndarray:
        """Logits of every position of `tokens` [len, V]: one token a pass (block None), or the
        first token alone then passes of `block` tokens."""
        llm = self.scorer
        llm.reset()
        tokens = list(tokens)
        width = 1 if block is None else block
        llm.eval(tokens[:1])
        for i in range(1, len(tokens), width):
            llm.eval(tokens[i:i + width])
        return np.array(llm.scores[:len(tokens)], dtype=np.float64)

    def noise(self, sequences, widths=(2, 4, 9)) -> float:
        """max |one-token logits - block logits| over the sequences and block widths."""
        key = (tuple(tuple(s) for s in sequences), tuple(widths))
        if key not in self._noise:
            worst = 0.0
            for seq in sequences:
                step = self.logits(seq)
                for w in widths:
                    worst = max(worst, float(np.abs(self.logits(seq, w) - step).max()))
            self._noise[key] = worst
        return self._noise[key]

    def diagnose(self, prompt, expected, actual, noise: float, gamma: int = 8) -> Divergence | None:
        """The first divergence of `actual` from the engine's greedy `expected`, tie or bug."""
        j = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), None)
        if j is None:
            return None
        context = list(prompt) + list(expected[:j])
        row = self.logits(context)[-1]
        top2 = np.sort(row)[-2:]
        gap = float(top2[1] - top2[0])
        replay = []
        for width in range(1, gamma + 2):
            if width >= len(context):
                break
            self.scorer.reset()
            self.scorer.eval(context[:-width])
            self.scorer.eval(context[-width:])
            if int(np.argmax(self.scorer.scores[len(context) - 1])) == actual[j]:
                replay.append(width)
        verdict = "tie" if gap <= noise else "BUG"
        return Divergence(j, int(expected[j]), int(actual[j]), gap, noise, replay, verdict)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows to llama.cpp's interleaved rope layout (its converter's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_gguf(model, dst: Path) -> Path:
    """Write a Hugging Face LlamaForCausalLM (e.g. a tiny seeded one) as an f32 GGUF llama.cpp runs.
    Its vocabulary is a stand-in (token i is the string "<i>", no merges): the kit feeds token ids."""
    import gguf

    cfg = model.config
    vocab = cfg.vocab_size
    tmp = Path(dst).with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(vocab)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(vocab)])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * vocab)
    w.add_token_merges(["< 0"])   # llama.cpp wants a non-empty merge list; the kit never tokenizes text
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[pre + theirs + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[pre + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[pre + "self_attn.k_proj.weight"], kv_heads))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return Path(dst)
