#!/usr/bin/env python3
"""A/B two builds of the kernel extension on input-sparse decode against the --dense file.

    python tools/ab_input_decode.py OLD_kernels.so NEW_kernels.so DENSE.gguf INPUT.gguf \
        --thresholds thr.npz [--targets 0.25 0.4 0.5] [--threads 2] [--reps 5] [--n-gen 32]

DENSE.gguf is the model converted with ``--dense``, INPUT.gguf the same model in sparse mode
"input". The thresholds for each target come from one calibration (the same calibration text,
scores and uniform allocation as ``pyinfer-convert`` and tools/input_sparsity_curve.py), cached in
--thresholds (made on the first run). Every round decodes --n-gen greedy tokens after an 8-token
prompt for each configuration (dense file; input file with every channel kept; each target) with
the old build swapped into ``pyinfer.ops.cpu`` and then the new one, so a slow spell of a shared
machine hits both alike. Prints median tokens/s, new/old, and each configuration against the
dense file under the same build. Make the .so files as tools/ab_kernels.py says.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import greedy_decode, load_kernels  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402

PROMPT = "The history of the printing press begins"



def make_thresholds(dense, inp, targets, path, n_threads):
    """Calibrate once (as tools/input_sparsity_curve.py) and save thresholds per target."""
    from predictors.calibrate import calibration_tokens
    from predictors.input_sparse import calibrate, thresholds_for
    from predictors.offline import DEFAULT_INPUT_CALIB_TOKENS
    cal = Engine(dense, n_ctx=512, n_threads=n_threads, dense=True)
    seqs, _ = calibration_tokens(cal, None, DEFAULT_INPUT_CALIB_TOKENS, 0, 512, False)
    curves, _ = calibrate(cal, seqs, False, 0, n_threads, max_sparsity=min(0.95, max(targets) + 0.05),
                          alloc="uniform")
    cfg = Engine(inp, n_ctx=64, n_threads=n_threads).cfg
    thr = {f"{t:.2f}": thresholds_for(curves, cfg, t)[0] for t in targets}
    tmp = path + ".tmp.npz"
    np.savez(tmp, **thr)
    os.replace(tmp, path)


def set_thresholds(eng, thr):
    for gi, g in enumerate(C.IN_GROUPS):
        eng.model.ffn.thr[g] = (np.full(eng.cfg.n_layer, -1.0, np.float32) if thr is None
                                else np.ascontiguousarray(thr[:, gi]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("dense")
    ap.add_argument("input")
    ap.add_argument("--thresholds", required=True, help=".npz cache of the calibrated thresholds")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.4, 0.5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=32)
    args = ap.parse_args(argv)
    if not os.path.exists(args.thresholds):
        make_thresholds(args.dense, args.input, args.targets, args.thresholds, args.threads)
    thr = np.load(args.thresholds)
    builds = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    dense = Engine(args.dense, n_ctx=256, n_threads=args.threads, dense=True)
    inp = Engine(args.input, n_ctx=256, n_threads=args.threads)
    ids = dense.tokenizer.encode(PROMPT)[:8]
    configs = [("dense file", dense, "dense"), ("input file, all kept", inp, None)]
    configs += [(f"input file, target {t:.0%}", inp, thr[f"{t:.2f}"]) for t in args.targets]
    rates = {}
    for rnd in range(args.reps + 1):  # round 0 warms up
        for name, eng, th in configs:
            if not isinstance(th, str):
                set_thresholds(eng, th)
            for b, mod in builds.items():
                cpu._k = mod
                r = greedy_decode(eng, ids, args.n_gen)[0]
                if rnd:
                    rates.setdefault((name, b), []).append(r)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"decode tokens/s, {args.threads} threads, medians of {args.reps} interleaved rounds, "
          f"{args.n_gen} tokens")
    print("| configuration | old | new | new/old | old vs dense file | new vs dense file |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in configs:
        o, n = med[name, "old"], med[name, "new"]
        print(f"| {name} | {o:.1f} | {n:.1f} | {n / o:.2f}x | {o / med['dense file', 'old']:.2f}x | "
              f"{n / med['dense file', 'new']:.2f}x |")


if __name__ == "__main__":
    main()
