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
``--fisher-weight W ...`` evaluates the Fisher allocation shrunk towards uniform by each weight
(``--sparse-alloc fisher --fisher-weight W``); uniform and every weight then share one
calibration (the Fisher pass gives the uniform curves too). With several ``--heldout`` texts,
perplexity only, no "same file dense" run: each text's table gives the perplexity of each quarter of its chunks, and
``--json`` keeps every chunk's negative log-likelihood for paired comparisons.
Decode: --n-gen greedy tokens after an 8-token prompt, every configuration once per round,
--reps rounds; tokens/s are medians, ratios the medians of the per-round ratios, against the
dense file and against the same input file with every channel kept (``pyinfer-run --dense``,
issue 12's baseline).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.input_sparse import thresholds_from_reader  # noqa: E402
from pyinfer.perplexity import log_softmax_at, perplexity  # noqa: E402
from ab_common import greedy_decode  # noqa: E402
from predictors.calibrate import calibration_tokens  # noqa: E402
from predictors.input_sparse import calibrate, thresholds_for  # noqa: E402
from predictors.offline import DEFAULT_FISHER_WEIGHT, DEFAULT_INPUT_CALIB_TOKENS  # noqa: E402

PROMPT = "The history of the printing press begins"


def set_thresholds(eng, thr, head=None):
    """Body thresholds (n_layer, 4) or None (every channel kept); the lm head's threshold too
    when given (-1: the exact head, as ``--dense``: a two-stage head's q4_1 copy and candidates
    are set aside, and put back with a threshold >= 0)."""
    isp = eng.model.ffn
    file_thr = thresholds_from_reader(eng.reader, eng.cfg)  # the file's head: threshold, K
    if head is not None and "output" in file_thr:
        k = file_thr.get("output_candidates", 0)
        if head < 0 and k:
            isp.lm_head_thr, isp.head_candidates = None, 0
        else:
            isp.lm_head_thr, isp.head_candidates = head, k
    for gi, g in enumerate(C.IN_GROUPS):
        eng.model.ffn.thr[g] = (np.full(eng.cfg.n_layer, -1.0, np.float32) if thr is None
                                else np.ascontiguousarray(thr[:, gi]))


def calibration_engine(args, n_ctx):
    """The engine the calibration records inputs with, as the offline stage's (f32 cache): the
    --calib file, else DENSE; it must hold ``ffn_down_t`` (the converter's neuron-major staging
    layout, ``convert.cli.convert(src, out, type)``), which a ``--dense`` file does not."""
    eng = Engine(args.calib or args.dense, n_ctx=n_ctx, n_threads=args.threads, dense=True,
                 cache_type="f32")
    if any(lw.ffn_down_t is None for lw in eng.model.w.layers):
        sys.exit(f"{args.calib or args.dense}: no ffn_down_t (a --dense file); pass a neuron-major "
                 "dense file as --calib (convert.cli.convert(src, out, type))")
    return eng


def chunk_nll(eng, tokens, n_ctx, n_chunks):
    """Per chunk (sum of -log p over the scored second half, count scored), exactly as
    ``pyinfer.perplexity`` scores: (n_chunks, 2) f64."""
    out = np.zeros((n_chunks, 2))
    first = n_ctx // 2
    bos = eng.tokenizer.bos_id if eng.tokenizer.add_bos else None
    for c in range(n_chunks):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        eng.reset()
        logits = eng.forward(chunk, 0, all_logits=True)
        lp = log_softmax_at(logits[first:n_ctx - 1], np.asarray(chunk[first + 1:n_ctx]))
        out[c] = (-lp.sum(), lp.shape[0])
    return out


def quarters(nll):
    """Perplexity of each quarter of the chunks (consecutive, as equal as the count allows)."""
    return [math.exp(q[:, 0].sum() / q[:, 1].sum()) for q in np.array_split(nll, 4) if len(q)]


def main_texts(args):
    """Several held-out texts, perplexity only (module docstring)."""
    cal_eng = calibration_engine(args, 512)
    t0 = time.perf_counter()
    seqs, source = calibration_tokens(cal_eng, None, args.calib_tokens, args.seed, 512, False)
    print(f"calibration: {sum(map(len, seqs))} tokens ({source}) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    dense = Engine(args.dense, n_ctx=args.ctx, n_threads=args.threads, dense=True)
    texts = {}
    for path in args.heldout:
        toks = dense.tokenizer.encode(open(path, encoding="utf-8").read(), add_bos=False)
        n = min(len(toks) // args.ctx, args.chunks)
        texts[path] = (toks, n)
        print(f"{path}: {len(toks)} tokens, {n} chunks of {args.ctx}", flush=True)
    res = {p: [] for p in texts}  # per text: (label, target, measured sparsity, per-chunk nll)

    def run(label, tgt, eng):
        for p, (toks, n) in texts.items():
            eng.reset_stats()
            nll = chunk_nll(eng, toks, args.ctx, n)
            sp = 0.0 if tgt is None else eng.ffn_sparsity()
            res[p].append((label, tgt, sp, nll))
            print(f"{os.path.basename(p)} {label}: perplexity "
                  f"{math.exp(nll[:, 0].sum() / nll[:, 1].sum()):.4f}, sparsity {sp:.1%}",
                  flush=True)

    run("dense file", None, dense)
    score, path = args.file[0].split("=", 1)
    eng = Engine(path, n_ctx=args.ctx, n_threads=args.threads)
    cals = {}
    first = "fisher" if "fisher" in args.alloc else args.alloc[0]
    t0 = time.perf_counter()
    base, _ = calibrate(cal_eng, seqs, score == "wina", args.seed, args.threads,
                        max_sparsity=min(0.95, max(args.targets) + 0.05), alloc=first)
    print(f"{first} calibration in {time.perf_counter() - t0:.1f} s", flush=True)
    for alloc in args.alloc:
        if alloc == first or (alloc == "uniform" and first == "fisher"):
            cals[alloc] = dataclasses.replace(base, alloc=alloc)
        else:
            cals[alloc], _ = calibrate(cal_eng, seqs, score == "wina", args.seed, args.threads,
                                       max_sparsity=min(0.95, max(args.targets) + 0.05),
                                       alloc=alloc)
    for tgt in args.targets:
        for alloc in args.alloc:
            for w in (args.fisher_weight if alloc == "fisher" else [1.0]):
                thr, lv, _ = thresholds_for(cals[alloc], eng.cfg, tgt, w)
                set_thresholds(eng, thr)
                run(alloc if alloc != "fisher" else f"fisher w={w:g}", tgt, eng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({p: [(lb, t, sp, nll.tolist()) for lb, t, sp, nll in r]
                       for p, r in res.items()}, f)
    for p, rows in res.items():
        d = rows[0][3]
        pd = math.exp(d[:, 0].sum() / d[:, 1].sum())
        print(f"\n{p}: {int(d[:, 1].sum())} scored tokens; dense {pd:.3f}")
        print("| allocation | target | measured sparsity | perplexity | vs dense | per quarter |")
        print("|---|---|---|---|---|---|")
        for lb, t, sp, nll in rows:
            ppl = math.exp(nll[:, 0].sum() / nll[:, 1].sum())
            print(f"| {lb} | {'-' if t is None else f'{t:.0%}'} | {sp:.1%} | {ppl:.3f} | "
                  f"{ppl / pd - 1:+.1%} | {' / '.join(f'{q:.2f}' for q in quarters(nll))} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dense")
    ap.add_argument("--file", action="append", required=True, metavar="SCORE=PATH")
    ap.add_argument("--calib", help="neuron-major dense file to calibrate with (default DENSE)")
    ap.add_argument("--heldout", required=True, nargs="+",
                    help="text file(s); with more than one, perplexity only (main_texts)")
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
    ap.add_argument("--fisher-weight", type=float, nargs="+", default=[DEFAULT_FISHER_WEIGHT],
                    help="fisher: the weights to shrink it towards uniform by (blend_levels; "
                         f"default {DEFAULT_FISHER_WEIGHT:g}, the converter's)")
    ap.add_argument("--json", help="several texts: write every chunk's nll here")
    ap.add_argument("--no-perplexity", action="store_true", help="decode speed only")
    ap.add_argument("--no-decode", action="store_true", help="perplexity and sparsity only")
    args = ap.parse_args()
    if len(args.heldout) > 1 or args.json:
        return main_texts(args)
    args.heldout = args.heldout[0]

    dense = Engine(args.dense, n_ctx=args.ctx, n_threads=args.threads, dense=True)
    cal = calibration_engine(args, min(512, dense.cfg.n_ctx_train))
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
        head_thr = eng.model.ffn.lm_head_thr
        set_thresholds(eng, None, -1.0)
        ppl0 = 1.0 if args.no_perplexity else perplexity(eng, tokens, args.ctx, args.chunks,
                                                         progress=False)[0]
        rows.append((score, "-", 0.0, ppl0, 0.0))
        configs.append((f"{score} same file dense", eng, (None, -1.0)))
        for alloc in args.alloc:
            t0 = time.perf_counter()
            curves, _ = calibrate(cal, seqs, score == "wina", args.seed, args.threads,
                                  max_sparsity=min(0.95, max(args.targets) + 0.05), alloc=alloc)
            print(f"{score} {alloc}: calibration in {time.perf_counter() - t0:.1f} s", flush=True)
            for tgt, w in [(t, w) for t in args.targets
                           for w in (args.fisher_weight if alloc == "fisher" else [1.0])]:
                thr, _, _ = thresholds_for(curves, eng.cfg, tgt, w)
                set_thresholds(eng, thr, head_thr)
                eng.reset_stats()
                if args.no_perplexity:  # measured sparsity from a short prefill instead
                    ppl = 1.0
                    eng.reset()
                    eng.model.forward(tokens[:256], 0)
                else:
                    ppl = perplexity(eng, tokens, args.ctx, args.chunks, progress=False)[0]
                lb = alloc if alloc != "fisher" or w == 1.0 else f"fisher w={w:g}"
                rows.append((score, lb, tgt, ppl, eng.ffn_sparsity()))
                configs.append((f"{score} {lb} {tgt:.0%}", eng, (thr, head_thr)))
                print(f"{score} {lb} target {tgt:.0%}: perplexity {ppl:.4f} "
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
                set_thresholds(eng, *thr)
            tps[name].append(greedy_decode(eng, ids, args.n_gen)[0])
    base = statistics.median(tps["dense file"])
    print(f"\ndecode tokens/s, {args.threads} threads, medians of {args.reps} interleaved rounds")
    for name, _, _ in configs:
        m = statistics.median(tps[name])
        print(f"{name:>28}: {m:7.1f}  ({m / base:.2f}x dense file)")

    def ratio(name, ref):  # median of the per-round ratios (rounds are interleaved)
        return statistics.median(a / b for a, b in zip(tps[name], tps[ref]))

    print("\n| score | allocation | target | measured sparsity | perplexity | vs dense | decode tok/s "
          "| vs dense file | vs same file --dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (score, alloc, tgt, ppl, sp), (name, _, _) in zip(rows, [c for c in configs if c[0] != "dense file"]):
        m = statistics.median(tps[name])
        print(f"| {score} | {alloc} | {'same file, all kept' if tgt == 0 else f'{tgt:.0%}'} | {sp:.1%} | "
              f"{ppl:.3f} | {ppl / ppl_dense - 1:+.1%} | {m:.1f} | {ratio(name, 'dense file'):.2f}x | "
              f"{ratio(name, f'{score} same file dense'):.2f}x |")


if __name__ == "__main__":
    main()
