"""The conformance kit's models, references and evidence.

Models (built from config with seeded weights, targets in fp64 so that any greedy divergence is
a bug, not a rounding tie, and drafts in fp32):
  ZOO: three architectures, 640-wide logits, prompts drawn from ids < 500 -- GPT-NeoX (the suite's
       tiny target: rotary, parallel residual), Llama (RMSNorm, SwiGLU, grouped-query attention),
       GPT-2 (learned absolute positions, fused QKV). Each has drafts "self" (the target: all
       accepted), "partial" (the target plus 10% weight noise: some accepted) and "random" (an
       unrelated model of the same family: almost none accepted), and "none" (model-free drafting).
       Each model's config and generation_config name an EOS id that its greedy continuation of
       EOS_PROMPT emits: a decoder run with eos_token_id=None must not stop there.
  SMALL: a 4-token one-layer GPT-NeoX pair with sharpened logits for the sampling laws (64
       three-token sequences, so the exact joint law is enumerable); the draft is the target with
       120% weight noise (alpha 0.61 at the prompt: rejections, residuals and bonuses all common).
       Its bf16 form (small_pair_bf16): the target in fp32, the draft in bf16 with every logit
       shifted by 256 (the same law, but logits that bf16 rounds to a spacing of 1-2).

References: greedy continuations from spec.greedy_generate (checked against HF generate by
the correctness suite); exact sampling laws from a fresh forward pass over each
context, processed by stats.reference_probabilities and reference_processed below, both written
independently of spec.sampling and spec.processors.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math

import pytest
import torch
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from spec import build_gpt_neox, greedy_generate, hf, hfref
from spec.conformance import checks
from spec.conformance.hypo import SHRINK, final_replay, kit_settings  # noqa: F401 (the kit's names for them)
from spec.conformance.endpoint import UnsupportedRequest
from spec.conformance.stats import law_fit, reference_probabilities
from spec.conformance.subject import decoder_subject
from spec.models import perturbed_copy

TOKENS = 500            # ids every zoo model can embed (the tiny pair's "tokenizer")
EOS_PROMPT = [3, 141, 59, 26, 53, 58, 97]
EOS_AT = 5              # the config EOS is the greedy continuation's token here
ARCHS = ("gpt-neox", "llama", "gpt2")
DRAFT_KINDS = ("self", "partial", "random", "none")


def _build(arch: str, seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    if arch == "gpt-neox":
        return build_gpt_neox("tiny-target", seed=seed, dtype=dtype)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                                             tie_word_embeddings=False))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=640, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                           bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    # (untied: with GPT-2's tied embeddings the head's scaling would reach the input embeddings, and
    # the model would only ever repeat the last token)
    with torch.no_grad():  # default init gives near-uniform logits; give the head some contrast
        model.get_output_embeddings().weight.mul_(4.0)
    return model.to(dtype).eval()


@functools.cache
def zoo(arch: str) -> dict:
    """{"target": fp64 model, "self"/"partial"/"random": drafts, "none": None, "eos": config EOS id}."""
    target = _build(arch, seed=1, dtype=torch.float64)
    models = {"target": target, "self": target,
              "partial": perturbed_copy(target, noise=0.1, seed=3, dtype=torch.float32),
              "random": _build(arch, seed=2, dtype=torch.float32), "none": None}
    eos = greedy_generate(target, EOS_PROMPT, max_new_tokens=EOS_AT + 1).tokens[EOS_AT]
    for m in (models["target"], models["partial"], models["random"]):
        m.config.eos_token_id = eos
        m.generation_config.eos_token_id = eos
    models["eos"] = eos
    return models


@functools.cache
def greedy(arch: str, prompt: tuple, max_new_tokens: int, eos=None) -> list[int]:
    return greedy_generate(zoo(arch)["target"], list(prompt), max_new_tokens=max_new_tokens,
                           eos_token_id=list(eos) if isinstance(eos, tuple) else eos).tokens


# --- the 4-token pair for sampling ---------------------------------------------------------------

SMALL_VOCAB = 4
SMALL_PROMPT = (1, 2, 3, 1, 2, 3, 1, 2)   # repeats, so prompt lookup finds candidates


@functools.cache
def small_pair():
    target = build_gpt_neox(dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 vocab_size=SMALL_VOCAB), seed=32, dtype=torch.float64, eos_token_id=None,
                            bos_token_id=None)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them
        target.get_output_embeddings().weight.mul_(12.0)
    draft = perturbed_copy(target, noise=1.2, seed=31, dtype=torch.float32)  # alpha 0.61 at the prompt
    return target, draft


def _bias(z, ctx, sequence_bias):
    for ids, bias in sequence_bias.items():
        head = list(ids[:-1])
        if len(head) <= len(ctx) and (not head or ctx[len(ctx) - len(head):] == head):
            z[ids[-1]] += float(torch.tensor(bias, dtype=torch.float32))  # HF keeps biases in float32


# bf16 keeps 8 significant bits: logits near 256 are rounded to a spacing of 1 (2 above 256), so near-ties
# flip and q moves by tens of percent (total variation up to 0.39 at T=0.6; the unshifted draft's logits,
# all below 8 in size, move by at most 0.004: below what n = 400 can see).
BF16_OFFSET = 256.0


def shifted_logits(model, offset: float, spread: float = 4.0, rows=None):
    """A copy of the GPT-NeoX `model` whose every logit is `offset` higher, in its own weights, so every
    runner computes the shift: the same law in exact arithmetic (a softmax ignores a common shift;
    in fp32 it moves by 1e-5), but large logits, which bf16 rounds coarsely.

    With h = g * x + b the final norm's output (x normalised: sum(x) = 0), adding a * u with u = 1 / g
    to every head row adds a * u.b to every logit whatever x is; the norm's bias gains a vector e
    orthogonal to every head row (so the rows' own products are unchanged) that makes u.(b + e)
    nonzero, and a is chosen to make a * u.(b + e) = offset. `spread`: the largest entry of e.
    `rows`: only these token ids' logits are shifted (the others are left as they were), default all."""
    m = copy.deepcopy(model)
    norm, head = m.gpt_neox.final_layer_norm, m.get_output_embeddings()
    with torch.no_grad():
        g, b, weights = norm.weight.double(), norm.bias.double(), head.weight.double()
        u = 1 / g
        span = torch.linalg.qr(weights.T).Q
        r = u - span @ (span.T @ u)           # u with the head rows' span removed
        e = spread * r / r.abs().max()
        a = offset / float(u @ (b + e))
        norm.bias.copy_((b + e).to(norm.bias.dtype))
        lift = a * u if rows is None else torch.zeros_like(weights).index_add_(
            0, torch.tensor(list(rows)), (a * u).expand(len(rows), -1).contiguous())
        head.weight.copy_((weights + lift).to(head.weight.dtype))
    return m


@functools.cache
def small_pair_bf16():
    """The small pair as a mixed-precision deployment runs it: the target in fp32, the draft in bf16
    with every logit shifted by BF16_OFFSET (its fp32 law is the small pair's draft's, to 1e-5)."""
    target, draft = small_pair()
    return copy.deepcopy(target).to(torch.float32), shifted_logits(draft, BF16_OFFSET).to(torch.bfloat16)


GAP_TOKEN = 0           # p = 0.22 after SMALL_PROMPT, where the residual also has mass elsewhere
GAP_OFFSET = -1e4       # exp(-1e4) is 0 in any float: the draft's q of GAP_TOKEN is exactly 0


@functools.cache
def small_pair_gap():
    """The small pair with a draft whose support misses target mass: the draft's logit of GAP_TOKEN
    is lowered by 1e4 in its own weights (shifted_logits on that row only), so q(GAP_TOKEN) = 0 in
    every context and at any temperature, while the target's first token is GAP_TOKEN 22% of the
    time. After a rejection the residual norm(max(0, p - q)) must keep that mass (it is p's there).
    After SMALL_PROMPT the residual is 0.22 at GAP_TOKEN and 0.12 at token 2: a decoder that
    normalises it over the draft's support (q > 0) only still has a token to draw, never GAP_TOKEN,
    so its first token is never GAP_TOKEN (89 of 400 expected)."""
    target, draft = small_pair()
    return target, shifted_logits(draft, GAP_OFFSET, rows=[GAP_TOKEN])


# --- the layout pair: a node's greedy token depends on its position and on exactly what it sees ---

LAYOUT_VOCAB = 640
LAYOUT_DECOY = LAYOUT_VOCAB - 1   # the decoy draft's first choice everywhere (no kit prompt holds it)
LAYOUT_KINDS = ("decoy", "self", "none")


def _zero_mean_basis(d: int) -> torch.Tensor:
    """d - 1 orthonormal rows, each summing to 0 (so a layer norm only rescales their combinations)."""
    centred = torch.eye(d, dtype=torch.float64) - 1.0 / d
    return torch.linalg.qr(centred[:, :d - 1]).Q.T


def _layout_target(seed: int = 7, d: int = 16, scale: float = 100.0, gain: float = 8.0):
    """One GPT-2 block by hand (see layout_pair); fp64."""
    gen = torch.Generator().manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=LAYOUT_VOCAB, n_embd=d, n_layer=1, n_head=1, n_positions=512,
                                       bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double().eval()
    e = _zero_mean_basis(d)
    token_angle = 2 * math.pi * torch.rand(LAYOUT_VOCAB, generator=gen, dtype=torch.float64)
    position_angle = 2 * math.pi * torch.rand(512, generator=gen, dtype=torch.float64)
    head_angle = 2 * math.pi * torch.randperm(LAYOUT_VOCAB, generator=gen).double() / LAYOUT_VOCAB
    t, block = model.transformer, model.transformer.h[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (block.ln_1, block.ln_2, t.ln_f):
            norm.weight.fill_(1.0)
        t.wte.weight.copy_(token_angle.cos()[:, None] * e[0] + token_angle.sin()[:, None] * e[1])
        t.wpe.weight.copy_(position_angle.cos()[:, None] * e[2] + position_angle.sin()[:, None] * e[3])
        block.attn.c_attn.weight[:, 2 * d] = e[0] + e[2]         # value: a(token) + b(position), as 2-D
        block.attn.c_attn.weight[:, 2 * d + 1] = e[1] + e[3]     # (query and key stay 0: equal weights)
        block.attn.c_proj.weight[0] = gain * e[4]                # the mean value, into the plane e4, e5
        block.attn.c_proj.weight[1] = gain * e[5]
        model.lm_head.weight.copy_(scale * (head_angle.cos()[:, None] * e[4] + head_angle.sin()[:, None] * e[5]))
    return model


@functools.cache
def layout_pair() -> dict:
    """A target whose greedy token at a tree node depends on the node's position and on exactly which
    tokens it sees, and two drafts for it: {"target", "self", "decoy", "none"}.

    The target (fp64, 640 ids, learned absolute positions: GPT-2) is one block set by hand: query and
    key weights are 0, so a position attends with equal weight to every position it may see, and the
    attention output is the mean, over the visible positions j, of a(t_j) + b(p_j): a 2-D vector, a(t)
    a unit vector at a random angle per token id, b(p) one per position id. The MLP is 0 and the head
    reads only the angle of that mean: token v's logit is 100 cos(psi_v - angle) (times the final
    norm's scale), the psi_v 640 equal steps round the circle in a random order, so the greedy token is
    the angle quantised to steps of 0.0098 rad. A node that sees one token more (an earlier sibling),
    one fewer (an ancestor masked), or sits at another position id (root + its place in the flattened
    tree, not root + its depth) moves the mean by about one visible position's share, which turns the
    angle by about 1 / sqrt(n) rad at n visible positions (0.2 at 25): tens of steps, so the greedy
    token after that node changes, unless the shift happens to point along the mean (a few percent of
    such nodes). Correct one-pass tree verification computes exactly the path's own forward.

    "decoy": the target in fp32 with the logit of LAYOUT_DECOY raised by 2000 in every context (the final
    norm's bias gains a component along a direction only that head row reads): the draft's first
    choice is always LAYOUT_DECOY, its second the target's argmax, so a tree drafted from its top
    tokens has the target's token as a LATER sibling: a node that a sibling leak, or a position
    counted in the flattened order, reaches. "self": the target (the first children right: the
    positions of deeper nodes matter)."""
    target = _layout_target()
    decoy = copy.deepcopy(target).float()
    e = _zero_mean_basis(decoy.config.n_embd).float()
    with torch.no_grad():
        decoy.transformer.ln_f.bias.copy_(e[6])
        decoy.lm_head.weight[LAYOUT_DECOY] += 2000.0 * e[6]
    return {"target": target, "self": target, "decoy": decoy, "none": None}


def reference_processed(logits: torch.Tensor, context, repetition_penalty=None, no_repeat_ngram_size=None,
                        sequence_bias=None, bad_words_ids=None):
    """HF's sequence bias, repetition penalty, no-repeat n-gram and bad words on one logits row,
    in HF's order, from their definitions (transformers' SequenceBiasLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor
    docstrings), in plain Python over the whole context. (No EOS here: no min_new_tokens.)"""
    z = [float(v) for v in logits.double().tolist()]
    ctx = [int(t) for t in context]
    if sequence_bias:
        _bias(z, ctx, sequence_bias)
    if repetition_penalty:
        for t in set(ctx):
            z[t] = z[t] * repetition_penalty if z[t] < 0 else z[t] / repetition_penalty
    n = no_repeat_ngram_size
    if n and len(ctx) >= n:
        tail = ctx[len(ctx) - n + 1:] if n > 1 else []
        for j in range(len(ctx) - n + 1):
            if ctx[j:j + n - 1] == tail:
                z[ctx[j + n - 1]] = -math.inf
    if bad_words_ids:
        _bias(z, ctx, {tuple(ids): -math.inf for ids in bad_words_ids})
    return torch.tensor(z, dtype=torch.float64)


class ExactLaw:
    """Exact processed next-token distributions of `model`, memoised by context."""

    def __init__(self, model, temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                 no_repeat_ngram_size=None, sequence_bias=None, bad_words_ids=None):
        self.model = model
        self.warp = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        self.proc = dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                         sequence_bias=sequence_bias, bad_words_ids=bad_words_ids)
        self._memo = {}

    @torch.inference_mode()
    def logits(self, context) -> torch.Tensor:
        key = ("logits",) + tuple(int(t) for t in context)
        if key not in self._memo:
            self._memo[key] = hf.forward(self.model, torch.tensor(key[1:]), hf.new_cache(self.model), keep=1)[-1]
        return self._memo[key]

    def __call__(self, context, processors_see=None) -> torch.Tensor:
        """The law after `context`; processors_see: the context the processors are shown instead
        (a negative control's stale state), default `context` itself."""
        key = tuple(int(t) for t in context)
        seen = key if processors_see is None else tuple(int(t) for t in processors_see)
        if (key, seen) not in self._memo:
            self._memo[key, seen] = reference_probabilities(
                reference_processed(self.logits(key), seen, **self.proc), **self.warp)
        return self._memo[key, seen]

    def joint(self, prompt, m: int) -> dict:
        """{sequence of m tokens: probability} under the target's processed law."""
        V = hf.logit_width(self.model)
        return {s: math.prod(float(self(tuple(prompt) + s[:i])[s[i]]) for i in range(m))
                for s in itertools.product(range(V), repeat=m)}


def joint_fit(name: str, samples: list[tuple], law: dict):
    """Pearson's chi-square of the observed m-token sequences against the exact joint law,
    and a table of the cells that deviate most (observed vs expected). `law` may leave out
    sequences of probability 0 (seen, they are outcomes of probability 0). For the negative
    controls' samples; a decoder's are fitted by checks.sampling_law (the same stats.law_fit)."""
    fitted = law_fit(name, samples, law)
    return fitted.fit, fitted.worst()


def expect_rejected(prop: str, what: str, fit, alpha: float, table: str = "", underpowered: bool = False) -> None:
    """A negative control's verdict: the fit of a deliberately broken sampler must reject. One that
    does not FAILS the run (an AssertionError: the property has lost the power it claims at this
    budget), never an expected failure; only a control named `underpowered` (listed beside its
    property as below the check's power at this sample size, and said so in docs/CONFORMANCE.md) is
    reported as xfail instead."""
    if fit.rejects(alpha):
        return
    if underpowered:
        pytest.xfail(f"{what}: below the check's power at n = {fit.n} ({fit})")
    raise AssertionError(f"property {prop}: {what} not rejected at n = {fit.n} (raise --conform-budget): "
                         f"{fit}\n{table}")


# --- running the decoder under test ----------------------------------------------------------------

class TiesOnly(AssertionError):
    """A greedy property failed only on divergences diagnosed as numerical ties: the one failure a
    known tie finding (spec.conformance.plugin.KNOWN_FINDINGS) may expect. A crash, a refused build
    or a divergence diagnosed as a bug raises something else, so it fails even there."""


def diagnosis(target, prompt, expected, actual) -> str:
    """spec.diagnose's verdict on a greedy divergence (position, tokens, top-2 gap: tie or bug), run on
    hypothesis's final replay of the smallest counterexample only: it costs a forward pass per context
    token, too much for every shrinking step."""
    if not final_replay():
        return "(diagnosis on the final replay)"
    from spec.diagnose import diagnose
    return str(diagnose(target, prompt, expected, actual))


def looping_prompts():
    """A head, then a short unit repeated: text that prompt lookup can draft from."""
    ids = st.integers(0, TOKENS - 1)
    return st.builds(lambda head, unit, reps: head + unit * reps,
                     st.lists(ids, max_size=4), st.lists(ids, min_size=1, max_size=5), st.integers(2, 5))


def short_prompts():
    """1 to 24 ids: random, one id repeated, ids at the edges of the vocabulary (and 0, the
    zoo's BOS/EOS id in the configs) mixed in."""
    any_id = st.integers(0, TOKENS - 1)
    edges = st.sampled_from([0, 1, TOKENS - 2, TOKENS - 1])
    return st.one_of(st.lists(any_id, min_size=1, max_size=24),
                     st.builds(lambda t, n: [t] * n, any_id | edges, st.integers(1, 24)),
                     st.lists(edges | any_id, min_size=1, max_size=24))


def prompts():
    return st.one_of(short_prompts(), looping_prompts())


def skip_unless_takes(impl, draft_kind):
    reason = impl.takes_draft(zoo(ARCHS[0])[draft_kind])
    if reason:
        pytest.skip(reason)


def run(impl, target, draft, prompt, **options) -> list[int]:
    """The decoder's new tokens; an option it does not support skips the test with its reason."""
    reason = impl.takes_draft(draft)
    if reason:
        pytest.skip(reason)
    try:
        return impl(target, draft, list(prompt), **options)
    except NotImplementedError as err:
        pytest.skip(f"{impl.name} does not support this: {err}")


# --- greedy properties against HF's own generate() with the same options -----------------

@functools.cache
def hf_greedy(arch, prompt, max_new_tokens, frozen):
    """HF's plain greedy generate() on the zoo's target, with the options `_frozen` made hashable."""
    thawed = {k: dict(v) if k == "sequence_bias" else [list(b) for b in v] if k == "bad_words_ids" else v
              for k, v in frozen}
    return hfref.hf_generate(zoo(arch)["target"], list(prompt), max_new_tokens=max_new_tokens, do_sample=False, **thawed)


def _frozen(options: dict) -> tuple:
    out = []
    for k, v in sorted(options.items()):
        if k == "sequence_bias":
            v = tuple(sorted(v.items()))
        elif k == "bad_words_ids":
            v = tuple(tuple(b) for b in v)
        out.append((k, v))
    return tuple(out)


# --- the in-process decoder as a Subject: the kit's greedy properties ------------------------------------

TARGET_GREEDY = "target greedy"               # the reference: the target's own greedy decoding (spec.diagnose)
HF_GREEDY = "HF greedy, same options"         # HF's plain generate() with the same options


def _eos(keywords: dict):
    eos = keywords.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else eos


def zoo_subject(impl, arch, draft_kind, gamma, reference: str = TARGET_GREEDY):
    """The decoder with the zoo's `draft_kind` draft on `arch`'s target, against the target's own greedy
    decoding (eos_token_id from the request's options) or HF's plain generate() with the same options."""
    z = zoo(arch)
    if reference == TARGET_GREEDY:
        def decode(prompt, n, keywords):
            return greedy(arch, prompt, n, _eos(keywords))
    else:
        def decode(prompt, n, keywords):
            return hf_greedy(arch, prompt, n, _frozen(keywords))
    return decoder_subject(impl, z["target"], z[draft_kind], gamma=gamma, reference=decode, called=reference)


def greedy_property(prop, impl, subject, prompt, max_new_tokens, setting: str, *, note: str = "",
                    options: dict | None = None) -> None:
    """Fail property `prop` unless the decoder's greedy output on `prompt` (with `options`, its own keywords:
    eos_token_id, processors) equals its reference's: the one greedy-exactness check (checks.greedy_exact)
    on the in-process `subject`, where any divergence fails (the targets are fp64). A request the decoder
    cannot take skips the test with the reason. The failure names `setting`, the prompt, spec.diagnose's
    verdict (against the target's own greedy decoding; else the first difference), both outputs, `note`."""
    try:
        (row,) = checks.greedy_exact(subject, [prompt], max_new_tokens, options=options or {}).rows
    except UnsupportedRequest as why:
        pytest.skip(str(why))
    if row.divergence is None:
        return
    expected, actual = row.expected.ids, row.actual.ids
    verdict = (diagnosis(subject.target, prompt, expected, actual) if subject.called == TARGET_GREEDY else
               f"first difference at new token {row.divergence.position} (lengths {len(expected)} / {len(actual)})")
    label = f"expected ({subject.called})"
    pytest.fail(f"property {prop} violated by {impl.name}\n  {setting}\n  prompt={prompt}\n  {verdict}\n"
                f"  {label} {expected}\n  {'actual':<{len(label)}} {actual}{note}", pytrace=False)


def check_against_hf(prop, impl, arch, draft_kind, prompt, gamma, max_new_tokens, options):
    """Fail property `prop` unless the decoder's greedy output with `options` equals HF's own
    plain greedy generate() with the same options (their reference semantics)."""
    greedy_property(prop, impl, zoo_subject(impl, arch, draft_kind, gamma, HF_GREEDY), prompt, max_new_tokens,
                    f"arch={arch} draft={draft_kind} gamma={gamma} max_new_tokens={max_new_tokens} {options}",
                    options=options)
