#!/usr/bin/env python3
"""Decode and prefill tokens/s of pyinfer (and of llama.cpp through llama-cpp-python, when it is
installed) on one model, at each thread count asked for.

    python tools/bench.py models/smollm2-135m-instruct.q8_0.gguf --threads 1 2 \
        [--llama-cpp models/SmolLM2-135M-Instruct.Q4_1.gguf] [--dense]

Prefill: one batched pass over a fixed prompt of --n-prompt tokens. Decode: --n-gen greedy tokens
one at a time after a short prompt. Each figure is the median of --reps runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from pyinfer.engine import Engine  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. " * 64)


def bench_pyinfer(path, threads, n_prompt, n_gen, reps, extra):
    eng = Engine(path, n_ctx=max(512, n_prompt + n_gen + 8), n_threads=threads, **extra)
    ids = eng.tokenizer.encode(TEXT)[:n_prompt]
    prefill, decode = [], []
    for _ in range(reps):
        eng.reset()
        t0 = time.perf_counter()
        eng.model.forward(ids, 0)
        prefill.append(len(ids) / (time.perf_counter() - t0))
        eng.reset()
        logits = eng.eval_prompt(ids[:8])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            logits = eng.eval_token(int(np.argmax(logits)))
        decode.append(n_gen / (time.perf_counter() - t0))
    sparsity = getattr(eng, "ffn_sparsity", lambda: None)()
    return statistics.median(prefill), statistics.median(decode), sparsity


def bench_llama_cpp(path, threads, n_prompt, n_gen, reps):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=max(512, n_prompt + n_gen + 8), n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False, use_extra_bufts=False)
    ids = llm.tokenize(TEXT.encode())[:n_prompt]
    prefill, decode = [], []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill.append(len(ids) / (time.perf_counter() - t0))
        llm.reset()
        llm.eval(ids[:8])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        decode.append(n_gen / (time.perf_counter() - t0))
    return statistics.median(prefill), statistics.median(decode)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="pyinfer GGUF")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", help="llama.cpp GGUF of the same model, for llama-cpp-python")
    args = ap.parse_args(argv)
    print(f"| engine | threads | prefill tokens/s ({args.n_prompt} tokens) | decode tokens/s |")
    print("|---|---|---|---|")
    for t in args.threads:
        pp, tg, _ = bench_pyinfer(args.model, t, args.n_prompt, args.n_gen, args.reps, {})
        print(f"| pyinfer | {t} | {pp:.1f} | {tg:.1f} |", flush=True)
        if args.llama_cpp:
            r = bench_llama_cpp(args.llama_cpp, t, args.n_prompt, args.n_gen, args.reps)
            if r is None:
                print(f"| llama.cpp | {t} | not installed | |", flush=True)
            else:
                print(f"| llama.cpp | {t} | {r[0]:.1f} | {r[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
