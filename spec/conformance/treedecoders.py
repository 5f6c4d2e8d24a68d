"""From-scratch tree decoders: the kit's negative controls for trees (spec/conformance/test_trees.py).

A cache-free decoder over Hugging Face models, written as an engine author would write one and
sharing no code with spec's runtime: each round the draft model grows a tree (every node of a level
up to `BRANCHES` of them offers `BRANCHES` children: its top tokens in greedy mode, independent draws
from its law q when sampling), the target scores the whole tree in ONE forward pass with explicit
position ids and a 4-D attention mask, and the tree is walked from the root: greedy keeps the child
that is the target's argmax; sampling is SpecInfer's rule (each child x_c, drawn from q_c, is kept if
u_c * q_c(x_c) < r(x_c); a rejected child's mass leaves r, r = norm(max(0, r - q_c)), over the
target's whole vocabulary; when every child is rejected, or at a leaf, the next token is drawn from
r). The processors are the kit's own references (kit.reference_processed, then
stats.reference_probabilities), so the correct decoder (`generate`) is exact for every option it takes.

One switch per bug class, each a mistake an engine's tree path can make:
  sibling-visible            the tree mask lets a node see its earlier siblings (not only its ancestors)
  sequential-positions       nodes get the positions of their place in the flattened tree (root + 1 + i),
                             not root + their depth (the position ids left out, or counted in order)
  residual-on-draft-support  after a rejected child, norm(max(0, r - q)) is normalised over the draft's
                             support (where q > 0) only: target mass the draft never proposes is lost
  no-mass-removal            a rejected child's mass is not removed before the next sibling is tried
  shared-noise               each child is drawn from q by inverse CDF from a uniform u, and that same u
                             is reused in its acceptance test (vLLM PR #54282's class for chains)

Run one through the kit: `python -m spec conform --impl spec/conformance/treedecoders.py:<name>`,
name `generate` (correct) or the bug with underscores (`sibling_visible`, ...).
"""

from __future__ import annotations

import torch

from spec.conformance.kit import reference_processed
from spec.conformance.stats import reference_probabilities

BRANCHES = 2
BUGS = ("sibling-visible", "sequential-positions", "residual-on-draft-support", "no-mass-removal", "shared-noise")
PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "sequence_bias", "bad_words_ids")
WARPERS = ("top_k", "top_p", "min_p")
OPTIONS = PROCESSORS + ("min_p",)


class _Law:
    """Next-token laws (sampling) or processed logits (greedy) of one decode call's options."""

    def __init__(self, do_sample: bool, temperature, top_k, top_p, options: dict):
        self.do_sample = do_sample
        self.proc = {k: options.get(k) for k in PROCESSORS}
        self.plain = not any(v is not None for v in self.proc.values())
        self.warp = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=options.get("min_p"))

    def __call__(self, logits: torch.Tensor, context: list[int]) -> torch.Tensor:
        z = logits.double() if self.plain else reference_processed(logits, context, **self.proc)
        return reference_probabilities(z, **self.warp) if self.do_sample else z


@torch.inference_mode()
def _last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].double()


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _draw_inverse_cdf(q: torch.Tensor, u: float) -> int:
    cdf = q.cumsum(0)
    return min(int((cdf <= u).sum()), int(q.nonzero().max()))


def _grow(draft, ctx: list[int], g: int, law: _Law, generator, bug) -> tuple[list, list, list, list]:
    """The round's tree: (tokens, parents, q of each node, the uniform each was drawn with or None)."""
    tokens, parents, qs, us = [], [], [], []
    level = [-1]
    for _ in range(g):
        grown = []
        for node in level[:BRANCHES]:
            ids = ctx + [tokens[i] for i in _path(parents, node)]
            q = law(_last_logits(draft, ids), ids)
            for rank in range(BRANCHES):
                if not law.do_sample:
                    x, u = int(q.topk(BRANCHES).indices[rank]), None
                elif bug == "shared-noise":
                    u = float(torch.rand((), generator=generator, dtype=torch.float64))
                    x = _draw_inverse_cdf(q, u)
                else:
                    x, u = int(torch.multinomial(q, 1, generator=generator)), None
                grown.append(len(tokens))
                tokens.append(x)
                parents.append(node)
                qs.append(q)
                us.append(u)
        level = grown
    return tokens, parents, qs, us


def _layout(parents: list[int], fed: int, bug) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [fed + N] and the visibility [fed + N, fed + N] (True: may attend) of one pass over
    the context (causal) and the tree's nodes (the context, the node's ancestors and itself)."""
    n = len(parents)
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    root = fed - 1
    tail = [root + 1 + i for i in range(n)] if bug == "sequential-positions" else [root + d for d in depth]
    positions = torch.tensor(list(range(fed)) + tail)
    sees = torch.ones(fed + n, fed + n, dtype=torch.bool).tril()
    sees[fed:, fed:] = False
    for i, p in enumerate(parents):
        sees[fed + i, fed + i] = True
        if p >= 0:
            sees[fed + i, fed:] |= sees[fed + p, fed:]
        if bug == "sibling-visible":
            for j in range(i):
                if parents[j] == p:
                    sees[fed + i, fed + j] = True
    return positions, sees


@torch.inference_mode()
def score_tree(target, ctx: list[int], tokens: list[int], parents: list[int], bug) -> torch.Tensor:
    """The target's logits after the root (row 0) and after each node (row i + 1), one forward."""
    positions, sees = _layout(parents, len(ctx), bug)
    dtype = next(target.parameters()).dtype
    mask = torch.zeros(sees.shape, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)
    out = target(torch.tensor([ctx + tokens]), attention_mask=mask[None, None], position_ids=positions[None])
    return out.logits[0, len(ctx) - 1:].double()


def _residual(r: torch.Tensor, q: torch.Tensor, bug) -> torch.Tensor:
    if bug == "no-mass-removal":
        return r
    left = (r - q).clamp(min=0)
    if bug == "residual-on-draft-support":
        left = left * (q > 0)
        if float(left.sum()) <= 0:
            left = (r - q).clamp(min=0)
    return left / left.sum()


def _walk(tree, rows, ctx: list[int], law: _Law, generator, bug) -> list[int]:
    """The accepted path's tokens and the token after it."""
    tokens, parents, qs, us = tree
    node, emitted = -1, []
    r = law(rows[0], ctx)
    while True:
        children = [c for c, p in enumerate(parents) if p == node]
        kept = None
        for c in children:
            x = tokens[c]
            if not law.do_sample:
                if x == int(r.argmax()):
                    kept = c
                    break
                continue
            u = us[c] if us[c] is not None else float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(qs[c][x]) < float(r[x]):
                kept = c
                break
            r = _residual(r, qs[c], bug)
        if kept is None:
            last = int(r.argmax()) if not law.do_sample else int(torch.multinomial(r, 1, generator=generator))
            return emitted + [last]
        node = kept
        emitted.append(tokens[node])
        r = law(rows[node + 1], ctx + emitted)


def make(bug: str | None = None, name: str = "generate"):
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")

    def generate(target, draft, input_ids, *, gamma, max_new_tokens, eos_token_id=None, do_sample=False,
                 temperature=1.0, top_k=None, top_p=None, generator=None, **options):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise NotImplementedError(f"{name} does not take {', '.join(unknown)}")
        eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        law = _Law(do_sample, temperature, top_k, top_p, options)
        out: list[int] = []
        while len(out) < max_new_tokens:
            ctx = list(input_ids) + out
            g = min(gamma, max_new_tokens - len(out) - 1)
            tree = _grow(draft, ctx, g, law, generator, bug)
            new = _walk(tree, score_tree(target, ctx, tree[0], tree[1], bug), ctx, law, generator, bug)
            for i, t in enumerate(new):
                if t in eos:
                    return (out + new[:i + 1])[:max_new_tokens]
            out += new
        return out[:max_new_tokens]

    generate.__name__ = name
    generate.conformance_draft = "model"
    generate.conformance_options = OPTIONS
    return generate


generate = make()
sibling_visible = make("sibling-visible", "sibling_visible")
sequential_positions = make("sequential-positions", "sequential_positions")
residual_on_draft_support = make("residual-on-draft-support", "residual_on_draft_support")
no_mass_removal = make("no-mass-removal", "no_mass_removal")
shared_noise = make("shared-noise", "shared_noise")
DECODERS = {None: generate, "sibling-visible": sibling_visible, "sequential-positions": sequential_positions,
            "residual-on-draft-support": residual_on_draft_support, "no-mass-removal": no_mass_removal,
            "shared-noise": shared_noise}
