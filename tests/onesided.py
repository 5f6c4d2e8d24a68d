"""From-scratch speculative decoders (Algorithm 1, cache-free, over HF models) whose logits
processors are transformers' own LogitsProcessor / LogitsWarper classes in HF's order, with one
switch per side: which processors the draft samples with, which make the q of the ratio, the p of
the ratio (and the greedy argmax), the p of the residual and the p of the bonus token. They are
the realistic decoders behind the kit's one-sided properties (spec/conformance/test_one_sided.py):
run `python -m spec conform --impl tests/onesided.py:<variant>` on each.

Algorithm 1 is exact for ANY draft law q as long as q is the law the proposal was drawn from and
the target side (ratio, residual, bonus, greedy argmax) uses the fully processed p. So
`<option>_target_only` (the draft samples unprocessed, q is that same unprocessed law) is exact and
must pass; `<option>_draft_only` (the target side lacks the option), `<option>_q_raw` (drawn
processed, q unprocessed), `<option>_q_processed` (drawn unprocessed, q processed),
`<option>_residual_raw` and `<option>_bonus_raw` (the residual / bonus from the unprocessed p) are
wrong and must be rejected.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

SIDES = ("draft", "q", "p", "residual", "bonus")
OPTIONS = ("sequence_bias", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "temperature", "top_k",
           "top_p", "min_p")


def processors(options: dict, prompt_length: int, eos, do_sample: bool, skip=()) -> LogitsProcessorList:
    """HF's processors for `options` in HF's order (_get_logits_processor), leaving out those in `skip`;
    the warpers only when sampling, as HF does."""
    o = {k: v for k, v in options.items() if v is not None and k not in skip}
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out = LogitsProcessorList()
    if "sequence_bias" in o:
        out.append(SequenceBiasLogitsProcessor([[list(k), float(v)] for k, v in o["sequence_bias"].items()]))
    if "repetition_penalty" in o:
        out.append(RepetitionPenaltyLogitsProcessor(o["repetition_penalty"]))
    if "no_repeat_ngram_size" in o:
        out.append(NoRepeatNGramLogitsProcessor(o["no_repeat_ngram_size"]))
    if "bad_words_ids" in o:
        out.append(NoBadWordsLogitsProcessor(o["bad_words_ids"], eos_token_id=eos_ids or None))
    if o.get("min_new_tokens") and eos_ids:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_length, o["min_new_tokens"], eos_ids))
    if do_sample:
        if o.get("temperature", 1.0) != 1.0:
            out.append(TemperatureLogitsWarper(o["temperature"]))
        if "top_k" in o:
            out.append(TopKLogitsWarper(o["top_k"]))
        if "top_p" in o and o["top_p"] < 1.0:
            out.append(TopPLogitsWarper(o["top_p"]))
        if "min_p" in o:
            out.append(MinPLogitsWarper(o["min_p"]))
    return out


@torch.inference_mode()
def _rows(model, ids: list[int], last: int) -> torch.Tensor:
    """The model's logits at the last `last` positions of `ids` (one cache-free forward), fp64."""
    return model(torch.tensor([ids])).logits[0, -last:].double()


def make(missing: dict | None = None, name: str = "correct"):
    """A decoder; missing: {side: set of options that side leaves out} (sides: SIDES)."""
    missing = {side: set((missing or {}).get(side, ())) for side in SIDES}

    def generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None, do_sample=False,
                 generator=None, **options):
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        side = {s: processors(options, len(input_ids), eos_token_id, do_sample, missing[s]) for s in SIDES}

        def law(s, ids, logits):
            z = side[s](torch.tensor([ids]), logits[None].clone())[0]
            return torch.softmax(z, -1) if do_sample else z

        def draw(probs):
            return int(torch.multinomial(probs, 1, generator=generator))

        out: list[int] = []
        while len(out) < max_new_tokens:
            ctx = list(input_ids) + out
            g = min(gamma, max_new_tokens - len(out) - 1)
            drafts, qs = [], []
            for _ in range(g):
                ids = ctx + drafts
                z = _rows(draft, ids, 1)[0]
                x = draw(law("draft", ids, z)) if do_sample else int(law("draft", ids, z).argmax())
                qs.append(law("q", ids, z))
                drafts.append(x)
            rows = _rows(target, ctx + drafts, g + 1)
            k, last = 0, None
            while k < g:
                ids = ctx + drafts[:k]
                p, x = law("p", ids, rows[k]), drafts[k]
                if not do_sample:
                    if x != int(p.argmax()):
                        last = int(p.argmax())
                        break
                elif float(torch.rand((), generator=generator, dtype=torch.float64)) * float(qs[k][x]) >= float(p[x]):
                    r = (law("residual", ids, rows[k]) - qs[k]).clamp(min=0)
                    last = draw(r / r.sum())
                    break
                k += 1
            if last is None:
                ids = ctx + drafts
                p = law("bonus" if do_sample else "p", ids, rows[g])
                last = draw(p) if do_sample else int(p.argmax())
            new = drafts[:k] + [last]
            for i, t in enumerate(new):
                if t in eos:
                    return out + new[:i + 1]
            out += new
        return out[:max_new_tokens]

    generate.__name__ = name
    generate.conformance_draft = "model"
    return generate


generate = make()                     # correct: every side fully processed


def _variants():
    for option in OPTIONS:
        yield f"{option}_target_only", {"draft": {option}, "q": {option}}                # exact: must pass
        yield f"{option}_draft_only", {"p": {option}, "residual": {option}, "bonus": {option}}
        yield f"{option}_q_raw", {"q": {option}}
        yield f"{option}_q_processed", {"draft": {option}}
        yield f"{option}_residual_raw", {"residual": {option}}
        yield f"{option}_bonus_raw", {"bonus": {option}}


VARIANTS = dict(_variants())
globals().update({name: make(missing, name) for name, missing in VARIANTS.items()})
EXACT = ("generate",) + tuple(f"{o}_target_only" for o in OPTIONS)
