#!/usr/bin/env python3
"""GPU benchmark of issue 10: hybrid hot/cold split vs llama.cpp-style layer offload vs all on
the GPU, whole-model decode, at the same VRAM budgets.

Models: Llama-2-7B and -13B shapes (``--shape 7b|13b``; ``--layers`` fewer for a quick run), ReLU
FFN, random weights at ``--qtype f16|q4_0``, built in memory (no file). ProSparse-like power-law
sparsity is built into the weights so that it is real, not simulated:

- embedding column 0 is the constant C = sqrt(n_embd), and no layer writes to it (row 0 of wo and
  column 0 of ffn_down_t are 0), so x[0] = C in every layer and h[0] = C / rms(x) is a bias input;
- gate row n = b_n e_0 + U_n R (a low-rank random part, rank r): after the norm
  P(gate_n . h > 0) = p_n, with p_n ~ rank^-alpha in a random neuron order, mean ``--density``
  (default 10%: ~90% of the neurons are exact ReLU zeros per token);
- the predictor is exact by construction: fc1 = [e_0 / C; R; -R] (relu(Rx) - relu(-Rx) = Rx),
  fc2 = [b_n C, U_n, -U_n] (rank 1 + 2r), so ``fc2 relu(fc1 x) >= -margin`` holds for every
  active neuron (sign of a positive multiple of gate . h) plus a margin of extra candidates.
- the activation counts that place hot neurons are the expected ones, p_n x 1e6.

For each budget in ``--budgets`` (fractions of the FFN weights, on top of everything else the
GPU needs) it times decode (``--tokens`` after a ``--prompt``-token prefill; tokens/s):

- hybrid:  GpuModel, PowerInfer's placement (attention, KV, predictors, output, then hot neurons)
- offload: llama.cpp -ngl at the same budget: whole layers (attention + dense FFN) on the GPU,
           the rest dense on the CPU. Since session 29 its ffn_down is in row layout, as a
           ``pyinfer-convert --dense`` file (and llama.cpp) stores it, and the GPU runs it as a
           GEMV; one matrix serves every layer's copy (its values do not follow the layers'
           permuted neurons: only speed is compared). ``--ngl-axpy`` also times the dense
           baseline of sessions 3-28: the AXPY over neuron-major ffn_down_t rows.
- at 100%: all on the GPU, sparse (= hybrid) and dense.

A second, profiled pass per configuration brackets each CUDA graph of a token with events to
split its time: GPU work (kernels and copies, per token), CPU cold neurons, host waits at the
per-layer syncs, GPU busy fraction and the GPU idle time per layer (wall - GPU work, over n_layer:
what launches, transfers and syncs cost). Configurations that run eagerly (layers on the CPU:
no graphs) report only their host-side figures. Each configuration's logits are
checked against the first one of the same FFN rule (sparse or dense) and weights before timing.

    python tools/bench_gpu.py --shape 7b --qtype f16 [--layers 32] [--tokens 24] [--threads 16]
    python tools/bench_gpu.py --numpy --n-embd 256 --n-ff 688 --layers 2   # smoke test, no GPU
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # FACTS.md: OpenBLAS threads clash with OpenMP's
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyinfer.config import ModelConfig  # noqa: E402
from pyinfer.device import GiB, NumpyDevice  # noqa: E402
from pyinfer.ffn import DenseFFN, Predictor, SparseFFN  # noqa: E402
from pyinfer.gpu_model import GpuModel  # noqa: E402
from pyinfer.hybrid import _Sizes, plan_hybrid, plan_layers  # noqa: E402
from pyinfer.model import Model  # noqa: E402
from pyinfer.ops import cuda  # noqa: E402
from pyinfer.ops.cpu import QT, QTensor  # noqa: E402
from pyinfer.weights import LayerWeights, ModelWeights  # noqa: E402

SHAPES = {  # n_embd, n_ff, n_head, n_layer (Llama-2)
    "7b": (4096, 11008, 32, 32),
    "13b": (5120, 13824, 40, 40),
}
N_VOCAB = 32000
#: session 29's kernel forms, written without a GPU, timed by --forms-ab: (label, forms)
FORMS_AB = (("wide GEMV dots + norm in registers", {"gemv_wide": True, "norm_vec": True}),
            ("q4_0 GEMV with x sums + norm in registers", {"gemv_sums": True, "norm_vec": True}))


def phi_inv(p: np.ndarray) -> np.ndarray:
    from statistics import NormalDist

    nd = NormalDist()
    return np.array([nd.inv_cdf(float(v)) for v in p])


def power_law(n: int, mean: float, alpha: float, rng) -> np.ndarray:
    """Per-neuron activation probabilities ~ rank^-alpha with the given mean, random order."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, 1e6
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(1, mid * p).mean() < mean else (lo, mid)
    return np.clip(lo * p, 1e-4, 0.999)[rng.permutation(n)]


def q(a: np.ndarray, qtype: QT) -> QTensor:
    return QTensor.from_array(a, qtype)


def build_model(shape: str, qtype: QT, n_layers: int, density: float, alpha: float, rank: int,
                margin: float, seed: int = 0, n_embd=None, n_ff=None):
    """cfg, ModelWeights, per-layer Predictor and expected counts of the model described in the
    module docstring. Base matrices are drawn once; each layer permutes their rows (neurons keep
    their gate/up/down rows together), so layers differ at the cost of a copy."""
    E, F, H, L = SHAPES[shape]
    E, F = n_embd or E, n_ff or F
    L = n_layers or L
    H = max(1, E // 128)
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(n_vocab=N_VOCAB, n_embd=E, n_layer=L, n_ff=F, n_head=H, n_head_kv=H,
                      head_dim=E // H, n_ctx_train=4096, rope_freq_base=1e4, rms_eps=1e-5,
                      hidden_act="relu", tied_embeddings=True)
    C = float(np.sqrt(E))
    f32 = np.float32
    emb = rng.standard_normal((N_VOCAB, E), dtype=f32)
    emb[:, 0] = C
    token_embd = q(emb, QT.F16)
    del emb
    p = power_law(F, density, alpha, rng)
    # gate = b e_0 + U R: P(gate . h > 0) = p with h0 = C / sqrt(2), (R h)_j ~ N(0, 1)
    R = rng.standard_normal((rank, E), dtype=f32) * np.sqrt(2.0 / E)
    R[:, 0] = 0.0
    U = rng.standard_normal((F, rank), dtype=f32) / np.sqrt(rank)
    noise = np.sqrt((U * U).sum(1))  # std of U_n R h
    b = (phi_inv(p) * noise / (C / np.sqrt(2.0))).astype(f32)
    gate = U @ R
    gate[:, 0] = b
    up = rng.standard_normal((F, E), dtype=f32) / np.sqrt(E)
    down = rng.standard_normal((F, E), dtype=f32) * 1e-3
    down[:, 0] = 0.0
    base = {"gate": q(gate, qtype), "up": q(up, qtype), "down": q(down, qtype)}
    down_rows = q(np.ascontiguousarray(down.T), qtype)  # (n_embd, n_ff): a --dense file's
    del gate, up, down
    att = {}
    for name in ("wq", "wk", "wv", "wo"):
        w = rng.standard_normal((E, E), dtype=f32) * (1e-3 if name == "wo" else 1 / np.sqrt(E))
        if name == "wo":
            w[0] = 0.0  # attention never writes x[0]
        att[name] = q(w, qtype)
    pad = (-(1 + 2 * rank)) % 8  # zero units: predictor rows a multiple of 16 bytes (128-bit loads)
    fc1 = np.concatenate([np.eye(1, E, dtype=f32) / C, R, -R, np.zeros((pad, E), f32)]).astype(np.float16)
    ones = np.ones(E, f32)
    layers, preds, counts = [], [], []
    for i in range(L):
        perm = rng.permutation(F)
        rows = {k: QTensor(np.ascontiguousarray(t.data[perm]), t.qtype, F, E) for k, t in base.items()}
        # other rows per layer; wo keeps row 0 (all zero) in place
        wo_perm = np.concatenate([[0], 1 + rng.permutation(E - 1)])
        aperm = {k: QTensor(np.ascontiguousarray(t.data[wo_perm if k == "wo" else rng.permutation(E)]),
                            t.qtype, E, E) for k, t in att.items()}
        layers.append(LayerWeights(attn_norm=ones, wq=aperm["wq"], wk=aperm["wk"], wv=aperm["wv"],
                                   wo=aperm["wo"], ffn_norm=ones, ffn_gate=rows["gate"],
                                   ffn_up=rows["up"], ffn_down_t=rows["down"]))
        fc2 = np.concatenate([(b * C)[perm, None], U[perm], -U[perm], np.zeros((F, pad), f32)],
                             axis=1).astype(np.float16)
        preds.append(Predictor(fc1, fc2, -margin))
        counts.append(np.round(p[perm] * 1e6))
    weights = ModelWeights(token_embd=token_embd, output_norm=ones, output=token_embd, layers=layers)
    return cfg, weights, preds, counts, down_rows


def with_rows_down(weights: ModelWeights, down_rows) -> ModelWeights:
    """``weights`` as a --dense file holds them: every layer's ffn_down in row layout
    (``down_rows``), no ffn_down_t."""
    import dataclasses

    return dataclasses.replace(weights, layers=[
        dataclasses.replace(lw, ffn_down=down_rows, ffn_down_t=None) for lw in weights.layers])


_cold_fused = GpuModel._cold


def _cold_steps(self, i, ly, h, mask, out):
    """GpuModel._cold through ffn.sparse_step (the path before cpu.cold_ffn), for --cold-ab."""
    from pyinfer.ffn import sparse_step

    ids = ly.cold_ids if mask is None else ly.cold_ids[mask[ly.cold_ids] != 0]
    n = sparse_step(self.w.layers[i], h, ids, self.silu, self.glu or not self.sparse,
                    float(self.act_thr[i]), out, self.n_threads)
    self._host_stats.candidates += ids.shape[0]
    self._host_stats.active += n


def decode_run(model, prompt, n_tokens, warmup):
    """Prefill ``prompt`` then decode; returns per-token wall seconds of the timed tokens."""
    model.forward(prompt, 0)
    pos = len(prompt)
    times = []
    for i in range(warmup + n_tokens):
        t0 = time.perf_counter()
        model.forward([(7 * i + 3) % N_VOCAB], pos)
        sync = getattr(getattr(model, "dev", None), "synchronize", None)
        if sync:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        pos += 1
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--qtype", default="f16", choices=["f16", "q4_0"])
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--tokens", type=int, default=24, help="timed decode tokens")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16, help="prefill tokens before decoding")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU kernel threads")
    ap.add_argument("--density", type=float, default=0.10, help="mean fraction of active neurons")
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of the hot set")
    ap.add_argument("--rank", type=int, default=128, help="low-rank part of gate (predictor 1+2r)")
    ap.add_argument("--margin", type=float, default=0.05, help="predictor threshold -margin")
    ap.add_argument("--budgets", default="0.1,0.3,0.5,1.0", help="fractions of the FFN weights")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-ff", type=int, default=None)
    ap.add_argument("--cpu-baseline", action="store_true", help="also time the CPU-only model")
    ap.add_argument("--cold-ab", action="store_true",
                    help="A/B of the host's cold path: each hybrid budget also runs with the "
                         "cold neurons through ffn.sparse_step (three kernel calls) instead of "
                         "cpu.cold_ffn (one)")
    ap.add_argument("--gate-up-ab", action="store_true",
                    help="A/B of the hot neurons' gate/up with a predictor: each hybrid budget "
                         "also runs with cuda.set_gate_up_list(True) (two launches: the "
                         "candidates listed, then gate/up over the list only)")
    ap.add_argument("--wide-ab", action="store_true",
                    help="A/B of the hot neurons' dots: each hybrid budget also runs with "
                         "cuda.set_gate_up_wide(True) (a candidate's gate and up loads in flight "
                         "together), fused and listed")
    ap.add_argument("--ngl-axpy", action="store_true",
                    help="also the dense baseline of sessions 3-28: ffn_down_t rows summed by the "
                         "AXPY kernel (now: ffn_down in row layout, a GEMV)")
    ap.add_argument("--forms-ab", action="store_true",
                    help="A/B of session 29's kernel forms (not yet the default): each budget's "
                         "hybrid and -ngl runs also run with cuda.kernel_forms(gemv_wide=True, "
                         "norm_vec=True) (the dense GEMVs' wide dots, RMSNorm in registers) and "
                         "with gemv_sums=True, norm_vec=True (q4_0's GEMVs with x's block sums)")
    ap.add_argument("--numpy", action="store_true",
                    help="smoke-test without a GPU: NumpyDevice stands in (timings mean nothing)")
    args = ap.parse_args(argv)
    if not cuda.available() and not args.numpy:
        print(f"bench_gpu: needs a CUDA device and CuPy ({cuda.unavailable_reason()})",
              file=sys.stderr)
        return 2
    qtype = QT.F16 if args.qtype == "f16" else QT.Q4_0
    t0 = time.perf_counter()
    cfg, weights, preds, counts, down_rows = build_model(
        args.shape, qtype, args.layers, args.density, args.alpha, args.rank, args.margin,
        n_embd=args.n_embd, n_ff=args.n_ff)
    L, F = cfg.n_layer, cfg.n_ff
    print(f"built {args.shape} x{L} layers {args.qtype} in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    zero = np.zeros(L, np.float32)

    def make_sparse():
        return SparseFFN(cfg, preds, zero, "relu")

    if args.numpy:
        def new_dev():
            return NumpyDevice(free_bytes=1 << 40)
    else:
        from pyinfer.device import CupyDevice

        def new_dev():
            return CupyDevice()
    dev0 = new_dev()
    prompt = [(11 * i + 5) % N_VOCAB for i in range(args.prompt)]
    sizes_s = _Sizes(cfg, weights, make_sparse(), args.n_ctx, dense=False)
    weights_d = with_rows_down(weights, down_rows)  # the dense baseline's
    sizes_d = _Sizes(cfg, weights_d, DenseFFN(cfg), args.n_ctx, dense=True)
    sizes_t = _Sizes(cfg, weights, DenseFFN(cfg), args.n_ctx, dense=True)  # --ngl-axpy
    ffn_bytes = F * sum(sizes_s.neuron)
    refs = {}
    rows = []

    def run(label, budget_frac, ffn, plan, w=None):
        kind = "dense" if isinstance(ffn, DenseFFN) else "sparse"
        if w is None:  # the dense baseline reads ffn_down in row layout
            w = weights_d if kind == "dense" else weights
        gc.collect()
        if not args.numpy:
            cuda.cupy.get_default_memory_pool().free_all_blocks()
        dev = new_dev()
        model = (Model(cfg, w, args.n_ctx, args.threads, ffn=ffn) if plan is None
                 else GpuModel(cfg, w, args.n_ctx, args.threads, ffn, dev, plan))
        logits = model.forward(prompt, 0)
        if (kind, id(w)) in refs:  # the first run of the same FFN rule and weights
            ref = refs[kind, id(w)]
            err = float(np.max(np.abs(logits - ref)) / np.max(np.abs(ref)))
        else:
            refs[kind, id(w)], err = logits, 0.0
        times = decode_run(model, prompt, args.tokens, args.warmup)
        med = statistics.median(times)
        prof = {}
        if plan is not None:
            if not args.numpy and model._graphs is not None:
                # profiled pass: each CUDA graph bracketed by events; the host queues a graph
                # faster than the GPU runs it, so the brackets hold GPU work, not launch gaps
                model.graph_events = []
                n = max(4, args.tokens // 3)
                for i in range(n):
                    model.forward([(7 * i + 3) % N_VOCAB], len(prompt) + args.warmup + i)
                cp = cuda.cupy
                busy = sum(cp.cuda.get_elapsed_time(a, b) for a, b in model.graph_events)
                prof = {"gpu": busy, "n": n}
                model.graph_events = None
            model.stats.reset()  # sparsity (prefill + decode) and the host-side decode profile
            model.forward(prompt, 0)
            model.profile.reset()
            n_tok = 4
            for i in range(n_tok):
                model.forward([(5 * i + 1) % N_VOCAB], len(prompt) + i)
            sp = model.stats.sparsity
            p = model.profile
            prof.update(cold=p.cold_ms / n_tok, wait=p.wait_ms / n_tok, syncs=p.syncs / n_tok)
            gpu_gib = model.device_bytes / GiB
            res = plan.n_resident
        else:
            model.ffn.stats.reset()
            decode_run(model, prompt, 2, 0)
            sp, gpu_gib, res = model.ffn.stats.sparsity, 0.0, 0
        rows.append(dict(budget=budget_frac, label=label, ms=med * 1e3, tps=1 / med, gib=gpu_gib,
                         res=res, sparsity=sp, err=err, **prof))
        print(f"  {budget_frac:>5} {label}: {med * 1e3:.2f} ms/token", file=sys.stderr)
        del model

    print(f"device: {dev0.describe()}; FFN weights {ffn_bytes / GiB:.2f} GiB, fixed (hybrid) "
          f"{sizes_s.fixed() / GiB:.2f} GiB", file=sys.stderr)
    if args.cpu_baseline:
        run("CPU only, sparse", "-", make_sparse(), None)
    for frac in (float(f) for f in args.budgets.split(",")):
        label = f"{frac:.0%}"
        budget = int(sizes_s.fixed() + frac * ffn_bytes) + 4 * F * L
        wide0 = cuda.gate_up_wide()  # the engine's default dots (wide since session 28)
        run("hybrid (hot neurons on GPU)", label, make_sparse(),
            plan_hybrid(cfg, sizes_s, budget, counts))
        other = "GEMV dots" if wide0 else "wide"
        forms = ([("listed", True, wide0)] if args.gate_up_ab else []) + (
            [(other, False, not wide0), (f"{other}, listed", True, not wide0)]
            if args.wide_ab else [])
        for name, listed, wide in forms:  # the hot neurons' gate/up in another form
            cuda.set_gate_up_list(listed)
            cuda.set_gate_up_wide(wide)
            try:
                run(f"hybrid, gate/up {name}", label, make_sparse(),
                    plan_hybrid(cfg, sizes_s, budget, counts))
            finally:
                cuda.set_gate_up_list(False)
                cuda.set_gate_up_wide(wide0)
        if args.cold_ab:
            GpuModel._cold = _cold_steps
            run("hybrid, cold via sparse_step", label, make_sparse(),
                plan_hybrid(cfg, sizes_s, budget, counts))
            GpuModel._cold = _cold_fused
        plan = plan_layers(cfg, sizes_d, budget, None, dense=True)
        run(f"offload -ngl {plan.n_resident} (dense)", label, DenseFFN(cfg), plan)
        if args.ngl_axpy:  # the dense baseline of sessions 3-28
            plan_t = plan_layers(cfg, sizes_t, budget, None, dense=True)
            run(f"offload -ngl {plan_t.n_resident} (dense, down by AXPY over ffn_down_t)", label,
                DenseFFN(cfg), plan_t, w=weights)
        for name, forms in FORMS_AB if args.forms_ab else ():  # after the defaults: a
            with cuda.kernel_forms(**forms):  # failing new kernel costs no default row
                run(f"hybrid, {name}", label, make_sparse(), plan_hybrid(cfg, sizes_s, budget,
                                                                         counts))
                run(f"offload -ngl {plan.n_resident} (dense), {name}", label, DenseFFN(cfg), plan)

    print(f"\nDecode, Llama-2-{args.shape} shape x{L} layers, {args.qtype}, ReLU at "
          f"{1 - args.density:.0%} target sparsity (power law alpha={args.alpha}), "
          f"{args.threads} CPU threads, prompt {args.prompt}, {args.tokens} tokens (median); "
          f"{dev0.describe()}\n")
    print("| budget (of FFN) | configuration | ms/token | tokens/s | GPU GiB | resident layers "
          "| sparsity | GPU work ms | CPU cold ms | host wait ms | syncs | GPU busy "
          "| GPU idle/layer us | max rel. err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "gpu" in r:
            k = r["gpu"] / r["n"]
            idle = (r["ms"] - k) / L * 1e3
            extra = (f"{k:.2f} | {r['cold']:.2f} | {r['wait']:.2f} | {r['syncs']:.0f} | "
                     f"{k / r['ms']:.0%} | {idle:.0f}")
        elif "cold" in r:
            extra = f"- | {r['cold']:.2f} | {r['wait']:.2f} | {r['syncs']:.0f} | - | -"
        else:
            extra = "- | - | - | - | - | -"
        print(f"| {r['budget']} | {r['label']} | {r['ms']:.2f} | {r['tps']:.1f} | {r['gib']:.2f} | "
              f"{r['res']} | {r['sparsity']:.1%} | {extra} | {r['err']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
