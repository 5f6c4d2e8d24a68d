"""Tree drafts (spec.tree, spec.treedraft): the proposal's shape, the tree acceptance rules as pure
functions by tables, one-pass verification against each path's own forward, greedy exactness over
trees, prompts and families, and the sampling law of the multi-candidate rule with negative
controls (siblings tried without removing a rejected sibling's mass)."""

from __future__ import annotations

import math

import pytest
import torch
from architectures import BY_NAME, cached_model, draft_model
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import assert_exact, assert_logits_close
from stats import TableLM, goodness_of_fit, noisy_table, random_table
from strategies import short_prompts_for_tiny_vocab

from spec import accept, batch, greedy_generate, hf, runner, sampling, speculative_generate
from spec.draft import Pick
from spec.protocols import DraftSource, Drafter, Need
from spec.runner import score_tree as score
from spec.tree import Tree, layout
from spec.treedraft import LookupTree, TreeDraft

NEG = -1e9


def _tree(tokens: list[int], parents: list[int], q=None) -> Tree:
    return Tree(torch.tensor(tokens, dtype=torch.long), tuple(parents), q)


# --- the proposal ------------------------------------------------------------------------------

def test_a_chain_is_a_tree_with_one_branch():
    chain = Tree.chain(torch.tensor([4, 5, 6]))
    assert chain.parents == (-1, 0, 1) and chain.is_chain and chain.depths() == [1, 2, 3]
    assert chain.leaves() == [2] and chain.path(2) == [0, 1, 2]
    assert not _tree([4, 5, 6], [-1, -1, 0]).is_chain


def test_paths_depths_children_and_visibility():
    #        root
    #       /    \
    #      0(a)   1(b)
    #     / \       \
    #   2(c) 3(d)    4(e)
    t = _tree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 1])
    assert t.depths() == [1, 1, 2, 2, 2]
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(2) == []
    assert t.path(3) == [0, 3] and t.path(4) == [1, 4] and t.leaves() == [2, 3, 4]
    assert t.visibility().int().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                              [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]]


def test_layout_places_nodes_at_their_depth_and_masks_other_branches():
    t = _tree([10, 11, 12], [-1, -1, 0])
    positions, mask = layout(t, start=4, fed=2)          # 4 cached, 2 fed (the root last), 3 nodes
    assert positions.tolist() == [4, 5, 6, 6, 7]
    assert mask.shape == (5, 9)
    assert mask[0].int().tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]      # the sequence is causal
    assert mask[1].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert mask[2].int().tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0]      # node 0 sees the root and itself
    assert mask[3].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 0]      # node 1: not its sibling
    assert mask[4].int().tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 1]      # node 2: its parent 0


@pytest.mark.parametrize("tree, depth, width, message", [
    (_tree([1, 2], [-1, 1]), 4, 10, r"parents\[1\] = 1: a parent must come before"),
    (_tree([1, 2], [-1, -2]), 4, 10, r"parents\[1\] = -2"),
    (_tree([1, 2, 3], [-1, 0, 1]), 2, 10, "3 deep, more than the 2 tokens"),
    (_tree([1, 12], [-1, 0]), 4, 10, r"ids in \[0, 10\)"),
    (Tree(torch.tensor([1, 2]), (-1,)), 4, 10, "parents has 1 entries for 2 tokens"),
    (Tree(torch.tensor([1.0]), (-1,)), 4, 10, "1-D LongTensor"),
    (_tree([1, 2], [-1, 0], torch.ones(3, 10)), 4, 10, r"q must be \[2, width\]"),
])
def test_a_malformed_tree_is_refused_with_what_was_expected(tree, depth, width, message):
    with pytest.raises(ValueError, match=message):
        tree.check(depth, width)


# --- the acceptance rules, by tables -------------------------------------------------------------

def _logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    rows = torch.full((len(argmaxes), vocab), NEG)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 1.0
    return rows


# tree (tokens, parents), the target's argmax after the root and after each node -> path, next token
TREE_GREEDY_TABLE = [
    (([1, 2, 3], [-1, 0, 1]), [1, 2, 3, 4], [0, 1, 2], 4),                 # a chain, all kept
    (([1, 5, 2], [-1, -1, 1]), [5, 0, 2, 7], [1, 2], 7),                  # the second branch
    (([1, 5, 2], [-1, -1, 1]), [6, 0, 2, 7], [], 6),                      # no child matches the root's
    (([1, 2, 3, 4], [-1, 0, 0, 2]), [1, 3, 0, 4, 6], [0, 2, 3], 6),       # the second child of node 0, then on
    (([1, 2, 3, 4], [-1, 0, 0, 2]), [1, 3, 0, 5, 6], [0, 2], 5),          # stops below node 2
    (([1, 1], [-1, -1]), [1, 2, 3], [0], 2),                              # twin siblings: the first wins
    (([], []), [3], [], 3),
]


@pytest.mark.parametrize("shape, argmaxes, path, token", TREE_GREEDY_TABLE)
def test_tree_greedy_table(shape, argmaxes, path, token):
    got_path, got_token = accept.greedy(_tree(*shape), _logits(argmaxes))
    assert (got_path, int(got_token)) == (path, token)


P3 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]], dtype=torch.float64)

# tree with one-hot q (deterministic), uniforms -> path, the next token's distribution
TREE_SAMPLED_TABLE = [
    # root's children 1 then 0. u 0.2 < r(1) = 0.3: node 0 kept; it is a leaf: p after node 0.
    (([1, 0], [-1, -1]), [0.2, 0.0], [0], [0.1, 0.1, 0.8]),
    # u 0.3 >= r(1) = 0.3: rejected, r = norm(0.5, 0, 0.2); node 1 (token 0): u 0.7 < 5/7: kept
    (([1, 0], [-1, -1]), [0.3, 0.7], [1], [0.6, 0.2, 0.2]),
    # both rejected: u 0.8 >= 5/7 -> r = norm(0, 0, 0.2) = [0, 0, 1]
    (([1, 0], [-1, -1]), [0.3, 0.8], [], [0.0, 0.0, 1.0]),
    # node 0 kept, its child (token 2) against p after node 0 = [0.1, 0.1, 0.8]: u 0.5 kept -> p after node 2
    (([1, 0, 2], [-1, -1, 0]), [0.0, 0.9, 0.5], [0, 2], [0.3, 0.3, 0.4]),
]


@pytest.mark.parametrize("shape, u, path, dist", TREE_SAMPLED_TABLE)
def test_tree_sampled_table(shape, u, path, dist):
    tree = _tree(*shape)
    got_path, got = accept.sampled(tree, P3[:len(tree) + 1], torch.tensor(u, dtype=torch.float64))
    assert got_path == path
    torch.testing.assert_close(got, torch.tensor(dist, dtype=torch.float64))


@given(st.integers(0, 4), st.integers(0, 10_000))
def test_on_a_chain_the_tree_rules_are_algorithm_1(g, seed):
    """On a chain, the acceptance rule's fast path (Algorithm 1's step 3 as the paper writes it)
    gives what walking the chain as a tree gives."""
    gen = torch.Generator().manual_seed(seed)
    V = 5
    p = torch.rand(g + 1, V, generator=gen, dtype=torch.float64).softmax(-1)
    q = torch.rand(g, V, generator=gen, dtype=torch.float64).softmax(-1)
    proposed = torch.multinomial(q, 1, generator=gen)[:, 0] if g else torch.zeros(0, dtype=torch.long)
    u = torch.rand(g, generator=gen, dtype=torch.float64)
    chain = Tree.chain(proposed, q if g else None)
    k_path, dist = accept.sampled(chain, p, u)
    path, tree_dist = accept._walk_sampled(chain, p, u)
    assert path == k_path
    torch.testing.assert_close(tree_dist, dist)
    k_path, token = accept.greedy(chain, p.log())
    path, tree_token = accept._walk_greedy(chain, p.log())
    assert path == k_path and int(tree_token) == int(token)


def _no_residual_tree_sampled(tree, p, u):
    """The bug the negative control plants: a rejected sibling's mass is not removed before the
    next sibling is tried (each sibling against the node's full p)."""
    tokens, path, node, r = tree.tokens.tolist(), [], -1, p[0]
    siblings = tree.children(-1)
    while siblings:
        for c in siblings:
            qc = tree.q[c]
            if u[c] * qc[tokens[c]] < r[tokens[c]]:
                path.append(c)
                node, r = c, p[c + 1]
                break
        else:
            return path, sampling.residual(r, tree.q[siblings[-1]])
        siblings = tree.children(node)
    return path, r


def _first_token_law(rule, p: torch.Tensor, q: torch.Tensor, k: int, n: int, seed: int) -> list[int]:
    """n draws of the first emitted token: k siblings drawn i.i.d. from q at the root (a depth-1
    tree), verified by `rule`, the next token drawn from what it returns."""
    gen = torch.Generator().manual_seed(seed)
    counts = [0] * p.shape[-1]
    P = p[None].expand(k + 1, -1)
    for _ in range(n):
        tokens = torch.multinomial(q, k, replacement=True, generator=gen)
        tree = Tree(tokens, (-1,) * k, q[None].expand(k, -1))
        path, dist = rule(tree, P, torch.rand(k, generator=gen, dtype=torch.float64))
        counts[int(tokens[path[0]]) if path else int(sampling.sample(dist, gen))] += 1
    return counts


P_LAW = torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0], dtype=torch.float64)
Q_LAW = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_siblings_drawn_from_q_emit_the_target_law(k):
    """SpecInfer's rule over k i.i.d. siblings (q far from p, p with a hole): the emitted token ~ p."""
    counts = _first_token_law(accept.sampled, P_LAW, Q_LAW, k, 6000, seed=k)
    fit = goodness_of_fit(f"first token, {k} siblings", {"all": (counts, P_LAW.tolist())})
    assert not fit.rejects(1e-3), str(fit)


def test_siblings_without_removing_a_rejected_ones_mass_are_rejected():
    """Negative control: the same check rejects the rule that keeps p for every sibling."""
    counts = _first_token_law(_no_residual_tree_sampled, P_LAW, Q_LAW, 3, 6000, seed=9)
    fit = goodness_of_fit("first token, no residual between siblings", {"all": (counts, P_LAW.tolist())})
    assert fit.rejects(1e-3), str(fit)


# --- one pass under a tree mask ------------------------------------------------------------------

ONE_PASS = ["llama", "gpt_neox", "gpt2", "mistral", "qwen2", "gemma2", "phi", "opt"]


@pytest.mark.parametrize("family", [f for f in ONE_PASS if f in BY_NAME])
@torch.inference_mode()
def test_one_pass_gives_every_node_its_paths_own_logits(family):
    """Verified by behaviour, sliding windows included: the probe passes, and a fresh tree's nodes
    (a branchy one, deeper than the probe's) match their paths' cache-free forwards."""
    model = cached_model(family)
    assert runner.tree_support(model) is None
    run = runner.KVRunner(model)
    assert run.takes_trees
    seq = torch.arange(3, 20) % hf.vocab_rows(model)
    tree = _tree([5, 6, 7, 8, 9, 10, 11], [-1, 0, 1, -1, 3, 0, 2])
    logits = score(run, seq, tree)
    for node in [-1] + list(range(len(tree))):
        path = tree.path(node) if node >= 0 else []
        want = hf.authors_forward(model, torch.cat([seq, tree.tokens[path]]))[-1]
        # fp32's bound on fp64 models: HF's eager attention takes its softmax in fp32, and a tree's row
        # sums its exps in another order than the path's own row (masked siblings between): 1.6 fp32 eps
        assert_logits_close(logits[node + 1], want, torch.float32, f"{family}, node {node}")


@pytest.mark.parametrize("family", ["mamba", "openai-gpt", "bloom"])
@torch.inference_mode()
def test_runners_without_tree_masks_are_fed_branch_by_branch(family):
    """A state snapshot, a recompute runner, a model that counts its own positions: no one-pass
    tree; `score` feeds each branch in turn and leaves the runner at the sequence, exact."""
    if family not in BY_NAME:
        pytest.skip(f"{family} is not in this transformers")
    model = cached_model(family)
    path, positions = runner.verdict(model)
    run = runner.RUNNERS[path](model, positions)
    assert not getattr(run, "takes_trees", False)
    seq = torch.arange(3, 15) % hf.vocab_rows(model)
    tree = _tree([5, 6, 7, 8], [-1, 0, -1, 2])
    logits = score(run, seq, tree)
    assert len(run) == seq.numel()
    for node in [-1] + list(range(len(tree))):
        p = tree.path(node) if node >= 0 else []
        want = hf.authors_forward(model, torch.cat([seq, tree.tokens[p]]))[-1]
        assert_logits_close(logits[node + 1], want, what=f"{family}, node {node}")   # Mamba's logits: fp32


@torch.inference_mode()
def test_keeping_the_path_drops_the_other_branches_from_the_cache():
    model = cached_model("llama")
    run = runner.KVRunner(model)
    seq = torch.arange(3, 15)
    tree = _tree([5, 6, 7, 8], [-1, -1, 1, 0])
    score(run, seq, tree)
    run.retain(seq.numel(), [1, 2])
    assert len(run) == seq.numel() + 2
    nxt = run(torch.tensor([9]), keep=1)[-1]
    want = hf.authors_forward(model, torch.cat([seq, torch.tensor([6, 7, 9])]))[-1]
    assert_logits_close(nxt, want, torch.float32)   # the kept keys came from the tree pass (fp32 softmax)


# --- greedy: exact over trees, prompts and families ----------------------------------------------

# one-pass families (full attention, sliding windows, both kinds of layers) and two verified branch
# by branch (recompute; positions the model counts itself); recurrent ones in the tests above
FAMILIES = [f for f in ["llama", "gpt_neox", "mistral", "qwen2", "gemma2", "openai-gpt", "bloom"] if f in BY_NAME]
EXAMPLES = settings(max_examples=max(3, settings().max_examples // 8))


@pytest.mark.parametrize("family", FAMILIES)
@EXAMPLES
@given(prompt=short_prompts_for_tiny_vocab(256), branches=st.integers(1, 3), nodes=st.integers(1, 9),
       gamma=st.integers(1, 5), max_new_tokens=st.integers(1, 16))
def test_tree_drafts_decode_exactly_greedy(family, prompt, branches, nodes, gamma, max_new_tokens):
    """Model trees (TreeDraft) and lookup trees (LookupTree): output == plain greedy, token for token."""
    target = cached_model(family)
    expected = greedy_generate(target, prompt, max_new_tokens=max_new_tokens).tokens
    for drafter in (TreeDraft(draft_model(family), branches=branches, nodes=nodes),
                    LookupTree(max_ngram=2, min_ngram=1, branches=branches, nodes=nodes)):
        out = speculative_generate(target, drafter, prompt, gamma=gamma, max_new_tokens=max_new_tokens)
        assert_exact(target, prompt, expected, out.tokens)
        assert all(r.accepted <= r.drafted and r.emitted >= 1 for r in out.rounds)


def test_tree_drafts_accept_tokens_and_branches_help(target):
    """Not vacuous: a self-draft's tree is accepted whole (its greedy chain is always in it), and
    with a partly agreeing draft three branches take fewer rounds than the chain for the same
    output (the tree always holds the chain, and sometimes a second guess that is right)."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12]
    self_tree = speculative_generate(target, TreeDraft(target, branches=2, nodes=8), prompt, gamma=4,
                                     max_new_tokens=20)
    assert self_tree.accepted_per_round == [4, 4, 4, 4]
    from spec.models import perturbed_copy
    draft = perturbed_copy(target, noise=0.3, seed=3, dtype=torch.float64)
    chain = speculative_generate(target, TreeDraft(draft, branches=1), prompt, gamma=4, max_new_tokens=40)
    wide = speculative_generate(target, TreeDraft(draft, branches=3, nodes=12), prompt, gamma=4, max_new_tokens=40)
    assert chain.tokens == wide.tokens == greedy_generate(target, prompt, max_new_tokens=40).tokens
    assert all(r.drafted <= 4 for r in chain.rounds) and max(r.drafted for r in wide.rounds) > 4
    assert len(wide.rounds) < len(chain.rounds), (len(wide.rounds), len(chain.rounds))


def test_tree_drafts_with_processors_and_eos_and_a_batch():
    """Each node's row is processed with its own path (repetition penalty, min_new_tokens); an EOS
    inside an accepted path stops the row; a batch with a tree drafter gives each row its solo run."""
    target = cached_model("llama")
    draft = draft_model("llama")
    prompts = [[5, 9, 14, 3, 5, 9], [7], [11, 12, 13, 11, 12]]
    options = dict(max_new_tokens=14, repetition_penalty=1.4, min_new_tokens=3)
    solo = [greedy_generate(target, p, **options).tokens for p in prompts]
    eos = solo[0][5]
    for drafter in (TreeDraft(draft, branches=2, nodes=6), LookupTree(min_ngram=1)):
        outs = speculative_generate(target, drafter, prompts, gamma=3, **options)
        assert [o.tokens for o in outs] == solo
        stopped = speculative_generate(target, drafter, prompts[0], gamma=3, eos_token_id=eos, **options)
        assert stopped.tokens == greedy_generate(target, prompts[0], eos_token_id=eos, **options).tokens
        assert stopped.stop_reason == "eos"


def test_tree_drafters_keep_the_drafter_protocol_and_refuse_bad_options():
    assert isinstance(TreeDraft(draft_model("llama")), Drafter) and isinstance(LookupTree(), Drafter)
    for bad in (dict(branches=0), dict(nodes=0), dict(branches=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TreeDraft(draft_model("llama"), **bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            LookupTree(**bad)


def test_a_drafters_tree_too_deep_or_out_of_vocabulary_is_refused():
    target = cached_model("llama")

    class Deep(DraftSource):
        needs = frozenset({Need.TREES})

        def __init__(self, tokens, parents):
            self.tree = _tree(tokens, parents)

        def begin(self, prompt):
            pass

        def draft(self, seq, n, g):
            return self.tree

        def observe(self, n, accepted):
            pass

        def __len__(self):
            return 0

    with pytest.raises(ValueError, match="3 deep, more than the 2 tokens"):
        speculative_generate(target, Deep([1, 2, 3], [-1, 0, 1]), [4, 5], gamma=2, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"ids in \[0, 256\)"):
        speculative_generate(target, Deep([1, 999], [-1, -1]), [4, 5], gamma=2, max_new_tokens=8)


def test_a_batch_with_a_tree_drafter_shares_one_pass_where_the_model_allows_it():
    """Rows verify each row's tree under its own 4-D mask in one pass (the model passed the batched-tree
    probe); a model whose rows cannot share a cache (recurrent) runs each row on its own runner."""
    from spec import choose
    chosen = choose.rows({"target": cached_model("llama"), "draft": LookupTree()}, [[1, 2], [3]])
    assert isinstance(chosen.target, batch.Rows) and batch.tree_support(cached_model("llama")) is None
    chosen = choose.rows({"target": cached_model("mamba2"), "draft": LookupTree()}, [[1, 2], [3]])
    assert isinstance(chosen.target, batch.EachRunner)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "qwen2"])
def test_a_batch_of_trees_in_one_shared_pass_equals_each_rows_greedy(family, monkeypatch):
    """Ragged prompts, a tree drafter: every row's output is its own greedy's, the target ran on the shared
    batch (Rows), and some accepted paths were not the tree's first nodes (Rows.retain moved them up)."""
    target = cached_model(family)
    prompts = [[5, 9, 14, 3, 5, 9, 14, 3, 5], [7, 7], [11, 12, 13, 11, 12, 13, 11], [4, 5, 6, 4, 5]]
    moved = []
    real = batch.Rows.retain

    def retain(self, row, base, path):
        moved.append(path != list(range(len(path))))
        return real(self, row, base, path)
    monkeypatch.setattr(batch.Rows, "retain", retain)
    for drafter in (TreeDraft(draft_model(family), branches=3, nodes=8), LookupTree(min_ngram=1, branches=3)):
        outs = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=20)
        assert [o.tokens for o in outs] == [greedy_generate(target, p, max_new_tokens=20).tokens for p in prompts]
    assert any(moved), "no accepted path had to be moved: the case under test did not happen"


def test_the_batched_tree_probe_catches_a_path_kept_in_place_and_a_mask_without_the_tree(monkeypatch):
    """Planted faults the probe must refuse (each probed afresh): a kept path not moved up behind its
    row's sequence, and a causal mask in which a node sees its siblings."""
    from spec import probe
    model = cached_model("llama")
    assert batch.tree_support(model) is None
    monkeypatch.setattr(hf, "keep_row_columns", lambda cache, row, columns, width: None)
    probe.forget(model)
    assert "after row" in batch.tree_support(model)
    monkeypatch.undo()

    def causal(tree, start, fed):
        positions, mask = layout(tree, start, fed)
        return positions, torch.ones_like(mask).tril(start)
    monkeypatch.setattr(batch, "layout", causal)
    probe.forget(model)
    assert "differs from its path's own forward" in batch.tree_support(model)
    monkeypatch.undo()
    probe.forget(model)


# --- sampling: the law of the output, end to end ----------------------------------------------------

class SampledTree(DraftSource):
    """A stochastic tree drafter for the law test: k siblings drawn i.i.d. from the draft's q at
    the root, each followed by one more token drawn from q after it (depth 2)."""

    needs = frozenset({Need.TREES})

    def __init__(self, draft: TableLM, k: int, generator: torch.Generator):
        self.model, self.k, self.gen = draft, k, generator

    def _q(self, context: list[int]) -> torch.Tensor:
        logits = self.model(input_ids=torch.tensor([context]), use_cache=False).logits[0, -1]
        return logits.double().softmax(-1)

    def begin(self, prompt):
        pass

    def draft(self, seq, n, g):
        if g < 1:
            return Tree(torch.zeros(0, dtype=torch.long), ())
        context = seq[:n].tolist()
        q0 = self._q(context)
        firsts = torch.multinomial(q0, self.k, replacement=True, generator=self.gen)
        tokens, parents, qs = list(firsts.tolist()), [-1] * self.k, [q0] * self.k
        if g >= 2:
            for i, t in enumerate(firsts.tolist()):
                qi = self._q(context + [t])
                tokens.append(int(torch.multinomial(qi, 1, generator=self.gen)))
                parents.append(i)
                qs.append(qi)
        return Tree(torch.tensor(tokens), tuple(parents), torch.stack(qs))

    def observe(self, n, accepted):
        pass

    def __len__(self):
        return 0


def _joint_two(target, drafter_for, n: int, seed: int, monkeypatch=None, **options):
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    drafter = drafter_for(gen)
    for _ in range(n):
        out = speculative_generate(target, drafter, [1, 2], gamma=2, max_new_tokens=2, do_sample=True,
                                   generator=gen, **options)
        key = tuple(out.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _exact_two(target, **options) -> dict:
    from stats import Oracle
    P = Oracle(target, **options)
    V = target.width
    return {(a, b): float(P((1, 2))[a]) * float(P((1, 2, a))[b]) for a in range(V) for b in range(V)}


def _fit(counts, exact, name):
    cells = sorted(exact)
    return goodness_of_fit(name, {"all": ([counts.get(c, 0) for c in cells], [exact[c] for c in cells])})


def _table_pair():
    t = random_table(4, 4, seed=10)
    return TableLM(t), TableLM(noisy_table(t, noise=0.8, seed=11))


@pytest.mark.parametrize("name, drafter_for", [
    ("sampled siblings (k=3, depth 2)", lambda d: lambda gen: SampledTree(d, 3, gen)),
    ("model tree (TreeDraft, one-hot)", lambda d: lambda gen: TreeDraft(d, branches=2, nodes=4)),
    ("model tree, sampled (TreeDraft, siblings without replacement)",
     lambda d: lambda gen: TreeDraft(d, branches=3, nodes=6, pick=Pick(do_sample=True, temperature=0.5,
                                                                       generator=gen))),
    ("lookup tree (one-hot)", lambda d: lambda gen: LookupTree(max_ngram=1, min_ngram=1, branches=2)),
])
def test_tree_sampling_follows_the_target_law(name, drafter_for):
    """The first two tokens ~ p(x1) p(x2 | x1), chi-square at 0.001 (TableLM: every tree is
    verified branch by branch there, the rule the same)."""
    target, draft = _table_pair()
    counts = _joint_two(target, drafter_for(draft), 3000, seed=5)
    fit = _fit(counts, _exact_two(target), name)
    assert not fit.rejects(1e-3), str(fit)


def test_tree_sampling_law_check_rejects_siblings_tried_against_the_full_p(monkeypatch):
    """Negative control, end to end: the loop with the no-residual rule fails the same check."""
    monkeypatch.setattr(accept, "_walk_sampled", _no_residual_tree_sampled)
    target, draft = _table_pair()
    counts = _joint_two(target, lambda gen: SampledTree(draft, 3, gen), 3000, seed=5)
    fit = _fit(counts, _exact_two(target), "no residual between siblings")
    assert fit.rejects(1e-3), str(fit)


def _full_q_level(self, tree, level, scores, path_logp, room, pick):
    """ModelDraft._level's sampled branch with a planted bug: siblings drawn without replacement, but
    each recorded with its parent's whole distribution as q (not what it was drawn from)."""
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    q = list(tree.q) if tree.q is not None else []
    new, full = [], [pick.probabilities(s) for s in scores]
    left = [f.clone() for f in full]
    for turn in range(room):
        i = turn % len(level)
        if float(left[i].sum()) <= 0:
            continue
        token = int(sampling.sample(left[i] / left[i].sum(), pick.generator))
        q.append(full[i] / full[i].sum())
        new.append(len(tokens))
        tokens.append(token)
        parents.append(level[i])
        left[i][token] = 0
    return Tree(torch.tensor(tokens), tuple(parents), torch.stack(q) if q else None), new


def _unrelated_pair():
    """A target and a draft from two unrelated random tables: where drawing siblings without replacement
    and claiming the parent's whole q goes far off the law (worked out exactly, a total variation up to
    0.77 on random 4-token laws; this pair shows it)."""
    return TableLM(random_table(4, 4, seed=10, scale=2.0)), TableLM(random_table(4, 4, seed=13, scale=2.0))


@pytest.mark.parametrize("planted", [False, True])
def test_a_sampled_model_tree_follows_the_law_and_the_check_rejects_a_q_it_did_not_draw_from(planted, monkeypatch):
    """TreeDraft sampled (3 siblings a level drawn without replacement, q what each was drawn from)
    on a pair where the draft is far from the target: the first two tokens follow the target's law;
    the negative control, each sibling claimed drawn from its parent's whole distribution, fails the
    same check (chi-square at 0.001, 2000 runs each)."""
    from spec.draft import ModelDraft
    if planted:
        monkeypatch.setattr(ModelDraft, "_level", _full_q_level)
    target, draft = _unrelated_pair()
    counts = _joint_two(target, lambda gen: TreeDraft(draft, branches=3, nodes=6,
                                                      pick=Pick(do_sample=True, generator=gen)), 2000, seed=5)
    fit = _fit(counts, _exact_two(target), "q not the distribution drawn from" if planted else "sampled TreeDraft")
    assert fit.rejects(1e-3) == planted, str(fit)


def test_tree_sampling_on_a_one_pass_model_follows_the_law():
    """The same law on a GPT-NeoX pair with vocab 8, where the target scores each tree in one pass."""
    from spec.models import build_gpt_neox, perturbed_copy
    target = build_gpt_neox(dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                 vocab_size=8), seed=30, dtype=torch.float64)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(40.0)
    assert runner.tree_support(target) is None
    draft = perturbed_copy(target, noise=0.3, seed=31, dtype=torch.float64)
    gen = torch.Generator().manual_seed(8)
    drafter = TreeDraft(draft, branches=2, nodes=4)
    counts: dict = {}
    for _ in range(1500):
        out = speculative_generate(target, drafter, [1, 2], gamma=2, max_new_tokens=2, do_sample=True, generator=gen)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    from stats import Oracle
    P = Oracle(target)
    exact = {(a, b): float(P((1, 2))[a]) * float(P((1, 2, a))[b]) for a in range(8) for b in range(8)}
    fit = _fit(counts, exact, "neox tree")
    assert not fit.rejects(1e-3) and math.isfinite(fit.stat), str(fit)


# --- docs/DEVELOPING.md's tree drafter, executed from the page ---------------------------------------

def _page_class(name: str):
    import re
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "DEVELOPING.md").read_text(encoding="utf-8")
    namespace: dict = {}
    exec(re.findall(r"```python\n(# spec/" + name + r"\.py.*?)```", page, re.S)[0], namespace)
    return namespace


@pytest.mark.parametrize("family", ["llama", "gemma2", "openai-gpt"])
def test_the_developer_pages_tree_drafter_decodes_exactly_as_written(family):
    """TwoGuesses, written from the page alone: a Drafter, greedy's output on a one-pass family, a
    mixed-window family and a recompute one; it drafts real trees and some are accepted."""
    TwoGuesses = _page_class("twoguesses")["TwoGuesses"]
    target = cached_model(family)
    source, ids = TwoGuesses(), [3, 5, 7, 9, 3, 5, 8, 3, 5, 7, 9, 3]
    assert isinstance(source, Drafter)
    seq = torch.tensor(ids + [0] * 4)
    tree = source.draft(seq, len(ids), 4)
    assert not tree.is_chain and tree.parents == (-1, 0, 1, 2, 0, 4, 5)   # two branches after "3 5"
    run = speculative_generate(target, source, ids, gamma=4, max_new_tokens=24)
    assert_exact(target, ids, greedy_generate(target, ids, max_new_tokens=24).tokens, run.tokens)


def test_the_developer_pages_tree_drafter_keeps_the_sampling_law():
    TwoGuesses = _page_class("twoguesses")["TwoGuesses"]
    target, _ = _table_pair()
    counts = _joint_two(target, lambda gen: TwoGuesses(), 2000, seed=6)
    fit = _fit(counts, _exact_two(target), "TwoGuesses")
    assert not fit.rejects(1e-3), str(fit)


# --- drafters that read the target's hidden states ---------------------------------------------------

class Recording(DraftSource):
    """A Drafter that needs the target's hidden states and records what it is told each round."""

    def __init__(self, inner, layers=(-1,)):
        self.inner, self.calls, self.layers = inner, [], layers
        self.needs = inner.needs | {Need.HIDDEN}

    def begin(self, prompt):
        self.inner.begin(prompt)

    def draft(self, seq, n, g):
        self.calls.append(["draft", n])
        return self.inner.draft(seq, n, g)

    def observe(self, n, accepted):
        self.calls[-1] += [n, accepted]
        self.inner.observe(n, accepted)

    def process(self, step):
        assert len(self.calls[-1]) == 4, "process comes after the round's observe, once"
        self.calls[-1] += [step.at(self.layers[-1]).clone(), step.positions.tolist(), step.hidden.clone()]

    def __len__(self):
        return 0


def _last_layer(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0]


@pytest.mark.parametrize("family, inner", [
    ("llama", lambda: TreeDraft(cached_model("llama"), branches=2, nodes=5)),     # trees in one pass
    ("llama", lambda: TreeDraft(cached_model("llama"), branches=1)),              # chains
    ("openai-gpt", lambda: TreeDraft(cached_model("openai-gpt"), branches=2, nodes=5)),  # branch by branch
    # recurrent targets (state-snapshot, stepwise): a crop restores a state and re-feeds the kept
    # tokens, so the states must be read before it; a perturbed draft makes rounds partly accepted
    ("mamba2", lambda: TreeDraft(draft_model("mamba2"), branches=1)),
    ("rwkv", lambda: TreeDraft(draft_model("rwkv"), branches=1)),
])
@torch.inference_mode()
def test_a_drafter_that_needs_hidden_states_gets_the_targets_own(family, inner):
    """Each round the drafter hears the target's last-layer states at every position it has not
    heard yet up to the one that chose the round's last emitted token (the first round: the prompt's
    too), each once, equal to the model's own cache-free forward's; the output stays greedy's."""
    target = cached_model(family)
    prompt = [5, 9, 14, 3, 5, 9, 14, 3, 5]
    drafter = Recording(inner())                    # a self-draft: its trees' paths are accepted
    out = speculative_generate(target, drafter, prompt, gamma=3, max_new_tokens=16)
    assert out.tokens == greedy_generate(target, prompt, max_new_tokens=16).tokens
    full = _last_layer(target, prompt + out.tokens)
    assert len(drafter.calls) == len(out.rounds) and out.accepted > 0
    if family in ("mamba2", "rwkv"):                # the case under test happened: a chain partly kept
        assert any(0 < r.accepted < r.drafted for r in out.rounds), out.rounds
    heard = 0
    for (_, before, after, accepted, hidden, positions, _), r in zip(drafter.calls, out.rounds):
        assert hidden.shape == (after - 1 - heard, full.shape[-1]) and accepted == r.accepted
        assert heard == (0 if heard == 0 else before - 1)      # the prefill first, then each round's own
        assert positions == list(range(heard, after - 1))
        # fp32's bound on these fp64 models: HF's eager attention takes its softmax in fp32 (a tree's
        # rows sum their exps in another order than the cache-free forward's)
        assert_logits_close(hidden, full[heard:after - 1], torch.float32, f"{family}, hidden states")
        heard = after - 1
    assert drafter.calls[0][-1].shape[0] >= len(prompt)      # the prompt's states came with the first round


@torch.inference_mode()
def test_a_drafter_gets_the_hidden_states_of_the_layers_it_asks_for():
    """layers=(0, 1, -1): the embeddings, the first layer's output and the last layer's (after the final
    norm), at each position once, as the model's own cache-free forward gives them; a layer the model
    does not have is refused by name."""
    target = cached_model("llama")
    prompt = [5, 9, 14, 3, 5, 9, 14, 3, 5]
    drafter = Recording(TreeDraft(cached_model("llama"), branches=2, nodes=5), layers=(0, 1, -1))
    out = speculative_generate(target, drafter, prompt, gamma=3, max_new_tokens=12)
    assert out.tokens == greedy_generate(target, prompt, max_new_tokens=12).tokens
    states = target(input_ids=torch.tensor([prompt + out.tokens]), output_hidden_states=True,
                    use_cache=False).hidden_states
    heard = torch.cat([call[6] for call in drafter.calls])
    assert heard.shape == (len(prompt) + len(out.tokens) - 1, 3, states[0].shape[-1])
    for i, layer in enumerate((0, 1, -1)):
        assert_logits_close(heard[:, i], states[layer][0, :heard.shape[0]], torch.float32, f"layer {layer}")
    assert not torch.allclose(heard[:, 0], heard[:, 2])         # the layers are not one another
    with pytest.raises(ValueError, match="layers: 99 is not a layer"):
        speculative_generate(target, Recording(TreeDraft(cached_model("llama")), layers=(99,)), prompt, gamma=2,
                             max_new_tokens=4)


def test_the_developer_pages_hidden_state_drafter_runs_as_written():
    HiddenHead = _page_class("hiddenhead")["HiddenHead"]
    target = cached_model("llama")
    prompts = [[5, 9, 14, 3, 5, 9], [7, 7, 7]]
    head = HiddenHead(target.get_output_embeddings())
    assert isinstance(head, Drafter)
    outs = speculative_generate(target, head, prompts, gamma=2, max_new_tokens=12)      # a batch: a copy a row
    assert [o.tokens for o in outs] == [greedy_generate(target, p, max_new_tokens=12).tokens for p in prompts]
    assert all(o.drafted > 0 for o in outs)


def test_a_hidden_state_drafter_on_a_target_that_cannot_give_them_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration
    HiddenHead = _page_class("hiddenhead")["HiddenHead"]
    t5 = T5ForConditionalGeneration(T5Config(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, vocab_size=16,
                                             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    with pytest.raises(ValueError, match="hidden states needs the target on a spec.runner path"):
        speculative_generate(t5, HiddenHead(t5.lm_head), [3, 4], gamma=2, max_new_tokens=4)


def test_the_tree_benchmark_recipe_runs_and_checks_exactness(target):
    """recipes/bench_trees.py's measuring step, end to end on the tiny fixture model."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "recipes" / "bench_trees.py"
    spec_ = importlib.util.spec_from_file_location("bench_trees", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    rows = module.bench(target, [[5, 6, 7, 5, 6, 7, 5]], {"tree": (TreeDraft(target, branches=2, nodes=4), 2),
                                                          "lookup": (LookupTree(), 3)}, 8, 1)
    assert set(rows) == {"greedy", "tree", "lookup"} and all(r["equal_to_greedy"] for r in rows.values())
    assert rows["tree"]["tokens_per_target_pass"] > 2 and rows["greedy"]["drafted_per_round"] == 0


def test_a_drafter_returning_trees_without_the_need_is_told_to_declare_it_and_an_empty_tree_is_nothing():
    """A batch on a shared cache cannot verify trees: a drafter that returns them without
    Need.TREES in its `needs` is refused naming it. An empty tree (even a float torch.tensor([]))
    is a round with nothing proposed."""
    target = cached_model("llama")

    class Unflagged(DraftSource):
        needs = frozenset()

        def __init__(self, empty=False):
            self.empty = empty

        def begin(self, prompt):
            pass

        def draft(self, seq, n, g):
            return Tree(torch.tensor([]), ()) if self.empty or g < 1 else _tree([1, 2], [-1, -1])

        def observe(self, n, accepted):
            pass

        def __len__(self):
            return 0

    with pytest.raises(ValueError, match="Need.TREES"):
        speculative_generate(target, Unflagged(), [[4, 5], [6, 7, 8]], gamma=2, max_new_tokens=4)
    out = speculative_generate(target, Unflagged(empty=True), [4, 5], gamma=2, max_new_tokens=4)
    assert out.tokens == greedy_generate(target, [4, 5], max_new_tokens=4).tokens and out.drafted == 0
    single = speculative_generate(target, Unflagged(), [4, 5], gamma=2, max_new_tokens=4)   # one prompt: fine
    assert single.tokens == out.tokens


@pytest.mark.parametrize("branches, nodes, g", [(2, 1, 4), (2, 3, 4), (3, 5, 3), (2, 6, 6), (3, 7, 2), (4, 9, 5)])
def test_tree_drafters_keep_their_node_budget_and_depth(branches, nodes, g):
    """A tree never has more than `nodes` nodes nor more than g levels, and a budget the width and
    depth can fill is filled (the round's target pass is sized by it)."""
    model = cached_model("llama")
    history = [3, 5, 7, 9, 3, 5, 8, 1, 3, 5, 7, 2, 3, 5, 9, 4, 3, 5, 7, 9, 3, 5]    # "3 5" followed four ways
    for drafter in (TreeDraft(model, branches=branches, nodes=nodes),
                    LookupTree(max_ngram=2, min_ngram=2, branches=branches, nodes=nodes)):
        seq = torch.tensor(history + [0] * 16)
        tree = drafter.draft(seq, len(history), g)
        depth = max(tree.depths(), default=0)
        assert len(tree) <= nodes and depth <= g, (drafter, len(tree), depth)
        if isinstance(drafter, TreeDraft):           # each level keeps the `branches` likeliest paths
            assert len(tree) == min(nodes, branches * g), (drafter, len(tree))
