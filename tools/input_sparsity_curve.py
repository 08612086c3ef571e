#!/usr/bin/env python3
"""Perplexity, measured sparsity and decode tokens/s of sparse mode "input" at several target
sparsities, against dense, in one run (docs/benchmarks.md, "Input sparsity (issue 12)").

    python tools/input_sparsity_curve.py DENSE.gguf --file wina=IN_WINA.gguf \
        --file magnitude=IN_MAG.gguf --heldout heldout.txt --targets 0.25 0.4 0.5 0.6 0.7 -t 2

DENSE.gguf is the same model converted with ``--dense`` (row layout): it is the calibration
engine, exactly as in ``pyinfer-convert`` (the same self-generated calibration tokens for the same
seed and count), and the dense baseline. Each IN_*.gguf was converted in sparse mode input with
that score (at any target: the weights and column norms do not depend on it); for each target the
thresholds come from the same allocation the converter runs (``--alloc``, one or more: uniform,
the converter's default, TEAL's block-wise greedy, or the model-wide Fisher allocation;
``thresholds_for``)
and are set on the loaded engine. "same file dense" runs the input file with every channel kept.
Decode: --n-gen greedy tokens after an 8-token prompt, every configuration once per round,
--reps rounds, medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.perplexity import perplexity  # noqa: E402
from predictors.calibrate import calibration_tokens  # noqa: E402
from predictors.input_sparse import calibrate, thresholds_for  # noqa: E402
from predictors.offline import DEFAULT_INPUT_CALIB_TOKENS  # noqa: E402

PROMPT = "The history of the printing press begins"


def set_thresholds(eng, thr):
    for gi, g in enumerate(C.IN_GROUPS):
        eng.model.ffn.thr[g] = (np.full(eng.cfg.n_layer, -1.0, np.float32) if thr is None
                                else np.ascontiguousarray(thr[:, gi]))


def decode_tps(eng, ids, n_gen):
    eng.reset()
    logits = eng.eval_prompt(ids)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        logits = eng.eval_token(int(np.argmax(logits)))
    return n_gen / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dense")
    ap.add_argument("--file", action="append", required=True, metavar="SCORE=PATH")
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.25, 0.4, 0.5, 0.6, 0.7])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--calib-tokens", type=int, default=DEFAULT_INPUT_CALIB_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--alloc", choices=list(C.IN_ALLOCS), nargs="+", default=["uniform"],
                    help="allocations to compare (each calibrated once per file)")
    ap.add_argument("--no-perplexity", action="store_true", help="decode speed only")
    ap.add_argument("--no-decode", action="store_true", help="perplexity and sparsity only")
    args = ap.parse_args()

    dense = Engine(args.dense, n_ctx=args.ctx, n_threads=args.threads, dense=True)
    cal = Engine(args.dense, n_ctx=min(512, dense.cfg.n_ctx_train), n_threads=args.threads,
                 dense=True)
    t0 = time.perf_counter()
    seqs, source = calibration_tokens(cal, None, args.calib_tokens, args.seed, 512, False)
    print(f"calibration: {sum(map(len, seqs))} tokens ({source}) in {time.perf_counter() - t0:.1f} s")
    text = open(args.heldout, encoding="utf-8").read()
    tokens = dense.tokenizer.encode(text, add_bos=False)
    ppl_dense, n_scored, _ = ((1.0, 0, 0) if args.no_perplexity else
                              perplexity(dense, tokens, args.ctx, args.chunks, progress=False))
    print(f"dense ({os.path.basename(args.dense)}): perplexity {ppl_dense:.4f} over {n_scored} tokens")

    configs = [("dense file", dense, "dense")]
    rows = []
    for spec in args.file:
        score, path = spec.split("=", 1)
        eng = Engine(path, n_ctx=args.ctx, n_threads=args.threads)
        set_thresholds(eng, None)
        ppl0 = 1.0 if args.no_perplexity else perplexity(eng, tokens, args.ctx, args.chunks,
                                                         progress=False)[0]
        rows.append((score, "-", 0.0, ppl0, 0.0))
        configs.append((f"{score} same file dense", eng, None))
        for alloc in args.alloc:
            t0 = time.perf_counter()
            curves, _ = calibrate(cal, seqs, score == "wina", args.seed, args.threads,
                                  max_sparsity=min(0.95, max(args.targets) + 0.05), alloc=alloc)
            print(f"{score} {alloc}: calibration in {time.perf_counter() - t0:.1f} s", flush=True)
            for tgt in args.targets:
                thr, _, _ = thresholds_for(curves, eng.cfg, tgt)
                set_thresholds(eng, thr)
                eng.reset_stats()
                if args.no_perplexity:  # measured sparsity from a short prefill instead
                    ppl = 1.0
                    eng.reset()
                    eng.model.forward(tokens[:256], 0)
                else:
                    ppl = perplexity(eng, tokens, args.ctx, args.chunks, progress=False)[0]
                rows.append((score, alloc, tgt, ppl, eng.ffn_sparsity()))
                configs.append((f"{score} {alloc} {tgt:.0%}", eng, thr))
                print(f"{score} {alloc} target {tgt:.0%}: perplexity {ppl:.4f} "
                      f"({ppl / ppl_dense - 1:+.2%}), measured sparsity {eng.ffn_sparsity():.1%}",
                      flush=True)

    if args.no_decode:
        print("\n| score | allocation | target | measured sparsity | perplexity | vs dense |")
        print("|---|---|---|---|---|---|")
        for score, alloc, tgt, ppl, sp in rows:
            print(f"| {score} | {alloc} | {'same file, all kept' if tgt == 0 else f'{tgt:.0%}'} | "
                  f"{sp:.1%} | {ppl:.3f} | {ppl / ppl_dense - 1:+.1%} |")
        return
    ids = dense.tokenizer.encode(PROMPT)[:8]
    tps = {name: [] for name, _, _ in configs}
    for _ in range(args.reps):
        for name, eng, thr in configs:
            if not isinstance(thr, str):
                set_thresholds(eng, thr)
            tps[name].append(decode_tps(eng, ids, args.n_gen))
    base = statistics.median(tps["dense file"])
    print(f"\ndecode tokens/s, {args.threads} threads, medians of {args.reps} interleaved rounds")
    for name, _, _ in configs:
        m = statistics.median(tps[name])
        print(f"{name:>28}: {m:7.1f}  ({m / base:.2f}x dense file)")
    print("\n| score | allocation | target | measured sparsity | perplexity | vs dense | decode tok/s | vs dense file |")
    print("|---|---|---|---|---|---|---|---|")
    for (score, alloc, tgt, ppl, sp), (name, _, _) in zip(rows, [c for c in configs if c[0] != "dense file"]):
        m = statistics.median(tps[name])
        print(f"| {score} | {alloc} | {'same file, all kept' if tgt == 0 else f'{tgt:.0%}'} | {sp:.1%} | "
              f"{ppl:.3f} | {ppl / ppl_dense - 1:+.1%} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
