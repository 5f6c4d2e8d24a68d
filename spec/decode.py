"""Greedy decoding and speculative decoding (Leviathan et al. 2023, Algorithm 1).

Both decoders run their own loop over Runners, and the speculative one over a Drafter
(spec.protocols), both made by spec.choose; the acceptance rule is spec.accept. The
sequence lives in one preallocated buffer `seq`; `n` is how many of its tokens are
final. A runner holds a model's state for a prefix `seq[:len(run)]`, and each forward
pass feeds exactly the tokens it has not seen, `seq[len(run):...]`. After a round both
runners are cut back to all but the newest token (`crop(n - 1)`), which the next round
feeds. A runner that restores an earlier state (a recurrent one) re-feeds the kept tokens
itself when cropped; one that goes back further still is fed the rest in the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec import accept, batch, choose, clock, hf, parallel, sampling, theory
from spec.autogamma import AutoGamma
from spec.draft import FixedGamma, Pick
from spec.processors import Processors
from spec.validate import check_options, check_positions, model_device, stop_ids


@dataclass
class Round:
    """One round of the decode loop: what was drafted, accepted and emitted, and with
    trace=True how long its phases took and what the caches held after the rollback."""
    drafted: int                       # draft tokens proposed (gamma, fewer near max_new_tokens)
    accepted: int                      # of those, the agreeing prefix kept
    emitted: int                       # tokens added to the output (accepted + 1, cut at EOS)
    draft_s: float | None = None       # wall time of the draft phase (trace=True)
    verify_s: float | None = None      # wall time of the target pass and acceptance (trace=True)
    target_cache: int | None = None    # positions held by each cache after rollback (trace=True)
    draft_cache: int | None = None


@dataclass
class Result:
    """A decode run: the new tokens and one Round per round; every other figure is derived."""
    tokens: list[int]                       # new tokens, prompt excluded
    rounds: list[Round] = field(default_factory=list)
    stop_reason: str = "max_new_tokens"     # or "eos"
    traced: bool = False                    # rounds carry their timings (trace=True)

    @property
    def trace(self) -> list[Round] | None:
        """The rounds with their timings, or None when the run was not traced."""
        return self.rounds if self.traced else None

    @property
    def drafted_per_round(self) -> list[int]:
        return [r.drafted for r in self.rounds]

    @property
    def accepted_per_round(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def tokens_per_round(self) -> list[int]:
        return [r.emitted for r in self.rounds]

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

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
        return len(self.tokens) / len(self.rounds) if self.rounds else float("nan")


def _clock(device: torch.device, on: bool) -> float:
    return clock.now(device) if on else 0.0


def _first_stop(tokens: list[int], stops: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stops), None)


def processors_for(options: dict, stops, target) -> Processors:
    """spec.processors.Processors for these options; ids they name must be in the target's
    vocabulary. Its prompt_len (where min_new_tokens counts from) is set once the prompt is known."""
    process = Processors(**options, eos_ids=stops)
    if process.max_id() >= hf.logit_width(target):
        raise ValueError(f"sequence_bias / bad_words_ids name id {process.max_id()}, outside the vocabulary "
                         f"[0, {hf.logit_width(target)})")
    return process


@torch.inference_mode()
def greedy_generate(model, input_ids, *, max_new_tokens: int = 64, eos_token_id=None, do_sample: bool = False,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    generator: torch.Generator | None = None, trace: bool = False,
                    input_features=None, decoder_input_ids=None,
                    repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                    min_p: float | None = None, min_new_tokens: int | None = None, sequence_bias=None,
                    bad_words_ids=None, attention_mask=None) -> Result | list[Result]:
    """Plain autoregressive decoding with `model` alone: one cached forward pass per token.

    do_sample=False takes the argmax (equal to HF generate(do_sample=False));
    do_sample=True is ancestral sampling from the processed distribution.
    Encoder-decoder models (spec.seq2seq): input_ids (or input_features, Whisper) is the
    encoder input, the tokens are the decoder's after its prompt (decoder_input_ids).
    repetition_penalty / no_repeat_ngram_size / sequence_bias / bad_words_ids / min_new_tokens: HF's
    processors of the same names (spec.processors); min_p: HF's min-p warper (sampling only).
    Several prompts (a list, or a (B, n) tensor with HF's left-padded attention_mask) are one batch
    (spec.batch): one Result per prompt, in order, each equal to that prompt's own run."""
    choose.check({"model": model})
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    device = model_device(model)
    stops = stop_ids(eos_token_id, {"model": model})
    process = processors_for(dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                  sequence_bias=sequence_bias, bad_words_ids=bad_words_ids,
                                  min_new_tokens=min_new_tokens), stops, model)
    pick = Pick(do_sample, temperature, top_k, top_p, generator, min_p=min_p)
    if batch.is_batch(input_ids, attention_mask):
        _refuse_in_batch(input_features=input_features, decoder_input_ids=decoder_input_ids)
        return _greedy_rows(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, stops=stops,
                            process=process, pick=pick, trace=trace)
    chosen = choose.runs({"model": model}, input_ids, input_features=input_features,
                         decoder_input_ids=decoder_input_ids, max_new_tokens=max_new_tokens)
    prompt, (model_run,) = chosen.prompt, chosen.runs
    process.prompt_len = prompt.numel()
    check_positions(prompt.numel(), max_new_tokens, chosen.models)
    parallel.check(model, prompt=prompt, generator=generator, max_new_tokens=max_new_tokens, stops=sorted(stops),
                   do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   sequence_bias=sequence_bias, bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens)
    P = prompt.numel()
    seq = torch.empty(P + max_new_tokens, dtype=torch.long, device=device)
    seq[:P] = prompt
    n = P
    result = Result(tokens=[], traced=trace)

    while n - P < max_new_tokens:
        t0 = _clock(device, trace)
        logits = model_run(seq[len(model_run):n], keep=1)[-1]
        seq[n] = _pick(process(logits[None], seq, n)[0] if process else logits, pick)
        n += 1
        timings = dict(draft_s=0.0, verify_s=_clock(device, trace) - t0, target_cache=len(model_run),
                       draft_cache=0) if trace else {}
        result.rounds.append(Round(0, 0, 1, **timings))
        if stops and int(seq[n - 1]) in stops:
            result.stop_reason = "eos"
            break
    result.tokens = seq[P:n].tolist()
    return result


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, *, gamma: int | str = 5, max_new_tokens: int = 64,
                         eos_token_id=None, do_sample: bool = False, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, trace: bool = False,
                         draft_impl: str = "auto", input_features=None, decoder_input_ids=None,
                         share_encoder: bool = False, repetition_penalty: float | None = None,
                         no_repeat_ngram_size: int | None = None, min_p: float | None = None,
                         min_new_tokens: int | None = None, sequence_bias=None, bad_words_ids=None,
                         attention_mask=None) -> Result | list[Result]:
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

    draft may also be any Drafter (spec.protocols) that is not a model, such as
    spec.PromptLookup: each round it proposes at most gamma tokens copied from an earlier
    occurrence in the prompt and output, and none where nothing matches (that round is one
    target step); draft_impl does not apply.

    Encoder-decoder pairs (spec.seq2seq): input_ids (or input_features, Whisper) is the
    encoder input, each model encodes it once (share_encoder=True: the draft's decoder
    attends to the target's encoder output), and the loop speculates over the decoders.

    repetition_penalty / no_repeat_ngram_size / sequence_bias / bad_words_ids / min_new_tokens
    (spec.processors, HF's semantics): verify row i sees exactly the prefix seq[:n + i], the draft's
    step i the same prefix, so nothing from a rejected draft token reaches a later round, and an EOS
    inside a drafted block is masked until min_new_tokens. min_p (sampling): HF's min-p warper, on
    both sides of the ratio, like temperature, top-k and top-p.

    Several prompts (a list of prompts, or a (B, n) tensor with HF's left-padded attention_mask)
    are decoded as one batch (spec.batch): one Result per prompt, in order, each row accepting,
    rolling back and stopping on its own, so that each equals that prompt's own run (greedy) or is
    distributed as it (sampling)."""
    roles = {"target": target, "draft": draft}
    choose.check(roles)
    check_options(max_new_tokens=max_new_tokens, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p)
    device = model_device(target)
    stops = stop_ids(eos_token_id, choose.models_of(roles))
    process = processors_for(dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                  sequence_bias=sequence_bias, bad_words_ids=bad_words_ids,
                                  min_new_tokens=min_new_tokens), stops, target)
    policy = AutoGamma() if gamma == "auto" else FixedGamma(gamma)
    pick = Pick(do_sample, temperature, top_k, top_p, generator, process, min_p)
    if batch.is_batch(input_ids, attention_mask):
        _refuse_in_batch(input_features=input_features, decoder_input_ids=decoder_input_ids,
                         share_encoder=share_encoder, gamma=gamma)
        return _speculative_rows(target, draft, input_ids, attention_mask, gamma=gamma, max_new_tokens=max_new_tokens,
                                 stops=stops, process=process, pick=pick, trace=trace, draft_impl=draft_impl)
    chosen = choose.runs(roles, input_ids, input_features=input_features,
                         decoder_input_ids=decoder_input_ids, share_encoder=share_encoder,
                         max_new_tokens=max_new_tokens, room=max_new_tokens + policy.max_gamma + 1,
                         draft_impl=draft_impl, pick=pick)
    prompt, (target_run, drafter) = chosen.prompt, chosen.runs
    process.prompt_len = prompt.numel()
    check_positions(prompt.numel(), max_new_tokens, chosen.models)
    parallel.check(target, None, gamma=gamma, prompt=prompt, generator=generator, max_new_tokens=max_new_tokens,
                   stops=sorted(stops), do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size, min_p=min_p,
                   sequence_bias=sequence_bias, bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens)
    timed = trace or policy.timed

    P = prompt.numel()
    seq = torch.empty(P + max_new_tokens + policy.max_gamma + 1, dtype=torch.long, device=device)
    seq[:P] = prompt
    n = P
    result = Result(tokens=[], traced=trace)

    while n - P < max_new_tokens:
        g = min(policy.gamma, max_new_tokens - (n - P) - 1)  # never draft past max_new_tokens

        # 1. Draft: Mq proposes up to g tokens after seq[:n], with q, the distributions they were drawn from.
        t0 = _clock(device, timed)
        g, q = drafter.draft(seq, n, g)

        # 2. Verify: Mp scores all g + 1 positions in one pass.
        t1 = _clock(device, timed)
        logits = target_run(seq[len(target_run):n + g], keep=g + 1)
        if process:
            logits = process(logits, seq, n)  # row i predicts seq[n + i] from seq[:n + i]

        # 3. Accept the longest prefix that passes, then append one token from Mp (spec.accept).
        proposed = seq[n:n + g]
        if do_sample:
            p = sampling.probabilities(logits, temperature, top_k, top_p, min_p)
            u = torch.rand(g, device=device, generator=generator, dtype=p.dtype)
            k, last = accept.sampled(proposed, q, p, u)
            seq[n + k] = sampling.sample(last, generator)
        else:
            k, token = accept.greedy(proposed, logits)
            seq[n + k] = token                                        # Mp's own token after the prefix

        # 4. Cut at EOS, then roll back: both models keep all but the newest token, fed next round.
        emitted = k + 1
        if stops:
            cut = _first_stop(seq[n:n + emitted].tolist(), stops)
            if cut is not None:
                emitted, result.stop_reason = cut + 1, "eos"
        n += emitted
        target_run.crop(n - 1)
        drafter.observe(n, k)
        t2 = _clock(device, timed)

        accepted = min(k, emitted)  # draft tokens that reached the output (EOS may cut a block)
        policy.observe(drafted=g, accepted=k, draft_s=t1 - t0, verify_s=t2 - t1)
        timings = dict(draft_s=t1 - t0, verify_s=t2 - t1, target_cache=len(target_run),
                       draft_cache=len(drafter)) if trace else {}
        result.rounds.append(Round(g, accepted, emitted, **timings))
        if result.stop_reason == "eos":
            break

    result.tokens = seq[P:n].tolist()
    return result


# --- Batches (spec.batch): the same loops over rows that each keep their own n ---------------------

def _refuse_in_batch(*, gamma=1, share_encoder=False, **encoder_inputs) -> None:
    for name, value in encoder_inputs.items():
        if value is not None:
            raise ValueError(f"{name}: a batch of prompts is decoded by decoder-only models; encoder-decoder "
                             f"inputs go one prompt at a time")
    if share_encoder:
        raise ValueError("share_encoder=True is for an encoder-decoder pair, which decodes one prompt at a time")
    if gamma == "auto":
        raise ValueError("gamma='auto' prices the rounds of one sequence; pass an integer gamma for a batch")


def _rows_start(prompts: list[torch.Tensor], room: int, process: Processors, max_new_tokens: int, models: dict):
    """The batch's token buffer (row b's prompt at seq[b, :P[b]]), each row's final length n (its
    prompt's), and each row's processors (min_new_tokens counts from its own prompt)."""
    P = [p.numel() for p in prompts]
    for length in P:
        check_positions(length, max_new_tokens, models)
    seq = torch.zeros(len(prompts), max(P) + room, dtype=torch.long, device=prompts[0].device)
    for b, p in enumerate(prompts):
        seq[b, :P[b]] = p
    return seq, list(P), P, [process.for_prompt(length) if process else None for length in P]


def _pick(logits: torch.Tensor, pick: Pick) -> torch.Tensor:
    if pick.do_sample:
        return sampling.sample(sampling.probabilities(logits, pick.temperature, pick.top_k, pick.top_p, pick.min_p),
                               pick.generator)
    return logits.argmax()


def _accept_row(seq: torch.Tensor, n: int, m: int, q, logits: torch.Tensor, pick: Pick) -> int:
    """Algorithm 1's step 3 for one row (spec.accept): the m proposals at seq[n:n + m] against the
    target's processed logits [m + 1, V]; writes the token after the kept prefix, returns its length."""
    proposed = seq[n:n + m]
    if pick.do_sample:
        p = sampling.probabilities(logits, pick.temperature, pick.top_k, pick.top_p, pick.min_p)
        u = torch.rand(m, device=seq.device, generator=pick.generator, dtype=p.dtype)
        k, last = accept.sampled(proposed, q, p, u)
        seq[n + k] = sampling.sample(last, pick.generator)
    else:
        k, token = accept.greedy(proposed, logits)
        seq[n + k] = token
    return k


def _still_going(live: list[int], results: list[Result], n: list[int], P: list[int], max_new_tokens: int) -> list[int]:
    """The indices (into `live`) of the rows that have not stopped on EOS or max_new_tokens."""
    return [j for j, b in enumerate(live) if results[b].stop_reason != "eos" and n[b] - P[b] < max_new_tokens]


def _retire(live: list[int], going: list[int], *runs) -> list[int]:
    """Drop the finished rows from every batch state: they cost nothing from now on."""
    if len(going) < len(live):
        for run in runs:
            run.select(going)
    return [live[j] for j in going]


def _greedy_rows(model, input_ids, attention_mask, *, max_new_tokens: int, stops, process: Processors, pick: Pick,
                 trace: bool) -> list[Result]:
    """greedy_generate over a batch: one pass per token for every live row."""
    chosen = choose.batch_runs({"model": model}, input_ids, attention_mask)
    prompts, (rows,) = chosen.prompt, chosen.runs
    seq, n, P, procs = _rows_start(prompts, max_new_tokens, process, max_new_tokens, chosen.models)
    device = seq.device
    results = [Result(tokens=[], traced=trace) for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        t0 = _clock(device, trace)
        logits = rows([seq[b, length:n[b]] for b, length in zip(live, rows.lengths)], keep=1)[:, -1]
        for j, b in enumerate(live):
            row = procs[b](logits[j][None], seq[b], n[b])[0] if procs[b] else logits[j]
            seq[b, n[b]] = _pick(row, pick)
            n[b] += 1
            if stops and int(seq[b, n[b] - 1]) in stops:
                results[b].stop_reason = "eos"
        t1 = _clock(device, trace)
        for j, b in enumerate(live):
            timings = dict(draft_s=0.0, verify_s=t1 - t0, target_cache=rows.lengths[j], draft_cache=0) if trace else {}
            results[b].rounds.append(Round(0, 0, 1, **timings))
        live = _retire(live, _still_going(live, results, n, P, max_new_tokens), rows)
    for b, result in enumerate(results):
        result.tokens = seq[b, P[b]:n[b]].tolist()
    return results


def _speculative_rows(target, draft, input_ids, attention_mask, *, gamma: int, max_new_tokens: int, stops,
                      process: Processors, pick: Pick, trace: bool, draft_impl: str) -> list[Result]:
    """speculative_generate over a batch: Algorithm 1 with every row keeping its own n."""
    chosen = choose.batch_runs({"target": target, "draft": draft}, input_ids, attention_mask, draft_impl=draft_impl,
                               pick=pick)
    prompts, (target_rows, drafter) = chosen.prompt, chosen.runs
    seq, n, P, procs = _rows_start(prompts, max_new_tokens + gamma + 1, process, max_new_tokens, chosen.models)
    device = seq.device
    results = [Result(tokens=[], traced=trace) for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        left = [max_new_tokens - (n[b] - P[b]) - 1 for b in live]     # drafts each row may still emit
        g = min(gamma, max(left))

        # 1. Draft: every live row proposes up to g tokens after its seq[b, :n[b]] (a row near its
        #    max_new_tokens keeps fewer of them).
        t0 = _clock(device, trace)
        drafted, q = drafter.draft(seq, n, g, live)
        drafted = [min(m, cap) for m, cap in zip(drafted, left)]

        # 2. Verify: Mp scores each row's drafted + 1 positions, all rows in one pass.
        t1 = _clock(device, trace)
        logits = target_rows([seq[b, length:n[b] + m] for b, length, m in zip(live, target_rows.lengths, drafted)],
                             keep=max(drafted) + 1)

        # 3. Accept, row by row (spec.accept), then cut each row at its EOS.
        accepted, emitted = [], []
        for j, b in enumerate(live):
            m = drafted[j]
            row = logits[j, logits.shape[1] - m - 1:]             # right-aligned: the row's last m + 1
            k = _accept_row(seq[b], n[b], m, None if q[j] is None else q[j][:m],
                            procs[b](row, seq[b], n[b]) if procs[b] else row, pick)
            out = k + 1
            if stops:
                cut = _first_stop(seq[b, n[b]:n[b] + out].tolist(), stops)
                if cut is not None:
                    out, results[b].stop_reason = cut + 1, "eos"
            n[b] += out
            accepted.append(k)
            emitted.append(out)

        # 4. Roll back: each row keeps all but its newest token; finished rows leave the batch.
        target_rows.crop([n[b] - 1 for b in live])
        drafter.observe(n, accepted, live)
        t2 = _clock(device, trace)
        for j, b in enumerate(live):
            timings = dict(draft_s=t1 - t0, verify_s=t2 - t1, target_cache=target_rows.lengths[j],
                           draft_cache=len(drafter)) if trace else {}
            results[b].rounds.append(Round(drafted[j], min(accepted[j], emitted[j]), emitted[j], **timings))
        live = _retire(live, _still_going(live, results, n, P, max_new_tokens), target_rows, drafter)
    for b, result in enumerate(results):
        result.tokens = seq[b, P[b]:n[b]].tolist()
    return results
