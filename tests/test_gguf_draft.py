"""spec.gguf_draft: a GGUF file run by llama.cpp drafting for a PyTorch target, on tiny seeded Llamas
written as GGUFs by spec.conformance.llamacpp.llama_gguf. Greedy exactness, the cache following the final
sequence (checked against a fresh llama.cpp context every round, and in llama.cpp's own KV cache),
the sampling law (chi-square over the first two tokens), the refusals; each check has a broken
variant it must reject. Skipped with the reason without the `llama` extra. About 10 s."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec import greedy_generate, speculative_generate
from spec.protocols import DraftSource
from spec.conformance import llamacpp
from spec.conformance import kit
from spec.conformance.stats import goodness_of_fit, reference_probabilities
from spec.draft import Pick
from spec.models import perturbed_copy

from skewedq import SkewedQ

pytestmark = pytest.mark.skipif(llamacpp.available() is not None, reason=str(llamacpp.available()))

PROMPTS = [[5, 9, 5, 9, 300, 12, 7, 7, 100], [3, 141, 59, 26, 53, 58, 97], [11, 400, 22]]
ALPHA = 0.001


@pytest.fixture(scope="module")
def target():
    return kit.zoo("llama")["target"]   # fp64, 640-wide


@pytest.fixture(scope="module")
def partial_gguf(target, tmp_path_factory):
    """The target plus 10% weight noise, as an f32 GGUF: many proposals accepted, some rejected."""
    draft = perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32)
    return llamacpp.llama_gguf(draft, tmp_path_factory.mktemp("gguf") / "partial.gguf")


def gguf_draft(path, target, **kw):
    from spec.gguf_draft import GGUFDraft
    return GGUFDraft(path, target, **kw)


class Recording(DraftSource):
    """Wraps a GGUFDraft: keeps each round's final prefix and proposals, and after each observe the
    positions llama.cpp's own KV cache holds (its highest position + 1)."""

    def __init__(self, inner):
        import llama_cpp
        self.inner, self.rounds, self.cache_after_observe, self._llama_cpp = inner, [], [], llama_cpp

    needs = frozenset()

    def begin(self, prompt):
        self.inner.begin(prompt)

    def draft(self, seq, n, g):
        chain = self.inner.draft(seq, n, g)
        self.rounds.append((seq[:n].tolist(), chain.tokens.tolist()))
        return chain

    def observe(self, n, accepted):
        self.inner.observe(n, accepted)
        memory = self.inner.run.llm._ctx.memory
        self.cache_after_observe.append((n, len(self.inner),
                                         self._llama_cpp.llama_memory_seq_pos_max(memory, 0) + 1))

    def __len__(self):
        return len(self.inner)


def fresh_greedy(path, prefix: list[int], g: int) -> list[int]:
    """g greedy proposals from a fresh llama.cpp context fed `prefix` (nothing cached before)."""
    from spec.gguf_draft import LlamaRun
    run = LlamaRun(path)
    try:
        out, feed = [], torch.tensor(prefix)
        for _ in range(g):
            out.append(int(run(feed, keep=1)[-1].argmax()))
            feed = torch.tensor(out[-1:])
        return out
    finally:
        run.close()


def check_greedy_run(target, drafter, path) -> None:
    """Exact against greedy_generate; rejections happened; after every round the draft's cache (its
    count and llama.cpp's KV cache agree) holds only final tokens, never the newest, and every round's proposals
    equal a fresh llama.cpp context's greedy continuation of that round's final prefix."""
    rec = Recording(drafter)
    rejected = 0
    for ids in PROMPTS:
        for gamma in (2, 4):
            out = speculative_generate(target, rec, ids, gamma=gamma, max_new_tokens=24, trace=True)
            assert out.tokens == greedy_generate(target, ids, max_new_tokens=24).tokens
            rejected += sum(r.accepted < r.drafted for r in out.trace)
    assert rejected > 0, "no round rejected anything: the rollback went untested"
    for n, held, in_kv in rec.cache_after_observe:
        assert in_kv == held <= n - 1, f"after a round ending at {n}: the draft holds {held}, llama.cpp's KV {in_kv}"
    for prefix, proposed in rec.rounds[::3]:
        assert proposed == fresh_greedy(path, prefix, len(proposed)), f"proposals after {prefix} differ from a fresh run"


def test_greedy_is_exact_and_the_cache_follows_the_final_sequence(target, partial_gguf):
    drafter = gguf_draft(partial_gguf, target)
    try:
        check_greedy_run(target, drafter, partial_gguf)
        assert drafter.run.vocab == 640 and "partial.gguf" in repr(drafter)
    finally:
        drafter.close()


def _crop_nothing(self, keep):
    pass


def _crop_count_only(self, keep):   # llama.cpp's KV cache keeps the rejected positions
    self.llm.n_tokens = min(keep, self.llm.n_tokens)


@pytest.mark.parametrize("crop, caught", [(_crop_nothing, "nothing to feed"),
                                          (_crop_count_only, "llama.cpp's KV")], ids=["nothing", "count-only"])
def test_a_cache_not_cut_back_is_caught(target, partial_gguf, monkeypatch, crop, caught):
    """Negative controls: a draft whose cache keeps rejected positions (crop does nothing, or forgets
    them in its count but not in llama.cpp's KV cache) is caught by the checks above."""
    from spec.gguf_draft import LlamaRun
    monkeypatch.setattr(LlamaRun, "crop", crop)
    drafter = gguf_draft(partial_gguf, target)
    try:
        with pytest.raises((AssertionError, ValueError), match=caught):
            check_greedy_run(target, drafter, partial_gguf)
    finally:
        drafter.close()


def test_a_sequence_that_shares_only_a_prefix_reuses_it(target, partial_gguf):
    """One GGUFDraft over several runs keeps what the new prompt shares with the cached one."""
    drafter = gguf_draft(partial_gguf, target)
    try:
        speculative_generate(target, drafter, PROMPTS[0], gamma=3, max_new_tokens=8)
        other = PROMPTS[0][:5] + [1, 2, 3]
        seq = torch.tensor(other + [0] * 8)
        drafter.draft(seq, len(other), 2)
        assert len(drafter) == len(other) + 1   # fed only the 3 new tokens after the shared 5, and one proposal
    finally:
        drafter.close()


# --- the sampling law ----------------------------------------------------------------------------

SMALL_V, SMALL_PROMPT, TEMPERATURE, DRAWS = 5, [1, 2, 3, 1], 0.8, 1500
HEAD_GAIN = 20.0   # sharp laws (a one-layer 16-wide model is near uniform otherwise): a wrong q shows


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 5-token one-layer Llama target (fp64) and, as an f32 GGUF, the target with 100% weight noise."""
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=SMALL_V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_GAIN)
    model = model.double().eval()
    draft = perturbed_copy(model, noise=1.0, seed=5, dtype=torch.float32)
    return model, llamacpp.llama_gguf(draft, tmp_path_factory.mktemp("gguf") / "small.gguf")


def two_token_law(model) -> list[float]:
    """p(x1, x2 | prompt) over all 25 pairs, from fresh forward passes."""
    def p(ctx):
        with torch.inference_mode():
            return reference_probabilities(model(torch.tensor([ctx])).logits[0, -1], TEMPERATURE)
    first = p(SMALL_PROMPT)
    return [float(first[a]) * float(p(SMALL_PROMPT + [a])[b]) for a, b in itertools.product(range(SMALL_V), repeat=2)]


def sample_fit(model, drafter, gen, draws: int):
    counts = [0] * SMALL_V ** 2
    for _ in range(draws):
        out = speculative_generate(model, drafter, SMALL_PROMPT, gamma=2, max_new_tokens=2, do_sample=True,
                                   temperature=TEMPERATURE, generator=gen).tokens
        counts[out[0] * SMALL_V + out[1]] += 1
    return goodness_of_fit("joint law of the first 2 tokens, GGUF draft", {"all": (counts, two_token_law(model))})


@pytest.mark.parametrize("broken, draws", [(False, DRAWS), (True, 1000)], ids=["exact", "q-not-what-it-drew"])
def test_sampling_follows_the_targets_law(small, broken, draws):
    """Speculative sampling with the GGUF draft drawing from its own softmax (same temperature, the
    run's generator) follows the target's two-token law; a draft whose q is not what it drew from
    is rejected (at 1000 draws; at 500 its p-value was 1e-4)."""
    model, path = small
    gen = torch.Generator().manual_seed(11)
    drafter = gguf_draft(path, model, pick=Pick(do_sample=True, temperature=TEMPERATURE, generator=gen))
    try:
        fit = sample_fit(model, SkewedQ(drafter) if broken else drafter, gen, draws)
    finally:
        drafter.close()
    assert fit.rejects(ALPHA) == broken, str(fit)


# --- refusals ------------------------------------------------------------------------------------

class StubTokenizer:
    """The tiny GGUF's own vocabulary ("<i>"), with `renamed` ids spelled otherwise."""

    def __init__(self, bos=None, eos=None, renamed=()):
        self.bos_token_id, self.eos_token_id, self.renamed = bos, eos, set(renamed)

    def decode(self, ids):
        return "".join(f"other{i}" if i in self.renamed else f"<{i}>" for i in ids)

    def encode(self, text, add_special_tokens=False):
        raise AssertionError("not reached: the pieces differ first")


def test_a_gguf_of_another_vocabulary_is_refused(small, partial_gguf):
    model, _ = small
    with pytest.raises(ValueError, match=r"partial.gguf: its vocabulary has 640 tokens but the target's logits are 5"):
        gguf_draft(partial_gguf, model)


def test_a_gguf_of_a_smaller_vocabulary_is_refused(target, small):
    """The other direction: a 5-token GGUF for the 640-wide target. A check that only refused a larger
    GGUF vocabulary would let it draft (its q, 5 wide, is zero beyond: the loop would accept it)."""
    _, small_gguf = small
    with pytest.raises(ValueError, match=r"small.gguf: its vocabulary has 5 tokens but the target's logits are 640"):
        gguf_draft(small_gguf, target)


def test_a_build_known_to_crash_is_refused_before_a_model_loads(target, partial_gguf, monkeypatch):
    """spec.llamaguard: llama-cpp-python 0.3.36 reporting AMX_INT8 (a segfault in llama_decode on 2+
    tokens) is refused with the fix before llama.cpp loads the GGUF (no Llama is made, so nothing is
    decoded)."""
    import llama_cpp

    from spec.llamaguard import UnsafeLlamaBuild

    class NoModel:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a llama.cpp model was loaded before the build was checked")
    monkeypatch.setattr(llama_cpp, "__version__", "0.3.36")
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 | AMX_INT8 = 1 | ")
    monkeypatch.setattr(llama_cpp, "Llama", NoModel)
    with pytest.raises(UnsafeLlamaBuild, match=r"0\.3\.36 was built with AMX_INT8.*bash requirements/build-llama"):
        gguf_draft(partial_gguf, target)


@pytest.mark.parametrize("tokenizer, message", [
    (StubTokenizer(bos=3), r"its BOS token is id 0, the target tokenizer's is 3"),
    (StubTokenizer(renamed=[320]), r"token 320 is '<320>' in the GGUF but 'other320'"),
], ids=["special-id", "token-text"])
def test_a_gguf_of_another_tokenizer_is_refused(target, partial_gguf, tokenizer, message):
    with pytest.raises(ValueError, match=message):
        gguf_draft(partial_gguf, target, tokenizer=tokenizer)


def test_a_missing_file_and_a_missing_extra_are_named(target, tmp_path, partial_gguf, monkeypatch):
    with pytest.raises(FileNotFoundError, match="draft: no GGUF file"):
        gguf_draft(tmp_path / "absent.gguf", target)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match=r'pip install "spec\[llama\]"'):
        gguf_draft(partial_gguf, target)
