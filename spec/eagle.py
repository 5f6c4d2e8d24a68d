"""An EAGLE-style draft head: one small layer over the target's own features.

EAGLE (Li et al. 2024) drafts in the target's feature space: from the target's last-layer state
f_t at position t (the state that chose token x_{t+1}) and the embedding of x_{t+1}, one layer
predicts the next state, f_{t+1} ~ f_t + W2 silu(W1 [f_t; e(x_{t+1})]), and the target's own LM
head (here its rows for a reduced draft vocabulary `ids`) turns it into the next token. Repeating
the step on the predicted state drafts a chain; taking the top `branches` tokens at the first
step drafts a tree of chains. The head reads the target's states through the loop's Need.HIDDEN
contract (spec.protocols.Drafter): each round the loop hands it the verify pass's states, the
prompt's included on the first round, and the newest one starts the next draft.

Exact by construction: every proposal is a deterministic function of the sequence and the
target's states (q one-hot, given as None), and the target decides every emitted token (greedy
output is greedy's; sampling follows the target's law). A head only changes how often a proposal
is accepted. The training recipe is recipes/train_eagle.py (not part of the runtime package).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec import hf
from spec.protocols import DraftSource, Need, Step
from spec.tree import Tree


class EagleHead(torch.nn.Module):
    """The trainable layer; the target's input embedding and LM head rows are read from the target
    (not parameters of the head, not saved with it). ids: the draft vocabulary, [K] target ids."""

    def __init__(self, target, ids: torch.Tensor, width: int | None = None):
        super().__init__()
        emb, head = target.get_input_embeddings(), target.get_output_embeddings()
        hidden = head.weight.shape[1]
        width = width or hidden
        self.fuse = torch.nn.Linear(hidden + emb.weight.shape[1], width)
        self.out = torch.nn.Linear(width, hidden, bias=False)
        torch.nn.init.zeros_(self.out.weight)            # starts as the identity on f: LM head(f_t)
        self.register_buffer("ids", ids.to(torch.long).clone())
        # The target's weights, held by reference in a tuple so that they are neither parameters of
        # the head nor in its state_dict: [vocab rows, E] embedding, [K, H] head rows, [K] bias or None
        bias = getattr(head, "bias", None)
        self.target = (emb.weight.detach(), head.weight.detach()[self.ids.to(head.weight.device)],
                       None if bias is None else bias.detach()[self.ids.to(bias.device)])

    def step(self, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The next state from states f [..., H] and next tokens x [...] (target ids)."""
        e = self.target[0][x].to(f.dtype)
        return f + self.out(torch.nn.functional.silu(self.fuse(torch.cat([f, e], -1))))

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary, [..., K] (index k is target id ids[k])."""
        _, weight, bias = self.target
        out = f @ weight.to(f.dtype).T
        return out if bias is None else out + bias.to(f.dtype)


def save(head: EagleHead, target, path, about: dict | None = None) -> None:
    """The head's own weights and draft vocabulary, with the shape of the target it was trained on
    and `about` (how it was trained)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": head.state_dict(), "width": head.fuse.out_features, "hidden": head.out.out_features,
                "vocab": hf.logit_width(target), "about": about or {}}, path)


def load(path, target) -> EagleHead:
    """A head saved by `save`, bound to `target`; refused with the reason when `target` is not the
    model it was trained on (another hidden size or vocabulary)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    hidden = target.get_output_embeddings().weight.shape[1]
    if blob["hidden"] != hidden or blob["vocab"] != hf.logit_width(target):
        raise ValueError(f"{path}: this head was trained for a target with hidden size {blob['hidden']} and "
                         f"{blob['vocab']} logits; this target has {hidden} and {hf.logit_width(target)}")
    head = EagleHead(target, blob["state"]["ids"], blob["width"])
    head.load_state_dict(blob["state"])
    return head.to(next(target.parameters()).device).eval()


class EagleDraft(DraftSource):
    """Use as the draft: `speculative_generate(target, EagleDraft(head), ids, gamma=4)`, with
    `head = spec.eagle.load(path, target)` (trained by recipes/train_eagle.py). branches=1 drafts a
    chain of gamma tokens; branches=b drafts b chains from the first step's top b tokens (a tree
    of b x gamma nodes, verified in one pass where the target takes trees). The first round has no
    state yet and drafts nothing."""

    def __init__(self, head: EagleHead, branches: int = 1):
        if not isinstance(branches, int) or isinstance(branches, bool) or branches < 1:
            raise ValueError(f"branches must be an integer >= 1, got {branches!r}")
        self.head, self.branches = head.eval(), branches
        self.needs = frozenset({Need.HIDDEN} | ({Need.TREES} if branches > 1 else set()))
        self.state: torch.Tensor | None = None     # the target's state that chose seq[n - 1]

    def __repr__(self) -> str:
        return f"EagleDraft(branches={self.branches}, draft vocabulary {self.head.ids.numel()})"

    def __deepcopy__(self, memo):                  # one per row of a batch: the head shared, the state not
        return EagleDraft(self.head, self.branches)

    def begin(self, prompt: torch.Tensor) -> None:
        self.state = None                          # a new sequence: nothing heard yet

    @torch.inference_mode()
    def draft(self, seq: torch.Tensor, n: int, g: int) -> Tree:
        if g < 1 or self.state is None:
            return Tree.chain(seq[:0])
        head, ids = self.head, self.head.ids
        f = head.step(self.state.to(head.out.weight.dtype), seq[n - 1])
        firsts = head.logits(f).topk(min(self.branches, ids.numel())).indices
        tokens: list[int] = []
        parents: list[int] = []
        for k in firsts.tolist():                  # each branch: its first token, then greedy
            x, h, parent = ids[k], f, -1
            for depth in range(g):
                tokens.append(int(x))
                parents.append(parent)
                parent = len(tokens) - 1
                if depth + 1 < g:
                    h = head.step(h, x)
                    x = ids[head.logits(h).argmax()]
        return Tree(torch.tensor(tokens, dtype=torch.long, device=seq.device), tuple(parents))

    def process(self, step: Step) -> None:
        if step.positions.numel():
            self.state = step.at(-1)[-1]           # the state that chose seq[n - 1]
