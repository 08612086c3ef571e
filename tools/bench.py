#!/usr/bin/env python3
"""Decode and prefill tokens/s of pyinfer models (and of llama.cpp through llama-cpp-python, when it
is installed), at each thread count asked for.

    python tools/bench.py models/smollm2-135m-instruct.q8_0.gguf [more.gguf ...] --threads 1 2 \
        [--llama-cpp models/llamacpp-smollm2.q8_0.gguf] [--reps 7]

Every engine is loaded once per thread count and the runs are interleaved round by round (engine
A, B, llama.cpp, A, B, llama.cpp, ...), so a slow spell of a shared machine hits all of them alike;
each figure is the median over --reps rounds. Prefill: one batched pass over a fixed prompt of
--n-prompt tokens from an empty cache. Decode: --n-gen greedy tokens one at a time after an
8-token prompt.
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


class PyinferRunner:
    def __init__(self, path, threads, n_ctx):
        self.name = os.path.basename(path)
        self.eng = Engine(path, n_ctx=n_ctx, n_threads=threads)
        self.ids = self.eng.tokenizer.encode(TEXT)

    def prefill(self, n_prompt):
        self.eng.reset()
        ids = self.ids[:n_prompt]
        t0 = time.perf_counter()
        self.eng.model.forward(ids, 0)
        return len(ids) / (time.perf_counter() - t0)

    def decode(self, n_gen):
        eng = self.eng
        eng.reset()
        logits = eng.eval_prompt(self.ids[:8])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            logits = eng.eval_token(int(np.argmax(logits)))
        return n_gen / (time.perf_counter() - t0)


class LlamaCppRunner:
    def __init__(self, path, threads, n_ctx):
        from llama_cpp import Llama

        self.name = "llama.cpp " + os.path.basename(path)
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, use_extra_bufts=False)
        self.ids = self.llm.tokenize(TEXT.encode())

    def prefill(self, n_prompt):
        self.llm.reset()
        ids = self.ids[:n_prompt]
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t0)

    def decode(self, n_gen):
        llm = self.llm
        llm.reset()
        llm.eval(self.ids[:8])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return n_gen / (time.perf_counter() - t0)


def run(runners, n_prompt, n_gen, reps):
    """{runner: (median prefill tok/s, median decode tok/s)} over interleaved rounds (one warm-up)."""
    res = {r: ([], []) for r in runners}
    for rnd in range(reps + 1):
        for r in runners:
            pp, tg = r.prefill(n_prompt), r.decode(n_gen)
            if rnd:
                res[r][0].append(pp)
                res[r][1].append(tg)
    return {r: (statistics.median(p), statistics.median(d)) for r, (p, d) in res.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="pyinfer GGUF files")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama-cpp", help="llama.cpp GGUF of the same model, for llama-cpp-python")
    args = ap.parse_args(argv)
    n_ctx = max(512, args.n_prompt + args.n_gen + 8)
    print(f"| engine | threads | prefill tokens/s ({args.n_prompt} tokens) | decode tokens/s "
          f"| decode vs first |")
    print("|---|---|---|---|---|")
    for t in args.threads:
        runners = [PyinferRunner(m, t, n_ctx) for m in args.models]
        if args.llama_cpp:
            try:
                runners.append(LlamaCppRunner(args.llama_cpp, t, n_ctx))
            except ImportError:
                print(f"| llama.cpp | {t} | not installed | | |")
        res = run(runners, args.n_prompt, args.n_gen, args.reps)
        base = res[runners[0]][1]
        for r in runners:
            pp, tg = res[r]
            print(f"| {r.name} | {t} | {pp:.1f} | {tg:.1f} | {tg / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
