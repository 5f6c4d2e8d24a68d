"""llama.cpp (through llama-cpp-python, the `llama` extra) as a decoder under test: an engine that
brings its own models (GGUF files), its own non-speculative reference and its own logits.

- `Engine(path)`: one GGUF model, run in a child process (`LocalEngine` there), so that a native crash
  of llama.cpp is a verdict, not a dead test run: when the child dies by a signal, the call raises
  `EngineCrashed` ("engine crashed (SIGSEGV) on a 2-token batch, <model>, <CPU features>") and a
  standalone reproduction script (llama_cpp and the standard library: the model, the ids, the call) is
  written and named. `greedy` is the engine's own plain greedy decoding (the reference the
  speculative runs are compared with, token for token); `speculative` is llama-cpp-python's
  speculative decoding (`Llama(draft_model=...)`) with prompt lookup (`LlamaPromptLookupDecoding`)
  or a draft model (`LlamaCppModelDraft`: a second GGUF run greedily, gamma tokens a round). Every model is
  opened after spec.llamaguard's check of the build (a known-crashing one is refused with the fix).
- `noise`: the engine's own numerical noise, the largest difference between the logits of one
  position computed in a one-token pass and in a multi-token pass (the pass shapes speculative
  decoding uses), measured per model file (so per quantization and dtype).
- `diagnose`: the first divergence from the engine's greedy output, as a tie (the greedy top-2 gap
  there is within the measured noise) or a bug, and which of the engine's own pass shapes (a block
  of 1 to gamma+1 tokens ending there) gives the token the speculative run emitted.
- `sample` and `sampler_law`: the engine's own sampling (plain or speculative, seeded) and the law
  its sampler chain draws from, computed from the engine's own logits, so that the sampling law is
  checked against llama.cpp's numbers and its semantics, not PyTorch's.
- `dequantized_gguf`: the same weights at higher precision, written with the `gguf` package: every
  tensor of a quantized GGUF dequantized to f32 (or f16, norms kept f32), the metadata copied. These
  are exactly the weights `spec.realmodel` dequantizes for transformers, so the engine's f32 run
  and PyTorch's fp32 run are of the same numbers.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from spec import llamaguard
from spec.conformance.endpoint import Counters
from spec.conformance.subject import Crashed

PIN = "0.3.36"   # the llama-cpp-python version the findings in docs/CONFORMANCE.md were measured with


def available() -> str | None:
    """None when llama-cpp-python can be imported, else why not (for skips)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return f"llama-cpp-python is not installed (pip install 'spec[llama]'): {err}"
    return None


def dequantized_gguf(src: Path, dst: Path, dtype: str = "f32") -> Path:
    """Write `src` (any GGUF llama.cpp reads) with every tensor dequantized to `dtype` ("f32" or
    "f16"; 1-D tensors, the norms, stay f32 as llama.cpp's converter keeps them)."""
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = Path(dst).with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if dtype == "f16" and data.ndim > 1:
            data = data.astype(np.float16)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return Path(dst)


def _llama():
    """llama_cpp.Llama, after spec.llamaguard refused a build known to crash (before any model loads)."""
    from llama_cpp import Llama

    llamaguard.check()
    return Llama


class LlamaCppModelDraft:
    """A llama-cpp-python draft model: a second GGUF model proposes `gamma` greedy tokens a round
    (its KV cache reused across rounds through llama-cpp-python's prefix matching)."""

    def __init__(self, path: Path, gamma: int, threads: int = 1, n_ctx: int = 1024):
        Llama = _llama()
        self.gamma = gamma
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)

    def __call__(self, input_ids, /, **kwargs):
        out = []
        for token in self.llm.generate(list(int(t) for t in input_ids), top_k=1, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(token)
            if len(out) == self.gamma:
                break
        return np.array(out, dtype=np.intc)


def _model_draft_class():
    """LlamaCppModelDraft as a LlamaDraftModel (made here: llama_cpp is an optional import)."""
    from llama_cpp.llama_speculative import LlamaDraftModel
    return type("LlamaCppModelDraft", (LlamaCppModelDraft, LlamaDraftModel), {})


GREEDY = dict(top_k=1, temp=0.0)


class _Counting:
    """A llama-cpp-python draft model that tells its engine what it proposed (LocalEngine counts rounds)."""

    def __init__(self, drafter, engine):
        self.drafter, self.engine = drafter, engine

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def __call__(self, input_ids, /, **kwargs):
        drafted = self.drafter(input_ids, **kwargs)
        self.engine._propose(input_ids, drafted)
        return drafted


def sampler_law(logits: np.ndarray, temp: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The distribution llama.cpp's sampler chain draws from, on one row of the engine's own logits, in
    float64. The chain as llama-cpp-python 0.3.36 builds it (`Llama._init_sampler`): top-k (k <= 0: off),
    typical (off at 1), top-p, min-p, temperature, then the draw. So, unlike HF, top-p and min-p act on
    the distribution at temperature 1, before the temperature; top-p keeps the smallest prefix of the
    sorted tokens whose mass (renormalised over what top-k kept) reaches top_p; min-p keeps the tokens
    at least min_p times as likely as the most likely one."""
    z = np.asarray(logits, dtype=np.float64)
    kept = np.argsort(-z, kind="stable")
    if 0 < top_k < len(z):
        kept = kept[:top_k]
    if top_p < 1.0:
        p = np.exp(z[kept] - z[kept[0]])
        cum = np.cumsum(p / p.sum())
        kept = kept[:int(np.searchsorted(cum, top_p)) + 1]
    if min_p > 0.0:
        kept = kept[z[kept] >= z[kept[0]] + np.log(min_p)]
    w = np.exp((z[kept] - z[kept[0]]) / temp)
    out = np.zeros(len(z))
    out[kept] = w / w.sum()
    return out


class LocalEngine:
    """One GGUF model in llama.cpp at `threads` threads, in this process (`Engine` runs one in a child
    process: a native crash here takes the process with it). greedy, speculative and sample return the
    tokens; Engine times them."""

    def __init__(self, path, threads: int = 1, n_ctx: int = 1024):
        Llama = _llama()

        self.path, self.threads, self.n_ctx = Path(path), threads, n_ctx
        common = dict(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.plain = Llama(**common)                      # the engine's normal configuration
        self.scorer = Llama(**common, logits_all=True)    # every position's logits
        self._common = common
        self._noise: dict = {}
        self._counts = Counters(0, 0, 0, {})   # what the speculative runs drafted and had accepted
        self._proposals: list | None = None    # during a speculative run: (new-token index, drafted ids)

    def close(self):
        """Free the llama.cpp models now (at interpreter exit llama_cpp may already be gone)."""
        spec = getattr(self, "_spec", None)
        for llm in (self.plain, self.scorer, spec, getattr(getattr(spec, "draft_model", None), "llm", None)):
            if llm is not None:
                llm.close()
        self._spec = None

    def tokenize(self, text: str) -> list[int]:
        return self.plain.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def _run(self, llm, prompt, n, sampler=GREEDY) -> list[int]:
        llm.reset()
        out = []
        self._proposals = [] if llm is not self.plain else None
        self._prompt_len = len(prompt)
        for token in llm.generate(list(prompt), **sampler, typical_p=1.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        if self._proposals is not None:
            self._count(self._proposals, out)
        self._proposals = None
        return out

    def _propose(self, input_ids, drafted) -> None:
        """The drafter's call during a speculative run: what it proposed after how many new tokens."""
        if self._proposals is not None and len(drafted):
            self._proposals.append((len(input_ids) - self._prompt_len, [int(t) for t in drafted]))

    def _count(self, proposals, out) -> None:
        """A round per proposal that the run verified: a proposal is accepted while it equals the tokens
        emitted there (llama-cpp-python keeps a draft while it equals the target's token or draw)."""
        c = self._counts
        for start, drafted in proposals:
            if start >= len(out):
                continue
            kept = 0
            for token, emitted in zip(drafted, out[start:]):
                if token != emitted:
                    break
                kept += 1
            c.drafts += 1
            c.draft_tokens += len(drafted)
            c.accepted += kept
            for j in range(kept):
                c.per_position[j] = c.per_position.get(j, 0) + 1

    def counters(self) -> Counters:
        """What the speculative runs drafted and had accepted so far (spec.conformance.endpoint.Counters)."""
        return Counters(self._counts.drafts, self._counts.draft_tokens, self._counts.accepted,
                        dict(sorted(self._counts.per_position.items())))

    def greedy(self, prompt, n: int) -> list[int]:
        """The engine's own plain greedy decoding: n new tokens."""
        return self._run(self.plain, prompt, n)

    def speculative(self, prompt, n: int, *, draft: str = "prompt-lookup", gamma: int,
                    draft_path=None) -> list[int]:
        """llama-cpp-python's speculative greedy decoding: prompt lookup (max n-gram 3, `gamma`
        tokens) or a draft model (`draft_path`, default the target's own file)."""
        return self._run(self._speculative(draft, gamma, draft_path), prompt, n)

    def _speculative(self, draft, gamma, draft_path):
        """The Llama with `draft_model` set (one at a time: rebuilt when the drafter changes)."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        key = (draft, gamma, str(draft_path))
        if getattr(self, "_spec_key", None) != key:
            drafter = (LlamaPromptLookupDecoding(num_pred_tokens=gamma, max_ngram_size=3) if draft == "prompt-lookup"
                       else _model_draft_class()(draft_path or self.path, gamma, self.threads, self.n_ctx))
            self._spec, self._spec_key = _llama()(**self._common, draft_model=_Counting(drafter, self)), key
        return self._spec

    def sample(self, prompt, n: int, *, seed: int, sampler: dict, draft: str | None = None, gamma: int | None = None,
               draft_path=None) -> list[int]:
        """n tokens sampled by the engine's own sampler chain (`sampler`: temp, top_k, top_p, min_p, as
        llama-cpp-python takes them), seeded with `seed`: plain decoding (draft None) or speculative
        ("prompt-lookup" or "draft-model", as in `speculative`). llama-cpp-python draws every position
        from its own row of the target's logits and keeps a draft while it equals the draw."""
        llm = self.plain if draft is None else self._speculative(draft, gamma, draft_path)
        llm.set_seed(seed)   # its dist sampler is made from this seed at each generate()
        return self._run(llm, prompt, n, sampler)

    def logits(self, tokens, block: int | None = None) -> np.ndarray:
        """Logits of every position of `tokens` [len, V]: one token a pass (block None), or the
        first token alone then passes of `block` tokens."""
        llm = self.scorer
        llm.reset()
        tokens = list(tokens)
        width = 1 if block is None else block
        llm.eval(tokens[:1])
        for i in range(1, len(tokens), width):
            llm.eval(tokens[i:i + width])
        return np.array(llm.scores[:len(tokens)], dtype=np.float64)

    def noise(self, sequences, widths=(2, 4, 9)) -> float:
        """max |one-token logits - block logits| over the sequences and block widths."""
        key = (tuple(tuple(s) for s in sequences), tuple(widths))
        if key not in self._noise:
            worst = 0.0
            for seq in sequences:
                step = self.logits(seq)
                for w in widths:
                    worst = max(worst, float(np.abs(self.logits(seq, w) - step).max()))
            self._noise[key] = worst
        return self._noise[key]

    def top2(self, context) -> tuple[float, frozenset[int]]:
        """The engine's greedy top-2 logit gap after `context` (one-token passes) and those two ids."""
        row = self.logits(context)[-1]
        best = np.argsort(-row, kind="stable")[:2]
        return float(row[best[0]] - row[best[1]]), frozenset(int(t) for t in best)

    def replay(self, context, token: int, gamma: int) -> list[int]:
        """The block widths (1..gamma+1, a block ending at the last position of `context`, as the
        engine's verify passes run) whose last row's argmax is `token`."""
        widths = []
        for width in range(1, gamma + 2):
            if width >= len(context):
                break
            self.scorer.reset()
            self.scorer.eval(context[:-width])
            self.scorer.eval(context[-width:])
            if int(np.argmax(self.scorer.scores[len(context) - 1])) == token:
                widths.append(width)
        return widths


# --- the engine in a child process: a native crash is a verdict --------------------------------------

LOCAL = "spec.conformance.llamacpp:LocalEngine"
_HEADER = struct.Struct("<I")   # a breadcrumb: its byte length, a JSON line, the held ids and the batch (int32)


class EngineCrashed(Crashed):
    """The engine's child process died (a signal, e.g. SIGSEGV inside llama_decode, or an exit)
    during a call: the message is the verdict; `script` reproduces it with llama_cpp alone."""

    def __init__(self, verdict: str, signal_name: str, script: Path | None):
        super().__init__(verdict)
        self.signal_name, self.script = signal_name, script

    def __reduce__(self):
        return type(self), (str(self), self.signal_name, self.script)


class _Breadcrumbs:
    """In the child: before every Llama.eval, what it is about to feed (the model, the context's
    settings, the ids it holds and the batch), written over the same bytes of an inherited file, so
    that the parent can read the last one after a crash. A few microseconds an eval."""

    def __init__(self, fd: int):
        self.fd, self.call = fd, 0

    def install(self, Llama) -> None:
        real, crumbs = Llama.eval, self

        def eval(llm, tokens):
            crumbs.write(llm, tokens)
            return real(llm, tokens)
        Llama.eval = eval

    def write(self, llm, tokens) -> None:
        held = np.asarray(llm.input_ids[:llm.n_tokens], dtype="<i4")
        batch = np.asarray(list(tokens), dtype="<i4")
        params = llm.context_params
        head = json.dumps({"call": self.call, "model": llm.model_path, "n_ctx": int(params.n_ctx),
                           "n_batch": int(llm.n_batch), "n_threads": int(params.n_threads),
                           "n_threads_batch": int(params.n_threads_batch), "logits_all": bool(llm._logits_all),
                           "held": len(held), "batch": len(batch)}).encode() + b"\n"
        body = head + held.tobytes() + batch.tobytes()
        os.pwrite(self.fd, _HEADER.pack(len(body)) + body, 0)


def _read_breadcrumb(fd: int) -> dict | None:
    size = os.pread(fd, _HEADER.size, 0)
    if len(size) < _HEADER.size:
        return None
    body = os.pread(fd, _HEADER.unpack(size)[0], _HEADER.size)
    head, _, ids = body.partition(b"\n")
    crumb = json.loads(head)
    ids = np.frombuffer(ids, dtype="<i4").tolist()
    crumb["held_ids"], crumb["batch_ids"] = ids[:crumb["held"]], ids[crumb["held"]:]
    return crumb


def _child(argv: list[str]) -> None:
    """The child's loop: `make` (module:callable) builds the engine from (path, threads, n_ctx); each
    request (method, positional values, keyword values) is answered ("ok", result) or ("error",
    exception, traceback). Before anything else it says ("hello", llama-cpp-python's version, its
    system info), for the verdict if the model load itself crashes."""
    import faulthandler
    import importlib

    make, path, threads, n_ctx, rfd, wfd, crumb_fd = argv
    faulthandler.enable()   # a native crash prints the Python stack to stderr, then dies by its signal
    requests, answers = Connection(int(rfd), writable=False), Connection(int(wfd), readable=False)
    import llama_cpp
    answers.send(("hello", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode(errors="replace")))
    crumbs = _Breadcrumbs(int(crumb_fd))
    crumbs.install(llama_cpp.Llama)
    module, _, name = make.partition(":")
    try:
        engine = getattr(importlib.import_module(module), name)(path, int(threads), int(n_ctx))
        answers.send(("ok", None))
    except Exception as err:
        _answer_error(answers, err)
        return
    while True:
        try:
            method, values, kwargs = requests.recv()
        except EOFError:   # the parent is gone
            return
        crumbs.call += 1
        try:
            answers.send(("ok", getattr(engine, method)(*values, **kwargs)))
        except Exception as err:
            _answer_error(answers, err)
        if method == "close":
            return


def _answer_error(answers: Connection, err: Exception) -> None:
    tb = traceback.format_exc()
    try:
        pickle.dumps(err)
    except Exception:
        err = RuntimeError(f"{type(err).__name__}: {err}")
    answers.send(("error", err, tb))


class ChildTraceback(Exception):
    """The engine child's traceback, chained to the exception a call re-raises here."""


class Engine:
    """One GGUF model in llama.cpp at `threads` threads, in a child process (its methods are
    LocalEngine's, run there; greedy and speculative return (tokens, seconds), timed here). A child
    that dies during a call raises EngineCrashed with the verdict and writes a reproduction script to
    `crash_dir` (default: spec-llama-crashes in the temp folder); the next call starts a new child.
    make: "module:callable" building the child's engine from (path, threads, n_ctx) (tests inject
    a crashing one)."""

    def __init__(self, path, threads: int = 1, n_ctx: int = 1024, *, make: str = LOCAL, crash_dir=None):
        self.path, self.threads, self.n_ctx, self.make = Path(path), threads, n_ctx, make
        self.crash_dir = Path(crash_dir) if crash_dir else Path(tempfile.gettempdir()) / "spec-llama-crashes"
        self._proc = None
        self.version, self.system_info = "?", ""
        self._one_call = threading.Lock()   # one request and its answer on the pipes at a time, whatever thread asks
        self._start()

    # -- the child --
    def _start(self) -> None:
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        self._crumbs = tempfile.TemporaryFile()
        self._stderr = tempfile.TemporaryFile()
        fds = (req_r, ans_w, self._crumbs.fileno())
        code = "import sys; from spec.conformance.llamacpp import _child; _child(sys.argv[1:])"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen([sys.executable, "-c", code, self.make, str(self.path), str(self.threads),
                                       str(self.n_ctx), *map(str, fds)], pass_fds=fds, env=env,
                                      stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr)
        os.close(req_r)
        os.close(ans_w)
        self._requests, self._answers = Connection(req_w, readable=False), Connection(ans_r, writable=False)
        self._call_no, self._call = 0, "Engine() (loading the model)"
        _, self.version, self.system_info = self._receive()
        answer = self._receive()
        if answer[0] != "ok":   # refused (spec.llamaguard) or failed to load: the child has returned
            self._proc.wait()
            self._proc = None
            for handle in (self._requests, self._answers, self._crumbs, self._stderr):
                handle.close()
        self._result(answer)

    def _receive(self):
        try:
            return self._answers.recv()
        except (EOFError, OSError):
            raise self._crashed() from None

    def _result(self, answer):
        if answer[0] == "ok":
            return answer[1]
        _, err, tb = answer
        raise err from ChildTraceback(f"in the engine's child process:\n{tb}")

    def _invoke(self, method: str, *values, **kwargs):
        """`method` called in the child; callers in several threads take turns (the child serves one call at
        a time, and two requests interleaved on its pipes would read each other's answers)."""
        with self._one_call:
            return self._invoke_alone(method, *values, **kwargs)

    def _invoke_alone(self, method: str, *values, **kwargs):
        if self._proc is None:
            self._start()
        self._call_no += 1
        self._call = f"Engine.{method}"
        try:
            self._requests.send((method, values, kwargs))
        except (BrokenPipeError, OSError):
            raise self._crashed() from None
        return self._result(self._receive())

    def _crashed(self) -> EngineCrashed:
        """The verdict for a child that died: its signal, the batch it was feeding, the model, the CPU
        features; a reproduction script; the child is reaped and the next call starts another."""
        rc = self._proc.wait()
        self._proc = None
        for conn in (self._requests, self._answers):
            conn.close()
        name = signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else f"exit status {rc}"
        crumb = _read_breadcrumb(self._crumbs.fileno())
        if crumb is not None and crumb["call"] != self._call_no:
            crumb = None   # the last eval was an earlier call's: this one died before feeding anything
        self._stderr.seek(0)
        log = self._stderr.read().decode(errors="replace").strip().splitlines()
        self._crumbs.close()
        self._stderr.close()
        features = " ".join(k for k, v in llamaguard.features(self.system_info).items() if v == "1") or "unknown"
        build = f"llama-cpp-python {self.version}, system info: {features}"
        if crumb is None:
            return EngineCrashed(f"engine crashed ({name}) in {self._call}, {self.path.name}, {build}"
                                 + (f"; its last output: {' | '.join(log[-3:])}" if log else ""), name, None)
        n, held = crumb["batch"], crumb["held"]
        where = (f"on a {n}-token batch" if n <= crumb["n_batch"] else f"on an eval of {n} tokens in batches of "
                 f"{crumb['n_batch']}") + f" after {held} cached positions"
        script = self._reproduction(crumb, f"{name} {where}")
        return EngineCrashed(f"engine crashed ({name}) {where}, {self.path.name}, {build} (in {self._call}); "
                             f"reproduction: python {script}", name, script)

    def _reproduction(self, crumb: dict, what: str) -> Path:
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        name = f"crash-{Path(crumb['model']).stem}-{crumb['batch']}tok-{os.getpid()}-{self._call_no}.py"
        script = self.crash_dir / name
        script.write_text(REPRODUCTION.format(
            what=what, version=self.version, info=self.system_info.strip(), model=crumb["model"],
            kwargs=", ".join(f"{k}={crumb[k]!r}" for k in ("n_ctx", "n_batch", "n_threads", "n_threads_batch",
                                                            "logits_all")),
            held=crumb["held_ids"], batch=crumb["batch_ids"]))
        return script

    # -- LocalEngine's methods, run in the child --
    def _timed(self, method: str, *values, **kwargs) -> tuple[list[int], float]:
        from spec import clock
        if self._proc is None:   # a new child after a crash starts outside the timing
            self._start()
        return clock.timed(lambda: self._invoke(method, *values, **kwargs))

    def greedy(self, prompt, n: int) -> tuple[list[int], float]:
        """The engine's own plain greedy decoding: n new tokens and the seconds it took."""
        return self._timed("greedy", list(prompt), n)

    def speculative(self, prompt, n: int, *, draft: str = "prompt-lookup", gamma: int,
                    draft_path=None) -> tuple[list[int], float]:
        """llama-cpp-python's speculative greedy decoding (LocalEngine.speculative) and the seconds it took."""
        return self._timed("speculative", list(prompt), n, draft=draft, gamma=gamma,
                           draft_path=None if draft_path is None else str(draft_path))

    def sample(self, prompt, n: int, *, seed: int, sampler: dict, draft: str | None = None, gamma: int | None = None,
               draft_path=None) -> list[int]:
        """LocalEngine.sample: n tokens from the engine's own sampler chain, seeded."""
        return self._invoke("sample", list(prompt), n, seed=seed, sampler=sampler, draft=draft, gamma=gamma,
                            draft_path=None if draft_path is None else str(draft_path))

    def tokenize(self, text: str) -> list[int]:
        return self._invoke("tokenize", text)

    def logits(self, tokens, block: int | None = None) -> np.ndarray:
        """LocalEngine.logits: every position's logits [len, V], one-token passes or blocks."""
        return self._invoke("logits", list(tokens), block)

    def noise(self, sequences, widths=(2, 4, 9)) -> float:
        """LocalEngine.noise: max |one-token logits - block logits| (cached in the child)."""
        return self._invoke("noise", [list(s) for s in sequences], tuple(widths))

    def top2(self, context) -> tuple[float, frozenset[int]]:
        """LocalEngine.top2: the greedy top-2 logit gap after `context` and those ids."""
        return self._invoke("top2", list(context))

    def replay(self, context, token: int, gamma: int) -> list[int]:
        """LocalEngine.replay: the block widths whose last row gives `token`."""
        return self._invoke("replay", list(context), int(token), int(gamma))

    def counters(self) -> Counters:
        """LocalEngine.counters: drafted and accepted so far (a restarted child counts from 0)."""
        return self._invoke("counters")

    def close(self) -> None:
        """Free the models and end the child (a crashed one is already gone)."""
        if self._proc is None:
            return
        try:
            self._invoke("close")
        except EngineCrashed:
            return
        self._proc.wait(timeout=60)
        self._proc = None
        for handle in (self._requests, self._answers, self._crumbs, self._stderr):
            handle.close()


REPRODUCTION = '''"""Reproduces a llama.cpp crash the spec conformance kit saw: {what}.
llama-cpp-python {version}; llama_print_system_info: {info}
Needs only llama_cpp (pip install llama-cpp-python=={version}). Prints "ok" if it does not crash."""
import llama_cpp
from llama_cpp import Llama

MODEL = {model!r}
HELD = {held!r}     # what the context held before the crashing call
BATCH = {batch!r}   # the crashing eval

print("llama-cpp-python", llama_cpp.__version__, llama_cpp.llama_print_system_info().decode(), flush=True)
llm = Llama(model_path=MODEL, {kwargs}, verbose=False)
for token in HELD:   # one token a pass (single-row batches), as the context may have been filled
    llm.eval([token])
print(f"evaluating {{len(BATCH)}} tokens after {{len(HELD)}}", flush=True)
llm.eval(BATCH)
print("ok")
'''


# --- the kit's llama.cpp subject, models and sampling law (spec/conformance/test_endpoint.py, test_engine.py) --

_ENGINES: dict = {}
THREADS = 1
# token-id prompts for the kit's tiny Llama GGUF (a stand-in vocabulary: no text to tokenize)
TINY_PROMPTS = [[5, 9, 90, 260, 260, 5, 9, 90], [3, 141, 59, 26], [7] * 6, [300, 12, 7, 7, 100, 300, 12],
                [5, 9, 90, 260, 260, 260, 260, 260, 5, 9, 90, 260]]


def shared_engine(path) -> "Engine":
    """One Engine per model file for the kit's properties (closed by close_engines)."""
    key = str(path)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(key, threads=THREADS)
    return _ENGINES[key]


def close_engines() -> None:
    """Free llama.cpp's models now, while llama_cpp is still importable (not at exit)."""
    for e in list(_ENGINES.values()):
        e.close()
    _ENGINES.clear()


@functools.cache
def tiny_gguf(which: str) -> str:
    """The kit's seeded Llama ("target", or its 10%-noise copy "partial") as an f32 GGUF in a scratch folder."""
    import copy

    from spec.conformance import kit
    model = copy.deepcopy(kit.zoo("llama")[which]).float()
    folder = Path(tempfile.mkdtemp(prefix="spec-kit-gguf-"))
    return str(llama_gguf(model, folder / f"llama-{which}.gguf"))


SUBJECT_GAMMA = 4    # the kit's llama.cpp Subject: a draft model proposes 4 tokens a round


def kit_subject(impl):
    """`--impl llama-cpp` as a Subject (spec/conformance/subject.py): llama-cpp-python's speculative decoding
    with a draft model (gamma 4) against its own plain decoding, on the kit's tiny Llama GGUF (the draft its
    10%-noise copy; the prompts TINY_PROMPTS) or on the --model file (its own draft; the seed prompts)."""
    from spec.conformance.subject import engine_subject
    from spec.prompts import SEED_PROMPTS
    if impl.model:
        engine = shared_engine(impl.model)
        draft, prompts = impl.model, [engine.tokenize(text) for text in SEED_PROMPTS]
    else:
        engine, draft, prompts = shared_engine(tiny_gguf("target")), tiny_gguf("partial"), TINY_PROMPTS
    subject = engine_subject(engine, impl.name, drafter="draft-model", gamma=SUBJECT_GAMMA, draft_path=draft,
                             seed_prompts=prompts, caps=impl)
    subject.closers.append(close_engines)
    return subject


SAMPLERS = {   # llama-cpp-python's names. The second: all three filters, where their order matters: at T=0.6
    # HF's order (the temperature first) keeps 40 three-token sequences, llama.cpp's 83
    "temp=0.7,top_k=3": dict(temp=0.7, top_k=3, top_p=1.0, min_p=0.0),
    "temp=0.6,top_k=8,top_p=0.6,min_p=0.2": dict(temp=0.6, top_k=8, top_p=0.6, min_p=0.2),
}
# 5, 9 and the tiny target's greedy continuation, then the start again: prompt lookup proposes 260, 260,
# which the target draws first 40% (T=0.7) and 25% of the time, so drafts are accepted and rejected
LAW_PROMPT = (5, 9, 90, 260, 260, 260, 260, 260, 5, 9, 90, 260)
LAW_GAMMA, LAW_JOINT = 2, 3          # as sampling_law: drafts, then the bonus or the draw after a mismatch


def engine_law(e, sampler: dict, temperature_first: bool = False) -> dict:
    """{first LAW_JOINT tokens: probability} under llama.cpp's sampler chain on engine `e`'s own
    logits (one-token passes), every sequence of nonzero probability enumerated.
    temperature_first: HF's order instead (the temperature before top-p and min-p), for the control."""
    law = {}

    def extend(seq: tuple, prob: float):
        if len(seq) == LAW_JOINT:
            law[seq] = prob
            return
        row = e.logits(list(LAW_PROMPT + seq))[-1]
        if temperature_first:
            p = sampler_law(row / sampler["temp"], **dict(sampler, temp=1.0))
        else:
            p = sampler_law(row, **sampler)
        for t in p.nonzero()[0]:
            extend(seq + (int(t),), prob * float(p[t]))
    extend((), 1.0)
    return law


@functools.cache
def tiny_law(sampler: str, temperature_first: bool = False) -> dict:
    return engine_law(shared_engine(tiny_gguf("target")), SAMPLERS[sampler], temperature_first)


def law_seeds(n: int, seed: int) -> list[int]:
    """n seeds for the engine's sampler, drawn from `seed`."""
    import torch
    return torch.randint(0, 2 ** 31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sampling_law_fit(e, n: int, sampler: str, drafter: str, draft_path):
    """The engine's speculative samples (LAW_JOINT tokens after LAW_PROMPT, gamma LAW_GAMMA, n seeds) against
    the law of its own sampler chain on its own logits, by the one sampling-law check (checks.sampling_law)
    on its Subject: (fit, table, how many equal its plain samples with the same seed)."""
    from spec.conformance import checks
    from spec.conformance.subject import engine_subject
    subject = engine_subject(e, "llama-cpp", drafter=drafter, gamma=LAW_GAMMA, draft_path=draft_path)
    chain = dict(SAMPLERS[sampler])
    request = dict(temperature=chain.pop("temp"), options=chain)
    seeds = law_seeds(n, 1234)
    fitted = checks.sampling_law(subject, LAW_PROMPT, tiny_law(sampler), seeds, depth=LAW_JOINT, **request)
    plain = [tuple(subject.reference.complete(list(LAW_PROMPT), LAW_JOINT, seed=s, **request).ids) for s in seeds]
    return fitted.fit, fitted.worst(), sum(a == b for a, b in zip(fitted.samples, plain))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows to llama.cpp's interleaved rope layout (its converter's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tied(model) -> bool:
    """Whether `model`'s output layer is its input embedding (one tensor, as a tied checkpoint holds it)."""
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and emb is not None and out.weight is emb.weight


def llama_gguf(model, dst: Path, quantized: bool = False) -> Path:
    """Write a Hugging Face LlamaForCausalLM (e.g. a tiny seeded one) as an f32 GGUF llama.cpp runs,
    or with `quantized` as llama.cpp's Q4_1 export lays one out (the layers' matrices Q4_1, the
    embedding and output Q8_0, the norms f32; a tied output is the embedding, not written again). Its
    vocabulary is a stand-in (token i is the string "<i>", no merges): the kit feeds token ids."""
    import gguf

    def matrix(name: str, a: np.ndarray, kind=gguf.GGMLQuantizationType.Q4_1) -> None:
        if not quantized:
            w.add_tensor(name, a)
            return
        data = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    cfg = model.config
    vocab = cfg.vocab_size
    tmp = Path(dst).with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(vocab)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1 if quantized else gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(vocab)])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * vocab)
    w.add_token_merges(["< 0"])   # llama.cpp wants a non-empty merge list; the kit never tokenizes text
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    matrix("token_embd.weight", sd["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[pre + theirs + ".weight"])
        for ours, theirs in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            matrix(f"blk.{i}.{ours}.weight", sd[pre + theirs + ".weight"])
        matrix(f"blk.{i}.attn_q.weight", _permute(sd[pre + "self_attn.q_proj.weight"], heads))
        matrix(f"blk.{i}.attn_k.weight", _permute(sd[pre + "self_attn.k_proj.weight"], kv_heads))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not _tied(model):        # (tied: llama.cpp's converter writes no output, and llama.cpp reads token_embd)
        matrix("output.weight", sd["lm_head.weight"], gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return Path(dst)
