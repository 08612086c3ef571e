#!/usr/bin/env python3
"""A/B two builds of pyinfer's kernel extension on whole-model decode, interleaved in one process.

    python tools/ab_decode.py OLD_kernels.so NEW_kernels.so a.gguf[,b.gguf] [--threads 2]
        [--reps 9] [--n-gen 32] [--sparse] [--depths 8 480]

Each model is loaded once per build; every round decodes --n-gen greedy tokens after a prompt of each
--depths length (default 8 tokens) with
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

TEXT = "The quick brown fox jumps over the lazy dog. " * 400



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
    ap.add_argument("--depths", type=int, nargs="+", default=[8], help="prompt lengths (tokens)")
    args = ap.parse_args(argv)
    builds = {"old": load_kernels(args.old), "new": load_kernels(args.new)}
    models = args.models.split(",")
    n_ctx = max(256, max(args.depths) + args.n_gen + 8)
    engs = {}  # one engine per model and build: a kernel plan is an object of its build's module
    for m in models:
        for name, mod in builds.items():
            cpu._k = mod
            engs[m, name] = Engine(m, n_ctx=n_ctx, n_threads=args.threads, dense=not args.sparse)
    ids = {m: engs[m, "old"].tokenizer.encode(TEXT) for m in models}
    for depth in args.depths:
        if any(len(v) < depth for v in ids.values()):
            raise SystemExit(f"--depths: at most {min(len(v) for v in ids.values())} tokens")
        rates, toks = {}, {}
        for rnd in range(args.reps + 1):  # round 0 warms up
            for m in models:
                for name, mod in builds.items():
                    cpu._k = mod
                    r, t = greedy_decode(engs[m, name], ids[m][:depth], args.n_gen)
                    toks.setdefault((m, name), t)
                    if rnd:
                        rates.setdefault((m, name), []).append(r)
        med = {k: statistics.median(v) for k, v in rates.items()}
        for m in models:
            o, n = med[m, "old"], med[m, "new"]
            rr = sorted(a / b for a, b in zip(rates[m, "new"], rates[m, "old"]))
            q1, q3 = rr[len(rr) // 4], rr[(3 * len(rr)) // 4]
            print(f"{os.path.basename(m)} depth {depth} threads {args.threads}: old {o:.1f} tok/s, "
                  f"new {n:.1f} tok/s, new/old {n / o:.2f}x, median per-round new/old "
                  f"{statistics.median(rr):.3f}x (IQR {q1:.3f}-{q3:.3f}; same greedy tokens: "
                  f"{toks[m, 'old'] == toks[m, 'new']})", flush=True)
        if len(models) == 2:
            for name in builds:
                a, b = med[models[0], name], med[models[1], name]
                print(f"{name}: {os.path.basename(models[0])} / {os.path.basename(models[1])} = {a / b:.2f}x")


if __name__ == "__main__":
    main()
