"""spec.accept, the acceptance rule alone: tables of hand-made proposals, draft distributions,
target scores and uniforms, with the accepted count and the next token (greedy) or the
distribution it is drawn from (sampling) worked out by hand. The end-to-end tests
(test_exactness.py, test_sampling*.py) check the rule inside the loop."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_logits_close

from spec import accept
from spec.tree import Tree

NEG = -1e9  # a logit no argmax picks


def _logits(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    """One row per position, each with its maximum at the given id."""
    rows = torch.full((len(argmaxes), vocab), NEG)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 1.0
    return rows


def _greedy(proposed, logits):
    """The acceptance rule's greedy entry on the chain of `proposed`: (k, the token after)."""
    path, token = accept.greedy(Tree.chain(proposed), logits)
    assert path == list(range(len(path)))
    return len(path), token


def _sampled(proposed, q, p, u):
    """Its sampled entry on the chain of `proposed` drawn from q: (k, the next token's law)."""
    path, law = accept.sampled(Tree.chain(proposed, q), p, u)
    assert path == list(range(len(path)))
    return len(path), law


# proposals, the target's argmax at each of the g + 1 positions -> accepted, next token
GREEDY_TABLE = [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),        # all agree: the bonus is the target's last argmax
    ([1, 2, 3], [0, 2, 3, 4], 0, 0),        # the first disagrees: the target's token replaces it
    ([1, 2, 3], [1, 2, 0, 4], 2, 0),        # agreement stops at the third
    ([1, 2, 3], [1, 0, 3, 4], 1, 0),        # a later agreement after a disagreement does not count
    ([], [3], 0, 3),                         # nothing drafted: one target step
    ([4], [4, 4], 1, 4),
]


@pytest.mark.parametrize("proposed, argmaxes, k, token", GREEDY_TABLE)
def test_greedy_table(proposed, argmaxes, k, token):
    got_k, got_token = _greedy(torch.tensor(proposed, dtype=torch.long), _logits(argmaxes))
    assert (got_k, int(got_token)) == (k, token)


def test_greedy_takes_the_first_of_tied_logits_as_argmax_does():
    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]])
    assert _greedy(torch.tensor([2]), logits)[0] == 0            # torch.argmax picks id 1, not 2
    k, token = _greedy(torch.tensor([1]), logits)
    assert (k, int(token)) == (1, 0)


P = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], dtype=torch.float64)
Q = torch.tensor([[0.25, 0.75, 0.0], [0.2, 0.6, 0.2]], dtype=torch.float64)

# proposals, uniforms -> accepted, the next token's distribution (worked out from P and Q above)
SAMPLING_TABLE = [
    # x0 = 1: p/q = 0.5/0.75 = 2/3. u 0.6 passes (0.45 < 0.5); x1 = 1: p/q = 0.3/0.6 = 1/2, u 0.4 passes
    # (0.24 < 0.3): both kept, the bonus from p[2].
    ([1, 1], [0.6, 0.4], 2, [0.1, 0.1, 0.8]),
    # u 0.7 fails at x0 (0.525 >= 0.5): norm(max(0, p0 - q0)) = norm([0.25, 0, 0]).
    ([1, 1], [0.7, 0.0], 0, [1.0, 0.0, 0.0]),
    # x0 passes, u 0.5 at x1 fails (0.3 >= 0.3, the comparison is strict): norm(max(0, p1 - q1))
    # = norm([0, 0, 0.3]).
    ([1, 1], [0.0, 0.5], 1, [0.0, 0.0, 1.0]),
    # x0 = 0: p/q = 2, kept whatever u; x1 = 2: p/q = 2.5, kept.
    ([0, 2], [0.999, 0.999], 2, [0.1, 0.1, 0.8]),
]


@pytest.mark.parametrize("proposed, u, k, law", SAMPLING_TABLE)
def test_sampling_table(proposed, u, k, law):
    got_k, got = _sampled(torch.tensor(proposed), Q, P, torch.tensor(u, dtype=torch.float64))
    assert got_k == k
    assert_logits_close(got, torch.tensor(law, dtype=torch.float64))


def test_sampling_with_nothing_drafted_draws_from_the_first_row():
    k, law = _sampled(torch.tensor([], dtype=torch.long), None, P, torch.tensor([], dtype=torch.float64))
    assert k == 0 and torch.equal(law, P[0])


def test_a_deterministic_draft_is_kept_with_probability_p_and_else_p_without_it():
    """q=None: one-hot at each proposal (prompt lookup). x kept iff u < p(x); on rejection the
    next token is drawn from p with x removed."""
    proposed = torch.tensor([1, 2])
    k, law = _sampled(proposed, None, P, torch.tensor([0.49, 0.49], dtype=torch.float64))
    assert k == 2 and torch.equal(law, P[2])
    k, law = _sampled(proposed, None, P, torch.tensor([0.49, 0.5], dtype=torch.float64))
    assert k == 1
    assert_logits_close(law, torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64))


def test_a_deterministic_draft_may_propose_any_id_of_the_vocabulary():
    """q=None: the one-hot is as wide as the vocabulary (p's last dimension), not the g + 1 rows:
    a proposal past g is kept or removed like any other."""
    p = torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.4, 0.5], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    k, law = _sampled(torch.tensor([5]), None, p, torch.tensor([0.4], dtype=torch.float64))
    assert k == 1 and torch.equal(law, p[1])
    k, law = _sampled(torch.tensor([5]), None, p, torch.tensor([0.5], dtype=torch.float64))
    assert k == 0
    assert_logits_close(law, torch.tensor([0.2, 0, 0, 0, 0.8, 0], dtype=torch.float64))


def test_a_draft_distribution_narrower_than_the_target_counts_as_zero_beyond_it():
    """A draft head narrower than the target's (Pythia's padded embeddings): q is zero past its width."""
    p = torch.tensor([[0.2, 0.2, 0.6], [0.0, 0.0, 1.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    k, law = _sampled(torch.tensor([0]), q, p, torch.tensor([0.5], dtype=torch.float64))  # 0.25 >= 0.2
    assert k == 0
    assert_logits_close(law, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


def _law_of_one_round(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact law of the first emitted token, from the rule's outputs: for each proposal x
    (probability q(x)) the uniforms split into the accepting interval [0, r) and the rejecting
    [r, 1), r = min(1, p(x)/q(x)); the rule is asked once inside each."""
    law = torch.zeros_like(p[0])
    for x in range(q.shape[-1]):
        if q[0, x] == 0:
            continue
        r = min(1.0, float(p[0, x] / q[0, x]))
        for u, weight in ((r / 2, r), ((1 + r) / 2, 1 - r)):
            if weight == 0:
                continue
            k, nxt = _sampled(torch.tensor([x]), q, p, torch.tensor([u], dtype=p.dtype))
            law += q[0, x] * weight * (torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p.dtype)
                                       if k == 1 else nxt)
    return law


@pytest.mark.parametrize("seed", range(5))
def test_the_first_emitted_token_is_distributed_as_p(seed):
    """Leviathan et al. Appendix A.1, checked on random p and q: q(x) min(1, p/q) + (1 - beta) residual = p."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(2, 6, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(1, 6, generator=gen, dtype=torch.float64).softmax(-1)
    assert_logits_close(_law_of_one_round(p, q), p[0])


def test_the_law_check_fails_for_a_rule_that_forgets_the_residual(monkeypatch):
    """The check above can fail: drawing from p instead of the residual on rejection biases the law."""
    from spec import sampling
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(2, 6, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(1, 6, generator=gen, dtype=torch.float64).softmax(-1)
    monkeypatch.setattr(sampling, "residual", lambda p_k, q_k: p_k)
    with pytest.raises(AssertionError, match="largest difference"):
        assert_logits_close(_law_of_one_round(p, q), p[0])
