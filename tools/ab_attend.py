#!/usr/bin/env python3
"""A/B builds of the kernel extension on one query's attention (``attend_one``: attend.h
pi_attend_team, what each decode step's attention runs), interleaved in one process.

    python tools/ab_attend.py A_kernels.so B_kernels.so [...] [--threads 2] [--rounds 15]
        [--n-head 9] [--n-head-kv 3] [--head-dim 64] [--n-att 256 480 1024] [--f32]

Random q and an f16 cache (f32 with --f32) of n_att rows; per round every build runs 200
calls; prints the median microseconds per call of each build (SmolLM2's heads by default).
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
from pyinfer.ops import cpu  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("so", nargs="+", help="builds' _kernels*.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n-head", type=int, default=9)
    ap.add_argument("--n-head-kv", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-att", type=int, nargs="+", default=[256, 480, 1024])
    ap.add_argument("--f32", action="store_true", help="an f32 cache instead of f16")
    args = ap.parse_args(argv)
    mods = {os.path.basename(p): load_kernels(p) for p in args.so}
    rng = np.random.default_rng(0)
    nh, nkv, hd = args.n_head, args.n_head_kv, args.head_dim
    dt = np.float32 if args.f32 else np.float16
    print(f"attend_one, {nh} heads / {nkv} KV heads x {hd}, {dt.__name__} cache, "
          f"{args.threads} threads: median us per call over {args.rounds} rounds")
    for na in args.n_att:
        q = rng.standard_normal((nh, hd)).astype(np.float32)
        kv = cpu.kv_pair(rng.standard_normal((na, nkv, hd)).astype(dt),
                         rng.standard_normal((na, nkv, hd)).astype(dt))
        out = np.empty((nh, hd), np.float32)
        times = {name: [] for name in mods}
        for _ in range(args.rounds):
            for name, m in mods.items():
                t = time.perf_counter()
                for _ in range(200):
                    m.attend_one(q, *kv, na - 1, out, args.threads)
                times[name].append((time.perf_counter() - t) / 200 * 1e6)
        print(f"n_att {na}: " + "  ".join(f"{name} {statistics.median(v):.1f}"
                                          for name, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
