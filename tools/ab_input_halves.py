#!/usr/bin/env python3
"""A/B builds of the kernel extension on the input-sparse fused half-layers alone, interleaved.

    python tools/ab_input_halves.py INPUT.gguf OLD_kernels.so NEW_kernels.so [MORE.so ...]
        [--threads 2] [--rounds 60]

INPUT.gguf is a file in sparse mode "input". Each layer's real inputs (the last token of an
8-token prompt) are recorded once (tools/profile_input_decode.py record_inputs); then every
round, for the file's thresholds and for every channel kept, each build in turn (the order
alternating between rounds) runs ``decode_ffn_in`` and ``decode_attn_in`` over the 30 layers in
order. Prints the median microseconds per token of each half and the median of the per-round
ratios to the first build (below 1: faster). Issue 12, session 12.
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
from profile_input_decode import PROMPT, record_inputs  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("builds", nargs="+", help="kernel extension builds (.so), the first the base")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args(argv)
    builds = [(os.path.basename(p), load_kernels(p)) for p in args.builds]
    nt = args.threads
    inp = Engine(args.input, n_ctx=256, n_threads=nt)
    cfg, ffn = inp.cfg, inp.model.ffn
    ids = inp.tokenizer.encode(PROMPT)[:8]
    sets = {"file": {g: ffn.thr[g].copy() for g in C.IN_GROUPS},
            "all kept": {g: np.full(cfg.n_layer, -1.0, np.float32) for g in C.IN_GROUPS}}
    for g in C.IN_GROUPS:
        ffn.thr[g][:] = -1.0
    rec = record_inputs(inp, ids)
    layers, kc, vc = inp.model.w.layers, inp.model.cache.k, inp.model.cache.v
    pc = time.perf_counter
    res = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for sname, thr in sets.items():
            for bname, mod in (builds if rnd % 2 else builds[::-1]):
                cpu._k = mod
                tf = ta = 0.0
                for i, lw in enumerate(layers):
                    x = rec[i, "ffn"].copy()
                    t0 = pc()
                    cpu.decode_ffn_in(x, lw.ffn_norm, cfg.rms_eps, lw.ffn_gate_up_t, lw.ffn_down_t,
                                      None, thr["ffn_gate_up"][i], None, thr["ffn_down"][i], True,
                                      nt)
                    t1 = pc()
                    x = rec[i, "attn"].copy()
                    t2 = pc()
                    cpu.decode_attn_in(x, lw.attn_norm, cfg.rms_eps, lw.attn_qkv_t,
                                       lw.attn_output_t, kc[i], vc[i], len(ids), cfg.n_head,
                                       cfg.rope_freq_base, None, thr["attn_qkv"][i], None,
                                       thr["attn_output"][i], nt)
                    ta += pc() - t2
                    tf += t1 - t0
                if rnd:
                    res.setdefault((sname, bname, "FFN"), []).append(tf)
                    res.setdefault((sname, bname, "attn"), []).append(ta)
    b0 = builds[0][0]
    print(f"{os.path.basename(args.input)}, {nt} threads, {args.rounds} rounds: microseconds per "
          f"token ({cfg.n_layer} layers), median (median per-round ratio to {b0})")
    for sname in sets:
        for half in ("FFN", "attn"):
            cells = []
            for bname, _ in builds:
                v = res[sname, bname, half]
                r = statistics.median(a / b for a, b in zip(v, res[sname, b0, half]))
                cells.append(f"{bname} {statistics.median(v) * 1e6:7.0f} ({r:.3f})")
            print(f"  [{sname}] {half:4s}  " + "  ".join(cells))
    cpu._k = builds[0][1]


if __name__ == "__main__":
    main()
