"""The engine: opens a pyinfer GGUF, owns model, tokenizer and KV cache, and yields token ids.

Deals in token ids only (nanochat ``Engine.generate``); text belongs to the callers (CLI, REPL,
Python API). Keeps the evaluated tokens so a follow-up prompt that shares a prefix with them
(the next turn of a chat) evaluates only its new tokens.
"""
from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import gguf
import numpy as np

from pyinfer import constants as C
from pyinfer import llamacpp
from pyinfer.config import ModelConfig, read_field
from pyinfer.errors import PyinferError
from pyinfer.ffn import DenseFFN, Predictor, SparseFFN
from pyinfer.gguf_check import check_gguf
from pyinfer.gguf_reader import GGUFReader
from pyinfer.hybrid import place_model
from pyinfer.input_sparse import InputSparseFFN, head_from_reader, thresholds_from_reader
from pyinfer.ops import cpu
from pyinfer.sampler import SamplingParams, sample
from pyinfer.threads import ThreadGovernor
from pyinfer.tokenizer import Tokenizer
from pyinfer.weights import ModelWeights

DEFAULT_N_CTX = 4096
#: a prompt is evaluated in batches of at most this many tokens (llama.cpp's n_ubatch 512):
#: activation memory bounded whatever the prompt's length, and a point between two batches
#: where ``Engine.prompt_progress`` reports
PROMPT_BATCH = 512
#: llama.cpp's default DRY sequence breakers (common/common.h dry_sequence_breakers), as bytes
DRY_BREAKERS = (b"\n", b":", b'"', b"*")


def check_readable_file(path: str) -> None:
    """Raise PyinferError for a FIFO or a socket (opening one waits for a writer for ever) and
    for a file this process may not read; a missing path or a directory is the caller's to say."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise PyinferError(f"{path} is a pipe or a socket, not a GGUF file")
    if stat.S_ISREG(mode) and not os.access(path, os.R_OK):
        raise PyinferError(f"cannot read {path}: permission denied")


def open_gguf(path: str) -> gguf.GGUFReader:
    """Memory-map a GGUF file read-only. Raises PyinferError for a missing, non-GGUF, truncated
    or malformed file: ``pyinfer.gguf_check`` bounds every count, length and offset first, so
    gguf's reader never loops over a hostile count (gguf's own exception text, if it still
    raises, is kept after the colon)."""
    if not os.path.exists(path):
        raise PyinferError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise PyinferError(f"{path} is a directory, not a GGUF file")
    check_readable_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise PyinferError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise PyinferError(f"{path} is not a GGUF file (bad magic {magic!r})")
    check_gguf(path)
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError/IndexError/... on a damaged file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PyinferError(f"{path} is not a valid GGUF file (truncated or damaged): {msg}") from None


@dataclass
class Timings:
    """Milliseconds and token counts, as llama.cpp's perf summary reports them."""

    load_ms: float = 0.0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    eval_n: int = 0
    eval_ms: float = 0.0
    sample_ms: float = 0.0
    sample_n: int = 0  # tokens drawn (the stop token included)
    n_threads: int = 1  # -t: the most threads a forward pass may use
    passes: int = 0  # forward passes (a prompt, or one token)
    passes_reduced: int = 0  # of them, run on fewer threads: other processes held CPUs

    def reset(self):
        self.prompt_n = self.eval_n = 0
        self.prompt_ms = self.eval_ms = self.sample_ms = 0.0
        self.sample_n = 0
        self.passes = self.passes_reduced = 0


def prompt_batches(n: int, size: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of the batches a prompt of n new tokens is evaluated in: ``size``
    (default ``PROMPT_BATCH``, llama.cpp's n_ubatch) tokens each, the last one the rest, except
    that a last batch of one token takes a second from the batch before it (a one-token forward
    is a decode step: ``Engine.eval_prompt``). n = 1 is one batch of one."""
    size = PROMPT_BATCH if size is None else size
    if size < 3:  # (the batch before a lone last token keeps two or more)
        raise ValueError(f"prompt batches of {size} tokens: at least 3")
    bounds = list(range(0, n, size)) + [n]
    if n > 1 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return list(zip(bounds[:-1], bounds[1:]))


class Engine:
    """A loaded model ready to generate.

    Args:
        model_path: a GGUF written by ``pyinfer-convert``, or a llama.cpp GGUF of architecture
            llama, qwen2 or qwen3, run dense on the CPU (``pyinfer.llamacpp``).
        n_ctx: context size in tokens (default min(4096, the model's training context)).
        n_threads: kernel threads (default: the physical cores, ``cpu.default_n_threads``).
        dense: compute every FFN neuron even when the file has predictors (for comparison).
        device: "cpu" (default: the offline stage and tests get the CPU reference unless they
            ask), "auto" (the GPU when CuPy sees one, else the CPU with a notice), "cuda", or
            None: "auto" without the notice (what generation through LLM / the CLIs uses).
        vram_budget: GiB of device memory to use (default: free memory minus a margin).
        reset_gpu_index: re-solve the hot-neuron split from the stored activation counts.
        disable_gpu_index: ignore the stored split; offload whole layers instead.
        n_gpu_layers: llama.cpp -ngl: the first k layers' FFNs dense on the GPU (baseline).
        See ``pyinfer.hybrid.place_model``.
        cache_type: the KV cache, "auto" (f32 for an f32 file, f16 otherwise), "f16" or "f32"
            (``pyinfer.kv_cache.cache_dtype``; ValueError for another name).
    Raises PyinferError for a bad file or an impossible setting.
    """

    def __init__(self, model_path: str, *, n_ctx: int | None = None, n_threads: int | None = None,
                 dense: bool = False, verbose: bool = False, device: str | None = "cpu",
                 vram_budget: float | None = None, reset_gpu_index: bool = False,
                 disable_gpu_index: bool = False, n_gpu_layers: int | None = None,
                 cache_type: str = "auto"):
        t0 = time.perf_counter()
        self.path = model_path
        self.reader = open_gguf(model_path)
        self.llamacpp = llamacpp.is_llamacpp(self.reader)  # run as it is: dense, on the CPU
        if self.llamacpp:
            self.cfg, self.weights = llamacpp.load(self.reader, model_path)
        else:
            self.cfg = ModelConfig.from_gguf(self.reader)
            self.weights = ModelWeights.from_gguf(self.reader, self.cfg)
        self.tokenizer = Tokenizer.from_gguf(self.reader)
        if n_ctx is None or n_ctx <= 0:
            n_ctx = min(DEFAULT_N_CTX, self.cfg.n_ctx_train)
        if n_threads is None or n_threads <= 0:
            n_threads = cpu.default_n_threads()
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        lm_head = None
        if read_field(self.reader, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT:
            # the file holds only the transposed layout: --dense runs it with every input kept
            ffn = InputSparseFFN(self.cfg, thresholds_from_reader(self.reader, self.cfg), dense)
        else:
            ffn = (None if dense else self._sparse_ffn()) or DenseFFN(self.cfg)
            # a two-stage lm head (output_ib) in a file of another mode; --dense: the exact head
            lm_head = head_from_reader(self.reader, self.cfg, self.weights, dense)
        # a CPU Model, or the GPU-resident GpuModel (pyinfer.gpu_model) with its placement
        self.model = place_model(self.reader, self.cfg, self.weights, ffn, n_ctx, n_threads,
                                 device=device, vram_budget=vram_budget,
                                 reset_gpu_index=reset_gpu_index,
                                 disable_gpu_index=disable_gpu_index, n_gpu_layers=n_gpu_layers,
                                 verbose=verbose, cache_type=cache_type, lm_head=lm_head)
        self.tokens: list[int] = []  # tokens whose keys/values are in the cache, in order
        # how many of them a batched forward wrote (the rest: one-token decode steps)
        self._n_batched = 0
        # eval_prompt reuses decode-written rows too (the chat REPL: latency over bit-exact
        # replay of a conversation)
        self.reuse_decoded_rows = False
        # why the last generation ended: "stop" (a stop id, the grammar complete) or "length"
        # (max_tokens, a full context); None while one runs or when its consumer left early
        self.finish_reason: str | None = None
        self._epoch = 0  # bumped by whatever replaces the cache's contents (generate checks it)
        self._busy = threading.RLock()  # held while the model computes (_exclusive)
        self._dry_breakers: frozenset[int] | None = None  # see dry_breakers
        # fewer threads while other processes hold CPUs (spinning OpenMP waits: pyinfer.threads)
        self.governor = ThreadGovernor(n_threads)
        self.timings = Timings(load_ms=(time.perf_counter() - t0) * 1e3, n_threads=n_threads)
        # called as prompt_progress(evaluated, total) with 0 before the first batch and after
        # each batch of a prompt longer than PROMPT_BATCH new tokens (a CLI's progress bar), or
        # None
        self.prompt_progress = None
        self.verbose = verbose

    def _sparse_ffn(self):
        """The SparseFFN the file's offline stage calibrated, or None (dense) if it has none."""
        mode = read_field(self.reader, C.K_SPARSE_MODE, kind=str)
        if mode is None:
            return None
        if mode not in C.SPARSE_MODES:
            raise PyinferError(f"unknown sparse mode {mode!r} in {C.K_SPARSE_MODE}")
        if any(lw.ffn_down_t is None for lw in self.weights.layers):
            raise PyinferError(f"sparse mode {mode!r} needs ffn_down_t, but this file keeps "
                               "ffn_down in row layout (pyinfer-convert --dense): run it with "
                               "--dense, or convert without --dense for sparse decoding")
        n_layer = self.cfg.n_layer
        act_thr = np.asarray(read_field(self.reader, C.K_ACT_THRESHOLD, [0.0] * n_layer,
                                        kind=list, item=float), np.float32)
        pred_thr = read_field(self.reader, C.K_PRED_THRESHOLD, kind=list, item=float)
        use = read_field(self.reader, C.K_PRED_CPU, kind=list, item=int)
        if len(act_thr) != n_layer or (pred_thr is not None and len(pred_thr) != n_layer) or (
                use is not None and len(use) != n_layer):
            raise PyinferError("sparse metadata does not have one entry per layer")
        layers = self.weights.layers
        predictors = None
        if pred_thr is not None and all(lw.fc1 is not None for lw in layers):
            predictors = [Predictor(lw.fc1, lw.fc2, t) for lw, t in zip(layers, pred_thr)]
        use = None if use is None or predictors is None else [bool(u) for u in use]
        return SparseFFN(self.cfg, predictors, act_thr, mode, use_predictor=use)

    @property
    def is_sparse(self) -> bool:
        return isinstance(self.model.ffn, SparseFFN) or getattr(self.model.ffn, "is_sparse", False)

    def ffn_sparsity(self) -> float:
        """Measured fraction of FFN neurons skipped since the last ``reset_stats`` (0 if dense)."""
        return self.model.ffn.stats.sparsity

    def reset_stats(self):
        self.model.ffn.stats.reset()
        head_stats = getattr(self.model, "head_stats", None)  # the head over output_ib
        if head_stats is not None:
            head_stats.reset()
        self.timings.reset()

    def warmup(self) -> None:
        """llama.cpp's warm-up at load (``common_init_from_params``): a two-token batch (bos and
        eos where the vocabulary names them within the model's rows, else token 0) and one
        decode step, then an empty cache and zeroed counters. The first forward pays the memory
        map's page faults (of the weights it reads) and the thread team's start: without it the
        first prompt's timing is 2-9x the steady state (docs/benchmarks.md, session 35). Its
        time is added to ``timings.load_ms``; a context under 3 tokens skips it."""
        if self.n_ctx < 3:
            return
        t0 = time.perf_counter()
        tok, n_vocab = self.tokenizer, self.cfg.n_vocab
        # a llama.cpp file's tokenizer may name ids past its embedding rows: token 0 then
        first, last = (i if i is not None and 0 <= i < n_vocab else 0
                       for i in (tok.bos_id, tok.eos_id))
        self.forward([first, last], 0)
        self.forward([last], 2)
        self.reset()
        self.reset_stats()
        self.timings.load_ms += (time.perf_counter() - t0) * 1e3

    # ---- evaluation ------------------------------------------------------------------------
    def reset(self):
        """Forget the cached tokens (the cache memory is reused). PyinferError while another
        thread computes on the model."""
        with self._exclusive():
            self.tokens = []
            self._n_batched = 0
            self._epoch += 1

    def eval_prompt(self, tokens: list[int]) -> np.ndarray:
        """Make the cache hold exactly ``tokens`` and return the last token's logits (n_vocab,).

        Reuses the longest common prefix with what the cache already holds, as far as batched
        forwards wrote it, but evaluates at least the last two tokens of a prompt of two or
        more, and never a batch of one: a one-token forward runs the decode kernels, whose
        keys, values and logits differ from the batched path's by the quantized activations'
        rounding (up to ~1 in logits of ~27 on SmolLM2). So a generated answer's rows are
        evaluated again, batched, when the next prompt holds them (a chat's next turn), and a
        prompt's logits are those of a fresh batched evaluation whatever the cache held (the
        same greedy text on a second call and after any other request; a batched evaluation
        gives each position the same bits however the batch is split). With
        ``reuse_decoded_rows`` set (the chat REPL) the answer's rows are reused as they are.
        Raises PyinferError if the prompt does not fit, holds an id outside the model's
        vocabulary, or the model produces NaN/Inf logits.
        """
        with self._exclusive():
            return self._eval_prompt(tokens)

    def _eval_prompt(self, tokens: list[int]) -> np.ndarray:
        if not tokens:
            raise PyinferError("empty prompt")
        self._check_ids(tokens)
        self._epoch += 1  # an open generation's cache is no longer its own (generate)
        if len(tokens) > self.n_ctx:
            raise PyinferError(f"prompt is {len(tokens)} tokens, longer than the context "
                               f"({self.n_ctx}); raise -c/--ctx-size or shorten the prompt")
        n_keep = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            n_keep += 1
        if not self.reuse_decoded_rows:
            n_keep = min(n_keep, self._n_batched)
        n_keep = min(n_keep, max(len(tokens) - 2, 0))
        new = tokens[n_keep:]
        t0 = time.perf_counter()
        self.tokens = list(tokens[:n_keep])  # what the cache holds if a forward fails
        # the batched prefix of what is kept (reuse_decoded_rows may keep decode-written rows)
        self._n_batched = batched = min(n_keep, self._n_batched)
        report = self.prompt_progress if len(new) > PROMPT_BATCH else None
        if report is not None:
            report(0, len(new))  # the bar's clock starts with the first batch, not after it
        try:
            for s, e in prompt_batches(len(new)):
                part = new[s:e]
                logits = self.forward(part, n_keep + s)
                self.tokens.extend(part)
                if report is not None:
                    report(e, len(new))
        finally:
            self.timings.prompt_ms += (time.perf_counter() - t0) * 1e3
            self.timings.prompt_n += len(self.tokens) - n_keep
        try:
            self._check_finite(logits, len(tokens) - 1)
        except PyinferError:  # the batches' keys and values are not claimed either
            self.tokens = list(tokens[:n_keep])
            raise
        self.tokens = list(tokens)
        if len(new) > 1 and batched == n_keep:  # (a one-token prompt ran the decode kernels)
            self._n_batched = len(tokens)
        return logits

    def eval_token(self, token: int) -> np.ndarray:
        """Append one token to the cache and return its logits (n_vocab,). Raises PyinferError
        for an id outside the vocabulary, a full context (the kernels' ValueError before) or
        NaN/Inf logits (the token is then not appended)."""
        with self._exclusive():
            return self._eval_token(token)

    def _eval_token(self, token: int) -> np.ndarray:
        self._check_ids([token])
        if len(self.tokens) >= self.n_ctx:
            raise PyinferError(f"the context ({self.n_ctx} tokens) is full: no room for another "
                               "token")
        t0 = time.perf_counter()
        logits = self.forward([token], len(self.tokens))
        self.timings.eval_ms += (time.perf_counter() - t0) * 1e3
        self.timings.eval_n += 1
        self._check_finite(logits, len(self.tokens))
        self.tokens.append(token)
        return logits

    def forward(self, tokens: list[int], n_past: int, all_logits: bool = False) -> np.ndarray:
        """``model.forward`` (see ``pyinfer.model.Model.forward``) on the thread count the
        governor gives this pass (``pyinfer.threads``); the cache bookkeeping of ``tokens`` is
        the caller's."""
        with self._exclusive():
            return self._forward(tokens, n_past, all_logits)

    @contextlib.contextmanager
    def _exclusive(self):
        """Held while the model computes or its cache bookkeeping changes (``eval_prompt``,
        ``eval_token``, ``forward``, ``embeddings``; reentrant): a second thread's call (two
        threads sharing one LLM) is a PyinferError instead of both writing the same cache and
        buffers (their answers came back silently garbled)."""
        if not self._busy.acquire(blocking=False):
            raise PyinferError("the model is busy in another thread: one engine computes one "
                               "thing at a time (give each thread its own LLM, or queue the "
                               "requests, as pyinfer-serve does)")
        try:
            yield
        finally:
            self._busy.release()

    def _forward(self, tokens: list[int], n_past: int, all_logits: bool) -> np.ndarray:
        n = self.governor.begin()
        self.timings.passes += 1
        self.timings.passes_reduced += n < self.n_threads
        self.model.n_threads = n
        if getattr(self.model, "cpu", None) is not None:  # GpuModel: its CPU half
            self.model.cpu.n_threads = n
        try:
            return self.model.forward(tokens, n_past, all_logits)
        finally:
            self.governor.end()

    def _check_ids(self, tokens):
        n_vocab = self.cfg.n_vocab
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise PyinferError(f"token id {bad} is outside the model's vocabulary ({n_vocab})")

    @staticmethod
    def _check_finite(logits: np.ndarray, pos: int):
        """A broken model (or file) gives NaN/Inf logits: say so instead of sampling garbage.
        pos: the token's position in the context. (The sum is NaN or infinite wherever a logit
        is, and costs no temporary: the elementwise test runs only to confirm.)"""
        if not np.isfinite(logits.sum()) and not np.isfinite(logits).all():
            what = "NaN" if np.isnan(logits).any() else "infinite"
            raise PyinferError(f"the model produced {what} logits at token {pos}")

    def generate(self, prompt_tokens: list[int], params: SamplingParams = SamplingParams(), *,
                 max_tokens: int = -1, seed: int | None = None, ignore_eos: bool = False,
                 stop_ids: Iterable[int] | None = None, constraint=None,
                 on_token=None, context_shift: int | None = None,
                 halt_ids: Iterable[int] = ()) -> Iterator[int]:
        """Yield sampled token ids after ``prompt_tokens`` until a stop id, ``max_tokens``
        (-1: until the context is full) or the end of the context. The stop token is not yielded.
        Deterministic for a given ``seed`` (None: fresh entropy).

        ``constraint``: a ``pyinfer.grammar.Constraint``; only tokens it allows are drawn, and
        generation ends when its grammar is complete. ``on_token(logits, token)``: called with the
        model's (n_vocab,) logits each token was drawn from (for log-probabilities; before the
        ``ignore_eos`` ban, as llama.cpp reports them), stop token included.
        Sets ``finish_reason`` when it ends by itself: "stop" for a stop id (even one drawn in the
        last draw the context allows) or a complete grammar, "length" for max_tokens or a full
        context: prompt and answer together fill at most n_ctx tokens (llama.cpp's server), so a
        P-token prompt gets at most n_ctx - P.
        ``ignore_eos``: the model's end-of-generation tokens (``Tokenizer.stop_ids``) are never
        drawn (their logits -inf, as llama.cpp's --ignore-eos biases them), and no stop id ends
        the generation.
        ``context_shift`` (None: off): n_keep of llama.cpp's --context-shift / --keep. Where the
        context is full, the first n_keep tokens (a negative n_keep: the whole prompt; BOS kept
        in any case, as llama.cpp's main adds it to n_keep) stay, half of the others (the oldest)
        are dropped, and generation goes on; llama.cpp moves the cache rows and re-rotates their
        keys, this re-evaluates the kept tokens at their new positions (the same function, in
        exact arithmetic).
        ``halt_ids``: ids that end the generation ("stop", not yielded) even under
        ``ignore_eos``: a reverse prompt that is one control token (llama.cpp's main checks such
        an ``antiprompt_token`` against the last sampled token).
        """
        self.finish_reason = None
        stops = set(self.tokenizer.stop_ids if stop_ids is None else stop_ids)
        halt = frozenset(int(i) for i in halt_ids)
        eog = self.tokenizer.stop_ids  # (ids inside the vocabulary: the tokenizer checks them)
        banned = np.fromiter(eog, np.int64) if ignore_eos and eog else None
        rng = np.random.default_rng(seed)
        logits = self.eval_prompt(list(prompt_tokens))
        if len(self.tokens) >= self.n_ctx:  # the prompt filled the context: no room for an answer
            self.finish_reason = "length"
            return
        epoch = self._epoch
        n_keep = None
        if context_shift is not None:
            bos = 1 if self.tokenizer.add_bos and prompt_tokens and \
                prompt_tokens[0] == self.tokenizer.bos_id else 0
            n_keep = len(prompt_tokens) if context_shift < 0 else min(
                context_shift + bos, len(prompt_tokens))
        n = 0
        while max_tokens < 0 or n < max_tokens:
            t0 = time.perf_counter()
            last_n = params.repeat_last_n  # -1: the whole context (llama.cpp), 0: none
            recent = self.tokens if last_n < 0 else self.tokens[-last_n:] if last_n > 0 else ()
            allowed = None if constraint is None else constraint.allowed()
            drawn = logits
            if banned is not None:
                drawn = logits.copy()  # (the model's array may be a cached prompt's)
                drawn[banned] = -np.inf
            dry = params.dry_multiplier > 0
            tok = sample(drawn, params, rng, recent, allowed, self.tokens if dry else (),
                         self.dry_breakers() if dry else frozenset())
            self.timings.sample_ms += (time.perf_counter() - t0) * 1e3
            self.timings.sample_n += 1
            if on_token is not None:  # the model's logits, before the ban (llama.cpp's probs)
                on_token(logits, tok)
            if (tok in stops and not ignore_eos) or tok in halt:
                self.finish_reason = "stop"
                return
            if constraint is not None:
                constraint.advance(tok)
            yield tok
            n += 1
            # the yielded token is not in the cache yet: prompt + answer stop at n_ctx (llama.cpp's
            # server ends a slot at n_past + 1 >= n_ctx; the API and server check max_tokens so)
            if max_tokens >= 0 and n >= max_tokens:
                self.finish_reason = "length"
                return
            if len(self.tokens) + 1 >= self.n_ctx:
                kept = self._shifted(n_keep)
                if kept is None:
                    self.finish_reason = "length"
                    return
                if constraint is not None and constraint.done:
                    self.finish_reason = "stop"
                    return
                with self._exclusive():  # (the check and the shift as one step: no thread between)
                    self._check_epoch(epoch)
                    logits = self.eval_prompt(kept + [tok])  # (the cache's first n_keep reused)
                    epoch = self._epoch
                continue
            if constraint is not None and constraint.done:
                self.finish_reason = "stop"
                return
            with self._exclusive():  # (the check and the token as one step: no thread between)
                self._check_epoch(epoch)  # resumed after another call took the cache?
                logits = self.eval_token(tok)
        self.finish_reason = "length"  # max_tokens 0: nothing drawn

    def _check_epoch(self, epoch: int) -> None:
        if self._epoch != epoch:
            raise PyinferError("this generation was interrupted: another prompt, reset or "
                               "embedding ran on the same model meanwhile (one generation at a "
                               "time); start it again")

    def _shifted(self, n_keep: int | None) -> list[int] | None:
        """The tokens a context shift keeps of the full cache (llama.cpp's main: n_left = n_past
        - n_keep, the n_left // 2 after the first n_keep dropped), or None: no shift (off, or
        nothing left to drop)."""
        if n_keep is None:
            return None
        n_discard = (len(self.tokens) - n_keep) // 2
        if n_discard <= 0:
            return None
        return self.tokens[:n_keep] + self.tokens[n_keep + n_discard:]

    def dry_breakers(self) -> frozenset[int]:
        """DRY's sequence breakers as token ids: every token whose text holds one of llama.cpp's
        default breaker strings (newline, ':', '"', '*'), and the special tokens (a chat turn
        boundary ends a repetition too). Computed once (one pass over the vocabulary)."""
        if self._dry_breakers is None:
            tk = self.tokenizer
            ids = tk.ids_holding(DRY_BREAKERS)
            ids.update(i for i in range(tk.n_vocab) if tk.is_special(i))
            self._dry_breakers = frozenset(ids)
        return self._dry_breakers

    def embeddings(self, tokens: list[int]) -> np.ndarray:
        """Final hidden states after the output norm for ``tokens`` evaluated from position 0:
        (n_tok, n_embd) float32 (what llama.cpp's server pools for a generative model's
        embeddings). The KV cache is reused for this and forgotten afterwards. Raises PyinferError
        when the tokens do not fit, or for a model (GPU-resident) that does not expose its layers."""
        model = self.model
        if not all(hasattr(model, a) for a in ("embed", "run_layers", "w")):
            raise PyinferError("embeddings are computed on the CPU model only (run with --device cpu)")
        if not tokens or len(tokens) > self.n_ctx:
            raise PyinferError(f"the input is {len(tokens)} tokens; it must be 1..{self.n_ctx}")
        self._check_ids(tokens)
        with self._exclusive():
            self.tokens = []
            self._n_batched = 0
            self._epoch += 1
            x = model.embed(tokens, 0)
            model.run_layers(x, 0, 0)
            h = np.empty_like(x)  # (n_tok, n_embd)
            cpu.rmsnorm(x, model.w.output_norm, self.cfg.rms_eps, h)
        return h
