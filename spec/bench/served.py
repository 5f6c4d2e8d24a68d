"""The questions over HTTP: a served engine under test (`--impl openai:URL`, with speculation) against the same
model served without it (`--reference openai:URL`), both through the conformance kit's client
(spec/conformance/endpoint.py: token-id prompts in, token ids out; vLLM's dialect or llama.cpp's server).

Each first turn is tokenized once by the reference server, in its chat template where it has one (vLLM's
/tokenize with messages, llama-server's /apply-template; none: plain text, and `prompt_ids` says so), and
the same ids go to both servers. Per question the two are timed one request at a time, alternating which
goes first from repeat to repeat; a time is the client's wall time of the whole request. Where the ids
differ, the kit's verdict decides (spec.conformance.endpoints.diagnose): a tie when the reference's top-2 logprob gap at the first
divergent position is within the noise measured on the reference (its logprobs alone vs among concurrent
requests), else a bug. Where the engine exposes speculation counters (GET /metrics), each question's
accepted tokens and draft rounds give its tokens per round. Nothing here imports torch.
"""

from __future__ import annotations

import statistics

from spec import clock
from spec.bench.questions import Question
from spec.bench.table import Outcome
from spec.conformance.endpoint import Endpoint, EndpointError


def connect(impl: str, reference: str, model: str | None) -> tuple[Endpoint, Endpoint]:
    """(the server under test, the reference), each probed for token-id prompts in and token ids out."""
    test = Endpoint(impl, model)
    ref = Endpoint(reference, model if model is not None else test.model)
    for side in (test, ref):
        side.probe()
    return test, ref


def prompt_ids(ref: Endpoint, questions: list[Question], *, plain: bool) -> tuple[list[list[int]], bool]:
    """(each first turn's ids from the reference server, whether its chat template wrapped them): the
    template where the server applies one to the first question and `plain` is False, else plain text."""
    chat = not plain and ref.tokenize_chat(questions[0].text) is not None
    out = []
    for q in questions:
        ids = ref.tokenize_chat(q.text) if chat else ref.tokenize(q.text)
        if not ids:
            raise EndpointError(f"{q.where}: the reference server gave no token ids for it "
                                f"({'its chat template' if chat else 'POST /tokenize'})")
        out.append(ids)
    return out, chat


def _timed(side: Endpoint, ids: list[int], n: int, ignore_eos: bool):
    done, seconds = clock.timed(lambda: side.complete(ids, n, ignore_eos=ignore_eos))
    return done.ids, seconds


def _counted(before, after) -> tuple[int | None, int | None]:
    """(tokens from draft rounds, draft rounds) between two counter readings: each round's accepted drafts
    and the one token its verify pass adds; (None, None) where the engine counts no rounds."""
    if before is None or after is None:
        return None, None
    added = after.since(before)
    if added.drafts is None:
        return None, None
    return added.accepted + added.drafts, added.drafts


def run_question(test: Endpoint, ref: Endpoint, ids: list[int], *, n: int, ignore_eos: bool, repeats: int,
                 counting: bool) -> dict:
    """One question's timed requests: greedy's ids (the reference's first), the test's (one that differs if
    any), the median seconds of each, and the test's counted rounds over all repeats."""
    greedy, spec, g_s, s_s, tokens, rounds = [], [], [], [], 0, 0
    for rep in range(repeats):
        before = test.counters() if counting else None
        order = [(ref, greedy, g_s), (test, spec, s_s)]
        for side, outputs, seconds in order if rep % 2 == 0 else order[::-1]:
            out, t = _timed(side, ids, n, ignore_eos)
            outputs.append(out)
            seconds.append(t)
        made, passes = _counted(before, test.counters() if counting else None)
        tokens, rounds = (None, None) if made is None or tokens is None else (tokens + made, rounds + passes)
    kept = next((s for s in spec if s != greedy[0]), spec[0])
    return dict(greedy=greedy[0], spec=kept, greedy_s=statistics.median(g_s), spec_s=statistics.median(s_s),
                pass_tokens=tokens, passes=rounds, detail={"greedy_s_repeats": g_s, "spec_s_repeats": s_s,
                                                           "reference_repeats_agree": all(g == greedy[0] for g in greedy)})


def judged(test: Endpoint, ref: Endpoint, outcomes: list[Outcome], ids: list[list[int]], n: int) -> None:
    """Each differing outcome's verdict and message, from the kit's judge (a tie within the reference's
    measured noise, else a bug); where the reference cannot give logprobs, "unknown" (a failure)."""
    from spec.conformance.endpoints import diagnose, measure_noise
    from spec.conformance.subject import servers_subject

    differ = [(o, row) for o, row in zip(outcomes, ids) if not o.identical]
    if not differ:
        return
    subject = servers_subject(test, ref)
    try:
        noise = measure_noise(ref, [row for _, row in differ], n)
        for o, row in differ:
            div = diagnose(subject, row, o.greedy, o.spec, noise)
            o.verdict, o.message = (str(div.verdict), str(div)) if div is not None else ("unknown", None)
    except EndpointError as err:
        for o, _ in differ:
            if o.verdict is None:
                o.verdict, o.message = "unknown", f"not diagnosed: the reference's logprobs: {err}"


def run(test: Endpoint, ref: Endpoint, questions: list[Question], ids: list[list[int]], *, max_new_tokens: int,
        ignore_eos: bool, repeats: int, say=lambda msg: None) -> list[Outcome]:
    """Every question's Outcome, judged where it differs."""
    counting = test.counters() is not None
    outcomes = []
    for i, (q, row) in enumerate(zip(questions, ids), 1):
        got = run_question(test, ref, row, n=max_new_tokens, ignore_eos=ignore_eos, repeats=repeats,
                           counting=counting)
        outcomes.append(Outcome(q, len(row), **got))
        o = outcomes[-1]
        say(f"[{i}/{len(questions)}] {q.where} ({q.group}): reference {len(o.greedy)} tokens in {o.greedy_s:.2f}s, "
            f"impl {len(o.spec)} tokens in {o.spec_s:.2f}s" + ("" if o.identical else ", DIFFERS"))
    judged(test, ref, outcomes, ids, max_new_tokens)
    return outcomes
