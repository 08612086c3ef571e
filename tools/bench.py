#!/usr/bin/env python3
"""Decode and prefill tokens/s of pyinfer models (and of llama.cpp through llama-cpp-python, when it
is installed), at each thread count asked for.

    python tools/bench.py models/smollm2-135m-instruct.q8_0.gguf [more.gguf ...] --threads 1 2 \
        [--llama-cpp models/llamacpp-smollm2.q8_0.gguf] [--reps 7]
    python tools/bench.py pyinfer.q8_0.gguf --llama-bench /path/to/llama-bench \
        --llama-bench-model llamacpp.q8_0.gguf --n-prompt 128 512 --no-decode --old-prefill

Every engine is loaded once per thread count and the runs are interleaved round by round (engine
A, B, llama.cpp, A, B, llama.cpp, ...), so a slow spell of a shared machine hits all of them alike;
each figure is the median over --reps rounds. Prefill: one batched pass over a fixed prompt of
--n-prompt tokens from an empty cache (several sizes may be given). Decode: --n-gen greedy tokens
one at a time after an 8-token prompt (--no-decode skips it).

--old-prefill adds, for each pyinfer file, a runner on the same engine with the prefill kernels from
before issue 11's GEMM (pyinfer.ops._kernels.set_old_prefill; benchmarking only). --llama-bench runs
llama.cpp's own llama-bench binary (built from source, not installed by the project) once per round
and test as a subprocess (`-p N -n 0` for prefill, `-p 0 -n N` for decode, `-r 1 -o json`, its own
warm-up run included, load time not counted).
"""
from __future__ import annotations

import argparse
import os
import json
import statistics
import subprocess
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
        self.eng.forward(ids, 0)
        return len(ids) / (time.perf_counter() - t0)

    def decode(self, n_gen):
        eng = self.eng
        eng.reset()
        logits = eng.eval_prompt(self.ids[:8])
        t0 = time.perf_counter()
        for _ in range(n_gen):
            logits = eng.eval_token(int(np.argmax(logits)))
        return n_gen / (time.perf_counter() - t0)


class OldPrefillRunner:
    """The same engine, prefill through the pre-GEMM kernels (A/B of issue 11's change)."""

    def __init__(self, base):
        from pyinfer.ops import _kernels

        self.base, self._k = base, _kernels
        self.name = base.name + " (old prefill)"

    def prefill(self, n_prompt):
        prev = self._k.set_old_prefill(1)
        try:
            return self.base.prefill(n_prompt)
        finally:
            self._k.set_old_prefill(prev)

    def decode(self, n_gen):
        return self.base.decode(n_gen)


class LlamaBenchRunner:
    """llama.cpp's llama-bench binary, one repetition per call: prefill is ``-p N -n 0``, decode
    ``-p 0 -n N`` (llama-bench's "tg" test: N tokens one at a time from an empty cache, after its
    own warm-up run). Load time is not counted."""

    def __init__(self, binary, path, threads, extra=()):
        self.binary, self.path, self.threads, self.extra = binary, path, threads, list(extra)
        self.name = "llama-bench " + os.path.basename(path)

    def _run(self, n_prompt, n_gen):
        cmd = [self.binary, "-m", self.path, "-p", str(n_prompt), "-n", str(n_gen), "-t",
               str(self.threads), "-r", "1", "-o", "json"] + self.extra
        env = dict(os.environ)  # its shared libraries sit beside it in a llama.cpp build
        lib = os.path.dirname(os.path.abspath(self.binary))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, env.get("LD_LIBRARY_PATH")]))
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        return float(json.loads(res.stdout)[0]["avg_ts"])

    def prefill(self, n_prompt):
        return self._run(n_prompt, 0)

    def decode(self, n_gen):
        return self._run(0, n_gen)


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


def run(runners, n_prompts, n_gen, reps):
    """{runner: ([median prefill tok/s per n_prompt], median decode tok/s)} over interleaved
    rounds (one warm-up round); n_gen 0 skips decode."""
    res = {r: ([[] for _ in n_prompts], []) for r in runners}
    for rnd in range(reps + 1):
        for r in runners:
            pps = [r.prefill(n) for n in n_prompts]
            tg = r.decode(n_gen) if n_gen else float("nan")
            if rnd:
                for i, pp in enumerate(pps):
                    res[r][0][i].append(pp)
                res[r][1].append(tg)
    return {r: ([statistics.median(p) for p in ps], statistics.median(d))
            for r, (ps, d) in res.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="pyinfer GGUF files")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n-prompt", type=int, nargs="+", default=[128])
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old-prefill", action="store_true",
                    help="also time each pyinfer file with the pre-GEMM prefill kernels")
    ap.add_argument("--llama-cpp", help="llama.cpp GGUF of the same model, for llama-cpp-python")
    ap.add_argument("--llama-bench", help="path of a llama-bench binary (llama.cpp)")
    ap.add_argument("--llama-bench-model", nargs="+", default=[],
                    help="llama.cpp GGUF files for --llama-bench")
    args = ap.parse_args(argv)
    n_gen = 0 if args.no_decode else args.n_gen
    n_ctx = max(512, max(args.n_prompt) + n_gen + 8)
    pp_cols = " | ".join(f"prefill tokens/s ({n} tokens)" for n in args.n_prompt)
    tg_cols = "" if args.no_decode else " decode tokens/s | decode vs first |"
    print(f"| engine | threads | {pp_cols} |{tg_cols}")
    print("|---|---|" + "---|" * len(args.n_prompt) + ("" if args.no_decode else "---|---|"))
    for t in args.threads:
        runners = []
        for m in args.models:
            runners.append(PyinferRunner(m, t, n_ctx))
            if args.old_prefill:
                runners.append(OldPrefillRunner(runners[-1]))
        if args.llama_cpp:
            try:
                runners.append(LlamaCppRunner(args.llama_cpp, t, n_ctx))
            except ImportError:
                print(f"| llama.cpp | {t} | not installed |" + " |" * (len(args.n_prompt) - 1)
                      + ("" if args.no_decode else " | |"))
        if args.llama_bench:
            runners += [LlamaBenchRunner(args.llama_bench, m, t) for m in args.llama_bench_model]
        res = run(runners, args.n_prompt, n_gen, args.reps)
        base = res[runners[0]][1]
        for r in runners:
            pps, tg = res[r]
            pp = " | ".join(f"{v:.1f}" for v in pps)
            tg_cells = "" if args.no_decode else f" {tg:.1f} | {tg / base:.2f}x |"
            print(f"| {r.name} | {t} | {pp} |{tg_cells}", flush=True)


if __name__ == "__main__":
    main()
