#!/usr/bin/env python3
"""Decode tokens/s on an idle machine and beside CPU hogs, for several threading setups (issue 9).

    python tools/bench_busy.py MODEL.gguf [--n-gen 64] [--rounds 3] [--hogs 1 2] [--nice-hogs 2]
        [--explore]

OpenMP reads its wait policy once, when the kernels' runtime (libgomp) loads, so every setup runs in
a fresh child process with its own environment. Setups, interleaved round by round within each
condition (idle, then with each ``--hogs`` count of processes running ``while True: pass``,
then with ``--nice-hogs`` such processes under ``nice -n 19``):

- ``passive``: pyinfer's default from issue 9 to session 5 (OMP_WAIT_POLICY=PASSIVE: a waiting
  thread sleeps at once), default thread count.
- ``spin, no governor``: libgomp's default wait (spin about 300,000 times, then sleep) with every
  pass on the default thread count (PYINFER_ADAPTIVE_THREADS=0): what pyinfer did before issue 9.
- ``defaults``: pyinfer's defaults now (spin, and the thread governor of ``pyinfer.threads``).
- ``-t 1``: defaults with one thread.
- ``--explore`` adds passive waiting at -t 1 and other spin counts without the governor.

Each child loads the model once, decodes one warm-up run and then ``--reps`` runs of ``--n-gen``
greedy tokens after an 8-token prompt, and reports the median and the share of passes the governor
ran on fewer threads; the table gives the median over rounds, and the range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "PYINFER_ADAPTIVE_THREADS")


def child(model: str, threads: int | None, n_gen: int, reps: int) -> None:
    sys.path.insert(0, ROOT)
    import numpy as np

    from pyinfer.engine import Engine

    eng = Engine(model, n_ctx=256, n_threads=threads)
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:8]
    rates = []
    for i in range(reps + 1):
        if i == 1:
            eng.reset_stats()
        eng.reset()
        logits = eng.eval_prompt(ids)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            logits = eng.eval_token(int(np.argmax(logits)))
        if i:
            rates.append(n_gen / (time.perf_counter() - t0))
    t = eng.timings
    print(json.dumps({"tok_s": statistics.median(rates), "threads": eng.n_threads,
                      "reduced": t.passes_reduced / max(1, t.passes)}))


def setups(explore: bool) -> list[tuple[str, dict, int | None]]:
    """(label, OpenMP variables, -t or None for pyinfer's default)."""
    out = [("passive", {"OMP_WAIT_POLICY": "PASSIVE"}, None),
           ("spin, no governor", {"PYINFER_ADAPTIVE_THREADS": "0"}, None),
           ("defaults", {}, None),
           ("-t 1", {}, 1)]
    if explore:
        out += [("passive, -t 1", {"OMP_WAIT_POLICY": "PASSIVE"}, 1)]
        out += [(f"GOMP_SPINCOUNT={n}, no governor",
                 {"GOMP_SPINCOUNT": n, "PYINFER_ADAPTIVE_THREADS": "0"}, None)
                for n in ("1000", "10000", "30000")]
    return out


def run_child(model, env_vars, threads, n_gen, reps):
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(env_vars)
    cmd = [sys.executable, os.path.abspath(__file__), model, "--child", "--n-gen", str(n_gen),
           "--reps", str(reps)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hogs", type=int, nargs="+", default=[1])
    ap.add_argument("--nice-hogs", type=int, default=0)
    ap.add_argument("--explore", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.model, args.threads, args.n_gen, args.reps)
    print("| condition | setup | -t | decode tokens/s (median) | range | passes on fewer threads |")
    print("|---|---|---|---|---|---|")
    conditions = [(0, 0)] + [(h, 0) for h in args.hogs] + ([(args.nice_hogs, 19)]
                                                          if args.nice_hogs else [])
    for hogs, nice in conditions:
        procs = [subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", "while True: pass"])
                 for _ in range(hogs)]
        try:
            res = {s[0]: [] for s in setups(args.explore)}
            used, reduced = {}, {}
            for _ in range(args.rounds):
                for label, env_vars, threads in setups(args.explore):
                    r = run_child(args.model, env_vars, threads, args.n_gen, args.reps)
                    res[label].append(r["tok_s"])
                    used[label] = r["threads"]
                    reduced.setdefault(label, []).append(r["reduced"])
        finally:
            for p in procs:
                p.kill()
                p.wait()
        cond = "idle" if hogs == 0 else f"{hogs} CPU hog" + ("s" if hogs > 1 else "")
        if nice:
            cond += f" at nice {nice}"
        for label, rates in res.items():
            print(f"| {cond} | {label} | {used[label]} | {statistics.median(rates):.1f} | "
                  f"{min(rates):.1f}-{max(rates):.1f} | "
                  f"{100 * statistics.median(reduced[label]):.0f}% |", flush=True)


if __name__ == "__main__":
    main()
