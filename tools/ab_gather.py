#!/usr/bin/env python3
"""A/B of ``gather_matvec`` (the sparse FFN's gate/up rows) across builds and gather modes, from DRAM.

    python tools/ab_gather.py NAME=PATH.so[:MODE] ... [--shapes 1536x576:Q8_0 ...]
        [--densities 1.0 0.56 0.1] [--threads 1 2] [--rounds 5]

Each NAME=PATH.so is a complete ``pyinfer.ops._kernels`` build; ``:MODE`` calls its
``set_gather_mode(MODE)`` before each of its calls (builds from session 8 on: 0 the session-7
burst prefetch, 1 the prefetch spread over the blocks, 2 one row per pass). Builds and modes are
called alternately, best of --rounds, on sorted random subsets of the rows (SmolLM2's sparse
decode keeps about 56%); weights are copied until 64 MB are read per round, so rows come from
memory as in decode. Prints GB/s of the rows read and each column's speed over the first one.
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



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", metavar="NAME=PATH.so[:MODE]")
    ap.add_argument("--shapes", nargs="+", default=["1536x576:Q8_0", "1536x576:Q4_0",
                                                     "1536x576:Q5_0"], metavar="ROWSxCOLS:TYPE")
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.56, 0.10])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    builds, mods = [], {}
    for spec in args.builds:
        name, _, rest = spec.partition("=")
        path, _, mode = rest.partition(":")
        if path not in mods:
            mods[path] = load_kernels(path)
        builds.append((name, mods[path], int(mode) if mode else None))
    rng = np.random.default_rng(0)
    names = [b[0] for b in builds]
    print("| matrix | rows read | threads | " + " | ".join(f"{n} GB/s" for n in names) + " | " +
          " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " |")
    print("|---" * (3 + 2 * len(names) - 1) + "|")
    for spec in args.shapes:
        dims, _, tname = spec.partition(":")
        rows, cols = (int(v) for v in dims.split("x"))
        qt = QT[tname]
        w0 = cpu.QTensor.from_array(rng.standard_normal((rows, cols), np.float32) * 0.02, qt)
        n_copies = max(2, int(64e6 // w0.raw.nbytes))
        ws = [w0.raw.copy() for _ in range(n_copies)]
        x = rng.standard_normal(cols).astype(np.float32)
        for dens in args.densities:
            idx = np.sort(rng.choice(rows, max(1, int(rows * dens)), replace=False)).astype(np.int32)
            outs = {n: np.empty(idx.size, np.float32) for n in names}
            for nt in args.threads:
                best = {}
                for _ in range(args.rounds):
                    for name, m, mode in builds:
                        if mode is not None:
                            m.set_gather_mode(mode)
                        g = outs[name]
                        reps = max(1, 300 // n_copies)
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            for w in ws:
                                m.gather_matvec(w, int(qt), cols, x, idx, g, nt)
                        dt = (time.perf_counter() - t0) / (reps * n_copies)
                        best[name] = min(best.get(name, 1e9), dt)
                nbytes = w0.raw.nbytes * idx.size / rows
                gbs = [nbytes / best[n] / 1e9 for n in names]
                ratios = [best[names[0]] / best[n] for n in names[1:]]
                print(f"| {tname} {rows}x{cols} | {dens:.0%} | {nt} | " +
                      " | ".join(f"{v:.1f}" for v in gbs) + " | " +
                      " | ".join(f"{r:.2f}x" for r in ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
