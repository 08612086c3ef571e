#!/usr/bin/env python3
"""Decode speed of several GGUF files against the first, interleaved, at given context depths.

    python tools/ab_files_decode.py DENSE.gguf INPUT.gguf [INPUT.gguf:dense ...] [--threads 2]
        [--depths 8 256 480] [--rounds 20] [--n-gen 16]

A file named with the suffix ``:dense`` runs with every input kept (``pyinfer-run --dense``, the
issue's baseline "the same file with --dense": the same kernels and fixed work, nothing skipped);
a suffix ``:f32`` or ``:f16`` (after ``:dense`` where both) sets its KV cache type (``--cache-type``;
default auto: f32 for an f32 file, f16 otherwise).

For each depth P, every round evaluates a P-token prompt on each file's engine and then times
--n-gen greedy tokens (so the attention reads P .. P + n_gen cache rows, as llama-bench's
``-d P -n N``); the files run in turn, the order rotated and reversed round by round, so that the
machine's slow spells (they move one file's speed by 25% between minutes on the 2-core box, and
only interleaved ratios mean anything: docs/benchmarks.md) hit all files alike. Prints a
Markdown table per depth: median tokens/s of each file and the median and quartiles of its
per-round ratio to the first file.

Before each round a compute probe (``ab_common.TeamProbe``) measures how much faster T threads
run than one: this project's 2-core microVM (a kernel booted with ``sched_vcpu_pack``) now and
then gives its two vCPUs one core's worth of compute for 10-45 s, where a 2-thread input-sparse
file decodes at its 1-thread speed while a dense one, bound by memory, barely moves
(docs/benchmarks.md, session 38). With T > 1 the first table therefore gives the medians over
the rounds whose probe found at least ``--min-team`` x one thread, and says how many rounds
those were; the medians over all rounds follow in a second table.

The context depth matters: attention is a fixed cost that the files share, so an input-sparse
file's lead over the dense one shrinks as the cache grows (docs/benchmarks.md, session 13).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import pyinfer  # noqa: E402,F401  (before NumPy: pyinfer's OPENBLAS_NUM_THREADS=1 takes effect)

import numpy as np  # noqa: E402

from ab_common import TeamProbe  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.errors import PyinferError  # noqa: E402

TEXT = "The history of the printing press begins in the fifteenth century. " * 64


def decode_round(eng, prompt, n_gen: int) -> float:
    """Reset, evaluate ``prompt``, then time n_gen greedy steps: tokens/s."""
    eng.reset()
    tok = int(np.argmax(eng.eval_prompt(prompt)))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(eng.eval_token(tok)))
    return n_gen / (time.perf_counter() - t0)


def table(names, res, rounds) -> str:
    """Markdown rows: each file's median tokens/s over ``rounds`` and its per-round ratio to
    the first file (median, quartiles)."""
    out = [f"| file | tokens/s | vs {names[0]} | IQR |", "|---|---|---|---|"]
    for name, v in zip(names, res):
        v = [v[r] for r in rounds]
        rat = [a / res[0][r] for a, r in zip(v, rounds)]
        q = statistics.quantiles(rat, n=4) if len(rat) > 1 else [rat[0]] * 3
        out.append(f"| {name} | {statistics.median(v):.1f} | {statistics.median(rat):.3f}x "
                   f"| {q[0]:.3f}-{q[2]:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="GGUF files; ratios are to the first")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 256, 480],
                    help="prompt tokens before the timed steps (default 8 256 480)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--n-gen", type=int, default=16, help="timed greedy tokens per round")
    ap.add_argument("--min-team", type=float, default=1.5,
                    help="rounds whose team probe finds less than this speedup over one thread "
                         "are left out of the first table (default 1.5; 2-core box: 1.2-1.3 "
                         "packed, 1.8 not)")
    args = ap.parse_args(argv)
    if min(args.depths) < 1 or args.rounds < 1 or args.n_gen < 1 or args.threads < 1:
        ap.error("depths, --rounds, --n-gen and --threads must be positive")
    try:
        n_ctx = max(args.depths) + args.n_gen + 1
        engs = []
        for p in args.files:
            path, _, cache_type = p.partition(":f")
            cache_type = "f" + cache_type if cache_type else "auto"
            engs.append(Engine(path.removesuffix(":dense"), n_ctx=n_ctx, n_threads=args.threads,
                               dense=path.endswith(":dense"), cache_type=cache_type))
    except (PyinferError, OSError) as e:
        print(f"ab_files_decode: {e}", file=sys.stderr)
        return 1
    probe = TeamProbe(args.threads) if args.threads > 1 else None
    ids = engs[0].tokenizer.encode(TEXT)
    while len(ids) < max(args.depths):
        ids = ids + ids
    names = [os.path.basename(p).replace(":dense", " --dense").replace(":f", " --cache-type f")
             for p in args.files]
    print(f"{args.threads} threads, {args.rounds} rounds of {args.n_gen} tokens per file and depth; "
          f"PYINFER_ADAPTIVE_THREADS={os.environ.get('PYINFER_ADAPTIVE_THREADS', '(unset)')}\n")
    for depth in args.depths:
        prompt = ids[:depth]
        for e in engs:  # warm-up: first touch of the weights and the cache
            decode_round(e, prompt, 2)
        res = [[] for _ in engs]
        team = []  # the probe's speedup before each round
        for r in range(args.rounds):
            order = list(range(len(engs)))
            order = order[r % len(order):] + order[:r % len(order)]
            if r % 2:
                order.reverse()
            team.append(probe.speedup() if probe else 1.0)
            for k in order:
                res[k].append(decode_round(engs[k], prompt, args.n_gen))
        every = list(range(args.rounds))
        if not probe:
            print(f"depth {depth}\n\n{table(names, res, every)}\n")
            continue
        full = [r for r in every if team[r] >= args.min_team]
        print(f"depth {depth}: {len(full)} of {args.rounds} rounds with the team at "
              f">= {args.min_team:g}x one thread (probe median {statistics.median(team):.2f}x)\n")
        if full:
            print(table(names, res, full) + "\n")
        print(f"depth {depth}, all {args.rounds} rounds\n\n{table(names, res, every)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
