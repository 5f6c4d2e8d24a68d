"""Count what a target's forward is fed, round by round (tests/correctness/test_runner_cost.py and
recipes/bench_snapshot_cost.py).

Every token the target is fed passes through spec.hf.step, whatever its runner; the target's
runner (from spec.choose.runs) marks where each verify pass starts. A round's work is its verify
pass plus whatever its rollback feeds before the next one."""

from __future__ import annotations

from spec import choose, hf, speculative_generate


class _Marked:
    """The target's runner, marking in `log` where each verify pass starts."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def __call__(self, ids, keep=0):
        self.log.append("pass")
        return self.inner(ids, keep)

    def crop(self, keep):
        self.inner.crop(keep)

    def __len__(self):
        return len(self.inner)


def fed_per_round(target, draft, prompt, **kwargs):
    """speculative_generate(target, draft, prompt, **kwargs) with the target's feeds counted:
    (result, tokens the target's forward was fed in each round). Probe the target first
    (spec.runner.path_of): the probe's own passes are not the loop's."""
    log: list = []
    real_step, real_runs = hf.step, choose.runs

    def step(model, ids, *args, **kw):
        if model is target:
            log.append(ids.numel())
        return real_step(model, ids, *args, **kw)

    def runs(roles, *args, **kw):
        chosen = real_runs(roles, *args, **kw)
        chosen.runs[0] = _Marked(chosen.runs[0], log)   # the target's runner
        return chosen

    hf.step, choose.runs = step, runs
    try:
        result = speculative_generate(target, draft, prompt, **kwargs)
    finally:
        hf.step, choose.runs = real_step, real_runs
    rounds: list[int] = []
    for entry in log:
        if entry == "pass":
            rounds.append(0)
        elif rounds:
            rounds[-1] += entry
    return result, rounds
