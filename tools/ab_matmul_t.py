#!/usr/bin/env python3
"""A/B ``matmul_t`` (out = a @ W_t, the transposed prefill GEMM) of two kernel builds, interleaved.

    OPENBLAS_NUM_THREADS=1 python tools/ab_matmul_t.py OLD.so NEW.so [--types q8_0 q4_0] \
        [--shapes 1536x576 576x3072 576x960 11008x4096] [--n-tok 128 512] [--threads 1 2] \
        [--rounds 5]

Each shape is ROWSxCOLS of the stored (transposed) matrix: ffn_down_t of SmolLM2 is 1536x576,
its fused gate/up of an input-sparse file 576x3072, q/k/v 576x960; 7B's ffn_down_t 11008x4096.
Random N(0,1) weights quantized by gguf, activations N(0,1). Per (type, shape, n_tok, threads)
the two builds run in alternating order for --rounds rounds (best of 2 calls each); the table
gives median ms and OLD/NEW (speed-up). Both builds' outputs are checked against each other.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_common import load_kernels  # noqa: E402

QT = gguf.GGMLQuantizationType


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--shapes", nargs="+", default=["1536x576", "576x3072", "576x960", "11008x4096"])
    ap.add_argument("--n-tok", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    builds = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    rng = np.random.default_rng(0)
    print("| type | rows x cols | n_tok | threads | old ms | new ms | old/new | max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for tname in args.types:
        qt = QT[tname.upper()]
        for shape in args.shapes:
            rows, cols = (int(v) for v in shape.split("x"))
            wf = rng.standard_normal((rows, cols)).astype(np.float32)
            w = np.ascontiguousarray(gguf.quants.quantize(wf, qt)).view(np.uint8)
            del wf
            for n_tok in args.n_tok:
                a = rng.standard_normal((n_tok, rows)).astype(np.float32)
                outs = {k: np.empty((n_tok, cols), np.float32) for k in builds}
                for nt in args.threads:
                    times = {k: [] for k in builds}
                    for rnd in range(args.rounds + 1):
                        order = list(builds) if rnd % 2 == 0 else list(builds)[::-1]
                        for k in order:
                            best = 1e9
                            for _ in range(2):
                                t0 = time.perf_counter()
                                builds[k].matmul_t(w, int(qt), cols, a, outs[k], nt)
                                best = min(best, time.perf_counter() - t0)
                            if rnd:  # round 0 warms up
                                times[k].append(best * 1e3)
                    mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
                    diff = np.abs(outs["new"] - outs["old"]).max() / np.abs(outs["old"]).max()
                    print(f"| {tname} | {rows}x{cols} | {n_tok} | {nt} | {mo:.2f} | {mn:.2f} | "
                          f"{mo / mn:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
