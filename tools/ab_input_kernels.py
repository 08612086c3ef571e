#!/usr/bin/env python3
"""A/B builds of the kernel extension on the row sums of an input-sparse file, per projection.

    python tools/ab_input_kernels.py INPUT.gguf OLD_kernels.so NEW_kernels.so [...]
        [--threads 1 2] [--fracs 1.0 0.7] [--rounds 8] [--names attn_qkv_t ffn_down_t]

For each transposed matrix of the file (``attn_qkv_t``, ``attn_output_t``, ``ffn_gate_up_t``,
``ffn_down_t``) and each fraction of its rows (a sorted random subset, the same for every build),
times ``axpy_rows`` over the 30 layers' matrices in turn ("stream": the weights come from memory,
as in a decode) and over layer 0's matrix 30 times ("cache": from L2/L3), every build in turn
within each round, after checking that every build gives build 0's bits (layer 0, at 1-3 and the
given thread counts). Prints the median microseconds per 30 calls for each build (build 0 first).
Make the .so files as tools/ab_kernels.py says.
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
from pyinfer.engine import Engine  # noqa: E402

NAMES = ["attn_qkv_t", "attn_output_t", "ffn_gate_up_t", "ffn_down_t"]



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--fracs", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--names", nargs="+", default=NAMES)
    ap.add_argument("--evict-mib", type=int, default=0,
                    help="read this many MiB before each stream timing, so that matrices small "
                         "enough for the L3 cache come from memory too (0: no eviction)")
    args = ap.parse_args(argv)
    builds = [load_kernels(p) for p in args.builds]
    layers = Engine(args.input, n_ctx=64, n_threads=1).model.w.layers
    rng = np.random.default_rng(0)
    sets = {}
    for nm in args.names:
        rows = getattr(layers[0], nm).rows  # input channels (QTensor or IBTensor)
        for frac in args.fracs:
            n = int(rows * frac)
            sets[nm, frac] = (np.sort(rng.choice(rows, n, replace=False)).astype(np.int32),
                              rng.standard_normal(n).astype(np.float32))
    # every build must give build 0's bits (layer 0, each thread count, each row set)
    for (nm, frac), (idx, coef) in sets.items():
        w = getattr(layers[0], nm)
        ref = None
        for k in builds:
            for nt in sorted(set(args.threads) | {1, 2, 3}):
                out = np.empty(w.cols, np.float32)
                k.axpy_rows(w.raw, int(w.qtype), w.cols, coef, idx, out, nt)
                if ref is None:
                    ref = out.copy()
                elif not np.array_equal(out.view(np.uint32), ref.view(np.uint32)):
                    sys.exit(f"{nm} {frac:.0%}: a build or thread count {nt} differs from build 0")
    print("bits: every build and thread count equal to build 0")
    evict = np.ones(args.evict_mib << 18, np.float32)
    res = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for nt in args.threads:
            for (nm, frac), (idx, coef) in sets.items():
                out = np.empty(getattr(layers[0], nm).cols, np.float32)
                for mode in ("stream", "cache"):
                    row = []
                    for k in builds:
                        if mode == "stream" and evict.size:
                            evict += 1.0  # read and write every line: the caches hold it now
                        t0 = time.perf_counter()
                        for i in range(len(layers)):
                            w = getattr(layers[i if mode == "stream" else 0], nm)
                            k.axpy_rows(w.raw, int(w.qtype), w.cols, coef, idx, out, nt)
                        row.append((time.perf_counter() - t0) * 1e6)
                    if rnd:
                        res.setdefault((nt, nm, frac, mode), []).append(row)
    print("| threads | matrix | rows | weights from | " + " | ".join(
        f"build {i} (us / {len(layers)} calls)" for i in range(len(builds))) + " |")
    print("|---" * (4 + len(builds)) + "|")
    for (nt, nm, frac, mode), v in res.items():
        med = [statistics.median(r[i] for r in v) for i in range(len(builds))]
        print(f"| {nt} | {nm} | {frac:.0%} | {mode} | " + " | ".join(f"{m:.0f}" for m in med) + " |")


if __name__ == "__main__":
    main()
