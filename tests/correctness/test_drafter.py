"""The Drafter protocol (spec.protocols) from the outside: a draft source written here, in the test,
with no change to spec, runs in speculative_generate; the loop keeps greedy's output whatever it
proposes, hands it what was accepted, and reports what it drafted. The same source is the example
in docs/DEVELOPING.md."""

from __future__ import annotations

import pytest
import torch

from spec import greedy_generate, speculative_generate
from spec.protocols import Drafter
from spec.tree import Tree

PROMPT = [5, 9, 13, 2, 7, 11]


class Oracle:
    """Proposes the tokens of a known continuation (right up to position `wrong`, then one wrong
    token), at most `cap` a round: a deterministic source, so q is None. Records what it is told."""

    def __init__(self, prompt_len: int, continuation: list[int], cap: int = 3, wrong: int | None = None):
        self.P, self.tokens, self.cap, self.wrong = prompt_len, continuation, cap, wrong
        self.observed = []

    needs: frozenset = frozenset()
    layers = (-1,)

    def begin(self, prompt):
        pass

    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        at = n - self.P
        out = self.tokens[at:at + min(g, self.cap)]
        if self.wrong is not None and at <= self.wrong < at + len(out):
            out = out[:self.wrong - at] + [(out[self.wrong - at] + 1) % 100]
        return Tree.chain(torch.tensor(out, dtype=torch.long, device=seq.device))

    def observe(self, n: int, accepted: int) -> None:
        self.observed.append((n, accepted))

    def process(self, step) -> None:
        raise AssertionError("a source without Need.HIDDEN is handed no Step")

    def __len__(self) -> int:
        return 0


def test_a_source_written_outside_spec_is_a_drafter_and_keeps_greedys_output(target):
    free = greedy_generate(target, PROMPT, max_new_tokens=20).tokens
    oracle = Oracle(len(PROMPT), free, cap=3, wrong=9)
    assert isinstance(oracle, Drafter)
    run = speculative_generate(target, oracle, PROMPT, gamma=5, max_new_tokens=20)
    assert run.tokens == free
    # at most `cap` drafted a round (fewer than gamma: the loop takes what the source proposes)
    assert max(run.drafted_per_round) == 3 and run.accepted_per_round[:2] == [3, 3]
    # rounds start at new tokens 0, 4, 8: the wrong token at 9 is rejected: the round that drafted it keeps 1 of them
    assert run.accepted_per_round[2] == 1
    # observe hears each round's final length and accepted count
    ns = [len(PROMPT) + sum(run.tokens_per_round[:i + 1]) for i in range(len(run.rounds))]
    assert oracle.observed == list(zip(ns, run.accepted_per_round))


def test_a_source_proposing_nothing_makes_each_round_one_target_step(target):
    free = greedy_generate(target, PROMPT, max_new_tokens=8).tokens
    run = speculative_generate(target, Oracle(len(PROMPT), free, cap=0), PROMPT, gamma=4, max_new_tokens=8)
    assert run.tokens == free and run.drafted_per_round == [0] * 8 and run.tokens_per_round == [1] * 8


@pytest.mark.parametrize("seed", [0, 1])
def test_a_deterministic_source_under_sampling_draws_what_plain_sampling_draws_when_it_proposes_nothing(target, seed):
    """With nothing proposed, a round draws one token from p: the same draws as plain sampling."""
    plain = greedy_generate(target, PROMPT, max_new_tokens=8, do_sample=True,
                            generator=torch.Generator().manual_seed(seed)).tokens
    spec = speculative_generate(target, Oracle(len(PROMPT), [], cap=0), PROMPT, gamma=4, max_new_tokens=8,
                                do_sample=True, generator=torch.Generator().manual_seed(seed)).tokens
    assert spec == plain


def test_the_developer_pages_example_source_runs_as_written(target):
    """docs/DEVELOPING.md's LastSeen, executed from the page: a Drafter, greedy's output, and it drafts."""
    import re
    from pathlib import Path
    page = (Path(__file__).resolve().parents[2] / "docs" / "DEVELOPING.md").read_text(encoding="utf-8")
    namespace: dict = {}
    exec(re.findall(r"```python\n(# spec/lastseen.py.*?)```", page, re.S)[0], namespace)
    source, ids = namespace["LastSeen"](), [3, 5, 7, 3, 5, 7, 3, 5]
    assert isinstance(source, Drafter)
    run = speculative_generate(target, source, ids, gamma=4, max_new_tokens=40)
    assert run.tokens == greedy_generate(target, ids, max_new_tokens=40).tokens and run.accepted > 0


def test_choose_hands_a_model_free_drafter_back_as_it_is_and_counts_only_models(target, random_draft):
    from spec import PromptLookup, choose
    from spec.draft import ModelDraft
    from spec.protocols import Runner
    lookup = PromptLookup()
    chosen = choose.runs({"target": target, "draft": lookup}, [1, 2, 3])
    assert chosen.runs[1] is lookup and list(chosen.models) == ["target"] and isinstance(chosen.runs[0], Runner)
    assert chosen.prompt.tolist() == [1, 2, 3]
    rows = choose.rows({"target": target, "draft": lookup}, [1, 2, 3])
    assert rows.drafter.drafters == [lookup] and rows.prompts[0].tolist() == [1, 2, 3] and not rows.batched
    chosen = choose.rows({"target": target, "draft": random_draft}, [1, 2, 3], room=8)
    assert isinstance(chosen.drafter, ModelDraft) and isinstance(chosen.drafter.run.runs[0], Runner)
    assert list(chosen.models) == ["target", "draft"]
    # the ids both can use: the narrower head of the two (512), the target's 640 wider than the draft embeds
    assert (chosen.drafter.width, chosen.drafter.clamp) == (512, True)


def test_a_torch_module_that_keeps_the_drafter_protocol_is_a_drafter(target):
    """What is a drafter is decided by the protocol: a torch module with draft/observe/len (a learned
    draft head, say) is served as a Drafter, not probed as a draft model; the output stays exact."""
    from spec import PromptLookup, choose

    class ModuleDrafter(torch.nn.Module):
        needs, layers = frozenset(), (-1,)

        def __init__(self):
            super().__init__()
            self.lookup, self.calls = PromptLookup(min_ngram=1), 0

        def begin(self, prompt):
            pass

        def draft(self, seq, n, g):
            self.calls += 1
            return self.lookup.draft(seq, n, g)

        def observe(self, n, accepted):
            pass

        def process(self, step):
            pass

        def __len__(self):
            return 0

    source = ModuleDrafter()
    assert choose.is_drafter(source) and not choose.is_drafter(target)
    ids = [5, 6, 7, 5, 6, 7, 5, 6]
    run = speculative_generate(target, source, ids, gamma=3, max_new_tokens=20)
    assert run.tokens == greedy_generate(target, ids, max_new_tokens=20).tokens and source.calls == len(run.rounds)


def test_one_prompts_draft_runs_the_way_draft_impl_says(target, random_draft):
    """draft_impl reaches the single prompt's draft runner (the output cannot show it: no draft_impl
    changes a token): "hf" runs the draft's own forward on the probed path, "plain" and "auto" the
    plain-tensor GPT-NeoX draft."""
    from spec import choose, neox, runner
    runs = {impl: choose.rows({"target": target, "draft": random_draft}, [1, 2, 3], room=8,
                              draft_impl=impl).drafter.run.runs[0] for impl in ("hf", "plain", "auto")}
    assert isinstance(runs["hf"], runner.KVRunner)
    assert isinstance(runs["plain"], neox.NeoXDraft) and isinstance(runs["auto"], neox.NeoXDraft)
