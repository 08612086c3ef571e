#!/usr/bin/env python3
"""Where input-sparse decode spends its time against the --dense file, per token and projection.

    python tools/profile_input_decode.py DENSE.gguf INPUT.gguf [--threads 2] [--reps 15]
        [--thresholds thr.npz] [--so OTHER_kernels.so [--so ...]] [--imported]

DENSE.gguf is the model converted with ``--dense``, INPUT.gguf the same model in sparse mode
"input". Each layer's real inputs (the last token of an 8-token prompt) are recorded once; then,
round by round and in layer order (so the weights stream from memory as in a decode), this times

* the fused half-layers a decode calls (dense: ``decode_attn`` / ``decode_ffn``; input:
  ``decode_attn_in`` / ``decode_ffn_in``), summed over the layers;
* each projection on its own (dense: the int8 GEMVs ``matvec``, the down projection's
  ``matvec_t``; input: ``select_inputs`` and ``axpy_rows`` over the kept rows);
* the lm head (``matvec``) and a whole ``eval_token``, whose excess over the fused calls and the
  lm head is the Python and bookkeeping overhead.

The input file runs with every channel kept and at the file's own thresholds (and at each target
of --thresholds, an .npz of tools/ab_input_decode.py). Prints medians over --reps rounds in
microseconds per token (30 layers summed). --so swaps another build of the kernel extension in;
with several --so (or --so and --imported, the build pyinfer imports), every round times each
build in turn (interleaved, so that the machine's swings hit all alike) and the rows of each
build follow under its name, with the ratios of the fused halves and eval_token to the first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402

PROMPT = "The history of the printing press begins"


def record_inputs(inp, ids):
    """{(layer, group): (n_in,) f32} the last prompt token's input of every projection, and
    {(layer, "attn"/"ffn"): (n_embd,) f32} its residual stream before each fused half-layer."""
    ffn = inp.model.ffn
    rec = {}
    orig = ffn._mask, ffn.decode_attn, ffn.decode

    def spy(lw, layer, group, x, *a):
        rec[layer, group] = np.array(x[-1], np.float32)
        return orig[0](lw, layer, group, x, *a)

    glu_mask = cpu.glu_mask
    seen = []

    def spy_glu(gu, silu, scale, thr, out, nt):  # the down projection's input: act(g) * u
        a = np.empty((1, out.shape[1]), np.float32)
        glu_mask(np.ascontiguousarray(gu[-1:]), silu, None, -1.0, a, 1)
        rec[len(seen), "ffn_down"] = a[0]
        seen.append(1)
        return glu_mask(gu, silu, scale, thr, out, nt)

    def spy_attn(lw, layer, x, *a):
        rec[layer, "attn"] = x.copy()
        return orig[1](lw, layer, x, *a)

    def spy_ffn(lw, layer, x, *a):
        rec[layer, "ffn"] = x.copy()
        return orig[2](lw, layer, x, *a)

    import pyinfer.input_sparse as isp_mod

    try:
        ffn._mask = spy
        isp_mod.cpu.glu_mask = spy_glu
        inp.reset()
        inp.eval_prompt(ids)
        isp_mod.cpu.glu_mask = glu_mask
        ffn._mask, ffn.decode_attn, ffn.decode = orig[0], spy_attn, spy_ffn
        ffn.whole_token = False  # the per-layer calls, so that the spies see each layer's input
        inp.reset()
        inp.eval_prompt(ids[:-1])
        inp.eval_token(ids[-1])
    finally:
        ffn._mask, ffn.decode_attn, ffn.decode = orig
        ffn.whole_token = True
        isp_mod.cpu.glu_mask = glu_mask
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dense")
    ap.add_argument("input")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--thresholds", help=".npz of tools/ab_input_decode.py (targets to add)")
    ap.add_argument("--so", action="append", default=[],
                    help="another build of pyinfer.ops._kernels to time (repeatable)")
    ap.add_argument("--imported", action="store_true",
                    help="time the imported build too (after the --so builds)")
    args = ap.parse_args(argv)
    builds = [(os.path.basename(p), load_kernels(p)) for p in args.so]
    if args.imported or not builds:
        builds.append(("imported", cpu._k))
    cpu._k = builds[0][1]
    nt = args.threads
    dense = Engine(args.dense, n_ctx=256, n_threads=nt, dense=True)
    inp = Engine(args.input, n_ctx=256, n_threads=nt)
    cfg = inp.cfg
    ids = dense.tokenizer.encode(PROMPT)[:8]
    ffn = inp.model.ffn
    file_thr = {g: ffn.thr[g].copy() for g in C.IN_GROUPS}
    for g in C.IN_GROUPS:
        ffn.thr[g][:] = -1.0
    rec = record_inputs(inp, ids)
    thr_sets = {"all kept": {g: np.full(cfg.n_layer, -1.0, np.float32) for g in C.IN_GROUPS},
                "file": file_thr}
    if args.thresholds:
        npz = np.load(args.thresholds)
        for key in npz.files:
            thr_sets[f"target {float(key):.0%}"] = {g: np.ascontiguousarray(npz[key][:, gi])
                                                    for gi, g in enumerate(C.IN_GROUPS)}
    E, F = cfg.n_embd, cfg.n_ff
    n_past = len(ids)
    dl, il = dense.model.w.layers, inp.model.w.layers
    kc, vc = dense.model.cache.k, dense.model.cache.v
    kci, vci = inp.model.cache.k, inp.model.cache.v
    W = {"attn_qkv": lambda lw: lw.attn_qkv_t, "attn_output": lambda lw: lw.attn_output_t,
         "ffn_gate_up": lambda lw: lw.ffn_gate_up_t, "ffn_down": lambda lw: lw.ffn_down_t}
    outs = {g: np.empty(W[g](il[0]).cols, np.float32) for g in C.IN_GROUPS}
    coef = np.empty(max(E, F, cfg.n_embd_q), np.float32)
    idx = np.empty(coef.shape[0], np.int32)
    q = np.empty(cfg.n_embd_q, np.float32)
    k = np.empty(cfg.n_embd_kv, np.float32)
    v = np.empty(cfg.n_embd_kv, np.float32)
    y = np.empty(E, np.float32)
    g_ = np.empty(F, np.float32)
    u_ = np.empty(F, np.float32)
    logits = np.empty(cfg.n_vocab, np.float32)
    h = rec[0, "attn_qkv"].copy()
    res = {}
    pc = time.perf_counter

    def add(key, dt):
        res.setdefault(key, [0.0])[-1] += dt

    for rnd in range(args.reps + 1):
        for r in res.values():
            r.append(0.0)
        for bname, kmod in builds:
            cpu._k = kmod
            # the one-call decode plans are objects of the build that made them: remake them
            dense.model._rows_plan = None
            inp.model.input_sparse._plan = None
            # dense file: fused half-layers, then each projection
            for i, lw in enumerate(dl):
                x = rec[i, "attn"].copy()
                t0 = pc()
                cpu.decode_attn(x, lw.attn_norm, cfg.rms_eps, lw.wq, lw.wk, lw.wv, lw.wo, kc[i],
                                vc[i], n_past, cfg.n_head, cfg.rope_freq_base, nt)
                ta = pc()
                x = rec[i, "ffn"].copy()
                t1 = pc()
                if lw.ffn_down_t is None:  # a --dense file: ffn_down in row layout (session 9)
                    cpu.decode_ffn_rows(x, lw.ffn_norm, cfg.rms_eps, lw.ffn_gate, lw.ffn_up,
                                        lw.ffn_down, True, nt)
                else:
                    cpu.decode_ffn(x, lw.ffn_norm, cfg.rms_eps, lw.ffn_gate, lw.ffn_up,
                                   lw.ffn_down_t, cpu.FFN_DENSE, True, 0.0, nt)
                t2 = pc()
                add((bname, "dense", "fused attn half"), ta - t0)
                add((bname, "dense", "fused FFN half"), t2 - t1)
            for i, lw in enumerate(dl):
                t0 = pc()
                cpu.matvec(lw.wq, rec[i, "attn_qkv"], q, nt)
                cpu.matvec(lw.wk, rec[i, "attn_qkv"], k, nt)
                cpu.matvec(lw.wv, rec[i, "attn_qkv"], v, nt)
                t1 = pc()
                cpu.matvec(lw.wo, rec[i, "attn_output"], y, nt)
                t2 = pc()
                cpu.matvec(lw.ffn_gate, rec[i, "ffn_gate_up"], g_, nt)
                cpu.matvec(lw.ffn_up, rec[i, "ffn_gate_up"], u_, nt)
                t3 = pc()
                if lw.ffn_down_t is None:
                    cpu.matvec(lw.ffn_down, rec[i, "ffn_down"], y, nt)
                    down_key = "down (GEMV, row layout)"
                else:
                    cpu.matvec_t(lw.ffn_down_t, rec[i, "ffn_down"], y, nt)
                    down_key = "down (matvec_t, f32)"
                t4 = pc()
                for key, dt in (("q,k,v (3 GEMV)", t1 - t0), ("o (GEMV)", t2 - t1),
                                ("gate,up (2 GEMV)", t3 - t2), (down_key, t4 - t3)):
                    add((bname, "dense", key), dt)
            t0 = pc()
            cpu.matvec(dense.model.w.output, h, logits, nt)
            add((bname, "dense", "lm head"), pc() - t0)
            dense.reset()
            dense.eval_prompt(ids)
            t0 = pc()
            dense.eval_token(ids[0])
            add((bname, "dense", "eval_token"), pc() - t0)
            for name, thr in thr_sets.items():
                for gname in C.IN_GROUPS:
                    ffn.thr[gname][:] = thr[gname]
                for i, lw in enumerate(il):
                    x = rec[i, "attn"].copy()
                    t0 = pc()
                    cpu.decode_attn_in(x, lw.attn_norm, cfg.rms_eps, lw.attn_qkv_t,
                                       lw.attn_output_t, kci[i], vci[i], n_past, cfg.n_head,
                                       cfg.rope_freq_base, None, thr["attn_qkv"][i], None,
                                       thr["attn_output"][i], nt)
                    ta = pc()
                    x = rec[i, "ffn"].copy()
                    t1 = pc()
                    cpu.decode_ffn_in(x, lw.ffn_norm, cfg.rms_eps, lw.ffn_gate_up_t, lw.ffn_down_t,
                                      None, thr["ffn_gate_up"][i], None, thr["ffn_down"][i], True,
                                      nt)
                    t2 = pc()
                    add((bname, name, "fused attn half"), ta - t0)
                    add((bname, name, "fused FFN half"), t2 - t1)
                for i, lw in enumerate(il):
                    for gname in C.IN_GROUPS:
                        xin = rec[i, gname]
                        t0 = pc()
                        n = cpu.select_inputs(xin, None, thr[gname][i], coef[:len(xin)],
                                              idx[:len(xin)])
                        t1 = pc()
                        cpu.axpy_rows(W[gname](lw), coef[:n], idx[:n], outs[gname], nt)
                        t2 = pc()
                        add((bname, name, f"{gname} select"), t1 - t0)
                        add((bname, name, f"{gname} axpy"), t2 - t1)
                        add((bname, name, f"{gname} kept"), n / len(xin) / cfg.n_layer)
                inp.reset()
                inp.eval_prompt(ids)
                t0 = pc()
                inp.eval_token(ids[0])
                add((bname, name, "eval_token"), pc() - t0)
        if rnd == 0:
            res = {key: [] for key in res}
    cpu._k = builds[0][1]
    med = {key: statistics.median(v) for key, v in res.items()}
    print(f"{args.threads} threads, medians of {args.reps} rounds, microseconds per token "
          f"({cfg.n_layer} layers summed; 'kept' = mean fraction of rows kept)")
    for bname, _ in builds:
        print(f"\n==== build {bname}")
        for cname in ["dense"] + list(thr_sets):
            keys = [k2 for (b2, c2, k2) in med if b2 == bname and c2 == cname]
            print(f"\n[{cname}]")
            for k2 in keys:
                val = med[bname, cname, k2]
                print(f"  {k2:28s} {val:8.3f}" if k2.endswith("kept")
                      else f"  {k2:28s} {val * 1e6:8.0f}")
            fused = med[bname, cname, "fused attn half"] + med[bname, cname, "fused FFN half"]
            head = med[bname, "dense", "lm head"]
            print(f"  {'fused halves + lm head':28s} {(fused + head) * 1e6:8.0f}")
            print(f"  {'eval_token - that':28s} "
                  f"{(med[bname, cname, 'eval_token'] - fused - head) * 1e6:8.0f}")
    if len(builds) > 1:
        b0 = builds[0][0]
        print(f"\nmedian of per-round ratios, build / {b0} (time: below 1 is faster)")
        for bname, _ in builds[1:]:
            for cname in ["dense"] + list(thr_sets):
                for k2 in ("fused attn half", "fused FFN half", "eval_token"):
                    r = statistics.median(a / b for a, b in zip(res[bname, cname, k2],
                                                                 res[b0, cname, k2]))
                    print(f"  {bname:12s} [{cname}] {k2:18s} {r:6.3f}")

if __name__ == "__main__":
    main()
