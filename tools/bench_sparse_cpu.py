#!/usr/bin/env python3
"""Sparse vs dense decode on the CPU for a 7B-shaped ReLU model (issue 4, benchmark 2).

Llama-2-7B dimensions (n_embd 4096, n_ff 11008, 32 heads), a few layers of random weights in f16
or q4_0 (random bytes in ggml's block layout: a valid file's worth of numbers, no quantization
time), a tiny vocabulary so the output projection does not count, and a synthetic predictor: each
token's active neurons are drawn from a power law over a random ranking of the neurons, scaled so
about --sparsity of them are inactive (ProSparse-7B measured 89%). Every layer is decoded in full
(attention dense, FFN dense or sparse), as pyinfer-run does.

Reports tokens/s scaled to 32 layers, the sparse/dense ratio, and the fraction of the bandwidth
bound reached: bytes read per token / time, divided by the read bandwidth measured here with a
dense f32 GEMV over a matrix far larger than the caches.

    python tools/bench_sparse_cpu.py --layers 4 --threads 1 2 --types f16 q4_0 [--reps 5]

Bandwidth, dense and sparse decode are measured in interleaved rounds; each figure is a median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from pyinfer.config import ModelConfig  # noqa: E402
from pyinfer.ffn import DenseFFN, SparseFFN  # noqa: E402
from pyinfer.model import Model  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402
from pyinfer.weights import LayerWeights, ModelWeights  # noqa: E402

QT = cpu.QT


def random_weight(rng, rows, cols, qtype):
    """A (rows, cols) QTensor of random values stored as ``qtype`` (scale ~ 1/sqrt(cols))."""
    if qtype == QT.F16:
        return cpu.QTensor((rng.standard_normal((rows, cols), np.float32) / np.sqrt(cols))
                           .astype(np.float16), qtype, rows, cols)
    block, nbytes = {QT.Q4_0: (32, 18), QT.Q8_0: (32, 34)}[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    d = np.full((rows, cols // block), 0.25 / np.sqrt(cols), np.float16)
    data[:, :, :2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return cpu.QTensor(data.reshape(rows, -1), qtype, rows, cols)


class SyntheticPredictor:
    """Draws each token's active set from fixed per-neuron probabilities p_i = min(1, c/rank_i^a)
    (a power law over a random ranking), c chosen so the mean density is ``density``."""

    def __init__(self, rng, n_ff, density, alpha=0.8):
        ranks = rng.permutation(n_ff) + 1.0
        base = ranks ** -alpha
        lo, hi = 0.0, 1e6
        for _ in range(100):  # bisection on c for mean(min(1, c*base)) = density
            c = (lo + hi) / 2
            lo, hi = (c, hi) if np.minimum(1, c * base).mean() < density else (lo, c)
        self.p = np.minimum(1.0, c * base)
        self.rng = rng

    def active(self, x, n_threads):
        return np.flatnonzero(self.rng.random(self.p.shape[0]) < self.p).astype(np.int32)

    def mask(self, x, n_threads=1):
        return self.rng.random((x.shape[0], self.p.shape[0])) < self.p


def build(n_layer, qtype, seed=0):
    cfg = ModelConfig(n_vocab=256, n_embd=4096, n_layer=n_layer, n_ff=11008, n_head=32, n_head_kv=32,
                      head_dim=128, n_ctx_train=4096, rope_freq_base=10000.0, rms_eps=1e-5,
                      hidden_act="relu", tied_embeddings=True)
    rng = np.random.default_rng(seed)
    E, F = cfg.n_embd, cfg.n_ff
    layers = [LayerWeights(
        attn_norm=np.ones(E, np.float32), ffn_norm=np.ones(E, np.float32),
        wq=random_weight(rng, E, E, qtype), wk=random_weight(rng, E, E, qtype),
        wv=random_weight(rng, E, E, qtype), wo=random_weight(rng, E, E, qtype),
        ffn_gate=random_weight(rng, F, E, qtype), ffn_up=random_weight(rng, F, E, qtype),
        ffn_down_t=random_weight(rng, F, E, qtype)) for _ in range(n_layer)]
    embd = cpu.QTensor(rng.standard_normal((cfg.n_vocab, E), np.float32), QT.F32, cfg.n_vocab, E)
    return cfg, ModelWeights(token_embd=embd, output_norm=np.ones(E, np.float32), output=embd,
                             layers=layers)


def read_bandwidth(n_threads, gib=1.0):
    """GB/s of a dense f32 GEMV over a matrix of ``gib`` GiB (best of 3)."""
    rows = int(gib * 2**30 / 4 / 4096)
    w = cpu.QTensor(np.ones((rows, 4096), np.float32), QT.F32, rows, 4096)
    x, out = np.ones(4096, np.float32), np.empty(rows, np.float32)
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        cpu.matvec(w, x, out, n_threads)
        best = min(best, time.perf_counter() - t0)
    return w.nbytes / best / 1e9


def decode_rate(model, n_tokens):
    model.forward(list(range(8)), 0)
    t0 = time.perf_counter()
    for i in range(n_tokens):
        model.forward([i % 200], 8 + i)
    return n_tokens / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--types", nargs="+", default=["f16", "q4_0"])
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5,
                    help="rounds of (bandwidth, dense, sparse), interleaved; medians reported")
    args = ap.parse_args(argv)
    print("| type | threads | dense tok/s | sparse tok/s | sparse/dense | measured sparsity "
          "| bytes/token sparse (MB) | GB/s sparse | read bandwidth GB/s | fraction of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    scale = args.layers / 32  # tokens/s reported for a 32-layer model
    for tname in args.types:
        qtype = {"f16": QT.F16, "q4_0": QT.Q4_0, "q8_0": QT.Q8_0}[tname]
        cfg, weights = build(args.layers, qtype)
        lw = weights.layers[0]
        attn_bytes = sum(w.nbytes for w in (lw.wq, lw.wk, lw.wv, lw.wo))
        row_bytes = lw.ffn_gate.nbytes // cfg.n_ff  # one neuron's row in one matrix
        for nt in args.threads:
            dense = Model(cfg, weights, n_ctx=64 + args.tokens, n_threads=nt, ffn=DenseFFN(cfg))
            pred = SyntheticPredictor(np.random.default_rng(1), cfg.n_ff, 1 - args.sparsity)
            # threshold -1: every predicted neuron is computed (ReLU zeros come from the predictor)
            ffn = SparseFFN(cfg, [pred] * cfg.n_layer, np.full(cfg.n_layer, -1.0, np.float32))
            sparse = Model(cfg, weights, n_ctx=64 + args.tokens, n_threads=nt, ffn=ffn)
            ffn.stats.reset()
            # interleaved rounds: a slow spell of the shared machine hits all three alike
            bws, tds, tss = [], [], []
            for _ in range(args.reps):
                bws.append(read_bandwidth(nt))
                tds.append(decode_rate(dense, args.tokens))
                tss.append(decode_rate(sparse, args.tokens))
            bw, tps_dense, tps_sparse = (statistics.median(v) for v in (bws, tds, tss))
            density = 1 - ffn.stats.sparsity
            bytes_tok = cfg.n_layer * (attn_bytes + 3 * row_bytes * density * cfg.n_ff)
            gbs = bytes_tok * tps_sparse / 1e9
            print(f"| {tname} | {nt} | {tps_dense * scale:.2f} | {tps_sparse * scale:.2f} | "
                  f"{tps_sparse / tps_dense:.2f}x | {ffn.stats.sparsity:.1%} | "
                  f"{bytes_tok / args.layers * 32 / 1e6:.0f} | {gbs:.1f} | {bw:.1f} | {gbs / bw:.0%} |",
                  flush=True)
            del dense, sparse


if __name__ == "__main__":
    main()
