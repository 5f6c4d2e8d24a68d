"""spec.FirstOf, a chain of draft sources: the first source that proposes anything drafts the
round; every source hears observe; needs are the union; statistics per source add up to the
run's; greedy output is greedy's over families, with a stateful source that sits out rounds, and
over a batch of prompts."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import cached_model, draft_model

from spec import FirstOf, LookupTree, PromptLookup, TreeDraft, greedy_generate, speculative_generate
from spec.firstof import Counts
from spec.protocols import DraftSource, Drafter, Need
from spec.tree import Tree

PROMPT = [5, 9, 13, 2, 7, 11, 5, 9]


class Fixed(DraftSource):
    """Proposes `tokens` (capped at g) where `when(n)`, else nothing; records every call."""

    def __init__(self, name: str, tokens: list[int], when=lambda n: True, needs=frozenset()):
        self.name, self.tokens, self.when, self.needs = name, tokens, when, needs
        self.drafts: list[int] = []
        self.observed: list[tuple] = []

    def __repr__(self) -> str:
        return f"Fixed({self.name})"

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        self.drafts.append(n)
        out = self.tokens[:g] if self.when(n) else []
        return Tree.chain(torch.tensor(out, dtype=torch.long, device=seq.device))

    def observe(self, n: int, accepted: int) -> None:
        self.observed.append((n, accepted))

    def process(self, step) -> None:
        self.observed[-1] += (step.hidden.shape[0],)      # after the round's observe


def test_the_first_source_that_proposes_drafts_and_every_source_hears_observe():
    empty, first, second = Fixed("empty", []), Fixed("first", [3, 4]), Fixed("second", [6])
    chain = FirstOf(empty, first, second)
    seq = torch.tensor(PROMPT + [0] * 4)
    tree = chain.draft(seq, len(PROMPT), 3)
    assert tree.tokens.tolist() == [3, 4]
    assert empty.drafts == first.drafts == [len(PROMPT)] and second.drafts == []     # the rest not asked
    chain.observe(len(PROMPT) + 2, 1)
    assert empty.observed == second.observed == [(len(PROMPT) + 2, 0)] and first.observed == [(len(PROMPT) + 2, 1)]
    assert chain.stats == {"Fixed(empty)": Counts(), "Fixed(first)": Counts(1, 2, 1), "Fixed(second)": Counts()}
    # nobody proposes: an empty tree, and everyone hears 0
    nothing = FirstOf(Fixed("a", []), Fixed("b", []))
    assert len(nothing.draft(seq, len(PROMPT), 3)) == 0
    nothing.observe(len(PROMPT) + 1, 0)
    assert all(s.observed == [(len(PROMPT) + 1, 0)] for s in nothing.sources)
    # g 0: nothing to propose, no source asked
    assert len(chain.draft(seq, len(PROMPT), 0)) == 0 and empty.drafts == [len(PROMPT)]


def test_needs_are_the_union_and_bad_sources_are_refused():
    assert FirstOf(PromptLookup()).needs == frozenset()
    assert FirstOf(PromptLookup(), LookupTree()).needs == {Need.TREES}
    hidden = Fixed("h", [1], needs=frozenset({Need.HIDDEN}))
    assert FirstOf(PromptLookup(), hidden, LookupTree()).needs == {Need.TREES, Need.HIDDEN}
    assert isinstance(FirstOf(PromptLookup(), LookupTree()), Drafter)
    with pytest.raises(ValueError, match="at least one"):
        FirstOf()
    with pytest.raises(TypeError, match="TreeDraft"):
        FirstOf(PromptLookup(), draft_model("llama"))
    # the same repr twice: both counted apart
    assert list(FirstOf(PromptLookup(), PromptLookup()).stats) == ["PromptLookup(max_ngram=3, min_ngram=2) #0",
                                                                    "PromptLookup(max_ngram=3, min_ngram=2) #1"]


def test_a_copy_copies_the_sources_and_shares_the_statistics():
    model = draft_model("llama")
    chain = FirstOf(PromptLookup(), TreeDraft(model, branches=1))
    made = copy.deepcopy(chain)
    assert made.sources[0] is not chain.sources[0] and made.sources[1] is not chain.sources[1]
    assert made.sources[1].model is model and made.stats is chain.stats
    assert repr(made) == repr(chain) == f"FirstOf({chain.sources[0]!r}, {chain.sources[1]!r})"


def _sums(chain: FirstOf) -> tuple[int, int, int]:
    return tuple(sum(getattr(c, f) for c in chain.stats.values()) for f in ("rounds", "proposed", "accepted"))


@pytest.mark.parametrize("family", ["llama", "gpt2", "mamba2"])
def test_greedy_output_is_greedys_and_the_statistics_add_up(family):
    """Lookup where the text repeats, the draft model's chain (or tree) where it does not: both
    draft in the run, the output is greedy's, and the per-source counts sum to the Result's."""
    target = cached_model(family)
    free = greedy_generate(target, PROMPT, max_new_tokens=24).tokens
    for chain in (FirstOf(PromptLookup(min_ngram=2), TreeDraft(draft_model(family), branches=1)),
                  FirstOf(LookupTree(min_ngram=2), TreeDraft(draft_model(family), branches=2, nodes=6))):
        out = speculative_generate(target, chain, PROMPT, gamma=3, max_new_tokens=24)
        assert out.tokens == free, chain
        assert all(c.rounds > 0 for c in chain.stats.values()), chain.stats       # both sources drafted
        assert _sums(chain) == (sum(r.drafted > 0 for r in out.rounds), out.drafted, out.accepted)


def test_a_stateful_source_that_sat_out_rounds_drafts_as_a_fresh_one():
    """A TreeDraft asked only every other round resyncs its runner to the final sequence: its
    proposals are a fresh TreeDraft's on the same sequence, and the output stays greedy's; so
    too when the chain serves a second prompt that shares only the first tokens."""
    target, model = cached_model("llama"), draft_model("llama")

    class Checked(TreeDraft):
        def draft(self, seq, n, g):
            tree = super().draft(seq, n, g)
            fresh = TreeDraft(model, branches=2, nodes=5).draft(seq.clone(), n, g)
            assert (tree.tokens.tolist(), tree.parents) == (fresh.tokens.tolist(), fresh.parents)
            self.checked += 1
            return tree

    inner = Checked(model, branches=2, nodes=5)
    inner.checked = 0
    odd = Fixed("odd", [1, 2], when=lambda n: n % 2 == 1)       # drafts (wrong tokens) on odd lengths
    chain = FirstOf(odd, inner)
    out = speculative_generate(target, chain, PROMPT, gamma=3, max_new_tokens=20)
    assert out.tokens == greedy_generate(target, PROMPT, max_new_tokens=20).tokens
    assert inner.checked >= 2 and len(odd.drafts) > inner.checked     # it sat out some rounds
    other, before = PROMPT[:3] + [20, 21, 22, 23], inner.checked
    out = speculative_generate(target, chain, other, gamma=3, max_new_tokens=12)
    assert out.tokens == greedy_generate(target, other, max_new_tokens=12).tokens and inner.checked > before


def test_a_batch_of_prompts_gives_each_row_its_solo_output():
    target = cached_model("llama")
    prompts = [PROMPT, [7], [11, 12, 13, 11, 12]]
    chain = FirstOf(PromptLookup(min_ngram=1), TreeDraft(draft_model("llama"), branches=2, nodes=5))
    outs = speculative_generate(target, chain, prompts, gamma=3, max_new_tokens=12)
    assert [o.tokens for o in outs] == [greedy_generate(target, p, max_new_tokens=12).tokens for p in prompts]
    # the copies (one per row) share the statistics: they count every row
    assert _sums(chain) == (sum(r.drafted > 0 for o in outs for r in o.rounds), sum(o.drafted for o in outs),
                            sum(o.accepted for o in outs))


def test_sources_that_read_different_layers_are_refused_by_name():
    a = Fixed("a", [1], needs=frozenset({Need.HIDDEN}))
    b = Fixed("b", [1], needs=frozenset({Need.HIDDEN}))
    b.layers = (0, -1)
    with pytest.raises(ValueError, match="ask for different layers"):
        FirstOf(a, b)
    assert FirstOf(a, Fixed("plain", [1])).layers == (-1,)


def test_a_source_that_needs_hidden_states_gets_them_and_the_others_do_not():
    target = cached_model("llama")
    plain = Fixed("plain", [4, 4], when=lambda n: n % 2 == 0)
    reader = Fixed("reader", [], needs=frozenset({Need.HIDDEN}))
    out = speculative_generate(target, FirstOf(plain, reader), PROMPT, gamma=2, max_new_tokens=10)
    assert out.tokens == greedy_generate(target, PROMPT, max_new_tokens=10).tokens
    assert len(plain.observed) == len(reader.observed) == len(out.rounds)
    assert all(len(o) == 2 for o in plain.observed) and all(len(o) == 3 and o[2] > 0 for o in reader.observed)
