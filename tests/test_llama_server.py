"""llama.cpp's own server, `llama-server`, as a subject of the kit (spec/conformance/endpoint.py's
llama-server dialect): the dialect's requests and parsing against scripted answers in llama-server
11434's shapes (always run), and the kit end to end against the real server built by
requirements/build-llama-server (SPEC_LLAMA_SERVER=PATH of the binary; skipped with the reason
without it: the build takes minutes, so the default run never does it)."""

from __future__ import annotations

import json

import pytest

from spec.conformance import endpoints
from spec.conformance.endpoint import Counters, Endpoint, EndpointError, UnsupportedRequest, parse_counters

# GET /metrics of llama-server 11434 started with --metrics: a speculative one after some requests, and
# a plain one (its spec_decode counters exist, at 0)
LLAMA_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 48
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 30
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 12
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 11
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 6
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 4
"""
PLAIN_METRICS = """llamacpp:prompt_tokens_total 120
llamacpp:spec_decode_num_draft_tokens_total 0
llamacpp:spec_decode_num_accepted_tokens_total 0
llamacpp:spec_decode_num_drafts_total 0
"""


def test_llama_server_counters_say_what_it_drafted_and_a_plain_one_drafted_nothing():
    got = parse_counters(LLAMA_METRICS)
    assert got == Counters(12, 48, 30, {0: 11, 1: 9, 2: 6, 3: 4})
    assert got.acceptance_by_position() == pytest.approx([11 / 12, 9 / 12, 6 / 12, 4 / 12])
    assert got.alpha() == pytest.approx(30 / (30 + 12 - 4))
    plain = parse_counters(PLAIN_METRICS)
    assert plain == Counters(0, 0, 0, {}) and plain.draft_tokens == 0   # the kit: "drafted nothing"


# POST /completion's answer (llama-server 11434, return_tokens and n_probs 2): the second token came from
# a speculative round, so the server says p = 1 and gives no top logprobs for it
ANSWER = {"index": 0, "content": " the cat", "tokens": [260, 2541], "id_slot": 0, "stop": True,
          "model": "m", "tokens_predicted": 2, "tokens_evaluated": 3, "stop_type": "eos", "stopping_word": "",
          "completion_probabilities": [
              {"id": 260, "token": " the", "bytes": [32], "logprob": -0.25,
               "top_logprobs": [{"id": 260, "token": " the", "bytes": [32], "logprob": -0.25},
                                {"id": 253, "token": " a", "bytes": [32], "logprob": -1.75}]},
              {"id": 2541, "token": " cat", "bytes": [32], "logprob": 0.0, "top_logprobs": []}]}


def scripted(answers: dict, dialect: str | None = "llama-server"):
    """An Endpoint on a mock llama-server: `answers` maps a path to a JSON body or (for a stream) the
    text of server-sent events; and the requests it got."""
    import httpx2
    seen = []

    def handle(request):
        seen.append(request)
        answer = answers[request.url.path]
        if isinstance(answer, str):
            return httpx2.Response(200, text=answer, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=answer)
    ep = Endpoint("http://127.0.0.1:1/v1", model="m", retries=0, pause=0.0, dialect="openai")
    ep.client = httpx2.Client(transport=httpx2.MockTransport(handle))
    ep.dialect = dialect
    return ep, seen


def test_the_dialect_is_read_from_the_models_owner(monkeypatch):
    for owner, dialect in (("llamacpp", "llama-server"), ("vllm", "openai"), ("me", "openai")):
        monkeypatch.setattr(Endpoint, "_listed", lambda self, owner=owner: [{"id": "m", "owned_by": owner}])
        ep = Endpoint("http://127.0.0.1:1/v1")
        assert (ep.dialect, ep.model) == (dialect, "m")
    with pytest.raises(ValueError, match="dialect"):
        Endpoint("http://127.0.0.1:1/v1", dialect="tgi")


def test_a_completion_goes_to_the_native_route_with_ids_and_neutral_filters():
    ep, seen = scripted({"/completion": ANSWER})
    out = ep.complete([1, 2, 3], 2, logprobs=2, seed=7, ignore_eos=False, options={"repetition_penalty": 1.3})
    (request,) = seen
    body = json.loads(request.content)
    assert request.url.path == "/completion"
    assert body == {"prompt": [1, 2, 3], "n_predict": 2, "temperature": 0.0, "ignore_eos": False,
                    "return_tokens": True, "cache_prompt": False, "stream": False, "n_probs": 2, "seed": 7,
                    "repeat_penalty": 1.3, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert (out.ids, out.text, out.finish_reason) == ([260, 2541], " the cat", "stop")
    assert out.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert out.logprobs == [-0.25, 0.0]
    assert out.top == [{260: -0.25, 253: -1.75}, {}]
    ep.complete([1], 1, options={"top_k": 2})
    assert json.loads(seen[-1].content)["top_k"] == 2          # an option the request names wins


def test_finish_reason_and_missing_fields():
    for stop_type, finish in (("eos", "stop"), ("word", "stop"), ("limit", "length"), ("none", "length")):
        ep, _ = scripted({"/completion": {**ANSWER, "stop_type": stop_type}})
        assert ep.complete([1], 2).finish_reason == finish
    ep, _ = scripted({"/completion": {k: v for k, v in ANSWER.items() if k != "tokens"}})
    with pytest.raises(EndpointError, match="return_tokens"):
        ep.complete([1], 2)
    ep, _ = scripted({"/completion": {**ANSWER, "completion_probabilities": ANSWER["completion_probabilities"][:1]}})
    with pytest.raises(EndpointError, match="no logprob for each"):
        ep.complete([1], 2, logprobs=1)


def test_options_llama_server_has_no_word_for_are_unsupported_and_named_untested():
    ep, seen = scripted({"/completion": ANSWER})
    for kw in ({"stop_token_ids": [5]}, {"min_tokens": 3}):
        with pytest.raises(UnsupportedRequest, match="llama-server"):
            ep.complete([1], 2, **kw)
    assert not seen                                             # nothing was sent
    with pytest.raises(endpoints.Untested, match="cannot be asked"):
        endpoints._refusable("the reference", lambda: ep.complete([1], 2, stop_token_ids=[5]))


STREAM = "".join(f"data: {json.dumps(e)}\n\n" for e in [
    {"index": 0, "content": " the", "tokens": [260], "stop": False, "tokens_predicted": 1, "tokens_evaluated": 3},
    {"index": 0, "content": " cat", "tokens": [2541], "stop": False, "tokens_predicted": 2, "tokens_evaluated": 3},
    {"index": 0, "content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 2,
     "tokens_evaluated": 3}])


def test_a_stream_joins_its_chunks():
    ep, seen = scripted({"/completion": STREAM})
    out = ep.stream([1, 2, 3], 2)
    assert json.loads(seen[0].content)["stream"] is True
    assert (out.ids, out.text, out.finish_reason, out.chunks) == ([260, 2541], " the cat", "length", [1, 1])
    assert out.usage == {"prompt_tokens": 3, "completion_tokens": 2}


def test_tokenize_identity_and_chat_use_the_native_routes():
    ep, seen = scripted({"/tokenize": {"tokens": [11, 12]}, "/props": {"build_info": "b11434-unknown"},
                         "/apply-template": {"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}})
    assert ep.tokenize("Hi") == [11, 12]
    assert json.loads(seen[-1].content) == {"model": "m", "content": "Hi", "add_special": False,
                                            "parse_special": False}
    assert ep.identity() == "llamacpp b11434-unknown"
    assert ep.tokenize_chat("Hi") == [11, 12]
    assert json.loads(seen[-1].content)["parse_special"] is True


# What llama-server 11434 fails (docs/CONFORMANCE.md, "llama-server: a speculative token's logprob"): the logprob of
# every token a speculative round emitted is reported as 0 (p = 1). Everything else passes.
LLAMA_FINDINGS = {"draft": {"endpoint_logprobs", "endpoint_sampled_logprobs"},
                  "ngram-simple": {"endpoint_logprobs", "endpoint_sampled_logprobs"}}
# Properties during which the server drafted nothing (its counters did not move): n-gram drafting finds
# nothing to copy in sampled text
LLAMA_NOT_SPECULATING = {"draft": set(),
                         "ngram-simple": {"endpoint_sampling_law", "endpoint_seeded", "endpoint_sampled_logprobs"}}
# n-gram drafting needs output long enough to repeat itself: 64 tokens (budget 1), not 16
LLAMA_BUDGET = {"draft": "0.25", "ngram-simple": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "ngram-simple"])
def test_conform_cli_on_llama_server(llama_servers, tmp_path, capsys, kind):
    """llama-server with a draft model (SmolLM2's Q4_1 GGUF drafting for its f32 one) or n-gram drafting
    against its own plain server: every endpoint property passes but the findings above (the slow
    sampling-option laws are left out; skipped without SPEC_LLAMA_SERVER; 5-7 minutes each)."""
    from spec.conformance import conform
    out = tmp_path / "conformance.json"
    argv = ["--impl", f"openai:{llama_servers(kind).url}", "--reference", f"openai:{llama_servers(None).url}",
            "--budget", LLAMA_BUDGET[kind], "-k", "endpoint and not sampling_options", "--out", str(out)]
    code = conform.main(argv)
    rows = json.loads(out.read_text())["results"]
    failed = {r["property"] for r in rows if r["outcome"] in ("failed", "error")}
    idle = {r["property"] for r in rows if r["outcome"] == "not-speculating"}
    assert failed <= LLAMA_FINDINGS[kind] and idle <= LLAMA_NOT_SPECULATING[kind], capsys.readouterr().out[-3000:]
    assert "endpoint_logprobs" in failed         # the finding shows wherever a round emitted a token
    assert code == 1
    passed = [r for r in rows if r["outcome"] == "passed"]
    assert passed and all("speculation: " in r["evidence"] and " 0 draft tokens" not in r["evidence"]
                          for r in passed), passed     # every pass drafted: the counters moved


@pytest.mark.slow
def test_a_plain_llama_server_given_as_the_impl_does_not_pass(llama_servers, tmp_path, capsys):
    """llama-server without speculation as --impl (against itself): its outputs are the reference's and
    its spec_decode counters exist, at 0: every property is `not speculating` and spec conform exits 4."""
    from spec.conformance import conform
    out = tmp_path / "conformance.json"
    plain = llama_servers(None).url
    argv = ["--impl", f"openai:{plain}", "--reference", f"openai:{plain}", "--budget", "0.25",
            "-k", "endpoint_greedy_exact or endpoint_stops", "--out", str(out)]
    assert conform.main(argv) == conform.NOT_SPECULATING, capsys.readouterr().out[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["outcome"] == "not-speculating" and "drafted nothing" in r["evidence"] for r in rows), rows
