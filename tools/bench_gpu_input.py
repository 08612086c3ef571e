#!/usr/bin/env python3
"""GPU benchmark of sparse mode input (issue 12 on the GPU engine): decode tokens/s of a
7B/13B-shaped SwiGLU model, all layers on the device, at several input sparsities, against the
same file with every input kept (the issue's ``--dense`` measure) and against a dense row-layout
file of the same shapes and types (what ``pyinfer-convert --dense`` makes, the q8 GEMV).

The model is built in memory with random weights at ``--qtype q8_0|q4_0|q4_1|f16``: one layer's
matrices (std 1 / sqrt(n_in)) stored in the input-block layout (or transposed for f16) and used
by every layer; the device holds a copy per layer, so the bytes each token reads are a real
7B's. Thresholds: one per projection group for all layers, found by bisection on the device's own
kept-channel counters so that each group skips ``--sparsity`` of its input channels (uniform
allocation); the reported sparsity is the measured fraction of projection weight bytes skipped.
The lm head is the dense tied embedding on the device (q4_1: f16, which the GPU GEMV reads).

    python tools/bench_gpu_input.py --shape 7b --qtype q4_0 --sparsity 0.25 0.5 [--layers 32]
    python tools/bench_gpu_input.py --numpy --n-embd 256 --n-ff 512 --layers 2   # smoke test
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyinfer import constants as C  # noqa: E402
from pyinfer.config import ModelConfig  # noqa: E402
from pyinfer.device import NumpyDevice  # noqa: E402
from pyinfer.ffn import DenseFFN  # noqa: E402
from pyinfer.gpu_model import GpuModel  # noqa: E402
from pyinfer.hybrid import _Sizes, plan_layers  # noqa: E402
from pyinfer.input_sparse import InputSparseFFN, in_sizes  # noqa: E402
from pyinfer.ops.cpu import QT, IBTensor, QTensor  # noqa: E402
from pyinfer.weights import LayerWeights, ModelWeights  # noqa: E402

SHAPES = {"7b": (4096, 11008, 32, 32), "13b": (5120, 13824, 40, 40)}  # n_embd, n_ff, n_head, L
N_VOCAB = 32000


def build(shape, qtype: QT, n_layers, n_embd=None, n_ff=None, seed=0):
    """cfg, input-mode ModelWeights and row-layout (dense file) ModelWeights of the same shapes
    and types (different random numbers: only the bytes read matter for speed)."""
    E, F, H, L = SHAPES[shape]
    E, F, L = n_embd or E, n_ff or F, n_layers or L
    H = H if E % H == 0 and E // H >= 32 else max(1, E // 64)
    cfg = ModelConfig(n_vocab=N_VOCAB, n_embd=E, n_layer=L, n_ff=F, n_head=H, n_head_kv=H,
                      head_dim=E // H, n_ctx_train=4096, rope_freq_base=1e4, rms_eps=1e-5,
                      hidden_act="silu", tied_embeddings=True)
    rng = np.random.default_rng(seed)

    def rand(n_out, n_in, qt=qtype):
        a = (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in))
        return QTensor.from_array(a, qt)

    def in_matrix(n_out, n_in):  # what sparse mode input stores: input-block, or transposed f16
        if qtype == QT.F16:
            w = rand(n_in, n_out)
            return w
        return IBTensor.from_rows(rand(n_out, n_in))

    t0 = time.perf_counter()
    nq = cfg.n_embd_q + 2 * cfg.n_embd_kv
    qkv, wo, gu, down = in_matrix(nq, E), in_matrix(E, E), in_matrix(2 * F, E), in_matrix(E, F)
    ones = np.ones(E, np.float32)
    head_t = QT.F16 if qtype == QT.Q4_1 else qtype
    emb = rand(N_VOCAB, E, head_t)
    layers = [LayerWeights(attn_norm=ones, wq=None, wk=None, wv=None, wo=None, ffn_norm=ones,
                           ffn_gate=None, ffn_up=None, ffn_down_t=down, attn_qkv_t=qkv,
                           attn_output_t=wo, ffn_gate_up_t=gu) for _ in range(L)]
    w_in = ModelWeights(token_embd=emb, output_norm=ones, output=emb, layers=layers)
    row_t = QT.F16 if qtype == QT.Q4_1 else qtype  # the GPU's row GEMV reads f16/q8_0/q4_0
    r = {k: rand(*s, row_t) for k, s in {"wq": (cfg.n_embd_q, E), "wk": (cfg.n_embd_kv, E),
                                         "wv": (cfg.n_embd_kv, E), "wo": (E, E), "gate": (F, E),
                                         "up": (F, E), "down_t": (F, E)}.items()}
    rows = [LayerWeights(attn_norm=ones, wq=r["wq"], wk=r["wk"], wv=r["wv"], wo=r["wo"],
                         ffn_norm=ones, ffn_gate=r["gate"], ffn_up=r["up"], ffn_down_t=r["down_t"])
            for _ in range(L)]
    w_rows = ModelWeights(token_embd=emb, output_norm=ones, output=emb, layers=rows)
    print(f"built {shape} x {L} layers ({qtype.name}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return cfg, w_in, w_rows


def whole_model(cfg, w, ffn, dev, n_ctx, n_threads):
    sizes = _Sizes(cfg, w, ffn, n_ctx, dense=True)
    plan = plan_layers(cfg, sizes, 1 << 50, None, dense=True)
    return GpuModel(cfg, w, n_ctx, n_threads, ffn, dev, plan)


def kept_fractions(gm, cfg, n_tok):
    """Per group (C.IN_GROUPS order) the fraction of input channels kept over n_tok tokens."""
    kept = np.zeros(len(C.IN_GROUPS), np.uint64)
    gm.dev.to_host(gm._kept, kept)
    sizes = in_sizes(cfg)
    return np.array([int(k) / (n_tok * cfg.n_layer * sizes[g][0])
                     for k, g in zip(kept, C.IN_GROUPS)])


def calibrate(gm, cfg, target: float, steps: int, n_tok: int):
    """Thresholds (one per group, every layer) at which each group keeps 1 - target of its
    inputs: by bisection in log space on the device's counters (eager decode), group after group
    in the order a layer reads them (a later group's inputs depend on the earlier thresholds;
    groups not yet calibrated keep every input). Returns the groups' skipped fractions."""
    isp = gm.cpu_ffn
    use, gm._use_graphs = gm._use_graphs, False
    for g in C.IN_GROUPS:
        isp.thr[g] = np.full(cfg.n_layer, -1.0, np.float32)
    for j, g in enumerate(C.IN_GROUPS):
        lo, hi = -30.0, 8.0  # log2 of the threshold
        for _ in range(steps):
            mid = (lo + hi) / 2
            isp.thr[g] = np.full(cfg.n_layer, 2.0 ** mid, np.float32)
            gm.stats.reset()
            for t in range(n_tok):
                gm.forward([t + 3], t)
            if 1 - kept_fractions(gm, cfg, n_tok)[j] < target:  # too few skipped: raise it
                lo = mid
            else:
                hi = mid
    gm.stats.reset()
    for t in range(n_tok):
        gm.forward([t + 3], t)
    skipped = 1 - kept_fractions(gm, cfg, n_tok)
    gm._use_graphs, gm._graphs, gm._decoded = use, None, False
    return skipped


def time_decode(gm, n_prompt: int, n_gen: int, reps: int) -> float:
    """Median tokens/s of n_gen decoded tokens after an n_prompt-token prefill."""
    prompt = list(range(5, 5 + n_prompt))
    rates = []
    for _ in range(reps):
        gm.forward(prompt, 0)
        gm.forward([7], n_prompt)  # the first eager token (graphs capture after it)
        t0 = time.perf_counter()
        for t in range(n_gen):
            gm.forward([11 + t % 50], n_prompt + 1 + t)
        rates.append(n_gen / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--qtype", default="q4_0", choices=["q8_0", "q4_0", "q4_1", "f16"])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-ff", type=int, default=None)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.4, 0.5])
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calib-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--numpy", action="store_true", help="NumpyDevice (no GPU; a smoke test)")
    args = ap.parse_args(argv)
    qt = QT[args.qtype.upper()]
    cfg, w_in, w_rows = build(args.shape, qt, args.layers, args.n_embd, args.n_ff)
    n_ctx = args.prompt + args.tokens + 16
    if args.numpy:
        new_dev = lambda: NumpyDevice(free_bytes=1 << 40)  # noqa: E731
    else:
        from pyinfer.device import CupyDevice

        new_dev = CupyDevice
    dense_thr = {g: np.full(cfg.n_layer, -1.0, np.float32) for g in C.IN_GROUPS}
    isp = InputSparseFFN(cfg, dense_thr)
    gm = whole_model(cfg, w_in, isp, new_dev(), n_ctx, args.threads)
    print(f"{gm.dev.describe()}; {cfg.n_layer} layers, {gm.device_bytes / 2**30:.2f} GiB on the "
          "device", file=sys.stderr)
    print(f"| {args.shape} {args.qtype}, {cfg.n_layer} layers | group sparsity (qkv/o/gate_up/down)"
          " | weight bytes skipped | decode tok/s | vs same file dense |")
    print("|---|---|---|---|---|")
    base = time_decode(gm, args.prompt, args.tokens, args.reps)
    print(f"| input file, every input kept | 0 | 0% | {base:.1f} | 1.00x |", flush=True)
    for s in args.sparsity:
        got = calibrate(gm, cfg, s, args.calib_steps, 4)
        gm.stats.reset()
        rate = time_decode(gm, args.prompt, args.tokens, args.reps)
        print(f"| input file, target {s:.0%} | {' / '.join(f'{v:.1%}' for v in got)} | "
              f"{gm.stats.sparsity:.1%} | {rate:.1f} | {rate / base:.2f}x |", flush=True)
    del gm
    rows = whole_model(cfg, w_rows, DenseFFN(cfg), new_dev(), n_ctx, args.threads)
    rate = time_decode(rows, args.prompt, args.tokens, args.reps)
    print(f"| dense row-layout file ({rows.layers[0].gate.qtype.name}) | - | - | {rate:.1f} | "
          f"{rate / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
