"""A broken draft source shared by the GGUF draft tests (tests/test_gguf_draft.py, tests/test_qdraft.py):
the sampling-law tests' negative control. Not a test module."""

from __future__ import annotations

from spec.protocols import DraftSource
from spec.tree import Tree


class SkewedQ(DraftSource):
    """Broken: draws as the wrapped draft does but reports q at four times its temperature. (A draft that
    reports no q at all, one-hot at its proposal, is still exact: given the proposal, the target
    keeps it with probability p(x) and otherwise draws from p without it.)"""

    def __init__(self, inner):
        self.inner = inner

    needs = frozenset()

    def begin(self, prompt):
        self.inner.begin(prompt)

    def draft(self, seq, n, g):
        chain = self.inner.draft(seq, n, g)
        if chain.q is None:   # nothing drafted
            return chain
        flat = chain.q.clamp_min(1e-30).log().div(4).softmax(-1) * (chain.q > 0)
        return Tree.chain(chain.tokens, flat / flat.sum(-1, keepdim=True))

    def observe(self, n, accepted):
        self.inner.observe(n, accepted)

    def __len__(self):
        return len(self.inner)
