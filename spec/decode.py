"""Greedy decoding and speculative decoding (Leviathan et al. 2023, Algorithm 1).

Both decoders run their own loop over the models' KV caches. The sequence lives
in one preallocated buffer `seq`; `n` is how many of its tokens are final. A cache
holds the keys and values of a prefix `seq[:cached]`, and each forward pass feeds
exactly the tokens it has not seen, `seq[cached:...]`, so nothing is computed twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spec import hf, neox, sampling, theory
from spec.autogamma import AutoGamma
from spec.measure import sync
from spec.processors import Processors
from spec.validate import as_prompt, check_model, check_options, check_pair, model_device, stop_ids


@dataclass
class Round:
    """One round of the decode loop, recorded with trace=True."""
    drafted: int          # draft tokens proposed (gamma, fewer near max_new_tokens)
    accepted: int         # of those, the agreeing prefix kept
    emitted: int          # tokens added to the output (accepted + 1, cut at EOS)
    draft_s: float        # wall time of the draft phase
    verify_s: float       # wall time of the target pass and acceptance
    target_cache: int     # positions held by each cache after rollback
    draft_cache: int


@dataclass
class Result:
    tokens: list[int]                       # new tokens, prompt excluded
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    tokens_per_round: list[int] = field(default_factory=list)
    stop_reason: str = "max_new_tokens"     # or "eos"
    trace: list[Round] | None = None

    @property
    def rounds(self) -> int:
        return len(self.tokens_per_round)

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_round)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def accept_rate(self) -> float:
        """accepted / drafted, the seed notebook's "accept rate" (not alpha)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def alpha(self) -> float:
        """Per-token acceptance alpha, the MLE from the per-round accepted counts."""
        return theory.alpha_from_accepted(self.accepted_per_round, self.drafted_per_round) \
            if self.drafted else float("nan")

    @property
    def mean_tokens_per_round(self) -> float:
        return len(self.tokens) / self.rounds if self.rounds else float("nan")


def _clock(device: torch.device, on: bool) -> float:
    if not on:
        return 0.0
    sync(device)
    return time.perf_counter()


DRAFT_IMPLS = ("auto", "plain", "hf", "compiled")


def draft_runner(draft, max_len: int, impl: str = "auto"):
    """The draft with its cache, run the way `impl` says (see speculative_generate)."""
    if impl not in DRAFT_IMPLS:
        raise ValueError(f"draft_impl must be one of {', '.join(map(repr, DRAFT_IMPLS))}, got {impl!r}")
    if impl == "auto":
        impl = "plain" if neox.supports(draft) else "hf"
    if impl == "plain":
        return neox.NeoXDraft(draft, max_len)
    return hf.Cached(draft, static_len=max_len if impl == "compiled" else None)


def _first_stop(tokens: list[int], stops: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stops), None)


@torch.inference_mode()
def greedy_generate(model, input_ids, *, max_new_tokens: int = 64, eos_token_id=None, do_sample: bool = False,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    generator: torch.Generator | None = None, trace: bool = False,
                    repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None) -> Result:
    """Plain autoregressive decoding with `model` alone: one cached forward pass per token.

    do_sample=False takes the argmax (equal to HF generate(do_sample=False));
    do_sample=True is ancestral sampling from the processed distribution.
    repetition_penalty / no_repeat_ngram_size: HF's stateful processors (spec.processors)."""
    check_model(model, "model")
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    process = Processors(repetition_penalty, no_repeat_ngram_size)
    device = model_device(model)
    prompt = as_prompt(input_ids, device, {"model": model})
    stops = stop_ids(eos_token_id, {"model": model})
    P = prompt.numel()
    seq = torch.empty(P + max_new_tokens, dtype=torch.long, device=device)
    seq[:P] = prompt
    model_run, cached, n = hf.Cached(model), 0, P
    result = Result(tokens=[], trace=[] if trace else None)

    while n - P < max_new_tokens:
        t0 = _clock(device, trace)
        logits = model_run(seq[cached:n])[-1]
        if process:
            logits = process(logits[None], seq, n)[0]
        cached = n
        if do_sample:
            seq[n] = sampling.sample(sampling.probabilities(logits, temperature, top_k, top_p), generator)
        else:
            seq[n] = logits.argmax()
        n += 1
        result.tokens_per_round.append(1)
        if trace:
            result.trace.append(Round(0, 0, 1, 0.0, _clock(device, trace) - t0, len(model_run), 0))
        if stops and int(seq[n - 1]) in stops:
            result.stop_reason = "eos"
            break
    result.drafted_per_round = [0] * result.rounds
    result.accepted_per_round = [0] * result.rounds
    result.tokens = seq[P:n].tolist()
    return result


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, *, gamma: int | str = 5, max_new_tokens: int = 64,
                         eos_token_id=None, do_sample: bool = False, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, trace: bool = False,
                         draft_impl: str = "auto", repetition_penalty: float | None = None,
                         no_repeat_ngram_size: int | None = None) -> Result:
    """Speculative decoding: `draft` (Mq) proposes, `target` (Mp) verifies.

    Greedy (do_sample=False): the output equals greedy_generate(target, ...) token
    for token. Sampling: the output is distributed exactly as the target's processed
    distribution. gamma="auto" picks Theorem 3.8's optimal gamma from alpha and c
    measured as the run goes.

    draft_impl says how the draft runs; none changes the output, since the target
    decides every emitted token: "plain" (spec.neox: the draft's forward in plain
    tensors on a preallocated KV buffer, GPT-NeoX only), "hf" (the model's own
    forward on a DynamicCache), "compiled" (its forward on a StaticCache with the
    one-token step compiled: CUDA graphs on GPU), "auto" ("plain" where it applies,
    else "hf").

    repetition_penalty / no_repeat_ngram_size (spec.processors): verify row i sees exactly the
    prefix seq[:n + i], the draft's step i the same prefix, so nothing from a rejected draft
    token reaches a later round."""
    check_pair(target, draft)
    check_options(max_new_tokens=max_new_tokens, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p)
    process = Processors(repetition_penalty, no_repeat_ngram_size)
    device = model_device(target)
    models = {"target": target, "draft": draft}
    prompt = as_prompt(input_ids, device, models)
    stops = stop_ids(eos_token_id, models)
    auto = AutoGamma() if gamma == "auto" else None
    max_gamma = auto.max_gamma if auto else gamma
    # The draft proposes only ids the target can score and the draft can embed again.
    draft_rows = hf.vocab_rows(draft)
    common = min(hf.logit_width(draft), hf.logit_width(target), draft_rows)
    # The target may emit an id the draft cannot embed (pythia-12b's head is wider than
    # pythia-410m's embedding); the draft is fed a stand-in. That changes only its guesses.
    clamp_for_draft = hf.logit_width(target) > draft_rows
    timed = trace or auto is not None

    P = prompt.numel()
    seq = torch.empty(P + max_new_tokens + max_gamma + 1, dtype=torch.long, device=device)
    seq[:P] = prompt
    target_run = hf.Cached(target)
    draft_run = draft_runner(draft, seq.numel(), draft_impl)
    t_cached = d_cached = 0
    n = P
    result = Result(tokens=[], trace=[] if trace else None)

    while n - P < max_new_tokens:
        g = auto.gamma if auto else gamma
        g = min(g, max_new_tokens - (n - P) - 1)  # never draft past max_new_tokens

        # 1. Draft: Mq proposes g tokens autoregressively (first catching up on tokens it has not seen).
        t0 = _clock(device, timed)
        q = []
        for i in range(g):
            feed = seq[d_cached:n + i]
            logits = draft_run(feed.clamp(max=draft_rows - 1) if clamp_for_draft else feed)[-1, :common]
            if process:
                logits = process(logits[None], seq, n + i)[0]
            d_cached = n + i
            if do_sample:
                q.append(sampling.probabilities(logits, temperature, top_k, top_p))
                seq[n + i] = sampling.sample(q[-1], generator)
            else:
                seq[n + i] = logits.argmax()

        # 2. Verify: Mp scores all g + 1 positions in one pass.
        t1 = _clock(device, timed)
        logits = target_run(seq[t_cached:n + g], keep=g + 1)
        if process:
            logits = process(logits, seq, n)  # row i predicts seq[n + i] from seq[:n + i]
        t_cached = n + g

        # 3. Accept the longest prefix that passes, then append one token from Mp.
        proposed = seq[n:n + g]
        if do_sample:
            p = sampling.probabilities(logits, temperature, top_k, top_p)
            q = torch.stack(q) if g else p.new_zeros(0, common)
            rows = torch.arange(g, device=device)
            u = torch.rand(g, device=device, generator=generator, dtype=p.dtype)
            passed = u * q[rows, proposed] < p[rows, proposed]      # u < p(x) / q(x)
            k = int(passed.cumprod(0).sum())
            last = sampling.residual(p[k], q[k]) if k < g else p[g]  # on rejection: norm(max(0, p - q))
            seq[n + k] = sampling.sample(last, generator)
        else:
            choice = logits.argmax(-1)
            k = int((proposed == choice[:g]).cumprod(0).sum())
            seq[n + k] = choice[k]                                    # Mp's own token after the prefix

        # 4. Cut at EOS, then roll back: both caches keep all but the newest token, fed next round.
        emitted = k + 1
        if stops:
            cut = _first_stop(seq[n:n + emitted].tolist(), stops)
            if cut is not None:
                emitted, result.stop_reason = cut + 1, "eos"
        n += emitted
        target_run.crop(n - 1)
        t_cached = n - 1
        if d_cached > n - 1:
            draft_run.crop(n - 1)
            d_cached = n - 1
        t2 = _clock(device, timed)

        accepted = min(k, emitted)  # draft tokens that reached the output (EOS may cut a block)
        result.drafted_per_round.append(g)
        result.accepted_per_round.append(accepted)
        result.tokens_per_round.append(emitted)
        if auto:
            auto.observe(drafted=g, accepted=k, draft_s=t1 - t0, verify_s=t2 - t1)
        if trace:
            result.trace.append(Round(g, accepted, emitted, t1 - t0, t2 - t1,
                                      len(target_run), len(draft_run)))
        if result.stop_reason == "eos":
            break

    result.tokens = seq[P:n].tolist()
    return result
