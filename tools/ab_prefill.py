#!/usr/bin/env python3
"""A/B the prefill of two pyinfer source trees (each with its own built kernels), interleaved.

    python tools/ab_prefill.py OLD_TREE NEW_TREE [--models a.gguf b.gguf] [--threads 1 2] \
        [--n-prompt 128 512] [--rounds 3] [--reps 2]

Two Python packages named ``pyinfer`` cannot be imported into one process, so each tree runs in
its own worker process (PYTHONPATH=TREE) that keeps every model loaded; the parent asks them in
turn, alternating which goes first each round, so a slow spell of a shared machine hits both.
Each answer is the best of --reps prefills of --n-prompt tokens from an empty cache (prefill
tokens/s); the table gives medians over --rounds rounds after one warm-up round, and NEW/OLD.

Make OLD_TREE with ``git archive REV | tar -x -C /tmp/old`` and build it there (``python
setup.py build_ext --inplace``), or copy a built .so into a copy of the tree.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time
from pyinfer.engine import Engine
TEXT = "The quick brown fox jumps over the lazy dog. " * 64
engs = {}
for line in sys.stdin:
    path, nt, n, reps = line.split()
    nt, n, reps = int(nt), int(n), int(reps)
    if path not in engs:
        engs[path] = Engine(path, n_ctx=1024, n_threads=nt)
    e = engs[path]
    e.model.n_threads = nt
    ids = e.tokenizer.encode(TEXT)[:n]
    best = 0.0
    for _ in range(reps):
        e.reset()
        t0 = time.perf_counter()
        e.model.forward(ids, 0)
        best = max(best, len(ids) / (time.perf_counter() - t0))
    print(best, flush=True)
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="source tree with built kernels (the A side)")
    ap.add_argument("new", help="source tree with built kernels (the B side)")
    ap.add_argument("--models", nargs="+", required=True, help="pyinfer GGUF files")
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--n-prompt", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    for tree in (args.old, args.new):
        if not os.path.isdir(os.path.join(tree, "pyinfer")):
            ap.error(f"{tree} holds no pyinfer package")

    def start(tree):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        return subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, cwd=tree)

    workers = {"A": start(args.old), "B": start(args.new)}

    def ask(side, model, nt, n):
        w = workers[side]
        w.stdin.write(f"{model} {nt} {n} {args.reps}\n")
        w.stdin.flush()
        line = w.stdout.readline()
        if not line:
            sys.exit(f"worker {side} stopped (see its error above)")
        return float(line)

    cells = list(itertools.product(args.models, args.threads, args.n_prompt))
    for c in cells:  # warm-up: load every model, touch the pages
        for side in "AB":
            ask(side, *c)
    res: dict = {}
    for r in range(args.rounds):
        for c in cells:
            for side in ("AB" if r % 2 == 0 else "BA"):
                res.setdefault((c, side), []).append(ask(side, *c))
    print("| model | threads | n_prompt | old tokens/s | new tokens/s | new/old |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        a, b = statistics.median(res[(c, "A")]), statistics.median(res[(c, "B")])
        print(f"| {os.path.basename(c[0])} | {c[1]} | {c[2]} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    for w in workers.values():
        w.stdin.close()
        w.wait()


if __name__ == "__main__":
    main()
