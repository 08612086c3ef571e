"""Hot neurons on the GPU, cold neurons on the CPU (PowerInfer, arXiv 2312.12456 §4-6).

``HybridFFN`` has SparseFFN's call signature and computes the same function: per layer, the
neurons of the placement (``gpu_bucket``) live on the device as new contiguous row slices of
ffn_gate / ffn_up / ffn_down_t in their stored type, uploaded once; the others stay in the CPU's
memory map. Per token and layer:

1. the device runs the layer's predictor on x and sends back the candidate mask (n_ff bytes),
2. the device computes its candidates (fused gate/up gather-GEMV, then AXPY over its down rows),
   asynchronously,
3. meanwhile the calling thread runs the CPU kernels (they release the GIL) on the cold candidates:
   CUDA launches return at once, so this thread *is* the CPU executor and no hand-off to a worker
   thread is needed,
4. the CPU's partial output is merged into the device's and the sum comes back.

Only activations cross PCIe (x, h, the mask, two n_embd vectors), never weights. A layer with no
hot neurons runs entirely in the CPU SparseFFN; a layer with no cold ones skips steps 1's download
and 3. Prefill runs the same path token by token (exactly what decode computes).

``LayerOffloadFFN`` is the llama.cpp ``-ngl`` baseline: the first k layers' whole FFNs dense on the
device, the rest on the CPU. ``place_ffn`` builds either from the engine's options.

The device is a ``pyinfer.device`` backend: ``CupyDevice`` (RawKernels) or ``NumpyDevice`` (tests).
Attention, norms and the KV cache stay on the CPU in this version (the placement still reserves
their bytes, so the neuron split is what it would be with them on the GPU).
"""
from __future__ import annotations

import sys

import numpy as np

from pyinfer.config import ModelConfig
from pyinfer.device import GiB, CupyDevice, NumpyDevice  # noqa: F401 (re-exported)
from pyinfer.errors import PyinferError
from pyinfer.ffn import FFNStats, SparseFFN
from pyinfer.ops import cpu, cuda
from pyinfer.weights import LayerWeights, ModelWeights

#: Device memory left free when no budget is given: min(1 GiB, 10% of the free memory).
DEFAULT_MARGIN_BYTES = 1 * GiB


class _SumStats:
    """FFNStats-shaped view over several counters (host FFNStats + device counters)."""

    def __init__(self, parts: list[FFNStats], device_counts=None):
        self._parts = parts
        self._device_counts = device_counts  # callable -> (candidates, active), reset callable

    def _dev(self):
        return self._device_counts[0]() if self._device_counts else (0, 0)

    @property
    def total(self) -> int:
        return sum(p.total for p in self._parts)

    @property
    def candidates(self) -> int:
        return sum(p.candidates for p in self._parts) + self._dev()[0]

    @property
    def active(self) -> int:
        return sum(p.active for p in self._parts) + self._dev()[1]

    @property
    def sparsity(self) -> float:
        total = self.total
        return 1.0 - self.active / total if total else 0.0

    def reset(self):
        for p in self._parts:
            p.reset()
        if self._device_counts:
            self._device_counts[1]()


class _DeviceLayer:
    """One layer's device-resident part: hot rows, predictor, ids (module docstring)."""

    def __init__(self, dev, lw: LayerWeights, hot: np.ndarray, n_ff: int, predictor):
        self.hot = np.asarray(hot, np.int32)  # (n_hot,) sorted neuron ids on the device
        self.n_hot = int(self.hot.size)
        self.ids = dev.array(self.hot)  # (n_hot,) int32 on the device
        self.gate = dev.rows(lw.ffn_gate, self.hot)  # (n_hot, row_bytes) stored type
        self.up = dev.rows(lw.ffn_up, self.hot)
        self.down = dev.rows(lw.ffn_down_t, self.hot)
        cold = np.ones(n_ff, bool)
        cold[self.hot] = False
        self.cold = cold  # (n_ff,) bool: neurons the CPU computes
        self.cold_ids = np.flatnonzero(cold).astype(np.int32)
        self.fc1 = self.fc2 = None
        self.pred_threshold = 0.0
        if predictor is not None:
            # the device kernel takes f32 (files may store f16 predictors)
            self.fc1 = dev.array(np.asarray(predictor.fc1.data, np.float32))  # (rank, n_embd)
            self.fc2 = dev.array(np.asarray(predictor.fc2.data, np.float32))  # (n_ff, rank)
            self.pred_threshold = predictor.threshold

    @property
    def nbytes(self) -> int:
        pred = 0 if self.fc1 is None else int(self.fc1.nbytes + self.fc2.nbytes)
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + pred


class HybridFFN:
    """SparseFFN split between a device (hot neurons) and the CPU (cold neurons).

    sparse: the CPU reference (its predictors, activation thresholds and kernels are used for the
    cold neurons and for layers without hot neurons). weights: the model's weights. dev: a
    ``pyinfer.device`` backend. gpu_bucket: per layer, sorted int32 ids of the hot neurons.
    """

    is_sparse = True

    def __init__(self, sparse: SparseFFN, weights: ModelWeights, dev, gpu_bucket: list[np.ndarray]):
        cfg = sparse.cfg
        if getattr(sparse, "glu", False):
            raise PyinferError("the GPU hot-neuron kernels implement the 'relu' and 'cats' sparse "
                               "modes, not 'glu'; run with --device cpu or -ngl N")
        if len(gpu_bucket) != cfg.n_layer:
            raise PyinferError(f"placement has {len(gpu_bucket)} layers, the model {cfg.n_layer}")
        self.cfg, self.cpu, self.dev = cfg, sparse, dev
        preds = sparse.predictors
        self.layers = [
            _DeviceLayer(dev, lw, b, cfg.n_ff, preds[i] if preds else None) if len(b) else None
            for i, (lw, b) in enumerate(zip(weights.layers, gpu_bucket))]
        n_hot = max([dl.n_hot for dl in self.layers if dl] or [1])
        rank = max([p.fc1.rows for p in preds] if preds else [1])
        # device buffers, shared by the layers (one layer runs at a time)
        self._x = dev.empty(cfg.n_embd, np.float32)  # (n_embd,) residual before the FFN norm
        self._h = dev.empty(cfg.n_embd, np.float32)  # (n_embd,) normed FFN input
        self._hid = dev.empty(rank, np.float32)  # (rank,) predictor hidden layer
        self._mask = dev.empty(cfg.n_ff, np.uint8)  # (n_ff,) predicted candidates
        self._coef = dev.empty(n_hot, np.float32)  # (n_hot,) act(gate) * up, 0 when inactive
        self._out = dev.empty(cfg.n_embd, np.float32)  # (n_embd,) device partial FFN output
        self._counts = dev.array(np.zeros(2, np.uint64))  # [candidates, active] on the device
        self._mask_host = np.empty(cfg.n_ff, np.uint8)
        self._partial = np.empty(cfg.n_embd, np.float32)  # (n_embd,) CPU partial FFN output
        self.act = sparse.act
        self._host_stats = FFNStats()  # cold-neuron counts of split layers
        self.stats = _SumStats([sparse.stats, self._host_stats],
                               (self._device_counts, self._reset_device_counts))

    # ---- bookkeeping -----------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of weights uploaded (hot rows + predictors)."""
        return sum(dl.nbytes for dl in self.layers if dl)

    @property
    def n_hot(self) -> int:
        return sum(dl.n_hot for dl in self.layers if dl)

    def _device_counts(self):
        c = np.zeros(2, np.uint64)
        self.dev.to_host(self._counts, c)
        return int(c[0]), int(c[1])

    def _reset_device_counts(self):
        self.dev.upload(np.zeros(2, np.uint64), self._counts)

    # ---- forward ---------------------------------------------------------------------------
    def __call__(self, lw: LayerWeights, layer: int, x: np.ndarray, h: np.ndarray,
                 out: np.ndarray, n_threads: int) -> np.ndarray:
        """x: (n_tok, n_embd) residual before the FFN norm; h: normed x. Writes the (n_tok, n_embd)
        FFN output into ``out`` and returns it."""
        dl = self.layers[layer]
        if dl is None:
            return self.cpu(lw, layer, x, h, out, n_threads)
        for t in range(h.shape[0]):
            self._token(dl, lw, layer, x[t], h[t], out[t], n_threads)
        return out

    def _token(self, dl: _DeviceLayer, lw, layer, x, h, out, n_threads):
        dev, cfg = self.dev, self.cfg
        thr = float(self.cpu.act_threshold[layer])
        dev.upload(h, self._h)
        if dl.fc1 is not None:
            dev.upload(x, self._x)
            dev.predict(dl.fc1, dl.fc2, dl.pred_threshold, self._x, self._hid, self._mask)
            if dl.n_hot < cfg.n_ff:  # the CPU needs its candidates: the one wait before step 3
                cold_ids = np.flatnonzero(dev.to_host(self._mask, self._mask_host).view(bool)
                                          & dl.cold).astype(np.int32)
            else:
                cold_ids = dl.cold_ids
            mask = self._mask
        else:
            cold_ids, mask = dl.cold_ids, None
        dev.ffn_gate_up(dl.gate, dl.up, self._h, self._coef[:dl.n_hot], self._counts,
                        self.cpu.cfg.hidden_act, thr, ids=dl.ids, mask=mask)
        dev.axpy_rows(dl.down, self._coef[:dl.n_hot], self._out)
        partial = self._cold(lw, h, cold_ids, thr, n_threads)  # overlaps the device work
        self._host_stats.total += cfg.n_ff
        dev.merge(self._out, partial, out)

    def _cold(self, lw, h, ids, thr, n_threads) -> np.ndarray:
        """SparseFFN's decode step restricted to the cold candidates ``ids``; (n_embd,) partial."""
        g = np.empty(ids.shape[0], np.float32)  # (n_cold_candidates,)
        cpu.gather_matvec(lw.ffn_gate, h, ids, g, n_threads)
        a = self.act(g)
        keep = np.abs(a) > thr
        ids_active = ids[keep]
        a = np.ascontiguousarray(a[keep], np.float32)  # (n_cold_active,)
        u = np.empty_like(a)
        cpu.gather_matvec(lw.ffn_up, h, ids_active, u, n_threads)
        a *= u
        cpu.axpy_rows(lw.ffn_down_t, a, ids_active, self._partial, n_threads)
        self._host_stats.candidates += ids.shape[0]
        self._host_stats.active += ids_active.shape[0]
        return self._partial


class LayerOffloadFFN:
    """llama.cpp ``-ngl`` style baseline: layers < n_gpu_layers run their whole FFN dense on the
    device (every row, no predictor), the others run in ``cpu_ffn``."""

    is_sparse = False

    def __init__(self, cpu_ffn, weights: ModelWeights, dev, n_gpu_layers: int):
        cfg = cpu_ffn.cfg
        self.cfg, self.cpu, self.dev = cfg, cpu_ffn, dev
        self.n_gpu_layers = k = max(0, min(int(n_gpu_layers), cfg.n_layer))
        self.layers = [(dev.rows(lw.ffn_gate), dev.rows(lw.ffn_up), dev.rows(lw.ffn_down_t))
                       for lw in weights.layers[:k]]
        self._h = dev.empty(cfg.n_embd, np.float32)
        self._coef = dev.empty(cfg.n_ff, np.float32)  # (n_ff,) act(gate) * up
        self._out = dev.empty(cfg.n_embd, np.float32)
        self._counts = dev.array(np.zeros(2, np.uint64))
        self._host_stats = FFNStats()
        self.stats = _SumStats([cpu_ffn.stats, self._host_stats])

    @property
    def device_bytes(self) -> int:
        return sum(r.nbytes for rows in self.layers for r in rows)

    def __call__(self, lw, layer, x, h, out, n_threads):
        if layer >= self.n_gpu_layers:
            return self.cpu(lw, layer, x, h, out, n_threads)
        gate, up, down = self.layers[layer]
        for t in range(h.shape[0]):
            self.dev.upload(h[t], self._h)
            # act_thr < 0 keeps every neuron; skip_zero=False reads every down row (dense)
            self.dev.ffn_gate_up(gate, up, self._h, self._coef, self._counts, self.cfg.hidden_act, -1.0)
            self.dev.axpy_rows(down, self._coef, self._out, skip_zero=False)
            self.dev.to_host(self._out, out[t])
        n = h.shape[0] * self.cfg.n_ff
        self._host_stats.total += n
        self._host_stats.candidates += n
        self._host_stats.active += n
        return out


# ---- building from the engine's options ---------------------------------------------------------
def _notice(msg: str) -> None:
    print(f"pyinfer: {msg}", file=sys.stderr)


def resolve_budget(dev, vram_budget: float | None) -> int:
    """Bytes of device memory to use: ``vram_budget`` GiB, or the free memory minus a margin.
    Raises PyinferError for a budget <= 0 or above the free memory."""
    free = int(dev.free_bytes())
    if vram_budget is None:
        return max(0, free - min(DEFAULT_MARGIN_BYTES, free // 10))
    budget = int(float(vram_budget) * GiB)
    if budget <= 0:
        raise PyinferError(f"--vram-budget must be > 0 GiB, got {vram_budget}")
    if budget > free:
        raise PyinferError(f"--vram-budget {vram_budget:g} GiB is more than the free device memory "
                           f"({free / GiB:.2f} GiB)")
    return budget


def _layers_that_fit(weights: ModelWeights, budget: int) -> int:
    k, used = 0, 0
    for lw in weights.layers:
        used += lw.ffn_gate.nbytes + lw.ffn_up.nbytes + lw.ffn_down_t.nbytes
        if used > budget:
            break
        k += 1
    return k


def _placement(reader, cfg: ModelConfig, budget: int, vram_budget, reset: bool):
    """Per-layer hot ids: the stored split when it was solved for this budget (or no budget was
    given) and fits, else one re-solved for ``budget`` from the stored activation counts."""
    from pyinfer import placement as P

    sizes = P.tensor_sizes(reader)
    if not reset:
        stored = P.stored_placement(reader, cfg)
        if stored is not None and (vram_budget is None or stored.budget_bytes == budget):
            if stored.bytes_used + P.fixed_gpu_bytes(sizes, cfg) <= budget:
                return stored.gpu_bucket
            _notice("the stored GPU split does not fit the device memory; re-solving it")
    counts = P.stored_counts(reader, cfg)
    if counts is None:
        _notice("the file has no activation counts (blk.N.act_count): hot neurons chosen blindly")
        counts = [np.ones(cfg.n_ff, np.int64) for _ in range(cfg.n_layer)]
    return P.solve(counts, sizes, cfg, budget).gpu_bucket


def place_ffn(reader, cfg: ModelConfig, weights: ModelWeights, cpu_ffn, *, device: str | None = "auto",
              vram_budget: float | None = None, reset_gpu_index: bool = False,
              disable_gpu_index: bool = False, n_gpu_layers: int | None = None, backend=None,
              verbose: bool = False):
    """Return the FFN the engine should run: ``cpu_ffn`` itself, a HybridFFN or a LayerOffloadFFN.

    device: None or "auto" (GPU when ``pyinfer.ops.cuda.available()``, else the CPU with a one-line notice),
    "cpu", or "cuda" (PyinferError without a device); None is "auto" without the notice. vram_budget: GiB (default: free memory minus
    a margin). reset_gpu_index: re-solve the split from the stored activation counts.
    disable_gpu_index: ignore the stored split: no hot-neuron split, whole layers instead
    (n_gpu_layers, default as many as fit). n_gpu_layers: llama.cpp ``-ngl``: the first k FFNs dense
    on the device (the baseline), instead of the hot-neuron split. backend: a ``pyinfer.device``
    backend to use instead of CupyDevice (tests pass NumpyDevice).
    """
    quiet = device is None  # the engine's default: use a GPU if there is one, say nothing if not
    device = (device or "auto").lower()
    if device not in ("auto", "cpu", "cuda", "gpu"):
        raise PyinferError(f"unknown device {device!r} (auto, cpu or cuda)")
    if device == "cpu":
        if vram_budget is not None or n_gpu_layers:
            raise PyinferError("--vram-budget and -ngl need a GPU device (--device cuda or auto)")
        return cpu_ffn
    if backend is None:
        if not cuda.available():
            if device == "auto":
                if not quiet:
                    _notice(f"no GPU ({cuda.unavailable_reason()}); running on the CPU")
                return cpu_ffn
            raise PyinferError(f"--device cuda: no CUDA device ({cuda.unavailable_reason()})")
        backend = CupyDevice()
    budget = resolve_budget(backend, vram_budget)
    # The hot-neuron kernels implement the "relu" and "cats" rules; a "glu" file offloads whole layers.
    whole_layers = (n_gpu_layers is not None or disable_gpu_index or not isinstance(cpu_ffn, SparseFFN)
                    or getattr(cpu_ffn, "glu", False))
    if whole_layers:
        k = _layers_that_fit(weights, budget) if n_gpu_layers is None else int(n_gpu_layers)
        if n_gpu_layers is not None and k > _layers_that_fit(weights, budget):
            raise PyinferError(f"-ngl {k}: the FFNs of {k} layers do not fit in "
                               f"{budget / GiB:.2f} GiB of device memory")
        ffn = LayerOffloadFFN(cpu_ffn, weights, backend, k)
        if verbose:
            _notice(f"{backend.name}: FFNs of {ffn.n_gpu_layers}/{cfg.n_layer} layers dense on the "
                    f"device ({ffn.device_bytes / GiB:.2f} GiB)")
        return ffn
    buckets = _placement(reader, cfg, budget, vram_budget, reset_gpu_index)
    ffn = HybridFFN(cpu_ffn, weights, backend, buckets)
    if verbose:
        _notice(f"{backend.name}: {ffn.n_hot}/{cfg.n_ff * cfg.n_layer} FFN neurons hot "
                f"({ffn.device_bytes / GiB:.2f} GiB), {sum(1 for d in ffn.layers if d)} layers split")
    return ffn
