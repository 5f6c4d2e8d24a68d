"""Recipe for the small target/draft pair shipped in ``spec/assets/pair``.

Run ``python recipes/train_pair.py`` (about 17 minutes on a shared 2-core CPU; pass ``--out``
to write elsewhere). The recipe:

1. Corpus: the ``*.py`` sources of the running Python's standard library
   (``sysconfig.get_paths()["stdlib"]``), sorted by relative path, skipping test
   folders, site-packages, idlelib, lib2to3, turtledemo, ensurepip, pydoc_data and
   encodings (data tables, not code). Each file goes either to *train* or to
   *held-out*, decided by a hash of its relative path; held-out files are never
   seen by the tokenizer or by training. The corpus depends on the Python
   version; RECIPE.json records the version, the held-out file list and a digest.
2. Tokenizer: byte-level BPE (``tokenizers``), ByteLevel pre-tokenizer, decoder
   and post-processor, no normaliser (exact round trip), 4000 tokens, one special
   token ``<|endoftext|>`` = id 0, used as EOS, BOS and UNK (Pythia style).
3. Models: GPT-NeoX in the Pythia style (rotary on 25% of each head, parallel
   residual, untied input/output embeddings). Embedding widths are padded like
   Pythia's (50277 tokens; 410m has 50304 rows, 12b 50688): the draft to the next
   multiple of 128 above the tokenizer (4096), the target to a larger multiple of
   512 (4608), so the two logit vectors differ in width; config.vocab_size is the
   padded width.
   Why the shapes: in eager HF on this CPU a one-token step costs about 1.3 ms of
   fixed overhead plus about 0.8 ms per layer, nearly independent of width at this
   size, so the cost ratio c is set by depth. The draft is 1 layer (hidden 128),
   the target 24 layers (hidden 128): c is about 0.1. A deep target is slow to
   train, so it is grown (progressive stacking): 4 layers trained first, then each
   layer followed by 5 copies whose residual output projections start at zero
   (same function), then all 24 layers trained on; one cosine schedule spans both.
   The draft starts from the target's embeddings, first layer and head, and is
   distilled: loss = kl_weight * KL(p_target || q_draft) over the common logit
   range (the draft's 4096 rows) + (1 - kl_weight) * CE.
4. Both are saved as bf16 safetensors, each folder with the tokenizer files, and
   RECIPE.json records settings, corpus and token counts, versions, held-out
   losses, agreement (alpha) and step times, measured on the saved weights
   loaded in fp32 with eager attention.

Determinism: everything is seeded, data order comes from a seeded generator, torch
uses deterministic algorithms and a fixed thread count (default 1). Results depend
on the thread count bit for bit; one thread makes them independent of the core
count, and on a shared 2-core machine one thread trained 3-5x faster than two.
With the same seed, Python (corpus), torch and thread count, the weights and the
tokenizer come out the same; RECIPE.json also holds wall-clock times, which vary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "spec" / "assets" / "pair"
EOS_TOKEN = "<|endoftext|>"
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "pydoc_data",
        "encodings",
        "__pycache__",
    }
)


# --------------------------------------------------------------------------- corpus


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative posix path, text) for the stdlib *.py files, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
    return out


def is_heldout(relpath: str, frac: float, salt: str = "spec-pair") -> bool:
    h = hashlib.sha256(f"{salt}:{relpath}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < frac


def split_corpus(files, frac):
    train = [(r, t) for r, t in files if not is_heldout(r, frac)]
    held = [(r, t) for r, t in files if is_heldout(r, frac)]
    return train, held


def corpus_digest(files) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return h.hexdigest()


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS_TOKEN) == 0
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok, texts: list[str]):
    """Concatenate files, each followed by EOS (id 0), as one int64 tensor."""
    import torch

    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


# --------------------------------------------------------------------------- models


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_config(vocab_width, hidden, layers, heads, max_pos=2048):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=vocab_width,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_act="gelu",
        rotary_pct=0.25,
        rotary_emb_base=10000,
        max_position_embeddings=max_pos,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        layer_norm_eps=1e-5,
        initializer_range=0.02,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=True,
    )


def grow(model, factor: int):
    """Progressive stacking, function-preserving: a model `factor` times deeper in which
    every layer of `model` appears `factor` times in a row. The first copy is the layer
    itself; the others copy its LayerNorms and input projections but start with zero
    residual output projections (attention.dense, mlp.dense_4h_to_h), so they add nothing
    until trained and the grown model computes exactly what `model` did. (Copying every
    layer with outputs divided by `factor` instead was tried: held-out loss jumped from
    4.32 to 6.23 and the deep stage ended worse than the shallow one.)"""
    from transformers import GPTNeoXForCausalLM

    c = model.config
    big = GPTNeoXForCausalLM(make_config(c.vocab_size, c.hidden_size, c.num_hidden_layers * factor, c.num_attention_heads))
    sd = {}
    for k, v in model.state_dict().items():
        if ".layers." not in k:
            sd[k] = v.clone()
            continue
        head, rest = k.split(".layers.", 1)
        i, tail = rest.split(".", 1)
        out_proj = tail.startswith(("attention.dense.", "mlp.dense_4h_to_h."))
        for j in range(factor):
            sd[f"{head}.layers.{int(i) * factor + j}.{tail}"] = v.clone() if j == 0 or not out_proj else v * 0
    big.load_state_dict(sd, strict=True)
    return big


def added_layer_ratio(model, factor):
    """Mean Frobenius norm of the added layers' residual output projections over that of
    the original layers (0 right after grow(); how much the added layers now write)."""
    orig, added = [], []
    for i, layer in enumerate(model.gpt_neox.layers):
        n = (layer.attention.dense.weight.norm() + layer.mlp.dense_4h_to_h.weight.norm()).item()
        (orig if i % factor == 0 else added).append(n)
    return round((sum(added) / max(1, len(added))) / (sum(orig) / len(orig)), 4)


def draft_from(target, draft):
    """Warm start for the draft: the target's embeddings (first rows), first layer, final
    LayerNorm and output rows, wherever the shapes match; the rest stays as initialised."""
    import torch

    tsd = target.state_dict()
    with torch.no_grad():
        for k, v in draft.state_dict().items():
            if k in tsd and tsd[k].shape[1:] == v.shape[1:] and tsd[k].shape[0] >= v.shape[0]:
                v.copy_(tsd[k][: v.shape[0]])
    return draft


def heldout_loss(model, held_stream, seq_len, max_windows=16):
    import torch
    import torch.nn.functional as F

    model.eval()
    tot = n = 0
    with torch.inference_mode():
        for w in heldout_windows(held_stream, seq_len, max_windows):
            logits = model(input_ids=w[None, :-1]).logits[0]
            tot += F.cross_entropy(logits, w[1:], reduction="sum").item()
            n += len(w) - 1
    return round(tot / n, 4)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step, steps, lr, warmup, final_frac=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model, lr, weight_decay):
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def sample_batch(stream, batch, seq_len, gen):
    import torch

    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def train_model(
    model,
    stream,
    *,
    steps,
    batch,
    seq_len,
    lr,
    warmup,
    weight_decay,
    seed,
    teacher=None,
    kl_weight=0.0,
    name="model",
    log_every=10,
    schedule=None,
):
    """Train in place. With a teacher, distill: kl_weight*KL(teacher||model) + (1-kl_weight)*CE.

    schedule: (offset, total) places these steps inside a longer cosine schedule
    (a later stage of one run); the stage then warms up over `warmup` steps again."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr, weight_decay)
    model.train()
    width = model.config.vocab_size
    if teacher is not None:
        teacher.eval()
        common = min(width, teacher.config.vocab_size)
    t0 = time.perf_counter()
    hist = []
    for step in range(steps):
        if schedule is None:
            lr_now = lr_at(step, steps, lr, warmup)
        else:
            lr_now = lr_at(schedule[0] + step, schedule[1], lr, 0) * min(1.0, (step + 1) / max(1, warmup))
        for g in opt.param_groups:
            g["lr"] = lr_now
        xb = sample_batch(stream, batch, seq_len, gen)
        x, y = xb[:, :-1], xb[:, 1:]
        logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits.reshape(-1, width), y.reshape(-1))
        loss = ce
        kl = torch.zeros(())
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x).logits[..., :common], dim=-1)
            s_logp = F.log_softmax(logits[..., :common], dim=-1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
            loss = kl_weight * kl + (1 - kl_weight) * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.append((ce.item(), kl.item()))
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            w = hist[-log_every:]
            el = time.perf_counter() - t0
            print(
                f"[{name}] step {step + 1}/{steps} ce {sum(a for a, _ in w) / len(w):.3f}"
                + (f" kl {sum(b for _, b in w) / len(w):.3f}" if teacher is not None else "")
                + f" lr {opt.param_groups[0]['lr']:.2e} {el:.0f}s ({el / (step + 1):.2f} s/step)",
                flush=True,
            )
    model.eval()
    tail = hist[-50:] or [(float("nan"), float("nan"))]
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "final_train_ce": round(sum(a for a, _ in tail) / len(tail), 4),
        "final_train_kl": round(sum(b for _, b in tail) / len(tail), 4) if teacher is not None else None,
    }


# --------------------------------------------------------------------------- evaluation


def heldout_windows(stream, seq_len, max_windows):
    n = min(max_windows, (len(stream) - 1) // seq_len)
    return [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]


def evaluate_pair(target, draft, held_stream, seq_len, *, max_windows, n_prompts, prompt_len, new_tokens):
    """Held-out losses and greedy agreement, models in fp32 eval mode."""
    import torch
    import torch.nn.functional as F

    res = {}
    windows = heldout_windows(held_stream, seq_len, max_windows)
    tot = {"target": 0.0, "draft": 0.0}
    agree = n = 0
    beta = 0.0
    with torch.inference_mode():
        for w in windows:
            x, y = w[None, :-1], w[None, 1:]
            lt = target(input_ids=x).logits[0]
            ld = draft(input_ids=x).logits[0]
            tot["target"] += F.cross_entropy(lt, y[0], reduction="sum").item()
            tot["draft"] += F.cross_entropy(ld, y[0], reduction="sum").item()
            agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
            beta += _beta(lt, ld).sum().item()
            n += y.numel()
    res["heldout_tokens_scored"] = n
    res["heldout_loss_target"] = round(tot["target"] / n, 4)
    res["heldout_loss_draft"] = round(tot["draft"] / n, 4)
    res["alpha_teacher_forced"] = round(agree / n, 4)
    res["beta_teacher_forced"] = round(beta / n, 4)

    # Greedy: target's own greedy continuation of held-out prompts.
    span = len(held_stream) - prompt_len - 1
    rows = draft.get_input_embeddings().num_embeddings
    agree = n = padded = 0
    beta = 0.0
    with torch.inference_mode():
        for i in range(n_prompts):
            off = i * span // n_prompts
            prompt = held_stream[off : off + prompt_len][None]
            cont = greedy(target, prompt, new_tokens)
            full = torch.cat([prompt, cont], dim=1)
            # A target that emits a padding id (only an untrained one does) cannot be
            # followed by the narrower draft: feed it EOS there; it counts as a miss.
            padded += (cont >= rows).sum().item()
            lt = target(input_ids=full[:, :-1]).logits[0, prompt_len - 1 :]
            ld = draft(input_ids=full[:, :-1].masked_fill(full[:, :-1] >= rows, 0)).logits[0, prompt_len - 1 :]
            agree += (ld.argmax(-1) == cont[0]).sum().item()
            beta += _beta(lt, ld).sum().item()
            n += new_tokens
    res["greedy_prompts"] = n_prompts
    res["greedy_prompt_len"] = prompt_len
    res["greedy_new_tokens"] = new_tokens
    res["alpha_greedy"] = round(agree / n, 4)
    res["beta_greedy"] = round(beta / n, 4)
    res["greedy_padding_ids_emitted"] = padded
    return res


def _beta(lt, ld):
    """sum_x min(p, q) per position (sampling acceptance at temperature 1)."""
    import torch

    p = torch.softmax(lt.float(), -1)
    q = torch.softmax(ld.float(), -1)
    w = min(p.shape[-1], q.shape[-1])
    return torch.minimum(p[..., :w], q[..., :w]).sum(-1)


def greedy(model, prompt, new_tokens):
    """Plain greedy decoding with a DynamicCache; ignores EOS. Returns (1, new_tokens)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    toks = []
    for _ in range(new_tokens):
        tok = out.logits[:, -1:].argmax(-1)
        toks.append(tok)
        out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(toks, dim=1)


def step_time_ms(model, prompt, steps=200, warmup=20):
    """Median time of a one-token cached forward (batch 1, after a prompt prefill)."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(warmup + steps):
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            ts.append(time.perf_counter() - t)
    return statistics.median(ts[warmup:]) * 1e3


def measure_cost(target, draft, prompt, repeats=3, steps=200):
    """Interleaved repeats; c from the min median of each (robust to a busy CPU)."""
    t_ms, d_ms = [], []
    for _ in range(repeats):
        d_ms.append(step_time_ms(draft, prompt, steps))
        t_ms.append(step_time_ms(target, prompt, steps))
    return {
        "target_step_ms": [round(v, 3) for v in t_ms],
        "draft_step_ms": [round(v, 3) for v in d_ms],
        "c": round(min(d_ms) / min(t_ms), 4),
    }


def load_pair(out: Path, dtype=None):
    """Load the saved pair (fp32 by default) with eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    kw = dict(dtype=dtype, attn_implementation="eager")
    target = AutoModelForCausalLM.from_pretrained(out / "target", **kw).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", **kw).eval()
    return target, draft


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python recipes/train_pair.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; results depend on it bit for bit (default %(default)s: reproducible on any "
        "machine, and on a shared 2-core box 3-5x faster than 2 threads)",
    )
    ap.add_argument("--heldout-frac", type=float, default=0.06, help="fraction of files held out")
    ap.add_argument("--vocab-size", type=int, default=4000, help="BPE vocabulary incl. <|endoftext|>")
    ap.add_argument("--draft-pad", type=int, default=128, help="draft embedding rows: multiple of this")
    ap.add_argument("--target-pad", type=int, default=512, help="target embedding rows: multiple of this, > draft")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-hidden", type=int, default=128)
    ap.add_argument("--target-layers", type=int, default=24, help="final depth (a multiple of --stage1-layers)")
    ap.add_argument("--stage1-layers", type=int, default=4, help="depth of the target's first, shallow stage")
    ap.add_argument("--target-heads", type=int, default=2)
    ap.add_argument("--draft-hidden", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--draft-heads", type=int, default=2)
    ap.add_argument("--stage1-steps", type=int, default=450, help="target steps at --stage1-layers")
    ap.add_argument("--target-steps", type=int, default=50, help="target steps after growing to --target-layers")
    ap.add_argument("--draft-steps", type=int, default=100)
    ap.add_argument("--target-lr", type=float, default=5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--stage2-warmup", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--kl-weight", type=float, default=0.8, help="draft loss = w*KL + (1-w)*CE")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows of seq-len for loss")
    ap.add_argument("--eval-prompts", type=int, default=20)
    ap.add_argument("--eval-prompt-len", type=int, default=64)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--timing-steps", type=int, default=200, help="0 skips the step-time measurement")
    ap.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    return ap.parse_args(argv)


def setup(args):
    """Threads, determinism and the seed: the recipe's results depend on all three bit for bit."""
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)


def prepare_data(args) -> dict:
    """Steps 1 and 2: the corpus split by file, and the tokenizer trained on the train split only."""
    files = stdlib_files(args.stdlib)
    train_files, held_files = split_corpus(files, args.heldout_frac)
    print(f"corpus: {len(files)} files, train {len(train_files)}, held-out {len(held_files)}", flush=True)
    t0 = time.perf_counter()
    raw_tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    hf_tok = wrap_tokenizer(raw_tok)
    data = dict(files=files, train_files=train_files, held_files=held_files, hf_tok=hf_tok, n_tok=len(hf_tok),
                train_stream=encode_stream(raw_tok, [t for _, t in train_files]),
                held_stream=encode_stream(raw_tok, [t for _, t in held_files]))
    data["tok_seconds"] = time.perf_counter() - t0
    print(f"tokenizer: {data['n_tok']} tokens; train {len(data['train_stream'])} held-out "
          f"{len(data['held_stream'])} tokens", flush=True)
    data["draft_width"] = pad_to(data["n_tok"] + 1, args.draft_pad)  # at least one padding row, like pythia
    data["target_width"] = pad_to(data["draft_width"] + 1, args.target_pad)
    assert data["n_tok"] < data["draft_width"] < data["target_width"]
    return data


def train_target(args, data):
    """Step 3a: the target in two stages, shallow then grown deep; returns (stage1, target, infos)."""
    import torch
    from transformers import GPTNeoXForCausalLM

    if args.target_layers % args.stage1_layers:
        raise SystemExit("--target-layers must be a multiple of --stage1-layers")
    factor = args.target_layers // args.stage1_layers
    total = args.stage1_steps + args.target_steps
    common = dict(batch=args.batch, seq_len=args.seq_len, weight_decay=args.weight_decay)
    train, held = data["train_stream"], data["held_stream"]
    torch.manual_seed(args.seed)
    stage1 = GPTNeoXForCausalLM(make_config(data["target_width"], args.target_hidden, args.stage1_layers,
                                            args.target_heads))
    s1_info = train_model(stage1, train, steps=args.stage1_steps, lr=args.target_lr, warmup=args.warmup,
                          seed=args.seed, schedule=(0, total), name=f"target-{args.stage1_layers}L", **common)
    s1_info["heldout_loss"] = heldout_loss(stage1, held, args.seq_len)
    target = grow(stage1, factor)
    s1_info["heldout_loss_after_growth"] = heldout_loss(target, held, args.seq_len)
    print(f"stage 1: {json.dumps(s1_info)}", flush=True)
    t_info = train_model(target, train, steps=args.target_steps, lr=args.target_lr, warmup=args.stage2_warmup,
                         seed=args.seed + 1, schedule=(args.stage1_steps, total),
                         name=f"target-{args.target_layers}L", **common)
    t_info["heldout_loss"] = heldout_loss(target, held, args.seq_len)
    t_info["added_layer_output_norm_ratio"] = added_layer_ratio(target, factor)
    print(f"stage 2: {json.dumps(t_info)}", flush=True)
    return stage1, target, {"stage1": s1_info, "training": t_info}


def train_draft(args, data, stage1, target):
    """Step 3b: the draft, started from the target's stage-1 weights and distilled from the target."""
    import torch
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(args.seed + 2)
    draft = GPTNeoXForCausalLM(make_config(data["draft_width"], args.draft_hidden, args.draft_layers,
                                           args.draft_heads))
    if args.draft_hidden == args.target_hidden:
        draft_from(stage1, draft)
    print(f"target {n_params(target) / 1e6:.2f}M params, draft {n_params(draft) / 1e6:.2f}M params", flush=True)
    info = train_model(draft, data["train_stream"], steps=args.draft_steps, lr=args.draft_lr, warmup=args.warmup,
                       seed=args.seed + 3, teacher=target, kl_weight=args.kl_weight, name="draft",
                       batch=args.batch, seq_len=args.seq_len, weight_decay=args.weight_decay)
    return draft, info


def save_pair(out: Path, target, draft, hf_tok) -> None:
    """Step 4: bf16 safetensors, the tokenizer in each folder."""
    import torch
    from transformers import GenerationConfig

    for name, model in (("target", target), ("draft", draft)):
        d = out / name
        model = model.to(torch.bfloat16)
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(d, safe_serialization=True)
        hf_tok.save_pretrained(d)
        for f in d.iterdir():
            f.chmod(0o644)


def evaluate_saved(args, out: Path, data) -> tuple:
    """Step 5: the saved weights loaded in fp32: held-out losses, agreement and step times."""
    target, draft = load_pair(out)
    ev = evaluate_pair(target, draft, data["held_stream"], args.seq_len, max_windows=args.eval_windows,
                       n_prompts=args.eval_prompts, prompt_len=args.eval_prompt_len,
                       new_tokens=args.eval_new_tokens)
    print(json.dumps(ev), flush=True)
    cost = None
    if args.timing_steps:
        cost = measure_cost(target, draft, data["held_stream"][: args.eval_prompt_len][None],
                            steps=args.timing_steps)
        print(json.dumps(cost), flush=True)
    return target, draft, ev, cost


def config_summary(model) -> dict:
    c = model.config
    return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size, "params": n_params(model)}


def versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def corpus_record(data) -> dict:
    train_files, held_files = data["train_files"], data["held_files"]
    return {
        "source": "Python standard library *.py (sysconfig.get_paths()['stdlib'])",
        "python_version": platform.python_version(),
        "skipped_dirs": sorted(SKIP_DIRS),
        "files_train": len(train_files),
        "files_heldout": len(held_files),
        "bytes_train": sum(len(t.encode()) for _, t in train_files),
        "bytes_heldout": sum(len(t.encode()) for _, t in held_files),
        "heldout_files": [r for r, _ in held_files],
        "digest_sha256": corpus_digest(data["files"]),
    }


def recipe_record(args, argv, data, models: dict, infos: dict, ev, cost, seconds: dict) -> dict:
    """RECIPE.json: settings, corpus, tokenizer, both models, evaluation and timings."""
    factor = args.target_layers // args.stage1_layers
    draft_width, target_width = data["draft_width"], data["target_width"]
    return {
        "command": "python recipes/train_pair.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "versions": versions(),
        "corpus": corpus_record(data),
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), no normaliser", "len": data["n_tok"], "eos_bos_unk": EOS_TOKEN,
            "eos_token_id": 0, "bos_token_id": 0, "tokens_train": len(data["train_stream"]),
            "tokens_heldout": len(data["held_stream"]), "seconds": round(data["tok_seconds"], 1),
        },
        "target": {
            **config_summary(models["target"]),
            "objective": "next-token cross-entropy",
            "method": f"progressive stacking: {args.stage1_layers} layers for {args.stage1_steps} steps, then each "
            f"layer followed by {factor - 1} copies of itself whose residual output projections start at zero "
            "(the grown model computes the same function), then "
            f"{args.target_steps} steps at {args.target_layers} layers; one cosine schedule over both stages",
            **infos["target"],
        },
        "draft": {
            **config_summary(models["draft"]),
            "objective": f"{args.kl_weight}*KL(target||draft) on logits[:{min(draft_width, target_width)}] "
            f"+ {1 - args.kl_weight:.2f}*CE",
            "init": "target's stage-1 embeddings, first layer, final LayerNorm and output rows (first "
            f"{draft_width} rows)" if args.draft_hidden == args.target_hidden else "random",
            "training": infos["draft"],
        },
        "saved_dtype": "bfloat16",
        "eval_note": "saved weights loaded in fp32, eager attention; losses in nats/token",
        "eval": ev,
        "cost": cost,
        "total_seconds_training_and_saving": round(seconds["train"], 1),
        "total_seconds": round(seconds["total"], 1),
    }


def main(argv=None):
    args = parse_args(argv)
    setup(args)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args)
    stage1, target, target_info = train_target(args, data)
    draft, draft_info = train_draft(args, data, stage1, target)
    del stage1
    save_pair(out, target, draft, data["hf_tok"])
    del target, draft
    train_seconds = time.perf_counter() - t_start
    target, draft, ev, cost = evaluate_saved(args, out, data)
    seconds = {"train": train_seconds, "total": time.perf_counter() - t_start}
    recipe = recipe_record(args, argv, data, {"target": target, "draft": draft},
                           {"target": target_info, "draft": draft_info}, ev, cost, seconds)
    (out / "RECIPE.json").write_text(json.dumps(recipe, indent=2) + "\n")
    print(f"wrote {out} in {recipe['total_seconds']:.0f}s", flush=True)
    return recipe


if __name__ == "__main__":
    main()
