#!/usr/bin/env python3
"""Benchmark 3 of issue 4: hot neurons on the GPU vs whole layers on the GPU, same VRAM budget.

A 7B-shaped ReLU FFN (Llama-2-7B: n_embd 4096, n_ff 11008; ``--layers`` layers, random f16
weights) with a synthetic predictor whose candidates follow a power law: neuron n of a layer is a
candidate for a token with probability p_n ~ rank^-alpha, scaled so that ``--density`` (default
20%) of the neurons are candidates per token; ReLU drops about half of them (~90% sparsity).
The predictor is a real one (fc1/fc2, run by the GPU kernel): one hidden unit reads a constant
input dimension and fc2 gives each neuron the bias Phi^-1(p_n); the other units add unit noise.

At VRAM budgets holding 10%, 30%, 50% and 100% of the FFN weights it times one decode step of the
FFNs (attention is not part of it: in pyinfer it is the same CPU code in every configuration):

- hybrid:   HybridFFN, the hottest neurons (solve_placement over the expected counts) on the GPU
- offload:  llama.cpp -ngl: the first floor(budget * layers) FFNs dense on the GPU, the rest dense
            on the CPU
- plus CPU-only sparse and dense, and at 100% all-on-GPU sparse (= hybrid) vs all-on-GPU dense.

Every configuration is checked against the CPU SparseFFN / DenseFFN output before it is timed.
Prints a markdown table. Needs a CUDA device and CuPy; exits with status 2 and a message without.

    python tools/bench_gpu.py [--layers 8] [--tokens 32] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # FACTS.md: OpenBLAS threads clash with OpenMP's
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyinfer.config import ModelConfig  # noqa: E402
from pyinfer.ffn import DenseFFN, Predictor, SparseFFN  # noqa: E402
from pyinfer.ops import cuda  # noqa: E402
from pyinfer.ops.cpu import QT, QTensor  # noqa: E402

N_EMBD, N_FF, N_HEAD = 4096, 11008, 32  # Llama-2-7B (--n-embd/--n-ff change them for a smoke run)
LLAMA2_7B_LAYERS = 32


def phi_inv(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF, elementwise."""
    from statistics import NormalDist

    nd = NormalDist()
    return np.array([nd.inv_cdf(float(v)) for v in p])


def make_layer(rng, density: float, alpha: float, rank: int, sample_x: np.ndarray):
    def f16(shape):
        return QTensor((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16),
                       QT.F16, *shape)

    lw = SimpleNamespace(ffn_gate=f16((N_FF, N_EMBD)), ffn_up=f16((N_FF, N_EMBD)),
                         ffn_down_t=f16((N_FF, N_EMBD)))
    # power-law candidate probabilities, mean = density, in a random neuron order
    p = np.arange(1, N_FF + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, 1e6
    for _ in range(60):  # scale so that mean(min(1, s * p)) = density
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(1, mid * p).mean() < density else (lo, mid)
    p = np.clip(lo * p, 1e-4, 1 - 1e-4)[rng.permutation(N_FF)]
    fc1 = rng.standard_normal((rank, N_EMBD), dtype=np.float32) / np.sqrt(N_EMBD)
    fc1[0] = 0.0
    fc1[0, 0] = 1.0  # hidden unit 0 = relu(x[0]) = 1: the bias channel
    fc2 = rng.standard_normal((N_FF, rank), dtype=np.float32)
    hid = np.maximum(sample_x @ fc1.T, 0.0)[:, 1:]
    z = hid @ fc2[:, 1:].T
    fc2[:, 1:] /= z.std(axis=0)[:, None]  # unit noise per neuron over the sample tokens
    fc2[:, 0] = phi_inv(p)
    return lw, Predictor(fc1, fc2, 0.0), p


def sample_inputs(rng, n):
    x = rng.standard_normal((n, N_EMBD), dtype=np.float32)
    x[:, 0] = 1.0  # the predictor's bias channel
    return x


def time_ffn(ffn, layers, xs, n_threads, sync):
    out = np.empty((1, N_EMBD), np.float32)
    t0 = time.perf_counter()
    for x in xs:
        for i, lw in enumerate(layers):
            ffn(lw, i, x[None], x[None], out, n_threads)
    sync()
    return (time.perf_counter() - t0) / len(xs)


def first_output(ffn, layers, x, n_threads):
    outs = []
    for i, lw in enumerate(layers):
        out = np.empty((1, N_EMBD), np.float32)
        ffn(lw, i, x[None], x[None], out, n_threads)
        outs.append(out[0].copy())
    return np.stack(outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU kernel threads")
    ap.add_argument("--density", type=float, default=0.20,
                    help="predicted candidates per token (ReLU keeps about half: ~90%% sparsity)")
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of the hot set")
    ap.add_argument("--rank", type=int, default=256, help="predictor hidden size")
    ap.add_argument("--budgets", default="0.1,0.3,0.5,1.0", help="fractions of the FFN weights")
    ap.add_argument("--n-embd", type=int, default=N_EMBD)
    ap.add_argument("--n-ff", type=int, default=N_FF)
    ap.add_argument("--numpy", action="store_true",
                    help="smoke-test this script without a GPU: NumpyDevice stands in (timings "
                         "mean nothing)")
    args = ap.parse_args(argv)
    globals().update(N_EMBD=args.n_embd, N_FF=args.n_ff)
    if not cuda.available() and not args.numpy:
        print(f"bench_gpu: needs a CUDA device and CuPy ({cuda.unavailable_reason()}); "
              "run it on a GPU machine: pip install -e .[cuda] && python tools/bench_gpu.py",
              file=sys.stderr)
        return 2

    from predictors.solver import solve_placement
    from pyinfer.device import CupyDevice
    from pyinfer.hybrid import HybridFFN, LayerOffloadFFN

    if args.numpy:
        from pyinfer.device import NumpyDevice

        dev = NumpyDevice()
    else:
        dev = CupyDevice()
    rng = np.random.default_rng(0)
    L = args.layers
    cfg = ModelConfig(n_vocab=32000, n_embd=N_EMBD, n_layer=L, n_ff=N_FF, n_head=N_HEAD,
                      n_head_kv=N_HEAD, head_dim=N_EMBD // N_HEAD, n_ctx_train=4096,
                      rope_freq_base=1e4, rms_eps=1e-5, hidden_act="relu", tied_embeddings=False)
    print(f"building {L} layers (random f16 weights, predictor rank {args.rank})...", file=sys.stderr)
    calib = sample_inputs(rng, 256)
    built = [make_layer(rng, args.density, args.alpha, args.rank, calib) for _ in range(L)]
    layers = [b[0] for b in built]
    preds = [b[1] for b in built]
    probs = [b[2] for b in built]
    weights = SimpleNamespace(layers=layers)
    zero_thr = np.zeros(L, np.float32)
    ffn_bytes = sum(lw.ffn_gate.nbytes + lw.ffn_up.nbytes + lw.ffn_down_t.nbytes for lw in layers)
    bpn = 3 * layers[0].ffn_gate.raw.shape[1]
    xs = sample_inputs(rng, args.warmup + args.tokens)
    check_x = xs[0]

    sparse_ref = SparseFFN(cfg, preds, zero_thr)
    ref_sparse = first_output(sparse_ref, layers, check_x, args.threads)
    ref_dense = first_output(DenseFFN(cfg), layers, check_x, args.threads)

    def run(name, ffn, ref, budget_frac):
        got = first_output(ffn, layers, check_x, args.threads)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        time_ffn(ffn, layers, xs[:args.warmup], args.threads, dev.synchronize)
        ffn.stats.reset()
        s = time_ffn(ffn, layers, xs[args.warmup:], args.threads, dev.synchronize)
        gpu_bytes = getattr(ffn, "device_bytes", 0)
        rows.append((budget_frac, name, s * 1e3, LLAMA2_7B_LAYERS / L / s if s else 0.0,
                     gpu_bytes / 2**30, ffn.stats.sparsity, err))
        print(f"  {budget_frac:>5} {name}: {s * 1e3:.2f} ms/token", file=sys.stderr)

    rows = []
    print(f"device: {dev.describe()}; FFN weights {ffn_bytes / 2**30:.2f} GiB", file=sys.stderr)
    run("CPU only, sparse", SparseFFN(cfg, preds, zero_thr), ref_sparse, "-")
    run("CPU only, dense", DenseFFN(cfg), ref_dense, "-")
    for frac in (float(f) for f in args.budgets.split(",")):
        budget = int(frac * ffn_bytes)
        counts = [np.round(p * 1e6) for p in probs]
        pl = solve_placement(counts, bpn, budget, min_neurons_per_layer=0)
        label = f"{frac:.0%}"
        run("hybrid (hot neurons on GPU)", HybridFFN(SparseFFN(cfg, preds, zero_thr), weights, dev,
                                                      pl.gpu_bucket), ref_sparse, label)
        k = int(frac * L + 1e-9)
        run(f"offload -ngl {k} (dense)", LayerOffloadFFN(DenseFFN(cfg), weights, dev, k),
            ref_dense, label)
        if frac >= 1.0:
            run("all on GPU, dense", LayerOffloadFFN(DenseFFN(cfg), weights, dev, L), ref_dense, label)
        if cuda.cupy is not None and not args.numpy:
            cuda.cupy.get_default_memory_pool().free_all_blocks()

    print(f"\nFFN decode step, {L} layers of Llama-2-7B shape (f16, ReLU, {args.density:.0%} "
          f"candidates, power law alpha={args.alpha}), {args.threads} CPU threads; "
          f"{dev.describe()}\n")
    print("| VRAM budget (of FFN weights) | configuration | ms/token | tok/s (x32 layers, FFN only) "
          "| GPU weights GiB | measured sparsity | max rel. err vs CPU |")
    print("|---|---|---|---|---|---|---|")
    for budget, name, ms, tps, gib, sp, err in rows:
        print(f"| {budget} | {name} | {ms:.2f} | {tps:.2f} | {gib:.2f} | {sp:.1%} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
