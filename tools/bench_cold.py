#!/usr/bin/env python3
"""The hybrid engine's host-side cold path on its own (issue 10): ``cpu.cold_ffn`` on the cold
neurons of bench_gpu.py's 7B/13B-shaped ReLU layers, by thread count, no GPU needed.

At a VRAM budget the GPU holds the hottest neurons (by the expected activation counts, as the
placement's ILP orders neurons of equal size), and per layer and token the host computes the
rest that the layer's predictor marks: gate rows of the candidates, up rows of the active ones,
their down rows' sum (``GpuModel._cold``). Inputs are real: h is a normed random residual with
bench_gpu's bias channel, the mask is the layer's exact predictor on it. Each timed pass walks
every (token, layer) pair in order, so rows come from memory as in a decode (the layers' cold
rows outgrow the last-level cache); per thread count the builds run in turn, pass by pass
(interleaved), and the median of ``--reps`` passes is printed.

    python tools/bench_cold.py [--shape 7b] [--qtype q4_0] [--layers 8] [--budget 0.5]
        [--threads 1 2 4 8 16] [--so OTHER_kernels.so ...]

Prints per build and thread count: microseconds per layer and token, candidates and active
neurons per layer, the row bytes they read, and that as GB/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from bench_gpu import SHAPES, build_model  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402
from pyinfer.ops.cpu import QT  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--qtype", default="q4_0", choices=["f16", "q4_0"])
    ap.add_argument("--layers", type=int, default=8, help="distinct layers (default 8)")
    ap.add_argument("--tokens", type=int, default=10, help="inputs per layer")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="fraction of each layer's neurons on the GPU (the hottest)")
    ap.add_argument("--density", type=float, default=0.10)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--so", nargs="*", default=[], help="other builds' _kernels*.so to compare")
    args = ap.parse_args(argv)
    if not 0.0 <= args.budget < 1.0:
        ap.error("--budget must be in [0, 1)")
    qtype = QT.F16 if args.qtype == "f16" else QT.Q4_0
    t0 = time.perf_counter()
    cfg, weights, preds, counts, _rows = build_model(args.shape, qtype, args.layers,
                                                     args.density, 1.0, 128, 0.05)
    E, F, L = cfg.n_embd, cfg.n_ff, cfg.n_layer
    print(f"built {args.shape} x{L} layers {args.qtype} in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    rng = np.random.default_rng(1)
    cold = [np.sort(np.argsort(-c, kind="stable")[int(args.budget * F):]).astype(np.int32)
            for c in counts]
    inputs = []  # per token, per layer: (h, mask)
    for _ in range(args.tokens):
        row = []
        for i in range(L):
            x = rng.standard_normal(E).astype(np.float32)
            x[0] = np.sqrt(E)  # bench_gpu's bias channel
            h = (x / np.sqrt(np.mean(x * x))).astype(np.float32)
            row.append((h, preds[i].mask(h[None], 1)[0].astype(np.uint8)))
        inputs.append(row)
    builds = [("imported", cpu._k)] + [(p, load_kernels(p)) for p in args.so]
    row_bytes = weights.layers[0].ffn_gate.data.shape[1]
    out = np.zeros(E, np.float32)

    def one_pass(k, n_threads):
        n_cand = n_kept = 0
        t = time.perf_counter()
        for row in inputs:
            for i, (h, mask) in enumerate(row):
                lw = weights.layers[i]
                c, n = k.cold_ffn(lw.ffn_gate.raw, int(lw.ffn_gate.qtype), lw.ffn_up.raw,
                                  int(lw.ffn_up.qtype), lw.ffn_down_t.raw,
                                  int(lw.ffn_down_t.qtype), h, cold[i], mask, 0, 0, 0.0, out,
                                  n_threads)
                n_cand += c
                n_kept += n
        return time.perf_counter() - t, n_cand, n_kept

    pairs = args.tokens * L
    print(f"Cold path, Llama-2-{args.shape} shape, {args.qtype}, {L} layers x {args.tokens} "
          f"tokens, {args.budget:.0%} of neurons on the GPU, {F - cold[0].size} hot / "
          f"{cold[0].size} cold per layer; median of {args.reps} interleaved passes\n")
    print("| build | threads | us/layer | candidates | active | MB read | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for T in args.threads:
        times = {name: [] for name, _ in builds}
        seen = {}
        for name, k in builds:  # warm-up pass (page faults, thread pool)
            one_pass(k, T)
        for _ in range(args.reps):
            for name, k in builds:
                dt, c, n = one_pass(k, T)
                times[name].append(dt / pairs)
                seen[name] = (c / pairs, n / pairs)
        for name, _ in builds:
            dt = statistics.median(times[name])
            c, n = seen[name]
            mb = (c + 2 * n) * row_bytes / 1e6  # gate rows of candidates, up + down of active
            print(f"| {name} | {T} | {dt * 1e6:.1f} | {c:.0f} | {n:.0f} | {mb:.2f} | "
                  f"{mb / 1e3 / dt:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
