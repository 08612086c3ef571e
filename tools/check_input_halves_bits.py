#!/usr/bin/env python3
"""Two builds of the kernel extension give the same bits on the input-sparse fused half-layers.

    python tools/check_input_halves_bits.py OLD_kernels.so INPUT.gguf [MORE.gguf ...]

For every file (sparse mode "input": input-block or transposed ``_t`` tensors), each layer's
real inputs (the last token of an 8-token prompt, tools/profile_input_decode.py record_inputs)
go through ``decode_ffn_in`` and ``decode_attn_in`` of OLD and of the imported build at 1, 2
and 3 threads, at four threshold sets (the file's, twice the file's, every channel kept, none
kept); the residuals, both kept counts and the K/V cache rows must be equal bit for bit to OLD
at 1 thread. Prints the number of comparisons and of differences; exit status 1 on any.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from ab_common import load_kernels  # noqa: E402
from profile_input_decode import PROMPT, record_inputs  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402


def halves(lw, cfg, rec, i, thr, kc, vc, n_past, nt):
    """(counts, residual after the FFN half, residual after the attn half, K, V) of layer i"""
    def sc(g):
        return None if lw.in_scale is None else lw.in_scale.get(g)
    x = rec[i, "ffn"].copy()
    c1 = cpu.decode_ffn_in(x, lw.ffn_norm, cfg.rms_eps, lw.ffn_gate_up_t, lw.ffn_down_t,
                           sc("ffn_gate_up"), thr["ffn_gate_up"][i], sc("ffn_down"),
                           thr["ffn_down"][i], True, nt)
    xa, k, v = rec[i, "attn"].copy(), kc.copy(), vc.copy()
    c2 = cpu.decode_attn_in(xa, lw.attn_norm, cfg.rms_eps, lw.attn_qkv_t, lw.attn_output_t, k, v,
                            n_past, cfg.n_head, cfg.rope_freq_base, sc("attn_qkv"),
                            thr["attn_qkv"][i], sc("attn_output"), thr["attn_output"][i], nt)
    return (c1, c2), x, xa, k, v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    old, new = load_kernels(args.old), cpu._k
    n_cmp = n_bad = 0
    try:
        for path in args.files:
            eng = Engine(path, n_ctx=64, n_threads=1)
            cfg, ffn = eng.cfg, eng.model.ffn
            ids = eng.tokenizer.encode(PROMPT)[:8]
            file_thr = {g: ffn.thr[g].copy() for g in C.IN_GROUPS}
            for g in C.IN_GROUPS:
                ffn.thr[g][:] = -1.0
            rec = record_inputs(eng, ids)
            sets = {"file": file_thr, "2 x file": {g: 2 * file_thr[g] for g in C.IN_GROUPS},
                    "all kept": {g: np.full(cfg.n_layer, -1.0, np.float32) for g in C.IN_GROUPS},
                    "none kept": {g: np.full(cfg.n_layer, 1e30, np.float32) for g in C.IN_GROUPS}}
            for name, thr in sets.items():
                for i, lw in enumerate(eng.model.w.layers):
                    kc, vc = eng.model.cache.k[i], eng.model.cache.v[i]
                    cpu._k = old
                    want = halves(lw, cfg, rec, i, thr, kc, vc, len(ids), 1)
                    for mod in (old, new):
                        for nt in (1, 2, 3):
                            if mod is old and nt == 1:
                                continue
                            cpu._k = mod
                            got = halves(lw, cfg, rec, i, thr, kc, vc, len(ids), nt)
                            n_cmp += 1
                            if got[0] != want[0] or not all(
                                    np.array_equal(a, b) for a, b in zip(got[1:], want[1:])):
                                n_bad += 1
                                print(f"differ: {os.path.basename(path)} [{name}] layer {i} "
                                      f"{'old' if mod is old else 'new'} {nt} threads")
    finally:
        cpu._k = new
    print(f"{n_cmp} comparisons, {n_bad} differ")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
