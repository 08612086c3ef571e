#!/usr/bin/env python3
"""A/B builds of the kernel extension on the prefill GEMM of input-block tensors (ibsum.h).

    python tools/ab_ib_prefill.py INPUT.gguf OLD_kernels.so NEW_kernels.so [...]
        [--threads 1 2] [--n-tok 128 512] [--drop 0.3] [--rounds 5]

INPUT is an input-sparse q8_0/q4_0 file (its four matrices as IBTensor: ``attn_qkv_t``,
``attn_output_t``, ``ffn_gate_up_t``, ``ffn_down_t``). For each matrix, each token count and each
thread count, times ``matmul_t`` over the 30 layers' matrices in turn with one (n_tok, n_in) f32
input whose entries are 0 with probability --drop (the masked input of a prefill), every build
in turn within each round (the order alternating), after checking that every build gives the
same bits. Prints the median milliseconds per pass over the layers for each build and the ratio
build 0 / last build. Make the .so files as tools/ab_kernels.py says.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from ab_input_kernels import NAMES  # noqa: E402  (the four matrices' LayerWeights fields)
from pyinfer.engine import Engine  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n-tok", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--drop", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--names", nargs="+", default=NAMES)
    args = ap.parse_args(argv)
    builds = [load_kernels(p) for p in args.builds]
    layers = Engine(args.input, n_ctx=64, n_threads=1).model.w.layers
    rng = np.random.default_rng(0)
    xs = {}
    for nm in args.names:
        w = getattr(layers[0], nm)
        for n in args.n_tok:
            x = rng.standard_normal((n, w.rows)).astype(np.float32)
            x[rng.random(x.shape) < args.drop] = 0.0
            outs = []
            for k in builds:
                o = np.empty((n, w.cols), np.float32)
                k.matmul_t(w.raw, int(w.qtype), w.cols, x, o, 2)
                outs.append(o)
            if not all(np.array_equal(outs[0], o) for o in outs[1:]):
                sys.exit(f"{nm} n_tok={n}: the builds give different bits")
            xs[nm, n] = x
    res = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        order = list(range(len(builds)))[::1 if rnd % 2 else -1]
        for nt in args.threads:
            for (nm, n), x in xs.items():
                out = np.empty((n, getattr(layers[0], nm).cols), np.float32)
                row = [0.0] * len(builds)
                for b in order:
                    t0 = time.perf_counter()
                    for lw in layers:
                        w = getattr(lw, nm)
                        builds[b].matmul_t(w.raw, int(w.qtype), w.cols, x, out, nt)
                    row[b] = (time.perf_counter() - t0) * 1e3
                if rnd:
                    res.setdefault((nt, nm, n), []).append(row)
    print("| threads | matrix | tokens | " + " | ".join(
        f"build {i} (ms / {len(layers)} calls)" for i in range(len(builds))) + " | build 0 / last |")
    print("|---" * (4 + len(builds)) + "|")
    for (nt, nm, n), v in res.items():
        med = [statistics.median(r[i] for r in v) for i in range(len(builds))]
        print(f"| {nt} | {nm} | {n} | " + " | ".join(f"{m:.2f}" for m in med)
              + f" | {med[0] / med[-1]:.2f} |")


if __name__ == "__main__":
    main()
