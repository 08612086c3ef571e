#!/usr/bin/env python3
"""A/B two builds of pyinfer's kernel extension on the dense decode GEMV (``matvec``).

    python tools/ab_gemv.py OLD_kernels.so NEW_kernels.so [--shapes 1536x576:Q5_0 ...]
        [--threads 1 2] [--cache]

Both builds are loaded side by side (each .so is a complete ``pyinfer.ops._kernels``) and called
alternately, best of 5 rounds, on SmolLM2's decode shapes by default (gate/up 1536 x 576, the
attention's 576 x 576, the output matrix 49152 x 576). Weights are copied until 64 MB are read
per round, so every call reads from memory as in decode (``--cache``: one copy, the weights stay
in L2/L3, which shows the arithmetic alone). Prints microseconds per call, GB/s of weight bytes
and new/old speed. Make the .so files as tools/ab_kernels.py says.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402

QT = cpu.QT
DEFAULT = ["1536x576:Q8_0", "1536x576:Q4_0", "1536x576:Q5_0", "1536x576:Q4_1", "1536x576:Q5_1",
           "576x576:Q5_0", "49152x576:Q8_0"]



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT, metavar="ROWSxCOLS:TYPE")
    ap.add_argument("--cache", action="store_true", help="one weight copy (cache-resident)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    mods = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    rng = np.random.default_rng(0)
    print("| matrix | threads | old us | new us | old GB/s | new GB/s | new/old speed |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.shapes:
        dims, _, name = spec.partition(":")
        rows, cols = (int(v) for v in dims.split("x"))
        qt = QT[name]
        w0 = cpu.QTensor.from_array(rng.standard_normal((rows, cols), np.float32) * 0.02, qt)
        n_copies = 1 if args.cache else max(2, int(64e6 // w0.raw.nbytes))
        ws = [w0.raw if i == 0 else w0.raw.copy() for i in range(n_copies)]
        x = rng.standard_normal(cols).astype(np.float32)
        out = {k: np.empty(rows, np.float32) for k in mods}
        reps = max(1, 200 // n_copies)
        for nt in args.threads:
            best = {}
            for _ in range(args.rounds):
                for key, m in mods.items():
                    o = out[key]
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        for w in ws:
                            m.matvec(w, int(qt), cols, x, o, nt)
                    dt = (time.perf_counter() - t0) / (reps * n_copies)
                    best[key] = min(best.get(key, 1e9), dt)
            ok = np.allclose(out["old"], out["new"], rtol=1e-4, atol=1e-4 * np.abs(out["old"]).max())
            t_old, t_new = best["old"], best["new"]
            print(f"| {name} {rows}x{cols} | {nt} | {t_old * 1e6:.1f} | {t_new * 1e6:.1f} | "
                  f"{w0.raw.nbytes / t_old / 1e9:.1f} | {w0.raw.nbytes / t_new / 1e9:.1f} | "
                  f"{t_old / t_new:.2f}x{'' if ok else ' (outputs differ!)'} |", flush=True)


if __name__ == "__main__":
    main()
