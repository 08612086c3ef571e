#!/usr/bin/env python3
"""Where one decode token's time goes on the GPU engine (issue 10): per-kernel device time and the
host's cold-neuron path, on the 7B/13B-shaped models of ``tools/bench_gpu.py``.

- ceilings: device-to-device copy bandwidth (bytes read + written) and the host's GEMV / gather
  bandwidth with pyinfer's CPU kernels at ``--threads`` (what the cold neurons can get);
- per kernel: decode runs eagerly (no CUDA graphs) with an event pair around every kernel call,
  for all-on-GPU sparse, all-on-GPU dense and the hybrid at ``--hybrid-frac``; the table gives
  calls per token, mean microseconds per call and the share of the token's kernel time;
- host cold path (hybrid): time per token in the mask lookup, the gate gather-GEMV, the selection,
  the up gather-GEMV and the down AXPY (wrappers around ``pyinfer.ops.cpu``).

Events around each launch add a little time per kernel; the totals are for comparing kernels,
``tools/bench_gpu.py`` times whole tokens with CUDA graphs.

    python tools/profile_gpu.py --shape 7b --qtype f16 --layers 4 --threads 16
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import N_VOCAB, build_model, with_rows_down  # noqa: E402
from pyinfer.device import CupyDevice  # noqa: E402
from pyinfer.ffn import DenseFFN, SparseFFN  # noqa: E402
from pyinfer.gpu_model import GpuModel  # noqa: E402
from pyinfer.hybrid import _Sizes, plan_hybrid, plan_layers  # noqa: E402
from pyinfer.ops import cpu, cuda  # noqa: E402
from pyinfer.ops.cpu import QT, QTensor  # noqa: E402

#: CupyDevice methods timed (each a kernel launch or two, or a transfer)
KERNELS = ("predict", "norm_fc1", "predict_fc2", "gemv", "ffn_gate_up", "axpy_rows", "rmsnorm",
           "rope_store", "attn_decode", "add", "upload", "download", "mask_inputs", "glu_mask",
           "ib_gemv", "copy", "quantize_q8")


class TimedDevice(CupyDevice):
    """CupyDevice with an event pair around every kernel method; eager (no graphs)."""

    graphs = False

    def __init__(self):
        super().__init__()
        self.events = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in KERNELS and callable(attr):
            stream = super().__getattribute__("stream")
            events = super().__getattribute__("events")

            def timed(*a, **k):
                e0 = stream.record()
                r = attr(*a, **k)
                events.append((name, e0, stream.record()))
                return r
            return timed
        return attr


def kernel_table(dev, n_tok):
    cp = cuda.cupy
    dev.synchronize()
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for name, a, b in dev.events:
        tot[name] += cp.cuda.get_elapsed_time(a, b) * 1e3  # us
        cnt[name] += 1
    dev.events.clear()
    all_us = sum(tot.values())
    rows = sorted(tot, key=lambda n: -tot[n])
    lines = [f"  {'kernel':<12} {'calls/tok':>9} {'us/call':>9} {'us/tok':>9} {'share':>6}"]
    for n in rows:
        lines.append(f"  {n:<12} {cnt[n] / n_tok:>9.1f} {tot[n] / cnt[n]:>9.1f} "
                     f"{tot[n] / n_tok:>9.1f} {tot[n] / all_us:>6.1%}")
    lines.append(f"  {'total':<12} {'':>9} {'':>9} {all_us / n_tok:>9.1f}")
    return "\n".join(lines)


class HostTimer:
    """Wraps pyinfer.ops.cpu kernels the cold path calls, summing their wall time."""

    def __init__(self):
        self.t = collections.defaultdict(float)
        self.n = collections.Counter()
        self._orig = {}

    def install(self):
        for name in ("cold_ffn", "gather_matvec", "select_active", "axpy_rows", "matvec"):
            f = getattr(cpu, name)
            self._orig[name] = f

            def w(*a, _f=f, _n=name, **k):
                t0 = time.perf_counter()
                r = _f(*a, **k)
                self.t[_n] += time.perf_counter() - t0
                self.n[_n] += 1
                return r
            setattr(cpu, name, w)

    def uninstall(self):
        for name, f in self._orig.items():
            setattr(cpu, name, f)

    def table(self, n_tok, n_layer):
        lines = [f"  {'host step':<18} {'us/layer':>9} {'ms/tok':>8}"]
        for k in sorted(self.t, key=lambda k: -self.t[k]):
            lines.append(f"  {k:<18} {self.t[k] / n_tok / n_layer * 1e6:>9.1f} "
                         f"{self.t[k] / n_tok * 1e3:>8.2f}")
        return "\n".join(lines)


def ceilings(threads, E, F):
    cp = cuda.cupy
    a = cp.empty(1 << 29, cp.float32)  # 2 GiB
    b = cp.empty_like(a)
    a.fill(1.0)
    for _ in range(2):
        b[...] = a
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(10):
        b[...] = a
    e1.record()
    e1.synchronize()
    ms = cp.cuda.get_elapsed_time(e0, e1) / 10
    print(f"device copy: {2 * a.nbytes / ms / 1e6:.0f} GB/s (read + write)")
    del a, b
    rng = np.random.default_rng(0)
    w = QTensor.from_array(rng.standard_normal((F, E), dtype=np.float32), QT.F16)
    x = rng.standard_normal(E, dtype=np.float32)
    out = np.empty(F, np.float32)
    for t in sorted({1, threads // 2, threads}):
        cpu.matvec(w, x, out, t)
        t0 = time.perf_counter()
        for _ in range(10):
            cpu.matvec(w, x, out, t)
        s = (time.perf_counter() - t0) / 10
        ids = np.sort(rng.choice(F, F // 7, replace=False)).astype(np.int32)
        o2 = np.empty(ids.size, np.float32)
        t1 = time.perf_counter()
        for _ in range(20):
            cpu.gather_matvec(w, x, ids, o2, t)
        s2 = (time.perf_counter() - t1) / 20
        print(f"host f16 GEMV {F}x{E}, {t} threads: {w.raw.nbytes / s / 1e9:.1f} GB/s "
              f"({s * 1e6:.0f} us); gather of 1/7 rows: {ids.size * w.raw.shape[1] / s2 / 1e9:.1f} "
              f"GB/s ({s2 * 1e6:.0f} us)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--qtype", default="f16", choices=["f16", "q4_0"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--hybrid-frac", type=float, default=0.5)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--only", default="sparse,dense,hybrid")
    args = ap.parse_args(argv)
    if not cuda.available():
        print(f"profile_gpu: needs a CUDA device ({cuda.unavailable_reason()})", file=sys.stderr)
        return 2
    qtype = QT.F16 if args.qtype == "f16" else QT.Q4_0
    cfg, weights, preds, counts, down_rows = build_model(args.shape, qtype, args.layers, 0.10, 1.0,
                                                         128, 0.05)
    weights_d = with_rows_down(weights, down_rows)  # dense: ffn_down in row layout (bench_gpu)
    L, F, E = cfg.n_layer, cfg.n_ff, cfg.n_embd
    print(f"{args.shape} x{L} {args.qtype}, wait policy {os.environ.get('OMP_WAIT_POLICY')}, "
          f"{args.threads} threads")
    if not args.no_ceilings:
        ceilings(args.threads, E, F)
    zero = np.zeros(L, np.float32)
    n_ctx = 512
    prompt = [(11 * i + 5) % N_VOCAB for i in range(16)]
    sizes_s = _Sizes(cfg, weights, SparseFFN(cfg, preds, zero, "relu"), n_ctx, dense=False)
    sizes_d = _Sizes(cfg, weights_d, DenseFFN(cfg), n_ctx, dense=True)
    ffn_bytes = F * sum(sizes_s.neuron)
    for what in args.only.split(","):
        dev = TimedDevice()
        if what == "dense":
            ffn = DenseFFN(cfg)
            plan = plan_layers(cfg, sizes_d, 1 << 40, None, dense=True)
        else:
            ffn = SparseFFN(cfg, preds, zero, "relu")
            frac = 1.0 if what == "sparse" else args.hybrid_frac
            budget = int(sizes_s.fixed() + frac * ffn_bytes) + 4 * F * L
            plan = plan_hybrid(cfg, sizes_s, budget, counts)
        model = GpuModel(cfg, weights_d if what == "dense" else weights, n_ctx, args.threads,
                         ffn, dev, plan)
        model.forward(prompt, 0)
        for i in range(3):
            model.forward([(7 * i + 3) % N_VOCAB], len(prompt) + i)
        dev.synchronize()
        dev.events.clear()
        timer = HostTimer()
        timer.install()
        model.profile.reset()
        t0 = time.perf_counter()
        for i in range(args.tokens):
            model.forward([(5 * i + 1) % N_VOCAB], len(prompt) + 3 + i)
        dev.synchronize()
        wall = (time.perf_counter() - t0) / args.tokens * 1e3
        timer.uninstall()
        p = model.profile
        print(f"\n== {what} (hot {model.n_hot}/{F * L}), eager wall {wall:.2f} ms/token, "
              f"{wall / L * 1e3:.0f} us/layer; host cold {p.cold_ms / args.tokens:.2f} ms/tok, "
              f"wait {p.wait_ms / args.tokens:.2f} ms/tok")
        print(kernel_table(dev, args.tokens))
        if what == "hybrid":
            print(timer.table(args.tokens, L))
        del model, dev
        cuda.cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
