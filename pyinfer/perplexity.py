"""pyinfer-perplexity: perplexity of a model on a text file, llama.cpp's method.

The text is tokenized once (with BOS in front where the tokenizer adds one) and cut into chunks
of the context size; each chunk is evaluated from an empty cache (its first token replaced by BOS
when the tokenizer adds one) and only the second half of each chunk is scored, so every scored
token sees at least n_ctx/2 tokens of context (llama.cpp ``examples/perplexity/perplexity.cpp``,
which also gives the final estimate's +/- error: the standard error of the mean per-token
negative log-likelihood, times the perplexity). In sparse mode it also prints the mean fraction
of FFN neurons computed per token.
"""
from __future__ import annotations

import math
import sys
import time
from typing import NamedTuple

import numpy as np

from pyinfer.errors import PyinferError, exit_code_of
from pyinfer.options import (MAX_TEXT_FILE_BYTES, Parser, add_model, add_version, arg_type, model_path,
                             read_text_file, warn_past_training)


def log_softmax_at(logits: np.ndarray, targets: np.ndarray, rows: int = 64) -> np.ndarray:
    """log p(target) per row: logits (n, n_vocab) f32, targets (n,) int -> (n,) f64, computed
    in f64 ``rows`` rows at a time (the f64 copies stay small whatever n)."""
    out = np.empty(logits.shape[0], np.float64)
    for s in range(0, logits.shape[0], rows):
        z = logits[s:s + rows].astype(np.float64)
        m = z.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
        out[s:s + rows] = z[np.arange(z.shape[0]), targets[s:s + rows]] - lse
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


def estimate(engine, tokens: list[int], n_ctx: int, max_chunks: int = 0, progress=True) -> Estimate:
    """Perplexity of ``tokens`` (the whole text's ids, :func:`text_tokens`) in chunks of ``n_ctx``
    (<= engine.n_ctx), at most ``max_chunks`` (0 or -1: all), with llama.cpp's error estimate.
    Raises PyinferError when the text is shorter than one chunk."""
    n_chunks = len(tokens) // n_ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise PyinferError(f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}; "
                           "use a longer text or a smaller -c")
    from pyinfer.engine import prompt_batches
    from pyinfer.progress import progress_bar

    engine.reset_stats()
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    first = n_ctx // 2
    nll, nll2, count = 0.0, 0.0, 0
    running = []
    bar = progress_bar(range(n_chunks), desc="perplexity", unit="chunk", enabled=progress)
    for c in bar:
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        engine.reset()
        # in the prompt's batches (engine.prompt_batches: at most PROMPT_BATCH positions' logits
        # held at once), scoring positions first .. n_ctx - 2 as their batch comes
        for s, e in prompt_batches(n_ctx):
            logits = engine.forward(chunk[s:e], s, all_logits=True)  # (e - s, n_vocab)
            a, b = max(s, first), min(e, n_ctx - 1)
            if a < b:
                lp = log_softmax_at(logits[a - s:b - s], np.asarray(chunk[a + 1:b + 1]))
                nll -= lp.sum()
                nll2 += float(np.dot(lp, lp))
                count += lp.shape[0]
        running.append(math.exp(nll / count))
        bar.set_postfix(ppl=f"{running[-1]:.4f}")
    ppl = math.exp(nll / count)
    var = nll2 / count - (nll / count) ** 2  # of the per-token nll
    err = math.sqrt(var / (count - 1)) * ppl if count > 1 and var > 0 else 0.0
    return Estimate(ppl, count, 1.0 - engine.ffn_sparsity(), err, tuple(running))


def main(argv=None) -> int:
    return exit_code_of(_main, argv)


def _main(argv) -> int:
    ap = Parser(prog="pyinfer-perplexity", description=__doc__.splitlines()[0])
    add_version(ap)
    add_model(ap)
    ap.add_argument("-f", "--file", required=True, help="text file to score")
    ap.add_argument("-c", "--ctx-size", type=arg_type("ctx_size"), default=512,
                    help="chunk size in tokens (0: the model's default context, as pyinfer-run)")
    ap.add_argument("-t", "--threads", type=arg_type("threads"), default=None)
    ap.add_argument("--chunks", type=arg_type("chunks"), default=-1,
                    help="score at most this many chunks (-1 or 0: all)")
    ap.add_argument("--dense", action="store_true", help="compute every FFN neuron")
    ap.add_argument("-ctk", "--cache-type", choices=["auto", "f16", "f32"], default="auto",
                    help="KV cache type (auto: f32 for an f32 file, else f16)")
    args = ap.parse_args(argv)
    from pyinfer.engine import Engine

    path = model_path(args, "pyinfer-perplexity MODEL.gguf -f TEXT (or -m MODEL.gguf)")
    text = read_text_file(args.file, MAX_TEXT_FILE_BYTES, "text file", hint="score a part of it")
    if 0 < args.ctx_size < 8:
        raise PyinferError("-c/--ctx-size must be 0 or at least 8")
    eng = Engine(path, n_ctx=args.ctx_size or None, n_threads=args.threads, dense=args.dense,
                 cache_type=args.cache_type)
    n_ctx = eng.n_ctx
    warn_past_training(n_ctx, eng.cfg.n_ctx_train)
    tokens = text_tokens(eng, text)
    t0 = time.perf_counter()
    ppl, n, frac, err, running = estimate(eng, tokens, n_ctx, args.chunks)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
