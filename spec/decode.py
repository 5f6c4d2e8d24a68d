"""Greedy decoding and speculative decoding (Leviathan et al. 2023, Algorithm 1): one loop.

Rows are the unit: one prompt is a batch of one. The loop runs over a BatchRunner for the target
and a BatchDrafter (spec.protocols), both made by spec.choose.rows; the acceptance rule is
spec.accept. Plain decoding is the same loop with nothing drafted (spec.draft.NoDraft): every
round is one target step.

The sequences live in one preallocated buffer `seq` [rows, length]; `n[b]` is how many of row b's
tokens are final. A runner holds a model's state for a prefix of each row, `seq[b, :lengths[b]]`,
and each forward pass feeds exactly the tokens it has not seen, `seq[b, lengths[b]:...]`. After a
round every row of both runners is cut back to all but its newest token (`crop(n - 1)`), which
the next round feeds. A runner that restores an earlier state (a recurrent one) re-feeds the kept
tokens itself when cropped; one that goes back further still is fed the rest in the next pass.
Each row accepts, rolls back and stops on its own; a finished row leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec import accept, batch, choose, clock, hf, parallel, sampling, theory
from spec.autogamma import AutoGamma
from spec.defaults import DEFAULT_GAMMA
from spec.draft import FixedGamma, Pick
from spec.options import GammaMode, StopReason
from spec.processors import Processors
from spec.protocols import Pass, Step
from spec.tree import in_place
from spec.validate import check_options, check_positions, stop_ids


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
    stop_reason: StopReason = StopReason.MAX_NEW_TOKENS     # or StopReason.EOS (equal to its string)
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


# The options a row of a batch may set for itself (per_row), over the call's.
ROW_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "generator", "repetition_penalty",
               "no_repeat_ngram_size", "sequence_bias", "bad_words_ids", "min_new_tokens")


def picks_for(options: dict, per_row, rows: int, stops, target) -> list[Pick]:
    """Each row's Pick (how its tokens are picked, its processors included): the call's options,
    with row b's own from per_row[b] where given; every value checked, a bad one named by row."""
    if per_row is None:
        return [_pick(options, stops, target)] * rows
    if not isinstance(per_row, (list, tuple)) or len(per_row) != rows or \
            not all(isinstance(row, dict) for row in per_row):
        raise ValueError(f"per_row must be a list of {rows} dicts, one per prompt, got {per_row!r}")
    if parallel.is_split(target):
        raise ValueError("per_row: a model split across devices or processes decodes with the call's options only")
    picks = []
    for b, row in enumerate(per_row):
        unknown = sorted(set(row) - set(ROW_OPTIONS))
        if unknown:
            raise ValueError(f"per_row[{b}]: {', '.join(map(repr, unknown))} is not a row's option; expected "
                             f"any of {', '.join(ROW_OPTIONS)}")
        try:
            picks.append(_pick({**options, **row}, stops, target))
        except (TypeError, ValueError) as e:
            raise type(e)(f"per_row[{b}]: {e}") from None
    return picks


def _pick(o: dict, stops, target) -> Pick:
    check_options(max_new_tokens=1, temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"],
                  min_p=o["min_p"])
    if not isinstance(o["do_sample"], bool):
        raise ValueError(f"do_sample must be True or False, got {o['do_sample']!r}")
    if o["generator"] is not None and not isinstance(o["generator"], torch.Generator):
        raise ValueError(f"generator must be None or a torch.Generator, got {type(o['generator']).__name__}")
    process = processors_for({k: o[k] for k in ("repetition_penalty", "no_repeat_ngram_size", "sequence_bias",
                                                "bad_words_ids", "min_new_tokens")}, stops, target)
    return Pick(o["do_sample"], o["temperature"], o["top_k"], o["top_p"], o["generator"], process, o["min_p"])


def processors_for(options: dict, stops, target) -> Processors:
    """spec.processors.Processors for these options; ids they name must be in the target's
    vocabulary. Each row's copy (Processors.for_prompt) counts min_new_tokens from its prompt."""
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
                    bad_words_ids=None, attention_mask=None, per_row: list[dict] | None = None) -> Result | list[Result]:
    """Plain autoregressive decoding with `model` alone: one cached forward pass per token.

    do_sample=False takes the argmax (equal to HF generate(do_sample=False));
    do_sample=True is ancestral sampling from the processed distribution.
    Encoder-decoder models (spec.seq2seq): input_ids (or input_features, Whisper) is the
    encoder input, the tokens are the decoder's after its prompt (decoder_input_ids).
    repetition_penalty / no_repeat_ngram_size / sequence_bias / bad_words_ids / min_new_tokens: HF's
    processors of the same names (spec.processors); min_p: HF's min-p warper (sampling only).
    Several prompts (a list, or a (B, n) tensor with HF's left-padded attention_mask) are one batch
    (spec.batch): one Result per prompt, in order, each equal to that prompt's own run. per_row:
    one dict a prompt, that row's own options (any of ROW_OPTIONS) over the call's."""
    choose.check({"model": model})
    check_options(max_new_tokens=max_new_tokens)
    stops = stop_ids(eos_token_id, {"model": model})
    picks = picks_for(dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           generator=generator, repetition_penalty=repetition_penalty,
                           no_repeat_ngram_size=no_repeat_ngram_size, sequence_bias=sequence_bias,
                           bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens),
                      per_row, batch.count(input_ids, attention_mask), stops, model)
    chosen = choose.rows({"model": model, "draft": None}, input_ids, attention_mask, input_features=input_features,
                         decoder_input_ids=decoder_input_ids, max_new_tokens=max_new_tokens)
    parallel.check(model, prompt=chosen.prompts[0], generator=generator, max_new_tokens=max_new_tokens,
                   stops=sorted(stops), do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                   min_p=min_p, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   sequence_bias=sequence_bias, bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens)
    results = _decode(chosen, [FixedGamma(0) for _ in chosen.prompts], max_new_tokens=max_new_tokens, stops=stops,
                      picks=picks, trace=trace)
    return results if chosen.batched else results[0]


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, *, gamma: int | str = DEFAULT_GAMMA, max_new_tokens: int = 64,
                         eos_token_id=None, do_sample: bool = False, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, trace: bool = False,
                         draft_impl: str = "auto", input_features=None, decoder_input_ids=None,
                         share_encoder: bool = False, repetition_penalty: float | None = None,
                         no_repeat_ngram_size: int | None = None, min_p: float | None = None,
                         min_new_tokens: int | None = None, sequence_bias=None, bad_words_ids=None,
                         attention_mask=None, per_row: list[dict] | None = None) -> Result | list[Result]:
    """Speculative decoding: `draft` (Mq) proposes, `target` (Mp) verifies.

    Greedy (do_sample=False): the output equals greedy_generate(target, ...) token
    for token. Sampling: the output is distributed exactly as the target's processed
    distribution. gamma="auto" picks Theorem 3.8's optimal gamma from alpha and c
    measured as the run goes (in a batch, each row from its own alpha).

    draft_impl says how the draft runs; none changes the output, since the target
    decides every emitted token: "plain" (spec.neox: the draft's forward in plain
    tensors on a preallocated KV buffer, GPT-NeoX only), "hf" (the model's own
    forward on a DynamicCache), "compiled" (its forward on a StaticCache with the
    one-token step compiled: CUDA graphs on GPU), "auto" ("plain" where it applies,
    else "hf").

    draft may also be any object that keeps the Drafter protocol (spec.protocols), such as
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
    distributed as it (sampling). per_row: one dict a prompt, that row's own options (any of
    ROW_OPTIONS: greedy or sampling, its warpers, generator and processors) over the call's, as a
    server mixes requests; each row is then exact by its own options."""
    roles = {"target": target, "draft": draft}
    choose.check(roles)
    check_options(max_new_tokens=max_new_tokens, gamma=gamma)
    stops = stop_ids(eos_token_id, choose.models_of(roles))
    picks = picks_for(dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           generator=generator, repetition_penalty=repetition_penalty,
                           no_repeat_ngram_size=no_repeat_ngram_size, sequence_bias=sequence_bias,
                           bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens),
                      per_row, batch.count(input_ids, attention_mask), stops, target)
    policy = _policy(gamma)                 # makes one a row: each row its own gamma
    chosen = choose.rows(roles, input_ids, attention_mask, input_features=input_features,
                         decoder_input_ids=decoder_input_ids, share_encoder=share_encoder,
                         max_new_tokens=max_new_tokens, room=max_new_tokens + policy().max_gamma + 1,
                         draft_impl=draft_impl, picks=picks)
    parallel.check(target, None, gamma=gamma, prompt=chosen.prompts[0], generator=generator,
                   max_new_tokens=max_new_tokens, stops=sorted(stops), do_sample=do_sample, temperature=temperature,
                   top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                   no_repeat_ngram_size=no_repeat_ngram_size, min_p=min_p, sequence_bias=sequence_bias,
                   bad_words_ids=bad_words_ids, min_new_tokens=min_new_tokens)
    results = _decode(chosen, [policy() for _ in chosen.prompts], max_new_tokens=max_new_tokens, stops=stops,
                      picks=picks, trace=trace)
    return results if chosen.batched else results[0]


def _policy(gamma: int | str):
    """What makes each row's GammaPolicy: AutoGamma for gamma="auto", else a fixed gamma."""
    if isinstance(gamma, str) and GammaMode(gamma).in_the_loop:     # (check_options admits no other name)
        return AutoGamma
    assert isinstance(gamma, int)
    return lambda: FixedGamma(gamma)


def _decode(chosen: choose.ChosenRows, policies: list, *, max_new_tokens: int, stops: frozenset[int],
            picks: list[Pick], trace: bool) -> list[Result]:
    """Algorithm 1 over every row of the batch, each row with its own gamma policy and Pick."""
    target_run, drafter, prompts = chosen.target, chosen.drafter, chosen.prompts
    seq, P = _start(prompts, max_new_tokens + max(policy.max_gamma for policy in policies) + 1, max_new_tokens,
                    chosen.models)
    n = list(P)
    processors = [pick.process.for_prompt(length) if pick.process else None   # min_new_tokens per row
                  for pick, length in zip(picks, P)]
    device, timed = seq.device, trace or any(policy.timed for policy in policies)
    results = [Result(tokens=[], traced=trace) for _ in prompts]
    live = list(range(len(prompts)))
    delivered = [0] * len(prompts)      # positions whose target states a Need.HIDDEN drafter has heard
    drafter.begin(prompts)

    while live:
        gs = [min(policies[b].gamma, max_new_tokens - (n[b] - P[b]) - 1) for b in live]  # never past max_new_tokens

        # 1. Draft: each live row b proposes a tree of at most gs[j] tokens deep after seq[b, :n[b]]
        #    (a chain: Algorithm 1's gamma tokens), with q, the distributions they were drawn from.
        t0 = _clock(device, timed)
        trees = drafter.draft(seq, n, gs, live)
        drafted = [len(tree) for tree in trees]

        # 2. Verify: Mp scores every row's drafted + 1 positions, all rows in one pass.
        t1 = _clock(device, timed)
        starts, before = list(target_run.lengths), [n[b] for b in live]
        verified = _verify(target_run, seq, n, live, trees)
        logits = verified.logits

        # 3. Accept the longest prefix (a tree: path) that passes, then append one token from Mp;
        # 4. cut at EOS.
        paths = [_accept_row(seq[b], n[b], trees[j], logits[j, logits.shape[1] - drafted[j] - 1:], processors[b],
                             picks[b], target_run, j) for j, b in enumerate(live)]     # (logits right-aligned)
        accepted = [len(path) for path in paths]
        emitted = [_emit(seq[b], n, b, k, stops, results[b]) for b, k in zip(live, accepted)]

        # 5. Roll back: each row keeps all but its newest token, fed next round. A drafter that reads
        #    the target's hidden states (Need.HIDDEN) is then handed the positions now final, once.
        target_run.crop([n[b] - 1 for b in live])
        drafter.observe(n, accepted, live)
        if verified.hidden is not None:
            steps = _steps(verified.hidden, live, starts, before, paths, emitted, delivered, verified.layers)
            drafter.process(steps, live)
        t2 = _clock(device, timed)

        for j, b in enumerate(live):
            policies[b].observe(drafted=drafted[j], accepted=accepted[j], draft_s=t1 - t0, verify_s=t2 - t1)
            timings: dict = dict(draft_s=t1 - t0, verify_s=t2 - t1, target_cache=target_run.lengths[j],
                                 draft_cache=len(drafter)) if trace else {}
            # draft tokens that reached the output (an EOS may cut a block)
            results[b].rounds.append(Round(drafted[j], min(accepted[j], emitted[j]), emitted[j], **timings))
        live = _retire(live, [j for j, b in enumerate(live) if results[b].stop_reason is not StopReason.EOS
                              and n[b] - P[b] < max_new_tokens], target_run, drafter)

    for b, result in enumerate(results):
        result.tokens = seq[b, P[b]:n[b]].tolist()
    return results


def _emit(seq: torch.Tensor, n: list[int], b: int, k: int, stops: frozenset[int], result: Result) -> int:
    """Step 4 for row b, whose k proposals and Mp's token after them lie at seq[n[b]:]: the tokens
    emitted (k + 1, or up to the first stop id), n[b] moved past them, an EOS recorded."""
    cut = _first_stop(seq[n[b]:n[b] + k + 1].tolist(), stops) if stops else None
    if cut is not None:
        result.stop_reason = StopReason.EOS
    out = k + 1 if cut is None else cut + 1
    n[b] += out
    return out


def _verify(target_run, seq: torch.Tensor, n: list[int], live: list[int], trees: list) -> Pass:
    """The target's one pass over every live row: each row fed what it has not seen up to its
    last final token (the root last), then its proposal's nodes. The logits of each row's
    proposals + 1 positions, right-aligned (and the rows' hidden states where they are kept)."""
    feeds = [seq[b, fed:n[b]] for b, fed in zip(live, target_run.lengths)]
    return target_run(feeds, keep=max(len(tree) for tree in trees) + 1, trees=trees)


def _retire(live: list[int], going: list[int], *runs) -> list[int]:
    """The rows still going (`going`: indices into live); finished rows leave every runner and
    drafter, so they cost nothing more."""
    if len(going) < len(live):
        for run in runs:
            run.select(going)
    return [live[j] for j in going]


def _start(prompts: list[torch.Tensor], room: int, max_new_tokens: int, models: dict) -> tuple[torch.Tensor, list]:
    """The token buffer, row b's prompt at seq[b, :P[b]] and `room` positions after the longest,
    and the prompts' lengths P (each checked against the models' position limits)."""
    P = [p.numel() for p in prompts]
    for length in P:
        check_positions(length, max_new_tokens, models)
    seq = torch.zeros(len(prompts), max(P) + room, dtype=torch.long, device=prompts[0].device)
    for b, p in enumerate(prompts):
        seq[b, :P[b]] = p
    return seq, P


def _accept_row(seq: torch.Tensor, n: int, tree, scores: torch.Tensor, process, pick: Pick,
                target_run, row: int) -> list[int]:
    """Step 3 for row `row` (spec.accept): its proposal against the target's scores [N + 1, V]
    after the row's processors. Writes the accepted path and the target's token after it to
    seq[n:], keeps only that path in the target's cache, returns the path (its nodes; a chain's
    first k)."""
    scores = _processed(process, scores, seq, n, tree)
    if pick.do_sample:
        p = pick.probabilities(scores)
        u = torch.rand(len(tree), device=seq.device, generator=pick.generator, dtype=p.dtype)
        path, last = accept.sampled(tree, p, u)
        token = sampling.sample(last, pick.generator)
    else:
        path, token = accept.greedy(tree, scores)
    k = len(path)
    if in_place(path):                                    # a chain's prefix: no gather, nothing to compact
        seq[n:n + k] = tree.tokens[:k]
    else:
        seq[n:n + k] = tree.tokens[path]
        target_run.retain(row, n, path)
    seq[n + k] = token                                    # Mp's own token after the path
    return path


def _steps(states: list[torch.Tensor], live: list[int], starts: list[int], before: list[int], paths: list,
           emitted: list[int], delivered: list[int], layers: tuple[int, ...]) -> list[Step]:
    """For a drafter that reads them (Need.HIDDEN): each live row's Step, from the verify pass
    (states[j]: every id row j was fed, positions starts[j] on, then its proposal's nodes), at each
    position not yet delivered up to the one that chose the row's last emitted token: the prompt's
    on the first round (prefill), then the root's and the accepted path's. Advances `delivered`."""
    out = []
    for j, b in enumerate(live):
        sequence = before[j] - starts[j]                   # rows of the sequence, the root last
        first = delivered[b] - starts[j]
        assert first >= 0, "a row's runner went back past the states already delivered"
        rows = list(range(first, sequence)) + [sequence + i for i in paths[j]][:emitted[j] - 1]
        positions = torch.arange(delivered[b], before[j] + emitted[j] - 1)
        # (consecutive rows, as a prompt's: a view, not a copy of every layer's states)
        there = states[j][first:first + len(rows)] if rows == list(range(first, first + len(rows))) else states[j][rows]
        out.append(Step(positions, there, layers))
        delivered[b] = before[j] + emitted[j] - 1
    return out


def _processed(process, scores: torch.Tensor, seq: torch.Tensor, n: int, tree) -> torch.Tensor:
    """A proposal's scores [N + 1, V] after the row's processors, each node's row seeing the
    prefix its own path makes (a chain's row i: seq[:n + i])."""
    if not process:
        return scores
    out = scores.clone()
    for leaf in tree.leaves() or [-1]:
        path = tree.path(leaf) if leaf >= 0 else []
        line = seq.clone()
        line[n:n + len(path)] = tree.tokens[path]
        rows = [0] + [i + 1 for i in path]
        out[rows] = process(scores[rows], line, n)
    return out
