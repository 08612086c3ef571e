#!/usr/bin/env python3
"""A/B two builds of pyinfer's kernel extension on the sparse operators, from DRAM.

    python tools/ab_kernels.py OLD_kernels.so NEW_kernels.so [--shapes 1536x576:Q5_0 ...]

Both builds are loaded side by side (each .so is a complete ``pyinfer.ops._kernels``) and called
alternately, best of 3 rounds, on SmolLM2's q8_0 FFN shape (1536 x 576) and Llama-2-7B's (11008 x
4096, f16 and q4_0), or the ROWSxCOLS:TYPE of --shapes, with every row (the dense matvec_t) or a sorted random 56% / 10% of them.
Weights are copied enough times that every call reads from memory, not cache. Prints GB/s of the
rows actually read for gather_matvec and axpy_rows, and new/old.

Make OLD.so with ``git stash; python setup.py build_ext --inplace; cp pyinfer/ops/_kernels*.so
/tmp/old.so; git stash pop`` and NEW.so the same way after the change.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402

QT = cpu.QT
SHAPES = [(1536, 576, QT.Q8_0, 150), (11008, 4096, QT.F16, 4), (11008, 4096, QT.Q4_0, 10)]



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", metavar="ROWSxCOLS:TYPE",
                    help="matrices to time instead of the default three (e.g. 1536x576:Q5_0)")
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.56, 0.10])
    args = ap.parse_args(argv)
    shapes = SHAPES
    if args.shapes:
        shapes = []
        for spec in args.shapes:
            dims, _, name = spec.partition(":")
            rows, cols = (int(v) for v in dims.split("x"))
            w_bytes = rows * cols // gguf.GGML_QUANT_SIZES[QT[name]][0] * \
                gguf.GGML_QUANT_SIZES[QT[name]][1]
            shapes.append((rows, cols, QT[name], max(2, int(64e6 // w_bytes))))
    mods = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    rng = np.random.default_rng(0)
    print("| matrix | rows read | threads | gather old -> new GB/s | AXPY old -> new GB/s |")
    print("|---|---|---|---|---|")
    for rows, cols, qt, n_copies in shapes:
        w0 = cpu.QTensor.from_array(rng.standard_normal((rows, cols), np.float32) * 0.02, qt)
        ws = [w0.raw.copy() for _ in range(n_copies)]
        x = rng.standard_normal(cols).astype(np.float32)
        a = rng.standard_normal(rows).astype(np.float32)
        o = np.empty(cols, np.float32)
        for dens in args.densities:
            idx = np.sort(rng.choice(rows, int(rows * dens), replace=False)).astype(np.int32)
            c = rng.standard_normal(idx.size).astype(np.float32)
            g = np.empty(idx.size, np.float32)
            for nt in args.threads:
                best = {}
                for _ in range(3):
                    for name, m in mods.items():
                        for kern in ("gather", "axpy"):
                            if kern == "gather":
                                f = lambda w: m.gather_matvec(w, int(qt), cols, x, idx, g, nt)  # noqa: E731
                            elif dens == 1.0:
                                f = lambda w: m.matvec_t(w, int(qt), cols, a, o, nt)  # noqa: E731
                            else:
                                f = lambda w: m.axpy_rows(w, int(qt), cols, c, idx, o, nt)  # noqa: E731
                            reps = max(1, 300 // n_copies)
                            t0 = time.perf_counter()
                            for _ in range(reps):
                                for w in ws:
                                    f(w)
                            dt = (time.perf_counter() - t0) / (reps * n_copies)
                            best[name, kern] = min(best.get((name, kern), 1e9), dt)
                nbytes = w0.nbytes * dens
                cells = []
                for kern in ("gather", "axpy"):
                    t_old, t_new = best["old", kern], best["new", kern]
                    cells.append(f"{nbytes / t_old / 1e9:.1f} -> {nbytes / t_new / 1e9:.1f} "
                                 f"({t_old / t_new:.2f}x)")
                print(f"| {qt.name} {rows}x{cols} | {dens:.0%} | {nt} | {cells[0]} | {cells[1]} |",
                      flush=True)


if __name__ == "__main__":
    main()
