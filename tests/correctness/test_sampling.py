"""Speculative sampling is exact: its output is distributed as the target's processed p.

How: tiny models with known next-token laws go through speculative_generate itself, many
times, each run a short independent generation (max_new_tokens = gamma + 1: the first round
drafts gamma tokens and may end with a bonus). Models: stats.TableLM (logits looked up from
the last two tokens; V = 4, or a 6-wide target over a 4-wide draft) and, in the thorough run,
GPT-NeoX with vocab 8 and 10. Counts are compared with exact probabilities obtained by
enumerating contexts through the models (target fp64), processed by an implementation of
temperature / top-k / top-p independent of spec.sampling (stats.Oracle).

Checks, each Pearson's chi-square against exact cell probabilities (cells pooled, smallest first,
to an expected count >= 5; an outcome of exact probability 0 fails the check outright):
  joint       the first 3 tokens (2 where noted) ~ prod p             the theorem itself
  first       x1 ~ p(. | prompt)
  first_paths (x1, accepted?) ~ min(p, q)(x1) accepted / max(0, p - q)(x1) resampled
  bonus       all gamma accepted: x_{gamma+1} | prefix ~ p(. | prefix)
  residual    first rejection at k+1: x_{k+1} | prefix ~ norm(max(0, p - q))
  next_round  first token of the round after a rejection | prefix ~ p (cache rollback)
  alpha       first-token acceptance rate vs theory.alpha_from_distributions(p1, q1), binomial z
Scenarios: table-g2 (alpha 0.78), table-g2-processed (T 1.3, top-k 3, top-p 0.85: p and q
both have zeros; alpha 0.68), wide-holes-g2 (target 6 wide, draft 4 wide and fed stand-ins;
p(3) = 0 < q(3), q(1) = 0 < p(1), 47% of p beyond the draft's width; alpha 0.32), t5-g2 (an
encoder-decoder pair, T5 with vocab 6, each model on its own encoder: the scenario's prompt is
the encoder input and the laws are the decoder's; n 250: a run costs 20-150 ms here, so it is there for large
errors: checked by hand, 250 runs of the mutants below rejected (a) by first_paths and residual,
(b) by joint, first and first_paths, and (c) by none; t5-g3-big in the thorough run has n 10,000).

False alarms: every test runs at ALPHA = 0.001 (chi-square asymptotic; binomial by normal
approximation); the probability-0 rule cannot false-alarm. The default run has 30 statistical
tests (4 scenarios x 7, 2 ancestral): family-wise false-alarm rate <= 3.0%. Seeds are fixed, so
the outcome is deterministic; a change in how the random stream is consumed redraws it, and
may then fail spuriously with probability <= 3.0% (check the thorough run before re-seeding).

Samples and power (default run; worst case over all laws at total-variation distance eps from
the exact one, noncentrality >= 4 n eps^2: stats.worst_case_power), power at eps 0.03 / 0.05:
  table-g2            n 8000: first .94/1, first_paths .89/1, joint .24/.98, bonus (n 5600)
                      .16/.92, residual (n 2400) .11/.72, next_round .03/.38
  table-g2-processed  n 2000: first .19/.81, first_paths .15/.75, joint .04/.37, others < .3
  wide-holes-g2       n 2500: first, first_paths .19/.85, joint (2 tokens) .04/.41, residual
                      .09/.64, bonus (n 435) .02 (it is there for large errors)
  ancestral           n 4000 and 3000 (2 tokens): .18/.91 and .21/.89
  thorough (-m thorough, 160k runs, 12 min of CPU): at eps 0.02, first >= .97, joint >= .76
                      for table-*, first .5 / .98 at 0.02 / 0.03 for the GPT-NeoX pairs
Power against the mutants (test_checks_reject_mutant_samplers: the real loop patched, 800 runs
of table-g2; also run by hand against this whole file on patched copies of spec/decode.py):
  (a) resample from p on rejection: 3.6% of runs emit a token with p <= q after a rejection at
      the first position alone (probability 0 under the residual), so first_paths and residual
      fail with probability > 1 - 1e-12; by hand it also failed joint and first, all scenarios.
  (b) accept every draft: first-token TV 0.22, power 1.000 for first, first_paths and joint;
      by hand all checks but bonus failed (residual and next_round as having nothing to test),
      and so did the alpha and the one-hot / low-temperature greedy tests.
  (c) bonus from q: mean TV of the bonus law 0.20, noncentrality 148, power 1.000 for bonus
      and joint; by hand exactly bonus and joint failed, in all three scenarios.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import textwrap
from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from oracles import assert_logits_close
from stats import (Oracle, TableLM, binomial_z, goodness_of_fit, noisy_table, random_table,
                   reference_probabilities, widen, z_two_sided)

from spec import accept, build_gpt_neox, decode, greedy_generate, hf, sampling, speculative_generate, theory
from spec.models import perturbed_copy

ALPHA = 1e-3  # level of every statistical test here


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from a second thread, and on a shared, loaded 2-core machine
    a parallel softmax was seen waiting milliseconds for it (5 ms instead of 0.03 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- model pairs -------------------------------------------------------------------------

def _table_pair():
    """V = 4, target fp64, draft fp32 = the target's table plus noise (alpha 0.78 at the prompt)."""
    t = random_table(4, 4, seed=10)
    return TableLM(t), TableLM(noisy_table(t, noise=0.8, seed=11))


def _wide_table_pair():
    """Target 6 wide, draft 4 wide with 4 rows (fed a stand-in for ids 4 and 5, as pythia-410m
    is for pythia-12b's extra ids). Holes: the target never emits 3, though the draft proposes
    it (p = 0 < q: always rejected); the draft never proposes 1 (q = 0 < p). Ids 1, 4 and 5
    can only come from the residual norm(max(0, p - q))."""
    base = random_table(6, 6, seed=20)
    draft = noisy_table(base[[0, 1, 2, 3, 6]][:, :4, :4], noise=0.8, seed=21)
    draft[..., 1] = -math.inf
    target = base.clone()
    target[..., 3] = -math.inf
    return TableLM(target), TableLM(draft)


def _neox(vocab: int, seed: int, dtype=torch.float64):
    model = build_gpt_neox(dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, vocab_size=vocab), seed=seed, dtype=dtype)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def _neox_pair():
    """GPT-NeoX, vocab 8: target fp64, draft a perturbed fp32 copy."""
    target = _neox(8, seed=30)
    return target, perturbed_copy(target, noise=0.3, seed=31, dtype=torch.float32)


def _neox_wide_pair():
    """GPT-NeoX target 10 wide (fp64), an unrelated 8-wide fp32 draft."""
    return _neox(10, seed=40), _neox(8, seed=41, dtype=torch.float32)


def _t5_pair():
    """Encoder-decoder: a 1-layer T5 with vocab 6 (fp64), the draft a perturbed fp32 copy with its own
    encoder. The scenario's prompt is the encoder input; the laws are of the decoder's tokens."""
    from seq2seq_models import perturbed, sharpen
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(5)
    target = T5ForConditionalGeneration(T5Config(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, vocab_size=6,
                                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    target = sharpen(target.double(), seed=5).eval()
    return target, perturbed(target, noise=0.5, seed=6).float()


PAIRS = {"table": _table_pair, "table-wide": _wide_table_pair, "neox": _neox_pair, "neox-wide": _neox_wide_pair,
         "t5": _t5_pair}


@functools.cache
def pair(name: str):
    return PAIRS[name]()


# --- scenarios: a pair, a gamma, processing options, a sample size and a seed -------------

@dataclass(frozen=True)
class Scenario:
    name: str
    pair: str
    gamma: int
    n: int
    seed: int
    joint_len: int = 3           # the joint law of the first joint_len tokens is tested
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    prompt: tuple[int, ...] = (1, 2)

    @property
    def max_new_tokens(self) -> int:
        return max(self.gamma + 1, self.joint_len)   # the first round drafts gamma tokens

    @property
    def options(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def __str__(self) -> str:
        return self.name


MAIN = Scenario("table-g2", "table", gamma=2, n=8_000, seed=1)
SCENARIOS = [
    MAIN,
    Scenario("table-g2-processed", "table", gamma=2, n=2_000, seed=2, temperature=1.3, top_k=3, top_p=0.85),
    Scenario("wide-holes-g2", "table-wide", gamma=2, n=2_500, seed=3, joint_len=2),
    Scenario("t5-g2", "t5", gamma=2, n=250, seed=7, joint_len=2, prompt=(2, 3, 4)),
]
THOROUGH = [
    Scenario("table-g2-big", "table", gamma=2, n=60_000, seed=11),
    Scenario("table-g1", "table", gamma=1, n=20_000, seed=12, joint_len=2),
    Scenario("table-g4-processed", "table", gamma=4, n=20_000, seed=13, temperature=0.7, top_k=2),
    Scenario("wide-holes-g3-big", "table-wide", gamma=3, n=30_000, seed=14),
    Scenario("neox-g2", "neox", gamma=2, n=10_000, seed=15, joint_len=2),
    Scenario("neox-wide-g2-processed", "neox-wide", gamma=2, n=10_000, seed=16, joint_len=2, top_k=6),
    Scenario("t5-g3-big", "t5", gamma=3, n=10_000, seed=17, joint_len=3, prompt=(5, 2)),
]
ALL = [pytest.param(s, id=s.name) for s in SCENARIOS] + \
      [pytest.param(s, id=s.name, marks=[pytest.mark.thorough, pytest.mark.slow]) for s in THOROUGH]


def draw(generate, scenario: Scenario, n: int, seed: int):
    """n independent generations, as (tokens, drafted in round 1, accepted in round 1)."""
    target, draft = pair(scenario.pair)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        r = generate(target, draft, list(scenario.prompt), gamma=scenario.gamma, do_sample=True,
                     max_new_tokens=scenario.max_new_tokens, generator=gen, **scenario.options)
        out.append((tuple(r.tokens), r.drafted_per_round[0], r.accepted_per_round[0]))
    return out


@functools.cache
def samples(scenario: Scenario):
    return draw(speculative_generate, scenario, scenario.n, scenario.seed)


@functools.cache
def oracles(scenario: Scenario):
    """Exact processed p (target) and q (draft) for any context."""
    target, draft = pair(scenario.pair)
    if target.config.is_encoder_decoder:
        return (Seq2SeqOracle(target, scenario.prompt, **scenario.options),
                Seq2SeqOracle(draft, scenario.prompt, **scenario.options))
    return Oracle(target, **scenario.options), Oracle(draft, **scenario.options)


class Seq2SeqOracle(Oracle):
    """The decoder's exact processed next-token law: context = encoder prompt + new tokens, computed
    without a cache by the full model over [decoder_start] + new tokens and the encoder prompt."""

    def __init__(self, model, encoder_prompt, **options):
        super().__init__(model, **options)
        self.encoder_prompt = tuple(encoder_prompt)

    @torch.inference_mode()
    def __call__(self, context) -> torch.Tensor:
        key = tuple(int(t) for t in context)
        assert key[:len(self.encoder_prompt)] == self.encoder_prompt
        if key not in self._memo:
            decoder = [self.model.config.decoder_start_token_id, *key[len(self.encoder_prompt):]]
            logits = self.model(input_ids=torch.tensor([self.encoder_prompt]),
                                decoder_input_ids=torch.tensor([decoder]), use_cache=False).logits[0, -1]
            self._memo[key] = reference_probabilities(logits, **self.options)
        return self._memo[key]


# --- the checks: each a chi-square goodness-of-fit test against exact probabilities -------

def check_joint(scenario, batch):
    """(x1, ..., xm) ~ prod p(x_i | prompt, x_<i): the paper's claim itself."""
    P, _ = oracles(scenario)
    V, m, prompt = hf.logit_width(pair(scenario.pair)[0]), scenario.joint_len, scenario.prompt
    seqs = list(itertools.product(range(V), repeat=m))
    probs = [math.prod(float(P(prompt + s[:i])[s[i]]) for i in range(m)) for s in seqs]
    index = {s: i for i, s in enumerate(seqs)}
    observed = [0] * len(seqs)
    for tokens, _, _ in batch:
        observed[index[tokens[:m]]] += 1
    return goodness_of_fit(f"joint law of the first {m} tokens", {"all": (observed, probs)})


def check_first(scenario, batch):
    """x1 ~ p."""
    P, _ = oracles(scenario)
    p = P(scenario.prompt)
    observed = [0] * p.numel()
    for tokens, _, _ in batch:
        observed[tokens[0]] += 1
    return goodness_of_fit("first token", {"all": (observed, p)})


def check_first_paths(scenario, batch):
    """(x1, accepted?) ~ accepted: min(p, q)(x1); rejected then resampled: max(0, p - q)(x1)."""
    P, Q = oracles(scenario)
    p = P(scenario.prompt)
    q = widen(Q(scenario.prompt), p.numel())
    probs = torch.stack([(p - q).clamp(min=0), torch.minimum(p, q)], dim=1).reshape(-1)
    observed = [0] * probs.numel()
    for tokens, _, k in batch:
        observed[2 * tokens[0] + (k >= 1)] += 1
    return goodness_of_fit("first token by path (accepted draft / resampled)", {"all": (observed, probs)})


def _stratified(name, scenario, batch, select, dist):
    """select(tokens, g, k) -> (stratum key, context, cell) or None; dist(context) -> cell probabilities."""
    V = hf.logit_width(pair(scenario.pair)[0])
    counts, contexts = defaultdict(lambda: [0] * V), {}
    for tokens, g, k in batch:
        chosen = select(tokens, g, k)
        if chosen is not None:
            key, context, cell = chosen
            counts[key][cell] += 1
            contexts[key] = context
    return goodness_of_fit(name, {key: (counts[key], dist(contexts[key])) for key in counts})


def check_bonus(scenario, batch):
    """All g drafts accepted: the bonus x_{g+1} ~ p(. | prompt, x_1..x_g), stratified by the prefix."""
    P, _ = oracles(scenario)
    prompt = scenario.prompt
    return _stratified("bonus token after g accepted", scenario, batch,
                       lambda t, g, k: (t[:g], prompt + t[:g], t[g]) if k == g else None, P)


def _residual(scenario, context):
    P, Q = oracles(scenario)
    p = P(context)
    r = (p - widen(Q(context), p.numel())).clamp(min=0)
    return r / r.sum()


def check_residual(scenario, batch):
    """First rejection at position k+1: x_{k+1} ~ norm(max(0, p - q)), stratified by (k, prefix)."""
    prompt = scenario.prompt
    return _stratified("token resampled after a rejection", scenario, batch,
                       lambda t, g, k: (t[:k], prompt + t[:k], t[k]) if k < g else None,
                       lambda ctx: _residual(scenario, ctx))


def check_next_round(scenario, batch):
    """After a rejection the next round starts afresh: its first token ~ p(. | prefix). Catches a
    cache not rolled back, or a next round that depends on how the prefix was made."""
    P, _ = oracles(scenario)
    prompt = scenario.prompt
    return _stratified("first token of the round after a rejection", scenario, batch,
                       lambda t, g, k: ((k, t[:k + 1]), prompt + t[:k + 1], t[k + 1])
                       if k < g and len(t) > k + 1 else None, P)


CHECKS = {"joint": check_joint, "first": check_first, "first_paths": check_first_paths,
          "bonus": check_bonus, "residual": check_residual, "next_round": check_next_round}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("scenario", ALL)
def test_speculative_sampling_matches_exact_law(scenario, check):
    fit = CHECKS[check](scenario, samples(scenario))
    assert fit.df > 0, f"{fit}: nothing to test, the scenario never reaches this case"
    assert not fit.rejects(ALPHA), f"{scenario}: {fit} (level {ALPHA})"


@pytest.mark.parametrize("scenario", ALL)
def test_first_token_acceptance_rate_is_alpha(scenario):
    """Empirical acceptance of the first draft token vs theory.alpha_from_distributions of the
    processed p and q at that position (sum_x min(p, q)), two-sided binomial test at ALPHA."""
    P, Q = oracles(scenario)
    beta = theory.alpha_from_distributions(P(scenario.prompt)[None], Q(scenario.prompt)[None])
    batch = samples(scenario)
    accepted = sum(k >= 1 for _, _, k in batch)
    z = binomial_z(accepted, len(batch), beta)
    assert abs(z) < z_two_sided(ALPHA), \
        f"{scenario}: first-token acceptance {accepted / len(batch):.4f} vs alpha {beta:.4f} (z = {z:.2f})"


# --- mutants: the same checks must reject deliberately wrong samplers ---------------------

def _bonus_from_draft(draft_run, feed, cached, common, like, options):
    """q at the bonus position: one more draft step, then the draft cache is put back."""
    logits = draft_run(feed, keep=1)[-1, :common]
    draft_run.crop(cached)
    out = torch.zeros_like(like)
    out[:common] = sampling.probabilities(logits, **options)
    return out


# name: (module, function, old text, new text): a source edit of that function, which the loop then calls
SOURCE_MUTANTS = {
    # (b) no rejection: every drafted token is accepted
    "accept-every-draft": (accept, "_chain_sampled", "passed = u * q[rows, proposed] < p[rows, proposed]",
                           "passed = torch.ones(g, dtype=torch.bool, device=p.device)"),
    # (c) the bonus token drawn from the draft's q instead of the target's p
    "bonus-from-q": (decode, "_decode",
                     "paths = [_accept_row(seq[b], n[b], trees[j],",
                     "paths = [_accept_bonus_from_q(drafter, seq[b], n[b], trees[j],"),
}


def _accept_bonus_from_q(drafter, seq, n, tree, scores, process, pick, target_run, row):
    """decode._accept_row, but when every proposal is kept the bonus token is drawn from the draft's
    q at that position (one more draft step), not from the target's p."""
    path = decode._accept_row(seq, n, tree, scores, process, pick, target_run, row)
    m = len(tree)
    if 0 < m == len(path):
        run = drafter.run.runs[0]      # a single prompt's draft Runner
        options = dict(temperature=pick.temperature, top_k=pick.top_k, top_p=pick.top_p)
        q_bonus = _bonus_from_draft(run, seq[len(run):n + m], len(run), drafter.width, pick.probabilities(scores[m]),
                                    options)
        seq[n + m] = sampling.sample(q_bonus, pick.generator)
    return path


def mutant(name: str, monkeypatch):
    if name == "resample-from-p":  # (a) on rejection, sample from p instead of norm(max(0, p - q))
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
        return speculative_generate
    module, function, old, new = SOURCE_MUTANTS[name]
    source = textwrap.dedent(inspect.getsource(getattr(module, function)))
    assert source.count(old) == 1, f"mutation site for {name!r} not found in {module.__name__}: update SOURCE_MUTANTS"
    namespace = dict(vars(module), _accept_bonus_from_q=_accept_bonus_from_q)
    exec(compile(source.replace(old, new), f"<{name} mutant of {module.__name__}>", "exec"), namespace)
    monkeypatch.setattr(module, function, namespace[function])
    return speculative_generate


N_MUTANT = 800
CAUGHT_BY = {"resample-from-p": ["first_paths", "residual"],
             "accept-every-draft": ["first", "first_paths", "joint"],
             "bonus-from-q": ["bonus", "joint"]}


@pytest.mark.parametrize("name", list(CAUGHT_BY))
def test_checks_reject_mutant_samplers(name, monkeypatch):
    """Each mutant of the real loop, sampled like MAIN but N_MUTANT times, is rejected at ALPHA
    by the checks named in CAUGHT_BY (the others are reported in the message)."""
    batch = draw(mutant(name, monkeypatch), MAIN, N_MUTANT, seed=100)
    fits = {check: CHECKS[check](MAIN, batch) for check in CHECKS}
    report = "\n".join(f"  {'REJECTS' if f.rejects(ALPHA) else 'passes '} {f}" for f in fits.values())
    missed = [c for c in CAUGHT_BY[name] if not fits[c].rejects(ALPHA)]
    assert not missed, f"mutant {name!r} not caught by {missed}:\n{report}"


# --- plain ancestral sampling ------------------------------------------------------------

@pytest.mark.parametrize("scenario", [
    pytest.param(Scenario("ancestral", "table", gamma=0, n=4_000, seed=4, joint_len=2), id="table"),
    pytest.param(Scenario("ancestral-processed", "table", gamma=0, n=3_000, seed=5, joint_len=2,
                          temperature=1.3, top_k=3, top_p=0.85), id="table-processed"),
    pytest.param(Scenario("ancestral-neox-wide", "neox-wide", gamma=0, n=10_000, seed=6, joint_len=3), id="neox",
                 marks=[pytest.mark.thorough, pytest.mark.slow]),
])
def test_greedy_generate_do_sample_is_ancestral_sampling(scenario):
    """greedy_generate(do_sample=True) draws from the same exact law as speculative sampling."""
    target, _ = pair(scenario.pair)
    gen = torch.Generator().manual_seed(scenario.seed)
    batch = [(tuple(greedy_generate(target, list(scenario.prompt), max_new_tokens=scenario.joint_len,
                                    do_sample=True, generator=gen, **scenario.options).tokens), 0, 0)
             for _ in range(scenario.n)]
    fit = check_joint(scenario, batch)
    assert not fit.rejects(ALPHA), f"{scenario}: {fit}"


# --- processing, edge cases, reproducibility ---------------------------------------------

PROMPT = [3, 141, 59, 26, 53, 58, 97]


@pytest.mark.parametrize("draft_kind", ["partial", "random"])
@pytest.mark.parametrize("options", [dict(top_k=1), dict(top_p=1e-9), dict(top_k=1, temperature=3.0)],
                         ids=["top_k=1", "top_p=tiny", "top_k=1,T=3"])
def test_one_hot_processing_makes_sampling_greedy(target, drafts, draft_kind, options):
    """top_k=1 (or a tiny top_p) makes p and q one-hot at each model's argmax, so speculative
    sampling must be greedy speculative decoding round for round: same tokens AND the same
    accepted counts. Processing only p would let the draft propose non-argmax tokens."""
    draft = drafts[draft_kind]
    greedy = speculative_generate(target, draft, PROMPT, gamma=4, max_new_tokens=16)
    sampled = speculative_generate(target, draft, PROMPT, gamma=4, max_new_tokens=16, do_sample=True,
                                   generator=torch.Generator().manual_seed(0), **options)
    assert sampled.tokens == greedy.tokens == greedy_generate(target, PROMPT, max_new_tokens=16).tokens
    assert sampled.accepted_per_round == greedy.accepted_per_round
    plain = greedy_generate(target, PROMPT, max_new_tokens=16, do_sample=True,
                            generator=torch.Generator().manual_seed(0), **options)
    assert plain.tokens == greedy.tokens


@pytest.mark.parametrize("draft_kind", ["partial", "random"])
def test_low_temperature_sampling_is_greedy(target, drafts, draft_kind):
    """temperature -> 0: p is one-hot at the target's argmax (fp64), so the tokens are greedy's."""
    expected = greedy_generate(target, PROMPT, max_new_tokens=16).tokens
    sampled = speculative_generate(target, drafts[draft_kind], PROMPT, gamma=4, max_new_tokens=16,
                                   do_sample=True, temperature=1e-6, generator=torch.Generator().manual_seed(0))
    assert sampled.tokens == expected


@pytest.mark.parametrize("options", [dict(), dict(top_k=2), dict(temperature=0.5, top_p=0.7)],
                         ids=["plain", "top_k=2", "T=0.5,top_p=0.7"])
def test_draft_equal_to_target_accepts_every_token(options):
    """p = q bitwise (the same table; top_k=2 also makes q(x) = p(x) = 0 for half the ids):
    u q(x) < p(x) always holds, so every draft token is accepted and no residual is formed."""
    target, _ = pair("table")
    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        r = speculative_generate(target, target, [1, 2], gamma=3, max_new_tokens=8, do_sample=True,
                                 generator=gen, **options)
        assert r.accepted_per_round == r.drafted_per_round
        assert len(r.tokens) == 8 and all(0 <= t < 4 for t in r.tokens)


def test_self_draft_gpt_neox_accepts_every_token(target, self_draft):
    r = speculative_generate(target, self_draft, PROMPT, gamma=4, max_new_tokens=40, do_sample=True,
                             generator=torch.Generator().manual_seed(0))
    assert r.accepted_per_round == r.drafted_per_round and len(r.tokens) == 40


def test_residual_edge_cases():
    """No NaN: p = q falls back to p; q narrower than p is zero beyond its width; q(x) = 0
    where p(x) > 0 and p(x) = 0 where q(x) > 0 give a proper distribution."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    assert torch.equal(sampling.residual(p, p.clone()), p)
    q = torch.tensor([0.2, 0.0, 0.2, 0.6], dtype=torch.float64)
    r = sampling.residual(p, q)
    assert torch.allclose(r, torch.tensor([0.3, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.6)
    wide_p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    narrow_q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    r = sampling.residual(wide_p, narrow_q)
    assert torch.allclose(r, torch.tensor([0.0, 0.0, 0.3, 0.4], dtype=torch.float64) / 0.7)
    assert all(torch.isfinite(x).all() for x in (r, sampling.residual(p, q)))


@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.6),
                                     dict(temperature=1.5, top_k=5, top_p=0.9), dict(top_k=1)])
def test_probabilities_match_reference_processing(options):
    """spec.sampling.probabilities = the independent reference used for the exact laws,
    including -inf logits (an id the model can never emit)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(12, generator=gen, dtype=torch.float64) * 2
        logits[3] = -math.inf
        ours = sampling.probabilities(logits, options.get("temperature", 1.0), options.get("top_k"),
                                      options.get("top_p"))
        assert_logits_close(ours, reference_probabilities(logits, **options), what=str(options))


def test_same_seed_same_tokens_other_seed_other_tokens(target, partial_draft):
    def run(generate, models, seed):
        return generate(*models, PROMPT, max_new_tokens=32, do_sample=True,
                        generator=torch.Generator().manual_seed(seed))
    state = torch.get_rng_state()
    a, b, c = (run(speculative_generate, (target, partial_draft), s) for s in (0, 0, 1))
    assert a.tokens == b.tokens and a.accepted_per_round == b.accepted_per_round
    assert a.tokens != c.tokens
    x, y, z = (run(greedy_generate, (target,), s) for s in (0, 0, 1))
    assert x.tokens == y.tokens != z.tokens
    assert torch.equal(state, torch.get_rng_state()), "a given generator must leave the global RNG alone"
