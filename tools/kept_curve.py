#!/usr/bin/env python3
"""Decode time of a sparse mode "input" file as its thresholds are scaled: what a token costs
at each fraction of projection bytes kept (issue 12).

    python tools/kept_curve.py INPUT.gguf [--threads 2] [--depth 8] [--rounds 7] [--n-gen 32]
        [--scales 0 0.5 1 1.5 2 3 none]

Each scale multiplies the file's per-layer, per-group thresholds (0: every input kept, as
``--dense`` runs the same kernels; "none": no input kept, so no projection row is read); the
lm head keeps the file's own threshold throughout. Every round decodes --n-gen greedy tokens
after a --depth-token prompt at each scale in turn (interleaved, so the machine's slow spells
hit all alike) and counts the projection bytes kept (the engine's own ``stats``). Prints, per
scale, the median microseconds per token and the fraction of projection bytes kept. A straight
line through the points gives the cost per byte kept (slope) and what any kept row costs beyond
its bytes (the intercept above the "none" point: scale rows, flushes, quantization, waits;
docs/benchmarks.md, session 27). Exits 1 with a message for a file without sparse mode input.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pyinfer  # noqa: E402,F401  (before NumPy: pyinfer's OPENBLAS_NUM_THREADS=1 takes effect)

import numpy as np  # noqa: E402

from pyinfer.engine import Engine  # noqa: E402
from pyinfer.errors import PyinferError  # noqa: E402

TEXT = "The history of the printing press begins in the fifteenth century. " * 64


def scale_arg(s: str) -> float:
    """A threshold scale: a number >= 0, or "none" (infinity: no input kept)."""
    if s == "none":
        return float("inf")
    v = float(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"scale {s} is negative")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", help="a GGUF file of sparse mode input")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=8, help="prompt tokens before the timed steps")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n-gen", type=int, default=32, help="timed greedy tokens per round")
    ap.add_argument("--scales", type=scale_arg, nargs="+",
                    default=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
    args = ap.parse_args(argv)
    try:
        eng = Engine(args.input, n_ctx=args.depth + args.n_gen + 8, n_threads=args.threads)
    except PyinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    isp = getattr(eng.model, "input_sparse", None)
    if isp is None or not isp.is_sparse:
        print(f"error: {args.input} has no sparse mode input", file=sys.stderr)
        return 1
    base = isp.thr.stacked.copy()
    prompt = eng.tokenizer.encode(TEXT, add_bos=False)[:args.depth]
    us = {s: [] for s in args.scales}
    kept = {s: [] for s in args.scales}
    for _ in range(args.rounds):
        for s in args.scales:
            # 0: every input (threshold -1); inf: none; else the file's thresholds times s
            isp.thr.stacked[...] = -1.0 if s == 0 else (np.inf if s == float("inf") else base * s)
            eng.reset()
            tok = int(np.argmax(eng.eval_prompt(prompt)))
            isp.stats.total = isp.stats.active = 0
            t0 = time.perf_counter()
            for _ in range(args.n_gen):
                tok = int(np.argmax(eng.eval_token(tok)))
            us[s].append((time.perf_counter() - t0) / args.n_gen * 1e6)
            kept[s].append(isp.stats.active / max(isp.stats.total, 1))
    isp.thr.stacked[...] = base
    print(f"{os.path.basename(args.input)}: {args.threads} threads, depth {args.depth}, "
          f"medians of {args.rounds} rounds of {args.n_gen} tokens")
    print("| thresholds | projection bytes kept | us / token |")
    print("|---|---|---|")
    for s in args.scales:
        name = "every input" if s == 0 else ("none" if s == float("inf") else f"x{s:g}")
        print(f"| {name} | {statistics.median(kept[s]):.3f} | {statistics.median(us[s]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
