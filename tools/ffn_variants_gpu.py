#!/usr/bin/env python3
"""The sparse FFN's two GPU kernels at one 7B/13B-shaped layer, the engine's forms against
variants (issue 10: why all-on-GPU sparse is 1.25x dense, not 1.5x).

A sparse token's FFN on the GPU is two launches (``pyinfer.ops.cuda``):

- ``ffn_gate_up``: warp per hot neuron; the predictor's fc2 row decides whether it is a
  candidate, and a candidate's gate and up rows are dotted with the q8 activation. Forms timed:
  fused (one launch, the default), listed (``set_gate_up_list``: the candidates listed first),
  each with the GEMV's dot or the wide one (``set_gate_up_wide``: a candidate's gate and up loads
  in flight together), and the dense case (every row, no predictor) for scale;
- ``axpy_rows``: the down projection over the kept neurons' ``ffn_down_t`` rows, per chunk of
  rows a block lists its nonzero coefficients and each thread adds UNROLL rows' units at a time,
  then ``axpy_sum`` adds the chunks' partial sums. Timed: the engine (chunks of 64 rows, the
  type's UNROLL), the same kernel compiled here with other UNROLLs and chunk sizes (the sums per
  column are the engine's in the same order where the chunks are the same: equal bits), and the
  dense case;
- the rest of the layer's kernels (``rest_of_layer``), so the tables add up to a layer.

Weights are random quants in the device layout (``tools/gemv_variants_gpu.random_rows``),
copied enough times that the timed calls cycle over more bytes than the L2 holds; one pass over
the copies is captured as a CUDA graph and replayed (the engine decodes from graphs too, so
Python's launch rate does not time the fast forms). The predictor
(fc2 (n_ff, rank) f16, a ReLU hidden layer) gets a threshold that makes ``--cand`` of the rows
candidates. Every form's coefficients are checked against the fused engine form's (the wide dots
sum in another order: within float rounding), every AXPY against the engine's.

    python tools/ffn_variants_gpu.py [--shape 7b] [--qtype q4_0] [--cand 0.15] [--reps 30]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import SHAPES  # noqa: E402
from gemv_variants_gpu import random_rows  # noqa: E402
from pyinfer.ops import cuda  # noqa: E402
from pyinfer.ops.cpu import QT  # noqa: E402

QTYPE = {"q4_0": QT.Q4_0, "q8_0": QT.Q8_0}
UNIT = {"q4_0": "UnitQ4_0", "q8_0": "UnitQ8_0"}
#: (rows per chunk, threads per block, UNROLL) of the AXPY variants compiled here
AXPY_VARIANTS = ((64, 64, 4), (64, 64, 8), (64, 64, 16), (32, 64, 8), (128, 128, 8),
                 (128, 128, 16))


def timed(fn, n_copy: int, reps: int) -> float:
    """Microseconds per call of fn(j): fn(0 .. n_copy-1) captured once as a CUDA graph (so the
    GPU runs the calls back to back, not at the rate Python launches them), the graph replayed
    reps times between two events, after warm-up calls (compiles, lookups, caches)."""
    cp = cuda.cupy
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for j in range(3):
            fn(j)
        stream.synchronize()
        stream.begin_capture()
        try:
            for j in range(n_copy):
                fn(j)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        e0 = stream.record()
        for _ in range(reps):
            graph.launch(stream)
        e1 = stream.record()
        e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / (reps * n_copy)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--qtype", default="q4_0", choices=sorted(QTYPE))
    ap.add_argument("--cand", type=float, default=0.15, help="fraction of rows the predictor marks")
    ap.add_argument("--rank", type=int, default=264, help="predictor hidden size (bench_gpu: 264)")
    ap.add_argument("--reps", type=int, default=30, help="timed passes over the copies")
    ap.add_argument("--l2-bytes", type=float, default=600e6, help="bytes cycled over")
    args = ap.parse_args(argv)
    if not cuda.available():
        print(f"ffn_variants_gpu: needs a CUDA device ({cuda.unavailable_reason()})",
              file=sys.stderr)
        return 2
    cp = cuda.cupy
    E, F = SHAPES[args.shape][0], SHAPES[args.shape][1]
    qt, qn = QTYPE[args.qtype], args.qtype
    rng = np.random.default_rng(0)
    raws = {k: random_rows(rng, F, E, qn) for k in ("gate", "up", "down")}
    per_layer = sum(r.nbytes for r in raws.values())
    n_copy = max(2, int(args.l2_bytes // per_layer))
    layers = [{k: cuda.DeviceRows(cp.asarray(r), qt, F, E) for k, r in raws.items()}
              for _ in range(n_copy)]
    fc2_h = rng.standard_normal((F, args.rank)).astype(np.float16)
    hid_h = np.maximum(rng.standard_normal(args.rank), 0).astype(np.float32)
    p = fc2_h.astype(np.float32) @ hid_h
    thr = float(np.quantile(p, 1.0 - args.cand))
    fc2 = [cuda.DeviceRows(cp.asarray(fc2_h.view(np.uint8).reshape(F, -1)), QT.F16, F, args.rank)
           for _ in range(n_copy)]
    hid = cp.asarray(hid_h)
    x = cp.asarray(rng.standard_normal(E).astype(np.float32))
    q8 = cuda.q8_buffers(E)
    cuda.quantize_q8(x, q8)
    ids = cp.arange(F, dtype=cp.int32)
    coef = cp.empty(F, cp.float32)
    counts = cp.zeros(2, cp.uint64)
    scratch = cp.empty(cuda.gate_up_list_len(F), cp.int32)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"device: {name}; {args.shape} {qn}: n_embd {E}, n_ff {F}, {per_layer / 1e6:.0f} MB a "
          f"layer's FFN, {n_copy} copies cycled; predictor rank {args.rank}, "
          f"{args.cand:.0%} candidates\n")

    def gate_up(j, pred=True):
        ly = layers[j % n_copy]
        cuda.ffn_gate_up(ly["gate"], ly["up"], x, coef, counts, "relu", 0.0 if pred else -1.0,
                         ids=ids, pred=(fc2[j % n_copy], hid, thr) if pred else None, q8=q8,
                         scratch=scratch)

    print("| ffn_gate_up form | us/call | candidates | kept | max diff vs fused (of max coef) |")
    print("|---|---|---|---|---|")
    ref = None
    wide0 = cuda.gate_up_wide()  # the engine's default (wide since session 28)
    forms = [("fused, GEMV dots", False, False, True), ("listed", True, False, True),
             ("fused, wide", False, True, True), ("listed, wide", True, True, True),
             ("dense (every row)", False, False, False),
             ("dense (every row), wide dots (gemv_wide)", False, None, False)]
    for label, listed, wide, pred in forms:
        cuda.set_gate_up_list(listed)
        cuda.set_gate_up_wide(wide0 if wide is None else wide)
        cuda.set_gemv_wide(wide is None)
        try:
            counts.fill(0)
            gate_up(0, pred)
            c = cp.asnumpy(coef)
            n = cp.asnumpy(counts)
            if ref is None:
                ref = c
                coef_sparse = cp.asarray(c)
            err = float(np.max(np.abs(c - ref)) / (np.abs(ref).max() or 1.0)) if pred else float("nan")
            us = timed(lambda j: gate_up(j, pred), n_copy, args.reps)
        finally:
            cuda.set_gate_up_list(False)
            cuda.set_gate_up_wide(wide0)
            cuda.set_gemv_wide(False)
        print(f"| {label} | {us:.1f} | {int(n[0])} | {int(n[1])} | {err:.1e} |")

    # the down projection over the fused form's coefficients (the kept neurons' rows)
    n_kept = int(np.count_nonzero(ref))
    part_src = cuda._AXPY_TEMPLATE[:cuda._AXPY_TEMPLATE.index('extern "C" __global__ void dequant_')]
    src = cuda.COMMON_SRC + cuda._AXPY_UNITS + "".join(
        part_src.replace("@T@", f"{qn}_u{u}").replace("@U@", UNIT[qn]).replace("@UNROLL@", str(u))
        for u in sorted({v[2] for v in AXPY_VARIANTS}))
    mod = cp.RawModule(code=src, options=("-std=c++14",))
    out = cp.empty(E, cp.float32)
    part = cp.empty(cuda.axpy_chunks(F) * E * 2 + E, cp.float32)
    coef_dense = cp.asarray(rng.standard_normal(F).astype(np.float32))
    print(f"\n| down projection (axpy over ffn_down_t, {n_kept} of {F} rows kept) | us/call | "
          f"max diff vs engine (of max out) |")
    print("|---|---|---|")

    def engine(j, a):
        cuda.axpy_rows(layers[j % n_copy]["down"], a, out, skip_zero=True, scratch=part)

    engine(0, coef_sparse)
    want = cp.asnumpy(out)
    print(f"| engine (64 rows a chunk, UNROLL {cuda._AXPY_TYPES[qn][1]}) | "
          f"{timed(lambda j: engine(j, coef_sparse), n_copy, args.reps):.1f} | 0 |")
    for rpc, block, unroll in AXPY_VARIANTS:
        fn = mod.get_function(f"axpy_part_{qn}_u{unroll}")
        n_chunks = -(-F // rpc)
        tile = block * 32

        def var(j, a, fn=fn, rpc=rpc, block=block, n_chunks=n_chunks, tile=tile):
            w = layers[j % n_copy]["down"]
            fn(((E + tile - 1) // tile, n_chunks), (block,),
               (w.data, np.int64(w.row_bytes), np.int32(F), np.int32(E), a, np.int32(rpc),
                np.int32(1), part))
            cuda._sum_partials(part, n_chunks, E, False, out)

        var(0, coef_sparse)
        err = float(np.max(np.abs(cp.asnumpy(out) - want)) / (np.abs(want).max() or 1.0))
        us = timed(lambda j: var(j, coef_sparse), n_copy, args.reps)
        print(f"| {rpc} rows a chunk, {block} threads, UNROLL {unroll} | {us:.1f} | {err:.1e} |")
    print(f"| engine, dense (every row) | "
          f"{timed(lambda j: engine(j, coef_dense), n_copy, args.reps):.1f} | - |")
    try:
        rest_of_layer(args, rng, E, qt, qn, q8, hid, x, n_copy)
    except Exception as e:  # the FFN tables above stand; say what failed here
        print(f"\nrest of the layer: failed ({type(e).__name__}: {e})")
    return 0


def rest_of_layer(args, rng, E, qt, qn, q8, hid, x, n_copy) -> None:
    """The other kernels of a decode layer, each timed as above (graph-captured over copies of
    its weights): the attention's RMSNorm (+ q8 form), the fused q/k/v GEMV, RoPE and the cache
    store, one-query attention at position 32 (+ q8 form), the output GEMV added into x, and
    norm_fc1 (the predictor's hidden layer with the FFN's RMSNorm and q8 form): with the FFN's
    two kernels, a whole all-GPU sparse layer (tools/bench_gpu.py's token / n_layer). Each step
    that has another form (session 29's, not yet the default: ``cuda.set_norm_vec``, RMSNorm in
    registers; ``cuda.set_gemv_wide``, the GEMVs' wide dots) is timed in it too, its output
    checked against the default form's (max difference of the output, of its max)."""
    cp = cuda.cupy
    n_head, hd = 32 if E == 4096 else 40, 128
    wqkv_raw = random_rows(rng, 3 * E, E, qn)
    wo_raw = random_rows(rng, E, E, qn)
    wqkv = [cuda.DeviceRows(cp.asarray(wqkv_raw), qt, 3 * E, E) for _ in range(n_copy)]
    wo = [cuda.DeviceRows(cp.asarray(wo_raw), qt, E, E) for _ in range(n_copy)]
    fc1_h = (rng.standard_normal((args.rank, E)) / np.sqrt(E)).astype(np.float16)
    fc1 = [cuda.DeviceRows(cp.asarray(fc1_h.view(np.uint8).reshape(args.rank, -1)), QT.F16,
                           args.rank, E) for _ in range(n_copy)]
    norm_w = cp.ones(E, cp.float32)
    xr = x.reshape(1, E)
    h = cp.empty((1, E), cp.float32)
    qkv = cp.empty(3 * E, cp.float32)
    q, k, v = (qkv[i * E:(i + 1) * E].reshape(n_head, hd) for i in range(3))
    n_ctx = 512
    ck = cp.asarray(rng.standard_normal((n_ctx, n_head, hd)).astype(np.float32))
    cv = cp.asarray(rng.standard_normal((n_ctx, n_head, hd)).astype(np.float32))
    ang = np.arange(n_ctx)[:, None] * (1e4 ** (-np.arange(0, hd, 2) / hd))[None, :]
    cos_sin = cp.asarray(np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32))
    pos = cp.asarray(np.array([32], np.int32))
    att = cp.empty((n_head, hd), cp.float32)
    qkv_out = cp.empty(3 * E, cp.float32)
    h2 = cp.empty(E, cp.float32)
    o_out = cp.empty(E, cp.float32)
    # (name, call, output to compare, the other form or None); q4_0's GEMVs also with x's sums
    steps = [
        ("rmsnorm (+ q8)", lambda j: cuda.rmsnorm(xr, norm_w, 1e-5, h, q8=q8), h, "norm_vec"),
        ("q/k/v GEMV", lambda j: cuda.gather_gemv(wqkv[j % n_copy], h[0], qkv_out, q8=q8),
         qkv_out, "gemv_wide"),
        ("rope_store", lambda j: cuda.rope_store(q, k, v, ck, cv, cos_sin, pos), None, None),
        ("attn_decode at 32 (+ q8)", lambda j: cuda.attn_decode(q, ck, cv, pos, att, n_ctx, q8=q8),
         None, None),
        ("output GEMV (+= x)", lambda j: cuda.gather_gemv(wo[j % n_copy], att.reshape(-1), x,
                                                         accumulate=True, q8=q8), None, "gemv_wide"),
        ("output GEMV (into a buffer, for the check)",
         lambda j: cuda.gather_gemv(wo[j % n_copy], att.reshape(-1), o_out, q8=q8), o_out,
         "gemv_wide"),
    ] + ([
        ("q/k/v GEMV, another form (for the check)",
         lambda j: cuda.gather_gemv(wqkv[j % n_copy], h[0], qkv_out, q8=q8), qkv_out, "gemv_sums"),
        ("output GEMV, another form (for the check)",
         lambda j: cuda.gather_gemv(wo[j % n_copy], att.reshape(-1), o_out, q8=q8), o_out,
         "gemv_sums"),
    ] if qn == "q4_0" else []) + [
        ("norm_fc1 (+ FFN norm, q8)", lambda j: cuda.norm_fc1(fc1[j % n_copy], x, hid, norm_w,
                                                              1e-5, h2, q8=q8), h2, "norm_vec"),
    ]
    print(f"\n| the rest of a layer (n_head {n_head}, head_dim {hd}) | us/call | other form | "
          f"us/call | other / default | max diff (of max) |")
    print("|---|---|---|---|---|---|")
    total = total_other = 0.0
    for name, fn, out, form in steps:
        if out is not None:
            fn(0)
            want = cp.asnumpy(out)
        us = timed(fn, n_copy, args.reps)
        if "for the check" not in name:
            total += us
        if form is None:
            total_other += us
            print(f"| {name} | {us:.1f} | - | - | - | - |")
            continue
        with cuda.kernel_forms(**{form: True}):
            err = "-"
            if out is not None:
                fn(0)
                got = cp.asnumpy(out)
                err = f"{float(np.max(np.abs(got - want)) / (np.abs(want).max() or 1.0)):.1e}"
            us2 = timed(fn, n_copy, args.reps)
        if "for the check" not in name:
            total_other += us2
        print(f"| {name} | {us:.1f} | {form} | {us2:.1f} | {us2 / us:.2f}x | {err} |")
    print(f"| sum | {total:.1f} | norm_vec + gemv_wide | {total_other:.1f} | "
          f"{total_other / total:.2f}x | - |")


if __name__ == "__main__":
    sys.exit(main())
