"""Recipe: train an EAGLE-style draft head (spec.eagle) for a target, on CPU, in minutes.

    python recipes/train_eagle.py --target smollm2        # SmolLM2-135M-Instruct fp32 (python -m spec.realmodel first)
    python recipes/train_eagle.py --target pair           # the shipped pair's target (spec/assets/pair)

1. Data, the project's own: training prompts that are not the evaluation prompts (SmolLM2: chat
   instructions built from TOPICS x TASKS; the pair: windows of the running Python's standard
   library sources, the pair's own training corpus), each continued by the target's greedy
   decoding (spec.greedy_generate, batched): the head learns the target's own text; and
   `--windows` 256-token windows of local text (this project's docs, the standard library),
   teacher-forced.
2. Features: one cache-free forward of the target over each whole sequence gives its last-layer
   states f_t and its argmax a_t at every position (self-distillation: the head is scored on the
   token the target would pick, which is what greedy acceptance asks).
3. Draft vocabulary: the K most frequent argmax tokens of the data (the head scores only those).
4. Training: from (f_t, x_{t+1}) the head predicts f_{t+1} and a_{t+1}; unrolled `unroll` steps on
   its own predicted states (as it drafts), loss = cross-entropy over the draft vocabulary +
   `feature_weight` x smooth-L1 to the target's next state; AdamW, cosine schedule, seeded.
5. Saved to $SPEC_CACHE/eagle/<target>.pt (spec.eagle.save) with RECIPE settings and losses; then
   evaluated on the evaluation prompts (the seed prompts / code prompts): greedy outputs equal,
   alpha, tokens per round, and time against plain greedy (bench numbers: docs/log/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec import eagle, greedy_generate, hf, speculative_generate  # noqa: E402

TOPICS = ["photosynthesis", "the water cycle", "black holes", "compound interest", "the French revolution",
          "machine learning", "vaccines", "climate change", "the stock market", "volcanoes", "the internet",
          "democracy", "gravity", "recycling", "the human heart", "electric cars"]
TASKS = ["Explain {} to a ten-year-old.", "Write three short facts about {}.", "What are the pros and cons of {}?"]


def chat_prompts(tok, count: int) -> list[list[int]]:
    """SmolLM2's training prompts: instructions from TOPICS x TASKS, chat-formatted."""
    from spec.models import encode_prompt
    texts = [task.format(topic) for task in TASKS for topic in TOPICS][:count]
    return [encode_prompt(tok, text, chat=True) for text in texts]


def code_prompts(tok, count: int, length: int = 48, seed: int = 0) -> list[list[int]]:
    """The pair's training prompts: `count` windows of `length` tokens from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < count:
        text = files[int(torch.randint(len(files), (1,), generator=gen))].read_text(errors="replace")
        ids = tok.encode(text)
        if len(ids) > length + 1:
            start = int(torch.randint(len(ids) - length, (1,), generator=gen))
            out.append(ids[start:start + length])
    return out


def text_windows(tok, count: int, length: int = 256, seed: int = 1) -> list[list[int]]:
    """`count` windows of `length` tokens of local text: this project's docs and the running Python's
    standard library sources (teacher-forced: the head is trained on the target's own argmax at every
    position, whoever wrote the text)."""
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "docs").glob("*.md")) + sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < count:
        ids = tok.encode(files[int(torch.randint(len(files), (1,), generator=gen))].read_text(errors="replace"))
        if len(ids) > length:
            start = int(torch.randint(len(ids) - length, (1,), generator=gen))
            out.append(list(ids[start:start + length]))
    return out


def corpus(target, prompts: list[list[int]], new_tokens: int, batch: int = 8) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation."""
    out = []
    for i in range(0, len(prompts), batch):
        rows = prompts[i:i + batch]
        for p, r in zip(rows, greedy_generate(target, rows, max_new_tokens=new_tokens)):
            out.append(p + r.tokens)
    return out


@torch.inference_mode()
def features(target, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids [T], the target's last-layer states [T, H], its argmax at each position [T]) per sequence."""
    out = []
    for seq in sequences:
        ids = torch.tensor(seq)
        res = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        out.append((ids, res.hidden_states[-1][0].float(), res.logits[0].argmax(-1)))
    return out


def draft_vocabulary(data, k: int) -> torch.Tensor:
    """The k most frequent argmax tokens of the data, most frequent first."""
    counts = torch.bincount(torch.cat([a for _, _, a in data]))
    return counts.argsort(descending=True)[:min(k, int((counts > 0).sum()))]


def _windows(data, unroll: int):
    """Per training position t: f_t, x_{t+1..t+unroll}, a_{t+1..t+unroll}, f_{t+1..t+unroll}."""
    f, x, a, nxt = [], [], [], []
    for ids, states, argmax in data:
        T = ids.numel() - unroll
        if T < 1:
            continue
        f.append(states[:T])
        x.append(torch.stack([ids[1 + s:T + 1 + s] for s in range(unroll)], 1))
        a.append(torch.stack([argmax[1 + s:T + 1 + s] for s in range(unroll)], 1))
        nxt.append(torch.stack([states[1 + s:T + 1 + s] for s in range(unroll)], 1))
    return torch.cat(f), torch.cat(x), torch.cat(a), torch.cat(nxt)


def train(target, data, ids: torch.Tensor, *, steps: int = 600, batch: int = 256, lr: float = 2e-3, unroll: int = 2,
          feature_weight: float = 0.1, seed: int = 0, say=print) -> tuple[eagle.EagleHead, list[float]]:
    """A head trained on `data` (from `features`); returns it (eval mode) and the loss every 50 steps."""
    torch.manual_seed(seed)
    head = eagle.EagleHead(target, ids)
    index = torch.full((hf.logit_width(target),), -100)
    index[ids] = torch.arange(ids.numel())          # target id -> draft-vocabulary index (-100: not in it)
    f0, x, a, nxt = _windows(data, unroll)
    labels = index[a]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    head.train()
    for step in range(steps):
        pick = torch.randint(f0.shape[0], (batch,), generator=gen)
        f, loss = f0[pick], 0.0
        for s in range(unroll):
            f = head.step(f, x[pick, s])
            loss = loss + torch.nn.functional.cross_entropy(head.logits(f), labels[pick, s], ignore_index=-100) \
                + feature_weight * torch.nn.functional.smooth_l1_loss(f, nxt[pick, s])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(round(loss.item() / unroll, 4))
            say(f"  step {step:5d}  loss {losses[-1]:.4f}")
    return head.eval(), losses


def evaluate(target, head, prompts: list[list[int]], *, gamma: int, new_tokens: int, branches: int = 1,
             repeats: int = 1) -> dict:
    """Greedy equality, alpha, tokens per round and time against plain greedy, interleaved per prompt."""
    draft = eagle.EagleDraft(head, branches=branches)
    rows, t_plain, t_spec = [], 0.0, 0.0
    for p in prompts:
        for _ in range(repeats):
            t0 = time.perf_counter()
            plain = greedy_generate(target, p, max_new_tokens=new_tokens)
            t1 = time.perf_counter()
            out = speculative_generate(target, draft, p, gamma=gamma, max_new_tokens=new_tokens)
            t2 = time.perf_counter()
            t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
        rows.append(dict(equal=out.tokens == plain.tokens, alpha=out.alpha, accept_rate=out.accept_rate,
                         tokens_per_round=out.mean_tokens_per_round))
    return dict(gamma=gamma, branches=branches, equal=all(r["equal"] for r in rows),
                alpha=sum(r["alpha"] for r in rows) / len(rows),
                tokens_per_round=sum(r["tokens_per_round"] for r in rows) / len(rows),
                speedup=t_plain / t_spec, plain_s=t_plain, spec_s=t_spec, rows=rows)


def compare(target, tok, head, prompts: list[list[int]], *, new_tokens: int, threads: int) -> dict:
    """SmolLM2: the head against the other drafters a CPU user has, interleaved prompt by prompt, one
    process: plain greedy, EAGLE chains (gamma 4) and trees (2 branches), prompt lookup (gamma 8) and
    the model's own Q4_1 GGUF in llama.cpp (gamma 6). Per drafter: outputs equal to greedy, alpha,
    tokens per round, the draft's cost c (its time per drafted token over greedy's per token) and the
    speedup over greedy (total time)."""
    from spec import realmodel
    from spec.gguf_draft import GGUFDraft
    from spec.lookup import PromptLookup
    drafters = {"eagle": (eagle.EagleDraft(head), 4), "eagle tree": (eagle.EagleDraft(head, branches=2), 4),
                "lookup": (PromptLookup(), 8), "q4_1": (GGUFDraft(realmodel.fetch(), target, tok, threads=threads), 6)}
    rows: dict = {name: dict(s=0.0, draft_s=0.0, drafted=0, alpha=[], tpr=[], equal=True) for name in drafters}
    plain_s, plain_tokens = 0.0, 0
    for p in prompts:
        t0 = time.perf_counter()
        plain = greedy_generate(target, p, max_new_tokens=new_tokens)
        plain_s, plain_tokens = plain_s + time.perf_counter() - t0, plain_tokens + len(plain.tokens)
        for name, (draft, gamma) in drafters.items():
            t0 = time.perf_counter()
            out = speculative_generate(target, draft, p, gamma=gamma, max_new_tokens=new_tokens, trace=True)
            row = rows[name]
            row["s"] += time.perf_counter() - t0
            row["draft_s"] += sum(r.draft_s for r in out.rounds)
            row["drafted"] += out.drafted
            row["alpha"].append(out.alpha)
            row["tpr"].append(out.mean_tokens_per_round)
            row["equal"] &= out.tokens == plain.tokens
    step = plain_s / plain_tokens
    return {name: dict(equal=r["equal"], alpha=sum(r["alpha"]) / len(r["alpha"]),
                       tokens_per_round=sum(r["tpr"]) / len(r["tpr"]),
                       c=(r["draft_s"] / r["drafted"]) / step if r["drafted"] else float("nan"),
                       speedup=plain_s / r["s"]) for name, r in rows.items()} | {"greedy_ms_per_token": 1e3 * step}


def _load(kind: str):
    """(target, tokenizer, training prompts maker, evaluation prompts) for --target."""
    if kind == "smollm2":
        from spec import realmodel
        from spec.models import encode_prompt
        from spec.prompts import SEED_PROMPTS
        target, tok = realmodel.load(say=lambda *a: None)
        return target, tok, chat_prompts, [encode_prompt(tok, t, chat=True) for t in SEED_PROMPTS]
    from spec.models import load_pair
    from spec.prompts import CODE_PROMPTS
    pair = load_pair()
    return pair.target, pair.tokenizer, code_prompts, [pair.tokenizer.encode(t) for t in CODE_PROMPTS]


def _train(args, target, tok, make_prompts, out: Path) -> dict:
    t0 = time.perf_counter()
    sequences = corpus(target, make_prompts(tok, args.prompts), args.new_tokens) + text_windows(tok, args.windows)
    data = features(target, sequences)
    t1 = time.perf_counter()
    ids = draft_vocabulary(data, args.k)
    positions = sum(i.numel() for i, _, _ in data)
    print(f"data: {len(sequences)} sequences, {positions} positions ({t1 - t0:.0f} s); draft vocabulary {ids.numel()}")
    head, losses = train(target, data, ids, steps=args.steps, batch=args.batch)
    t2 = time.perf_counter()
    about = dict(target=args.target, prompts=args.prompts, new_tokens=args.new_tokens, windows=args.windows,
                 positions=positions,
                 k=int(ids.numel()), steps=args.steps, losses=losses, data_s=round(t1 - t0), train_s=round(t2 - t1),
                 threads=args.threads)
    eagle.save(head, target, out, about)
    out.with_suffix(".json").write_text(json.dumps(dict(about=about), indent=1))
    print(f"saved {out} (training {t2 - t1:.0f} s)")
    return about


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("smollm2", "pair"), default="smollm2")
    ap.add_argument("--prompts", type=int, default=48, help="training prompts")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy tokens generated per training prompt")
    ap.add_argument("--windows", type=int, default=240, help="256-token windows of local text (teacher-forced)")
    ap.add_argument("--k", type=int, default=4096, help="draft vocabulary size")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--step", choices=("all", "train", "eval", "compare"), default="all",
                    help="train only, evaluate a saved head only, both, or (SmolLM2) compare a saved head with "
                         "prompt lookup and the Q4_1 GGUF draft")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok, make_prompts, eval_prompts = _load(args.target)
    out = args.out or Path(os.environ.get("SPEC_CACHE", Path.home() / ".cache" / "spec")) / "eagle" / f"{args.target}.pt"
    if args.step in ("all", "train"):
        about = _train(args, target, tok, make_prompts, out)
        if args.step == "train":
            return 0
    else:
        about = json.loads(out.with_suffix(".json").read_text())["about"]
    head = eagle.load(out, target)
    if args.step == "compare":
        table = compare(target, tok, head, eval_prompts, new_tokens=args.eval_tokens, threads=args.threads)
        print(json.dumps(table, indent=1))
        out.with_name(f"{args.target}-compare.json").write_text(json.dumps(table, indent=1))
        return 0 if all(v["equal"] for k, v in table.items() if isinstance(v, dict)) else 1
    results = [evaluate(target, head, eval_prompts, gamma=args.gamma, new_tokens=args.eval_tokens, branches=b)
               for b in (1, 2)]
    for r in results:
        print(f"branches {r['branches']}: equal {r['equal']}, alpha {r['alpha']:.3f}, tokens/round "
              f"{r['tokens_per_round']:.2f}, speedup over greedy {r['speedup']:.2f}x")
    out.with_suffix(".json").write_text(json.dumps(dict(about=about, eval=results), indent=1))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
