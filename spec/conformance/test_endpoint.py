"""Endpoint properties: a served model (`--impl openai:URL`, a server with speculation) against the same
model served without it (`--reference openai:URL`; pytest: --conform-reference). The reference is the
engine's own plain decoding, the evidence its own logprobs, the noise measured on it (alone vs among
concurrent requests). The checks are spec/conformance/endpoints.py; the adapter spec/conformance/endpoint.py.
Every property also reads the server's speculation counters (GET /metrics: vLLM's and llama.cpp's
spec_decode_* counters) before and after: one during which nothing was drafted fails as `not speculating`
(`spec conform` exits 4), never passes; a pass's evidence gives what was drafted and accepted, the
acceptance by draft position and the alpha fitted to it.

  endpoint_greedy_exact            the seed prompts (tokenized by the reference's /tokenize)
  endpoint_greedy_search           hypothesis: token-id prompts (ids the server has emitted or tokenized;
                                   heads and repeated units, which prompt lookup feeds on), 1..24 tokens
  endpoint_stops                   max_tokens exact, stop_token_ids and min_tokens inside accepted blocks,
                                   EOS and ignore_eos on the seed prompts
  endpoint_concurrency             each request alone == among concurrent requests
  endpoint_mixed_batch             each greedy request alone == while sampled requests are in flight
  endpoint_companions[kind]        ... while top_k, seeded or penalised requests are in flight
                                   (endpoints.COMPANIONS; a kind refused or a known crash: not a pass)
  endpoint_logprobs                reported logprobs of emitted tokens == the reference's, within noise
  endpoint_sampling_law            the first new token's law at T=1 and T=0.7 with per-request seeds, on
                                   the seed prompt whose first token is least certain (T < 1 only where
                                   the top-20 logprobs bound the unreported tail below 1e-4)
  endpoint_greedy_options          greedy with penalties, logit biases and a stop string == the reference's
  endpoint_fields                  finish_reason, text and usage agree with the reference's where ids do
  endpoint_streaming               streamed == unstreamed (ids, text, finish_reason, usage)
  endpoint_seeded                  a seeded request repeats its sample, as the reference's does
  endpoint_seeded_batch            seeded requests alone == all at once == at once in reversed order
                                   (untested where the reference's do not)
  endpoint_sampled_logprobs        sampled tokens' logprobs == the reference's raw ones for that prefix
  endpoint_sampling_options        the law of the first 2 new tokens with top-k, top-p, min-p, a logit bias,
                                   penalties: the speculative server's samples against the reference's
                                   (two-sample chi-square); options the reference refuses are skipped
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.conformance import endpoints, repro
from spec.conformance.hypo import kit_settings
from spec.conformance.levels import ALPHA, sample_size

TOP_LOGPROBS = 20     # what vLLM gives by default (--max-logprobs 20)


@pytest.fixture(scope="module")
def subject(impl):
    """What the properties run on (spec/conformance/subject.py): a server and its reference server
    (`--impl openai:URL`), or llama.cpp in process against its own plain decoding (`--impl llama-cpp`)."""
    from spec.conformance import subject as subjects
    if impl.engine == "openai":
        from spec.conformance import endpoint
        try:
            made = subjects.endpoint_subject(impl)
        except endpoint.EndpointError as err:
            pytest.fail(str(err), pytrace=False)
    elif impl.engine == "llama-cpp":
        from spec.conformance import llamacpp
        missing = llamacpp.available()
        if missing:
            pytest.skip(missing)
        made = llamacpp.kit_subject(impl)
    else:
        pytest.skip(f"{impl.name} is not a served model or an engine (these properties run for --impl openai:URL "
                    f"and llama-cpp)")
    yield made
    made.close()


@pytest.fixture(scope="module")
def seed_ids(subject):
    if subject.seed_prompts is None:
        pytest.skip("the reference server has no /tokenize: the seed prompts cannot be sent as its token ids")
    return subject.seed_prompts


def tokens(budget) -> int:
    return max(16, round(64 * budget))


@pytest.fixture(scope="module")
def noise(subject, seed_ids, budget):
    return subject.noise(seed_ids[:2], tokens(budget))


def _violated(name, impl, check, *args) -> tuple[str | None, str | None]:
    """(evidence, None), or (None, the failure message): failed outside the except block, so the
    report shows the violation, not a chain of exceptions. A subject that cannot be asked what the check
    needs gives "untested: why" (a skip, never a pass); one that dies gives its crash verdict; a server that
    answers a request with a 5xx fails the property with that request (a --repro crash script) and says
    whether it still answers a plain greedy request."""
    from spec.conformance.endpoint import EndpointError, UnsupportedRequest
    from spec.conformance.subject import Crashed
    try:
        return check(*args), None
    except endpoints.Violation as err:
        repro.record(name, impl, args[0], err)       # for `spec conform --repro DIR` (the last one: shrunk)
        return None, f"property {name} violated by {impl.name}: {err}"
    except Crashed as crash:
        return None, f"property {name} violated by {impl.name}: {crash}"
    except (UnsupportedRequest, endpoints.Untested) as why:   # (before EndpointError: UnsupportedRequest is one)
        return f"untested: {why}", None
    except EndpointError as err:
        if err.status is None or err.status < 500 or err.sent is None:
            raise
        return None, _server_error(name, impl, args[0], err)


def _server_error(name, impl, subject, err) -> str:
    """A 5xx answer as a failure: the request that got it (recorded for --repro as a Crash) and whether the
    server still answers a plain greedy request on the same prompt (an engine left dead)."""
    from spec.conformance.endpoint import EndpointError
    url, body = err.sent
    prompt = body.get("prompt") if isinstance(body, dict) else None
    try:
        subject.test.complete(list(prompt), 2)
        after = "a plain greedy request on the same prompt was then answered"
    except (EndpointError, TypeError, ValueError) as again:
        after = f"a plain greedy request on the same prompt then failed too, the engine is left dead: {str(again)[:200]}"
    message = f"the server answered {err.status} to a request: {str(err)[:300]}; {after}"
    crash = endpoints.Crash(None, int(body.get("max_tokens") or body.get("n_predict") or 1), {}, after, (url, body))
    repro.record(name, impl, subject, endpoints.Violation(message, [crash]))
    return f"property {name} violated by {impl.name}: {message}\n  request POST {url} {body}"


def _known_crash(name, impl, subject, prompt: list[int], n: int, request: dict, finding: str) -> None:
    """A known crash is not sent (it would leave the user's server dead), but `spec conform --repro` writes the
    request that would have been sent as a crash script (not rerun)."""
    repro.record(name, impl, subject, endpoints.Violation(
        "known crash, not sent by the kit (KNOWN_CRASHES): the request below took this engine down",
        [endpoints.Crash(list(prompt), n, request, finding)]))


def _speculated(name, impl, subject, before) -> str:
    """What the subject drafted while property `name` ran (its counters before and after: a server's
    /metrics, llama.cpp's drafter calls), or a `not speculating` failure: a property whose requests ran
    with nothing drafted certifies nothing about speculation, so it must not pass (a plain server given
    as --impl, or an engine whose speculation silently fell back)."""
    after = subject.counters()
    if after is None:
        pytest.fail(f"{endpoints.NOT_SPECULATING}: {impl.name} reports no speculation counters (GET /metrics has no "
                    f"spec_decode_* counter, as a server without speculation): {name}'s outputs matched the "
                    f"reference's, but nothing says a token was drafted", pytrace=False)
    done = after.since(before)
    if done.draft_tokens <= 0:
        pytest.fail(f"{endpoints.NOT_SPECULATING}: {impl.name} drafted nothing while {name} ran ({done.describe()}): "
                    f"its requests were decoded without speculation, so they certify nothing about it", pytrace=False)
    return f"speculation: {done.describe()}"


def _check(name, impl, record_property, check, subject, *args):
    """Run one property on `subject`: its evidence with what was drafted, a failure, or a skip where the
    subject cannot be asked what the property needs."""
    before = subject.counters()
    evidence, failure = _violated(name, impl, check, subject, *args)
    if failure:
        pytest.fail(failure, pytrace=False)
    if evidence.startswith("untested"):
        pytest.skip(evidence)              # not a pass, whatever was drafted
    evidence = f"{evidence}; {_speculated(name, impl, subject, before)}"
    record_property("evidence", evidence)
    return evidence


def test_endpoint_greedy_exact(impl, subject, seed_ids, noise, budget, record_property):
    _check("endpoint_greedy_exact", impl, record_property, endpoints.greedy_exact, subject, seed_ids,
           tokens(budget), noise)


def test_endpoint_greedy_search(impl, subject, seed_ids, noise, budget, record_property):
    before = subject.counters()
    pool = sorted({t for ids in seed_ids for t in ids} | set(subject.reference.complete(seed_ids[0], 16).ids))
    some = st.sampled_from(pool)
    prompts = st.one_of(st.lists(some, min_size=1, max_size=24),
                        st.builds(lambda head, unit, reps: head + unit * reps, st.lists(some, max_size=4),
                                  st.lists(some, min_size=1, max_size=5), st.integers(2, 5)))

    @kit_settings(budget, 12)
    @given(prompt=prompts, n=st.integers(1, 24))
    def prop(prompt, n):
        _, failure = _violated("endpoint_greedy_search", impl, endpoints.greedy_exact, subject, [prompt], n, noise)
        if failure:
            pytest.fail(failure, pytrace=False)
    prop()
    record_property("evidence", _speculated("endpoint_greedy_search", impl, subject, before))


# user turns an instruct model answers briefly, ending in its EOS (through the server's chat template)
CHAT_QUESTIONS = ["What is 2+2? Answer with one number.", "Say hello.", "Name a color."]
EOS_LIMIT = 64


@pytest.fixture(scope="module")
def eos_ids(subject, seed_ids):
    """Prompts whose reference output ends at EOS within EOS_LIMIT tokens: short chat questions (where
    the server has a chat template) and the seed prompts."""
    chats = [subject.reference.tokenize_chat(q) for q in CHAT_QUESTIONS]
    return endpoints.eos_prompts(subject.reference, [c for c in chats if c] + seed_ids, EOS_LIMIT)


def test_endpoint_stops(impl, subject, seed_ids, eos_ids, budget, record_property):
    _check("endpoint_stops", impl, record_property, endpoints.stops, subject, seed_ids[0], tokens(budget),
           eos_ids, EOS_LIMIT)


def test_endpoint_concurrency(impl, subject, seed_ids, noise, budget, record_property):
    _check("endpoint_concurrency", impl, record_property, endpoints.concurrency, subject, seed_ids,
           tokens(budget), noise)


def test_endpoint_mixed_batch(impl, subject, seed_ids, noise, budget, record_property):
    _check("endpoint_mixed_batch", impl, record_property, endpoints.mixed_batch, subject, seed_ids,
           tokens(budget), noise)


COMPANION_KINDS = [k for k in endpoints.COMPANIONS if k != "sampled"]   # sampled: endpoint_mixed_batch


@pytest.mark.parametrize("kind", COMPANION_KINDS)
def test_endpoint_companions(impl, subject, seed_ids, noise, budget, kind, record_property):
    crash = next((KNOWN_CRASHES[subject.identity(), o] for o in sorted(endpoints.companion_options(kind))
                  if (subject.identity(), o) in KNOWN_CRASHES), None)
    if crash:
        _known_crash("endpoint_companions", impl, subject, seed_ids[0], tokens(budget), endpoints.COMPANIONS[kind](0),
                     crash)
        pytest.xfail(f"known finding, not sent: {crash}")
    _check("endpoint_companions", impl, record_property, endpoints.companions, subject, seed_ids,
           tokens(budget), noise, kind)


def test_endpoint_logprobs(impl, subject, seed_ids, noise, budget, record_property):
    _check("endpoint_logprobs", impl, record_property, endpoints.logprobs, subject, seed_ids, tokens(budget), noise)


def widest(ref, prompts: list[list[int]]) -> list[int]:
    """The prompt whose first new token is least certain (the most entropy in the reference's top
    logprobs): where a wrong law shows at the fewest samples."""
    def entropy(p):
        return -sum(math.exp(v) * v for v in ref.complete(p, 1, logprobs=TOP_LOGPROBS).top[0].values())
    return max(prompts, key=entropy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_endpoint_sampling_law(impl, subject, seed_ids, budget, temperature, record_property):
    _check("endpoint_sampling_law", impl, record_property, endpoints.sampling_law, subject,
                      widest(subject.reference, seed_ids), temperature, sample_size(budget), TOP_LOGPROBS, ALPHA)


def test_endpoint_greedy_options(impl, subject, seed_ids, noise, budget, record_property):
    _check("endpoint_greedy_options", impl, record_property, endpoints.greedy_options, subject, seed_ids[:2],
           tokens(budget), noise)


def test_endpoint_fields(impl, subject, seed_ids, budget, record_property):
    _check("endpoint_fields", impl, record_property, endpoints.fields, subject, seed_ids, tokens(budget))


def test_endpoint_streaming(impl, subject, seed_ids, budget, record_property):
    _check("endpoint_streaming", impl, record_property, endpoints.streaming, subject, seed_ids, tokens(budget))


def test_endpoint_seeded(impl, subject, seed_ids, record_property):
    _check("endpoint_seeded", impl, record_property, endpoints.seeded, subject, seed_ids[:2], 8)


def test_endpoint_seeded_batch(impl, subject, seed_ids, record_property):
    _check("endpoint_seeded_batch", impl, record_property, endpoints.seeded_batch, subject, seed_ids[:2], 8)


def test_endpoint_sampled_logprobs(impl, subject, seed_ids, noise, record_property):
    _check("endpoint_sampled_logprobs", impl, record_property, endpoints.sampled_logprobs, subject,
                      seed_ids[:2], 8, noise, TOP_LOGPROBS)


SAMPLING_OPTIONS = ["top_k", "top_p", "min_p", "logit_bias", "repetition_penalty", "presence+frequency_penalty"]

# (server identity, option) -> the finding: requests that take a server down are not sent again by
# default (the kit would leave the user's server dead); reported as an expected failure with the reason
KNOWN_CRASHES = {
    ("vllm 0.32.0", "top_k"): "vLLM 0.32.0 (CPU) with speculative decoding (ngram or draft_model): a request "
                              "with top_k at T > 0 whose step has no draft tokens kills the EngineCore "
                              "(RuntimeError: max() of an empty tensor in apply_top_k_only, from the "
                              "rejection sampler); every later request answers 500 until a restart. The plain "
                              "server serves it. docs/CONFORMANCE.md has the request",
}


@pytest.mark.parametrize("option", SAMPLING_OPTIONS)
def test_endpoint_sampling_options(impl, subject, seed_ids, budget, option, record_property):
    ref = subject.reference
    crash = KNOWN_CRASHES.get((subject.identity(), option))
    if crash:   # the request sampling_options would send first (its defaults), on seed prompt 0
        _known_crash("endpoint_sampling_options", impl, subject, seed_ids[0], 4,
                     {"temperature": 0.9, "seed": 5000, "options": endpoints.FIXED_SAMPLING_OPTIONS[option]}, crash)
        pytest.xfail(f"known finding, not sent: {crash}")
    prompt = widest(ref, seed_ids)
    sets = endpoints.sampling_option_sets(ref, prompt, TOP_LOGPROBS)
    if option not in sets:
        pytest.skip(f"{option}: the reference's top logprobs are too few to build it")
    _check("endpoint_sampling_options", impl, record_property, endpoints.sampling_options, subject,
                      prompt, sets[option], sample_size(budget), ALPHA)
