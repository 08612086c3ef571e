"""pyinfer-perplexity: perplexity of a model on a text file, llama.cpp's method.

The text is tokenized once (with BOS in front where the tokenizer adds one) and cut into chunks
of the context size; each chunk is evaluated from an empty cache (its first token replaced by BOS
when the tokenizer adds one) and only the second half of each chunk is scored, so every scored
token sees at least n_ctx/2 tokens of context (llama.cpp ``examples/perplexity/perplexity.cpp``,
which also gives the final estimate's +/- error: the standard error of the mean per-token
negative log-likelihood, times the perplexity). In sparse mode it also prints the mean fraction
of FFN neurons computed per token. ``--kl-divergence-base`` / ``--kl-divergence``: llama.cpp's
comparison of two models' distributions on the same chunks (pyinfer/kld.py).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import NamedTuple

import numpy as np

from pyinfer.errors import PyinferError, exit_code_of
from pyinfer.options import (MAX_TEXT_FILE_BYTES, Parser, add_model, add_version, arg_type,
                             model_path, read_text_file, threads_arg, warn_past_training)

#: Positions converted to f64 log-probabilities at a time (their copies stay small).
ROWS = 64


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(n, n_vocab) f32 logits -> (n, n_vocab) f64 log-probabilities."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


def log_softmax_at(logits: np.ndarray, targets: np.ndarray, rows: int = ROWS) -> np.ndarray:
    """log p(target) per row: logits (n, n_vocab) f32, targets (n,) int -> (n,) f64, computed
    in f64 ``rows`` rows at a time (the f64 copies stay small whatever n)."""
    out = np.empty(logits.shape[0], np.float64)
    for s in range(0, logits.shape[0], rows):
        t = np.asarray(targets[s:s + rows])
        out[s:s + rows] = log_softmax(logits[s:s + rows])[np.arange(t.shape[0]), t]
    return out


class Estimate(NamedTuple):
    """``ppl`` +/- ``error`` over ``n_scored`` tokens; ``computed``: fraction of FFN neurons
    computed per token (1.0 dense); ``running``: the perplexity over the chunks so far after each
    chunk (llama.cpp's ``[1]x,[2]y,...`` values; the last is ``ppl``)."""

    ppl: float
    n_scored: int
    computed: float
    error: float
    running: tuple = ()


def text_tokens(engine, text: str) -> list[int]:
    """The ids perplexity scores: the whole text with BOS in front where the tokenizer adds one
    (llama.cpp's ``common_tokenize(ctx, text, true)``); control-token text (<|im_end|>) is plain
    text, as llama.cpp's perplexity scores it."""
    return engine.tokenizer.encode(text, add_bos=engine.tokenizer.add_bos, parse_special=False)


def perplexity(engine, tokens: list[int], n_ctx: int, max_chunks: int = 0, progress=True):
    """Returns (ppl, n_scored, fraction_of_ffn_neurons_computed): ``estimate``'s first three."""
    return tuple(estimate(engine, tokens, n_ctx, max_chunks, progress)[:3])


def first_scored(n_ctx: int) -> int:
    """The first position of a chunk that is scored (llama.cpp's: the second half, so every
    scored token sees at least n_ctx/2 of context)."""
    return n_ctx // 2


def chunk_tokens(engine, tokens, n_ctx: int, max_chunks: int = 0) -> np.ndarray:
    """(n_chunks, n_ctx) int64: the chunks :func:`estimate` evaluates, each with its first token
    replaced by BOS where the tokenizer adds one, at most ``max_chunks`` (0 or -1: all). Raises
    PyinferError when the text is shorter than one chunk."""
    n_chunks = len(tokens) // n_ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise PyinferError(f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}; "
                           "use a longer text or a smaller -c")
    chunks = np.asarray(tokens[:n_chunks * n_ctx], np.int64).reshape(n_chunks, n_ctx)
    if engine.tokenizer.add_bos:
        chunks[:, 0] = engine.tokenizer.bos_id
    return chunks


def estimate(engine, tokens, n_ctx: int, max_chunks: int = 0, progress=True, sink=None,
             as_given: bool = False) -> Estimate:
    """Perplexity of ``tokens`` (the whole text's ids, :func:`text_tokens`) in chunks of ``n_ctx``
    (<= engine.n_ctx), at most ``max_chunks`` (0 or -1: all), with llama.cpp's error estimate.
    as_given: ``tokens`` are the chunks to evaluate ((n_chunks, n_ctx), BOS already in place:
    a KL-divergence base file's). sink: an object whose ``rows(logprobs (n, n_vocab) f64,
    targets (n,) int)`` receives the scored positions' log-probabilities (the ones the
    perplexity is taken from) and next tokens in order, at most ROWS at a time within a chunk
    (pyinfer.kld's writer and comparison). Raises PyinferError when the text is shorter than
    one chunk."""
    from pyinfer.engine import prompt_batches
    from pyinfer.progress import progress_bar

    if as_given:
        chunks = np.asarray(tokens)[:max_chunks if max_chunks > 0 else None]
    else:
        chunks = chunk_tokens(engine, tokens, n_ctx, max_chunks)
    engine.reset_stats()
    first = first_scored(n_ctx)
    nll, nll2, count = 0.0, 0.0, 0
    running = []
    bar = progress_bar(range(chunks.shape[0]), desc="perplexity", unit="chunk", enabled=progress)
    for c in bar:
        chunk = [int(t) for t in chunks[c]]
        engine.reset()
        # in the prompt's batches (engine.prompt_batches: at most PROMPT_BATCH positions' logits
        # held at once), scoring positions first .. n_ctx - 2 as their batch comes
        for s, e in prompt_batches(n_ctx):
            logits = engine.forward(chunk[s:e], s, all_logits=True)  # (e - s, n_vocab)
            a, b = max(s, first), min(e, n_ctx - 1)
            for r in range(a, b, ROWS):
                r1 = min(r + ROWS, b)
                targets = np.asarray(chunk[r + 1:r1 + 1])
                full = log_softmax(logits[r - s:r1 - s])
                lp = full[np.arange(r1 - r), targets]
                if sink is not None:
                    sink.rows(full, targets)
                nll -= lp.sum()
                nll2 += float(np.dot(lp, lp))
                count += lp.shape[0]
        if not math.isfinite(nll):
            raise PyinferError(f"the model produced non-finite logits in chunk {c + 1}: a "
                               "damaged file, or weights outside the file type's range")
        running.append(math.exp(nll / count))
        bar.set_postfix(ppl=f"{running[-1]:.4f}")
    ppl = math.exp(nll / count)
    var = nll2 / count - (nll / count) ** 2  # of the per-token nll
    err = math.sqrt(var / (count - 1)) * ppl if count > 1 and var > 0 else 0.0
    return Estimate(ppl, count, 1.0 - engine.ffn_sparsity(), err, tuple(running))


def main(argv=None) -> int:
    from pyinfer.options import stop_signals_interrupt

    with stop_signals_interrupt() as came:  # (`kill` removes a half-written base file too)
        status = exit_code_of(_main, argv)
    return 128 + came[0] if came[0] is not None else status


def _main(argv) -> int:
    ap = Parser(prog="pyinfer-perplexity", description=__doc__.splitlines()[0])
    add_version(ap)
    add_model(ap)
    ap.add_argument("-f", "--file", help="text file to score")
    ap.add_argument("-c", "--ctx-size", type=arg_type("ctx_size"), default=None,
                    help="chunk size in tokens (default 512; 0: the model's default context, as "
                         "pyinfer-run; with --kl-divergence: the base file's)")
    ap.add_argument("-t", "--threads", type=threads_arg, default=None,
                    help="kernel threads (default, or 0 or less: the physical cores this process may use)")
    ap.add_argument("--chunks", type=arg_type("chunks"), default=-1,
                    help="score at most this many chunks (-1 or 0: all)")
    ap.add_argument("--dense", action="store_true", help="compute every FFN neuron")
    ap.add_argument("-ctk", "--cache-type", choices=["auto", "f16", "f32"], default="auto",
                    help="KV cache type (auto: f32 for an f32 file, else f16)")
    ap.add_argument("--kl-divergence-base", metavar="FILE",
                    help="save this run's log-probabilities of every scored position to FILE "
                         "(llama.cpp's flag; about 2 bytes a vocabulary entry a position), or "
                         "with --kl-divergence read them")
    ap.add_argument("--kl-divergence", action="store_true",
                    help="score the chunks of --kl-divergence-base FILE (no -f) and compare: "
                         "KL divergence from the base, perplexity ratio, same top token")
    args = ap.parse_args(argv)
    from pyinfer.engine import Engine

    path = model_path(args, "pyinfer-perplexity MODEL.gguf -f TEXT (or -m MODEL.gguf)")
    base = None
    if args.kl_divergence:
        base = _base_for_compare(args)
        ctx = base.n_ctx
    else:
        if not args.file:
            raise PyinferError("no text given: -f/--file TEXT (or --kl-divergence with "
                               "--kl-divergence-base FILE)")
        text = read_text_file(args.file, MAX_TEXT_FILE_BYTES, "text file",
                              hint="score a part of it")
        if args.kl_divergence_base:
            _check_base_path(args.kl_divergence_base, (path, args.file))
        ctx = 512 if args.ctx_size is None else args.ctx_size
    if 0 < ctx < 8:
        raise PyinferError("-c/--ctx-size must be 0 or at least 8")
    eng = Engine(path, n_ctx=ctx or None, n_threads=args.threads, dense=args.dense,
                 cache_type=args.cache_type)
    n_ctx = eng.n_ctx
    warn_past_training(n_ctx, eng.cfg.n_ctx_train)
    sink = None
    if base is not None:
        from pyinfer.kld import Comparison

        if n_ctx != base.n_ctx:
            raise PyinferError(f"the base file scored chunks of {base.n_ctx} tokens; this model "
                               f"runs a context of at most {n_ctx}")
        if base.n_vocab != eng.cfg.n_vocab:
            raise PyinferError(f"the base file's vocabulary has {base.n_vocab} tokens, this "
                               f"model's {eng.cfg.n_vocab}: compare models of one tokenizer")
        tokens, as_given, sink = base.tokens, True, Comparison(base)
    else:
        tokens, as_given = text_tokens(eng, text), False
        if args.kl_divergence_base:
            tokens = chunk_tokens(eng, tokens, n_ctx, args.chunks)
            sink = _base_writer(args.kl_divergence_base, tokens, eng.cfg.n_vocab, path)
            as_given = True
    t0 = time.perf_counter()
    try:
        ppl, n, frac, err, running = estimate(eng, tokens, n_ctx, args.chunks, sink=sink,
                                              as_given=as_given)
    except BaseException:
        if hasattr(sink, "abort"):
            sink.abort()
        raise
    if hasattr(sink, "close"):
        sink.close()
    dt = time.perf_counter() - t0
    mode = "sparse" if eng.is_sparse else "dense"
    print(f"perplexity: {ppl:.4f} over {n} tokens ({mode}, ctx {n_ctx}, {dt:.1f} s)")
    # llama.cpp's running estimate after each chunk, in its format ([chunk]ppl,)
    print("".join(f"[{i}]{p:.4f}," for i, p in enumerate(running, 1)))
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
    isp = getattr(eng.model, "input_sparse", None)
    lm_head = getattr(eng.model, "lm_head", None)
    head = ""
    if lm_head is not None and lm_head.head_on(eng.weights):  # the head over output_ib
        head = f"lm head inputs skipped: {eng.model.head_stats.sparsity:.1%}"
        if lm_head.head_candidates:
            copy = eng.weights.output_ib.parts[0][1].base_qtype.name.lower()
            head += f" ({copy} copy, {lm_head.head_candidates} exact candidates)"
    if isp is not None and eng.is_sparse:  # sparse mode input: weight bytes, not neurons
        print(f"projection weight reads skipped: {1 - frac:.1%}" + (f"; {head}" if head else ""))
    elif eng.is_sparse:
        print(f"ffn neurons computed per token: {frac:.1%} (sparsity {1 - frac:.1%})")
    if head and isp is None:
        print(head)
    if base is not None:
        from pyinfer.kld import report

        print()
        print(report(sink))
    elif args.kl_divergence_base:
        print(f"saved the log-probabilities of {n} positions to {args.kl_divergence_base}")
    return 0


def _base_for_compare(args):
    """The base file of a --kl-divergence run, its flags checked (-f unused: the base's tokens
    are scored; -c, when given, must be the base's). Raises PyinferError."""
    from pyinfer.kld import BaseFile

    if not args.kl_divergence_base:
        raise PyinferError("--kl-divergence compares against a base: give --kl-divergence-base "
                           "FILE (written by a run with --kl-divergence-base FILE -f TEXT)")
    if args.file:
        raise PyinferError("-f is not used with --kl-divergence: the chunks scored are the base "
                           "file's own")
    base = BaseFile(args.kl_divergence_base)
    if args.ctx_size is not None and args.ctx_size != base.n_ctx:
        raise PyinferError(f"-c {args.ctx_size}: the base file scored chunks of {base.n_ctx} "
                           "tokens; leave -c out or give that")
    return base


def _check_base_path(out: str, inputs: tuple = ()) -> str:
    """The directory of a base file to write, checked before the model loads: a regular file
    (or none) in an existing directory, none of ``inputs`` (the model, the text). Raises
    PyinferError."""
    if os.path.isdir(out) or (os.path.exists(out) and not os.path.isfile(out)):
        raise PyinferError(f"--kl-divergence-base {out}: not a regular file; name a new file")
    for path in inputs:
        if os.path.exists(out) and os.path.exists(path) and os.path.samefile(out, path):
            raise PyinferError(f"--kl-divergence-base {out} would overwrite {path}, an input; "
                               "name a new file")
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise PyinferError(f"--kl-divergence-base {out}: directory {directory} does not exist")
    return directory


def _base_writer(out: str, chunks: np.ndarray, n_vocab: int, model: str):
    """A pyinfer.kld.BaseWriter for ``out``, after the checks a long run should not fail at the
    end of: a regular file (or none) in an existing directory with room for it."""
    import shutil

    from pyinfer.kld import BaseWriter

    directory = _check_base_path(out, (model,))
    size = BaseWriter.nbytes(chunks.shape[0], chunks.shape[1], n_vocab)
    free = shutil.disk_usage(directory).free
    if size > free:
        raise PyinferError(f"--kl-divergence-base {out} needs {size / 2**20:.1f} MiB and "
                           f"{directory} has {free / 2**20:.1f} MiB free; score fewer --chunks")
    print(f"pyinfer-perplexity: writing {size / 2**20:.1f} MiB of log-probabilities to {out}",
          file=sys.stderr)
    return BaseWriter(out, chunks, n_vocab, model)


if __name__ == "__main__":
    sys.exit(main())
