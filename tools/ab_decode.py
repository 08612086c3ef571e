#!/usr/bin/env python3
"""A/B two builds of pyinfer's kernel extension on whole-model decode, interleaved in one process.

    python tools/ab_decode.py OLD_kernels.so NEW_kernels.so a.gguf[,b.gguf] [--threads 2]
        [--reps 9] [--n-gen 32] [--sparse]

Each model is loaded once; every round decodes --n-gen greedy tokens after an 8-token prompt with
the old build swapped into ``pyinfer.ops.cpu`` and then with the new one, so a slow spell of a
shared machine hits both alike. Prints median tokens/s per build, new/old (of the medians and
the median of the per-round ratios), whether both builds chose the same greedy tokens, and (for
two models) the ratio between the models per build. Make the .so files as tools/ab_kernels.py
says.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from ab_common import greedy_decode, load_kernels  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. " * 8



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("models", help="comma-separated pyinfer GGUF files")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--sparse", action="store_true",
                    help="run the files' predictors (sparse decode) instead of dense=True")
    args = ap.parse_args(argv)
    builds = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    models = args.models.split(",")
    engs = {m: Engine(m, n_ctx=256, n_threads=args.threads, dense=not args.sparse) for m in models}
    ids = {m: e.tokenizer.encode(TEXT) for m, e in engs.items()}
    rates, toks = {}, {}
    for rnd in range(args.reps + 1):  # round 0 warms up
        for m, eng in engs.items():
            for name, mod in builds.items():
                cpu._k = mod
                r, t = greedy_decode(eng, ids[m][:8], args.n_gen)  # an 8-token prompt
                toks.setdefault((m, name), t)
                if rnd:
                    rates.setdefault((m, name), []).append(r)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for m in models:
        o, n = med[m, "old"], med[m, "new"]
        rr = statistics.median(a / b for a, b in zip(rates[m, "new"], rates[m, "old"]))
        print(f"{os.path.basename(m)} threads {args.threads}: old {o:.1f} tok/s, new {n:.1f} tok/s, "
              f"new/old {n / o:.2f}x, median per-round new/old {rr:.3f}x "
              f"(same greedy tokens: {toks[m, 'old'] == toks[m, 'new']})")
    if len(models) == 2:
        for name in builds:
            a, b = med[models[0], name], med[models[1], name]
            print(f"{name}: {os.path.basename(models[0])} / {os.path.basename(models[1])} = {a / b:.2f}x")


if __name__ == "__main__":
    main()
