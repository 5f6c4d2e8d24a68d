"""A GGUF file as the draft for a PyTorch target, run by spec's own quantized kernel (spec.cpu.qdraft)
where it can, else by llama.cpp (llama-cpp-python, the `llama` extra): the target's own weights
quantized (SmolLM2's Q4_1 GGUF drafting for its fp32 model) run several times faster than the
target, and the acceptance rule keeps the output exactly the target's whatever the draft's engine,
precision or kernels.

- `LlamaRun`: one llama.cpp context as a Runner (spec.protocols): `run(ids)` feeds ids after the
  positions its KV cache holds and returns the last position's logits; `crop(keep)` removes every
  position from `keep` on from llama.cpp's KV cache, so a round after a rejection feeds only what
  the cache has not seen (nothing is re-evaluated from scratch).
- `GGUFDraft(path, target, tokenizer, engine=...)`: a Drafter driving a spec.draft.ModelDraft over
  one row of a LlamaRun or a spec.cpu.qdraft.QuantRun ("auto": the latter where `spec.cpu.qdraft.unsupported`
  says nothing against it: a Llama of Q4_1/Q8_0 matrices on a CPU with AVX-512 VNNI), so it proposes
  exactly as a PyTorch draft model does: greedy, its argmax; sampling, a draw from its own
  softmax by `pick` (spec.draft.Pick: temperature / top-k / top-p / min-p and spec.processors,
  with pick's torch generator), q over the target's vocabulary. A GGUF whose vocabulary is not
  the target's is refused when it is opened (`check_vocab`).

It is a Drafter that is not a model, so spec.choose uses it as it is. Pass the same sampling
options as `pick` that the run uses (and the run's generator): the output is exact whatever pick
says (q is what the draft drew from), but a draft picking by another rule is accepted less often.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import torch

from spec import batch, hf, llamaguard
from spec.draft import ModelDraft, ModelSource, Pick, shared_prefix
from spec.protocols import Need
from spec.tree import Tree

INSTALL = 'pip install "spec[llama]"'
PREFILLS = ("auto", "own")
FILL_FROM = 64    # the shortest prompt whose keys and values the draft takes from the target's prefill
N_CTX = 4096      # positions a draft may hold: prompt + new tokens + gamma
N_BATCH = 64      # a prompt is fed in blocks of this many; llama.cpp keeps an [n_batch, vocab] float buffer
PROBE_TEXT = "Hello, world! The quick brown fox: 12345 \u00e9t\u00e9\n  def f(x):"


def _llama_class():
    """llama_cpp.Llama, once spec.llamaguard has refused a build known to crash (UnsafeLlamaBuild: e.g.
    llama-cpp-python 0.3.36 built with AMX, which segfaults on a batch of 2+ tokens) before a model loads."""
    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise ImportError(f"a GGUF draft runs in llama.cpp through llama-cpp-python, which is not installed: "
                          f"{INSTALL} ({err})") from None
    llamaguard.check()
    return Llama


class LlamaRun:
    """A Runner over one llama.cpp context (see the module docstring). threads: llama.cpp's CPU
    threads (1 matches a 1-thread target: the two never run at once)."""

    def __init__(self, path, *, threads: int = 1, n_ctx: int = N_CTX, n_batch: int = N_BATCH):
        Llama = _llama_class()
        self.path, self.n_ctx = Path(path), n_ctx
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()

    def __call__(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("ids: nothing to feed (a draft step needs at least one new token)")
        if (keep or len(ids)) != 1:   # llama.cpp computes the last position's logits only (a draft needs no more)
            raise ValueError(f"keep: a llama.cpp draft returns the last position's logits only (keep=1), got {keep} "
                             f"for {len(ids)} ids")
        if len(self) + len(ids) > self.n_ctx:
            raise ValueError(f"the GGUF draft's context holds {self.n_ctx} positions; {len(self)} + {len(ids)} "
                             f"do not fit (GGUFDraft(n_ctx=...))")
        self.llm.eval([int(t) for t in ids.tolist()])
        row = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab,))
        return torch.from_numpy(row.copy())[None]

    def held(self) -> torch.Tensor:
        """The ids its cache holds."""
        return torch.from_numpy(self.llm.input_ids[:len(self)].astype(np.int64))

    def crop(self, keep: int) -> None:
        if keep < self.llm.n_tokens:
            # the positions themselves leave llama.cpp's KV cache; n_tokens is where the next eval writes
            self.llm._ctx.kv_cache_seq_rm(-1, keep, -1)
            self.llm.n_tokens = keep

    def __len__(self) -> int:
        return self.llm.n_tokens

    def close(self) -> None:
        self.llm.close()


ENGINES = ("auto", "native", "llama.cpp")


class GGUFDraft(ModelSource):
    """A GGUF file as the draft for `target` (a Hugging Face causal LM with the same vocabulary).
    tokenizer: the target's, to check the GGUF's tokens against (without one only the sizes are
    compared). pick: how the draft picks (spec.draft.Pick; greedy by default). engine: "native"
    (spec.cpu.qdraft's kernel; ValueError naming why where it cannot run this file here), "llama.cpp", or
    "auto" (native where it can, else llama.cpp). threads: either engine's (spec.cpu.qdraft splits its products
    over them); n_batch: llama.cpp's; n_ctx: the positions
    a draft holds. Refuses a GGUF whose vocabulary does not match with a ValueError.
    A Drafter (spec.protocols) for one sequence; the loop serves it each row through
    spec.batch.EachRow (neither engine's cache can be copied, so a batch of prompts refuses it)."""

    def __init__(self, path, target, tokenizer=None, *, pick: Pick = Pick(), engine: str = "auto", threads: int = 1,
                 n_ctx: int = N_CTX, n_batch: int = N_BATCH, prefill: str = "auto"):
        from spec.cpu import qdraft

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"draft: no GGUF file at {str(path)!r}")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill: one of {', '.join(map(repr, PREFILLS))} expected, got {prefill!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine: one of {', '.join(map(repr, ENGINES))} expected, got {engine!r}")
        run: qdraft.QuantRun | LlamaRun | None = None
        why: str | None = "llama.cpp asked for"
        if engine != "llama.cpp":
            try:
                run, why = qdraft.QuantRun(path, n_ctx=n_ctx, threads=threads), None
            except qdraft.Unsupported as e:
                if engine == "native":
                    raise ValueError(f"engine='native': {path.name}: {e}") from None
                why = str(e)
        # native, or why not (spec.cpu.qdraft.unsupported's reason)
        self.engine_name: str = "native" if why is None else "llama.cpp"
        self.why_not_native: str | None = why
        if run is None:
            run = LlamaRun(path, threads=threads, n_ctx=n_ctx, n_batch=n_batch)
        try:
            if isinstance(run, qdraft.QuantRun):
                check_pieces(run.pieces, run.bos, run.eos, target, tokenizer, path)
            else:
                check_vocab(run.llm, target, tokenizer, path)
        except ValueError:
            run.close()
            raise
        self.run, self.pick = run, pick
        # the draft model's proposals, q and processors exactly as a PyTorch draft's: the one engine
        self.engine = ModelDraft(batch.EachRunner([run]), [pick], [pick.process.prompt_len], width=run.vocab,
                                 rows=run.vocab, clamp=False)
        # a long prompt's keys and values made from the target's own prefill where it has the draft's shape:
        # each layer's input as the target's executor makes it (`_watched`), else through Need.HIDDEN
        self.why_own_prefill = self._fills_from(target, prefill)
        self._watching = None      # (a weak reference to) the target, where its executor is to hand the states
        if self.why_own_prefill is None and isinstance(run, qdraft.QuantRun):
            from spec.cpu import executor
            if executor.plain_expected(target):
                self._watching = weakref.ref(target)
            else:
                self.needs = frozenset({Need.HIDDEN})
                self.layers = tuple(range(run.n_layer))     # every layer's input (hidden_states 0..n_layer-1)

    needs: frozenset = frozenset()
    layers: tuple = (-1,)

    def _held(self, run) -> torch.Tensor:
        return run.held()

    def _fills_from(self, target, prefill: str) -> str | None:
        """Why the draft prefills a long prompt itself (None: it takes the target's prefill, `fill`)."""
        if prefill == "own":
            return "prefill='own'"
        from spec.cpu import qdraft
        if not isinstance(self.run, qdraft.QuantRun):
            return "llama.cpp runs the draft"
        cfg, run = getattr(target, "config", None), self.run
        shape = (getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None))
        if shape != (run.n_layer, run.dim):
            return f"the target's layers and width {shape} are not the draft's {(run.n_layer, run.dim)}"
        return None

    _waiting: torch.Tensor | None = None    # the sequence whose prompt states it waits for (`process`, `_watched`)
    _gave_up = False                         # the states did not come (asked after the first round): prefill
    _cancel = None                           # drops its watch on the target's executor

    def begin(self, prompt: torch.Tensor) -> None:
        self._unwatch()
        self._waiting, self._gave_up = None, False

    def _unwatch(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None

    def _watched(self, T: int):
        """The target's executor's pass of the first T ids of the prompt waited for: each layer's input into
        the draft's cache as the pass makes it (QuantRun.filler)."""
        from spec.cpu import qdraft
        seq, self._waiting, self._cancel = self._waiting, None, None
        return self.run.filler(seq[:T].cpu()) if seq is not None and isinstance(self.run, qdraft.QuantRun) else None

    def draft(self, seq: torch.Tensor, n: int, g: int):
        """A sequence whose prompt the draft holds nothing of, and at least FILL_FROM ids long, gets no
        proposal on its first round: the target's prefill pass then hands the draft each layer's input at
        every prompt position (`process`), from which it makes its cache (QuantRun.fill) at about a tenth
        of its own prefill's cost. Where those states do not come (first asked after the prefill, as a
        FirstOf's second source), it prefills itself. Otherwise as any model draft. Where the target runs on
        spec's executor the states come layer by layer during its pass (Executor.watch), not all at once
        after it."""
        self._unwatch()
        if self._waiting is not None:            # asked again, nothing handed in between
            self._waiting, self._gave_up = None, True
        if (Need.HIDDEN in self.needs or self._watching is not None) and not self._gave_up and \
                n - 1 - shared_prefix(self.run, self.run.held(), seq, n) >= FILL_FROM:
            target = self._watching() if self._watching is not None else None
            watcher = _layer_inputs_from(target) if target is not None else None
            if Need.HIDDEN in self.needs or watcher is not None:
                self.run.crop(0)                 # the whole prompt from the target's states, none of its own
                self._waiting = seq
                if watcher is not None:
                    self._cancel = watcher.watch(seq[:n], self._watched)
                return Tree.chain(seq[n:n])
        return super().draft(seq, n, g)

    def process(self, step) -> None:
        """The target's layer inputs at the positions its pass has made final: on the first round of a
        sequence the draft was waiting for, its prompt's, made into the draft's cache (states that start
        later than the prompt: it prefills itself); later ones it has fed itself."""
        seq, self._waiting = self._waiting, None
        if seq is None:
            return
        from spec.cpu import qdraft
        if isinstance(self.run, qdraft.QuantRun) and len(self.run) == 0 and int(step.positions[0]) == 0:
            self.run.fill(step.hidden, seq[step.positions].cpu())
        else:
            self._gave_up = True

    def __repr__(self) -> str:
        return f"GGUFDraft({self.run.path.name}, {self.engine_name})"

    def close(self) -> None:
        self._unwatch()
        self.run.close()


def _layer_inputs_from(target):
    """The target's spec.cpu.executor Executor, which hands a pass's layer inputs on as it makes them (watch),
    or None (its probe refused it: the draft then prefills itself)."""
    from spec.cpu import executor
    made = executor.executor_for(target)
    return made if isinstance(made, executor.Executor) else None


def _pieces(tokenizer, llm, ids) -> list[tuple[int, str, str]]:
    """(id, the tokenizer's text, llama.cpp's text) where the two differ, among `ids`."""
    bad = []
    for i in ids:
        ours = tokenizer.decode([i])
        if "\ufffd" in ours:   # a byte token: HF shows U+FFFD for a partial character, llama.cpp the byte
            continue
        theirs = llm.detokenize([i], special=True).decode("utf-8", errors="replace")
        if ours != theirs:
            bad.append((i, ours, theirs))
    return bad


def _sizes_and_specials(n: int, bos: int | None, eos: int | None, target, tokenizer, where: str) -> bool:
    """The GGUF's vocabulary size is the target's logit width and its BOS/EOS ids the tokenizer's (ValueError
    naming what differs); False when there is no tokenizer to check the rest against."""
    width = hf.logit_width(target)
    if n != width:
        raise ValueError(f"{where}: its vocabulary has {n} tokens but the target's logits are {width} wide; a GGUF "
                         f"draft must use the target's tokenizer (e.g. a quantized copy of the target)")
    if tokenizer is None:
        return False
    for name, theirs in (("bos", bos), ("eos", eos)):
        ours = getattr(tokenizer, f"{name}_token_id", None)
        if ours is not None and theirs is not None and theirs >= 0 and ours != theirs:
            raise ValueError(f"{where}: its {name.upper()} token is id {theirs}, the target tokenizer's is {ours}: "
                             f"not the target's vocabulary")
    return True


def check_pieces(pieces: list[str], bos: int | None, eos: int | None, target, tokenizer, path: Path) -> None:
    """check_vocab for a GGUF read without llama.cpp: its token strings (`pieces`, as the GGUF stores
    them, which is how the tokenizer's convert_ids_to_tokens writes them) and BOS/EOS ids against the
    target's: every piece is compared, so no probe text is needed. Raises ValueError naming what differs."""
    n, where = len(pieces), f"draft {path.name}"
    if not _sizes_and_specials(n, bos, eos, target, tokenizer, where):
        return
    ours = tokenizer.convert_ids_to_tokens(list(range(min(n, len(tokenizer)))))
    bad = [i for i, (a, b) in enumerate(zip(ours, pieces)) if a is not None and a != b]
    if bad:
        i = bad[0]
        raise ValueError(f"{where}: token {i} is {pieces[i]!r} in the GGUF but {ours[i]!r} in the target's tokenizer "
                         f"({len(bad)} of {len(ours)} ids differ): not the target's vocabulary")


def check_vocab(llm, target, tokenizer, path: Path) -> None:
    """The GGUF's vocabulary is the target's: as many tokens as the target's logits are wide and,
    with the target's tokenizer, the same special ids, the same text for a spread of ids, and the
    same ids for a probe text. Raises ValueError naming what differs."""
    n, where = llm.n_vocab(), f"draft {path.name}"
    if not _sizes_and_specials(n, llm.token_bos(), llm.token_eos(), target, tokenizer, where):
        return
    bad = _pieces(tokenizer, llm, sorted({0, 1, 2, n // 7, n // 5, n // 3, n // 2, 2 * n // 3, n - 1}))
    if bad:
        i, ours, theirs = bad[0]
        raise ValueError(f"{where}: token {i} is {theirs!r} in the GGUF but {ours!r} in the target's tokenizer "
                         f"({len(bad)} of the ids compared differ): not the target's vocabulary")
    ours = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    theirs = llm.tokenize(PROBE_TEXT.encode("utf-8"), add_bos=False, special=False)
    if list(ours) != list(theirs):
        raise ValueError(f"{where}: tokenizes {PROBE_TEXT!r} as {list(theirs)}, the target's tokenizer as "
                         f"{list(ours)}: not the target's tokenizer")
