"""What goes on the GPU for a VRAM budget, and the model that runs it (PowerInfer §5-6).

Two plans, both measured in the bytes ``pyinfer.gpu_model.GpuModel`` allocates (the plan's
``planned_bytes`` equals the device's count of what it allocated; tests check it):

- hybrid (the default for a sparse file): PowerInfer's order. First every layer's attention
  matrices, norms, KV cache and predictor, the output norm and matrix, and the forward's buffers
  (``gpu_model.buffer_bytes``) plus a reserve for prefill temporaries; the rest of the budget goes to hot FFN neurons, chosen by the
  ILP over the stored activation counts (``predictors.solver.solve_placement``), or the file's
  stored split when it fits. A budget too small for all the fixed parts keeps the first layers'
  attention that fit and runs the rest on the CPU.
- whole layers (llama.cpp ``-ngl N``, ``--disable-gpu-index``, dense files): the first k layers
  entirely on the device (attention and every FFN neuron), the others on the CPU, k = N or as
  many as the budget holds under the same rules. This is the baseline the hybrid is measured
  against. A file of sparse mode "input" (no predictors; every projection reads only its kept
  input channels, the lm head's too) takes this plan too.
"""
from __future__ import annotations

import sys

import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig, read_field
from pyinfer.device import GiB, CupyDevice
from pyinfer.errors import PyinferError
from pyinfer.ffn import SparseFFN
from pyinfer.gpu_model import (GpuModel, GpuPlan, buffer_bytes, device_predictors, gpu_refusal,
                               ib_head, is_input_layer, layer_fixed_bytes, model_head,
                               neuron_bytes, output_bytes, predictor_rank,
                               prefill_reserve_bytes, rows_down)
from pyinfer.model import Model
from pyinfer.ops import cuda
from pyinfer.ops.cpu import QT, IBTensor
from pyinfer.weights import ModelWeights, fused_model

#: Device memory left free when no budget is given: min(1 GiB, 10% of the free memory).
DEFAULT_MARGIN_BYTES = 1 * GiB


def _notice(msg: str) -> None:
    print(f"pyinfer: {msg}", file=sys.stderr)


def resolve_budget(dev, vram_budget: float | None) -> int:
    """Bytes of device memory to use: ``vram_budget`` GiB, or the free memory minus a margin.
    Raises PyinferError for a budget <= 0 or above the free memory."""
    free = int(dev.free_bytes())
    if vram_budget is None:
        return max(0, free - min(DEFAULT_MARGIN_BYTES, free // 10))
    from pyinfer.placement import budget_bytes

    budget = budget_bytes(vram_budget)  # as the converter stored it (the same rounding)
    if not budget > 0:
        raise PyinferError(f"--vram-budget must be > 0 GiB, got {vram_budget}")
    if budget > free:
        raise PyinferError(f"--vram-budget {vram_budget:g} GiB is more than the free device memory "
                           f"({free / GiB:.2f} GiB)")
    return budget


class _Sizes:
    """Device bytes of each part of the model under the GpuModel layout."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, cpu_ffn, n_ctx: int, dense: bool,
                 lm_head=None):
        preds = device_predictors(cpu_ffn, cfg.n_layer, dense)
        self.layer = [layer_fixed_bytes(cfg, lw, n_ctx, preds[i])
                      for i, lw in enumerate(weights.layers)]
        self.neuron = [neuron_bytes(lw) for lw in weights.layers]
        input_mode = getattr(cpu_ffn, "is_input_sparse", False)
        head = model_head(cpu_ffn, lm_head)
        self.output = output_bytes(cfg, weights, head, input_mode)
        rank = predictor_rank(preds)
        self.buffers = buffer_bytes(cfg, n_ctx, rank, input_mode,  # allocated by GpuModel
                                    rows_down(weights))
        # a sparse mode input file's dense head of a type the GPU GEMV cannot read stays here
        self.output_on_device = not head_on_cpu(cpu_ffn, weights, head)
        self.reserve = prefill_reserve_bytes(cfg, n_ctx)  # kept free for prefill temporaries
        self.n_ff = cfg.n_ff

    def fixed(self) -> int:
        """Everything but FFN neurons, the prefill reserve included."""
        return sum(self.layer) + self.output + self.buffers + self.reserve

    def whole_layer(self, i: int) -> int:
        return self.layer[i] + self.n_ff * self.neuron[i]


def head_on_cpu(cpu_ffn, weights: ModelWeights, head=None) -> bool:
    """True where a sparse mode input file's lm head stays on the CPU: a dense head of a type
    without a GPU GEMV (e.g. q4_1). A head over ``output_ib`` (input sparsity and/or the two-stage
    copy) runs on the device as input-block GEMVs (``gpu_model.ib_head``). head: the model's
    head over output_ib (``gpu_model.model_head``)."""
    if not getattr(cpu_ffn, "is_input_sparse", False) or ib_head(head, weights):
        return False
    return weights.output.qtype.name.lower() not in cuda.GPU_TYPES


def plan_layers(cfg: ModelConfig, sizes: _Sizes, budget: int, n_layers: int | None,
                dense: bool) -> GpuPlan:
    """Whole layers: the first k layers entirely on the device (k = n_layers, or as many as fit),
    the output too where every layer is and it fits (and ``sizes.output_on_device``).
    Raises PyinferError when n_layers layers do not fit."""
    used, k = sizes.buffers + sizes.reserve, 0
    while k < cfg.n_layer:
        step = sizes.whole_layer(k) + 4 * cfg.n_ff
        if used + step > budget:
            break
        used += step
        k += 1
    if n_layers is not None:
        asked, n_layers = n_layers, min(n_layers, cfg.n_layer)  # llama.cpp's -ngl 99: every layer
        if n_layers > k:
            raise PyinferError(f"-ngl {asked}: {n_layers} whole layers do not fit in "
                               f"{budget / GiB:.2f} GiB of device memory (at most {k} do)")
        k = n_layers
        used = sizes.buffers + sizes.reserve + sum(sizes.whole_layer(i) + 4 * cfg.n_ff
                                                   for i in range(k))
    output = k == cfg.n_layer and used + sizes.output <= budget and sizes.output_on_device
    hot = [np.arange(cfg.n_ff, dtype=np.int32) if i < k else np.zeros(0, np.int32)
           for i in range(cfg.n_layer)]
    used += sizes.output if output else 0
    return GpuPlan(k, output, hot, dense=dense, planned_bytes=used - sizes.reserve)


def plan_hybrid(cfg: ModelConfig, sizes: _Sizes, budget: int, counts, stored=None) -> GpuPlan:
    """PowerInfer's order (module docstring). counts: per layer (n_ff,) activation counts (None:
    all equal); stored: per-layer hot ids from the file, used when they fit."""
    from predictors.solver import solve_placement

    fixed = sizes.fixed()
    L = cfg.n_layer
    if fixed > budget:  # not even every layer's attention: the first ones that fit, no FFN rows
        used, k = sizes.buffers + sizes.reserve, 0
        while k < L and used + sizes.layer[k] <= budget:
            used += sizes.layer[k]
            k += 1
        note = (f"{budget / GiB:.2f} GiB holds the attention of {k}/{L} layers and no FFN neurons "
                f"(all of it needs {fixed / GiB:.2f} GiB)")
        return GpuPlan(k, False, [np.zeros(0, np.int32)] * L, planned_bytes=used - sizes.reserve,
                       notes=[note])
    ffn_budget = budget - fixed
    if stored is not None:
        cost = sum(int(b.size) * (sizes.neuron[i] + 4) for i, b in enumerate(stored))
        if cost <= ffn_budget:
            return GpuPlan(L, True, [np.asarray(b, np.int32) for b in stored],
                           planned_bytes=fixed - sizes.reserve + cost)
    if counts is None:
        counts = [np.ones(cfg.n_ff, np.int64) for _ in range(L)]
    # a hot neuron costs its rows plus its int32 id on the device
    pl = solve_placement(counts, [b + 4 for b in sizes.neuron], ffn_budget)
    hot = [np.asarray(b, np.int32) for b in pl.gpu_bucket]
    cost = sum(int(b.size) * (sizes.neuron[i] + 4) for i, b in enumerate(hot))
    return GpuPlan(L, True, hot, planned_bytes=fixed - sizes.reserve + cost)


def _stored_split(reader, cfg: ModelConfig, budget: int, vram_budget):
    """The file's split when it was solved for this budget (or no budget was given), else None."""
    from pyinfer import placement as P

    stored = P.stored_placement(reader, cfg)
    if stored is None or (vram_budget is not None and stored.budget_bytes != budget):
        return None
    return stored.gpu_bucket


def _mixed_gate_up(weights: ModelWeights) -> str | None:
    """Where a layer's ffn_gate and ffn_up differ in type (a llama.cpp mix converted with
    ``--outtype auto`` can), the words for it, else None: the device's gate/up kernel reads both
    rows with the gate's type and row size (``cuda.ffn_gate_up``), so such a layer would decode
    wrong numbers."""
    for i, lw in enumerate(weights.layers):
        if is_input_layer(lw) or lw.ffn_gate is None or lw.ffn_up is None:
            continue
        if lw.ffn_gate.qtype != lw.ffn_up.qtype:
            return (f"layer {i}'s are {lw.ffn_gate.qtype.name.lower()} and "
                    f"{lw.ffn_up.qtype.name.lower()}")
    return None


def _types_off_gpu(weights: ModelWeights, output: bool = True) -> list[str]:
    """Names of the layer weight types the GPU kernels cannot read (e.g. the K-quants that
    ``pyinfer-convert --outtype auto`` keeps), sorted; [] when every type is readable. A sparse
    mode input layer's matrices are readable in the input-block layout (q8_0, q4_0, q4_1) or
    transposed in f16/f32; a transposed quantized one (a shape without the input-block layout)
    is named "transposed TYPE". output: the output matrix goes on the device too."""
    odd = set()
    for lw in weights.layers:
        if is_input_layer(lw):
            for t in (lw.attn_qkv_t, lw.attn_output_t, lw.ffn_gate_up_t, lw.ffn_down_t):
                if not isinstance(t, IBTensor) and t.qtype not in (QT.F32, QT.F16):
                    odd.add(f"transposed {t.qtype.name.lower()}")
            continue
        for name in ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down_t", "ffn_down"):
            t = getattr(lw, name, None)
            if t is not None and t.qtype.name.lower() not in cuda.GPU_TYPES:
                odd.add(t.qtype.name.lower())
    out = getattr(weights, "output", None)
    if output and out is not None and out.qtype.name.lower() not in cuda.GPU_TYPES:
        odd.add(out.qtype.name.lower())
    return sorted(odd)


def place_model(reader, cfg: ModelConfig, weights: ModelWeights, cpu_ffn, n_ctx: int,
                n_threads: int, *, device: str | None = "cpu", vram_budget: float | None = None,
                reset_gpu_index: bool = False, disable_gpu_index: bool = False,
                n_gpu_layers: int | None = None, backend=None, verbose: bool = False,
                cache_type: str = "auto", lm_head=None):
    """The model the engine should run: a CPU ``Model`` or a ``GpuModel`` with the plan.

    device: "cpu"; "auto" (GPU when ``pyinfer.ops.cuda.available()``, else the CPU with a
    one-line notice); None ("auto" without the notice); "cuda" (PyinferError without a device).
    vram_budget: GiB (default: free memory minus a margin). reset_gpu_index: re-solve the split
    from the stored activation counts. disable_gpu_index: whole layers instead of the hot-neuron
    split. n_gpu_layers: llama.cpp ``-ngl``: the first k layers whole on the device (k over the
    model's layer count: all of them, as llama.cpp's ``-ngl 99``). backend: a
    ``pyinfer.device`` backend instead of CupyDevice (tests pass NumpyDevice). cache_type: the
    KV cache of a CPU ``Model`` (``kv_cache.cache_dtype``; a GpuModel keeps f32, as its device).
    lm_head: a two-stage head over ``output_ib`` for a file not of sparse mode input
    (``input_sparse.head_from_reader``), used by the CPU and the device alike.
    Raises PyinferError for an unknown device, a budget that is not positive or exceeds the free
    memory, -ngl layers that do not fit, or a device out of memory.
    """
    def cpu_model():
        return Model(cfg, weights, n_ctx, n_threads, ffn=cpu_ffn, cache_type=cache_type,
                     lm_head=lm_head)

    quiet = device is None
    device = (device or "auto").lower()
    if device not in ("auto", "cpu", "cuda", "gpu"):
        raise PyinferError(f"unknown device {device!r} (auto, cpu or cuda)")
    if n_gpu_layers is not None and n_gpu_layers < 0:
        raise PyinferError(f"-ngl must be >= 0, got {n_gpu_layers}")
    if device != "cpu" and not fused_model(cfg, weights):
        if device == "auto" and backend is None:  # the CPU runs every family
            if not quiet:
                _notice(f"the GPU engine runs Llama-shaped files only (Llama 3's RoPE, Qwen2's "
                        f"q/k/v biases and Qwen3's head norms included; no sliding windows), "
                        f"not this {cfg.family} model's layers; running on the CPU")
            return cpu_model()
        raise PyinferError(gpu_refusal(cfg))
    rows_file = reader is not None and read_field(reader, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
    if device != "cpu" and not rows_file and any(lw.ffn_down_t is None for lw in weights.layers):
        msg = "a llama.cpp GGUF runs on the CPU; pyinfer-convert it for the GPU engine"
        if device == "auto" and backend is None:
            if not quiet:
                _notice(msg)
            return cpu_model()
        raise PyinferError(msg)
    if device == "cpu" and backend is None:
        given = [name for name, on in (
            ("--vram-budget (vram_budget=)", vram_budget is not None),
            ("-ngl (n_gpu_layers=)", bool(n_gpu_layers)),
            ("--reset-gpu-index (reset_gpu_index=)", reset_gpu_index),
            ("--disable-gpu-index (disable_gpu_index=)", disable_gpu_index)) if on]
        if given:
            raise PyinferError(f"{', '.join(given)}: for a GPU device (--device / device= cuda "
                               "or auto), not the CPU")
        return cpu_model()
    # the output matrix itself goes on the device unless the head is the CPU's or input-sparse
    head = model_head(cpu_ffn, lm_head)
    odd = _types_off_gpu(weights, output=not (head_on_cpu(cpu_ffn, weights, head)
                                              or ib_head(head, weights)))
    mixed = _mixed_gate_up(weights)
    if device != "cpu" and (odd or mixed):
        if odd:
            msg = (f"the GPU kernels read {', '.join(cuda.GPU_TYPES)} weights, not {', '.join(odd)} "
                   "(convert with --outtype f16, q8_0 or q4_0)")
            if odd[0].startswith("transposed"):
                msg = (f"no GPU kernel reads sparse mode input's {', '.join(odd)} matrices (outputs "
                       "not a multiple of 64: no input-block layout)")
        else:
            msg = (f"the GPU kernels read a layer's ffn_gate and ffn_up rows as one type; {mixed} "
                   "(convert with one --outtype: f16, q8_0 or q4_0)")
        if device == "auto" and backend is None:
            if not quiet:
                _notice(msg + "; running on the CPU")
            return cpu_model()
        raise PyinferError(msg)
    if backend is None:
        if not cuda.available():
            if device == "auto":
                if not quiet:
                    _notice(f"no GPU ({cuda.unavailable_reason()}); running on the CPU")
                return cpu_model()
            raise PyinferError(f"--device cuda: no CUDA device ({cuda.unavailable_reason()})")
        backend = CupyDevice()
    sparse = isinstance(cpu_ffn, SparseFFN)
    if sparse and rows_down(weights):  # a --dense file run sparse: neuron rows for the AXPY
        weights = neuron_major_down(weights)
    budget = resolve_budget(backend, vram_budget)
    sizes = _Sizes(cfg, weights, cpu_ffn, n_ctx, dense=not sparse, lm_head=lm_head)
    if n_gpu_layers is not None or disable_gpu_index or not sparse:
        plan = plan_layers(cfg, sizes, budget, n_gpu_layers, dense=not sparse)
    else:
        from pyinfer import placement as P

        stored = counts = None  # reader None: a model built in memory (benchmarks, tests)
        if reader is not None:
            stored = None if reset_gpu_index else _stored_split(reader, cfg, budget, vram_budget)
            counts = P.stored_counts(reader, cfg)
        if counts is None and stored is None:
            _notice("the file has no activation counts (blk.N.act_count): hot neurons chosen blindly")
        plan = plan_hybrid(cfg, sizes, budget, counts, stored)
    for note in plan.notes:
        _notice(note)
    if plan.n_resident == 0:
        _notice("no layer fits in the VRAM budget; running on the CPU")
        return cpu_model()
    model = GpuModel(cfg, weights, n_ctx, n_threads, cpu_ffn, backend, plan, lm_head=lm_head)
    if verbose:
        n_hot = model.n_hot
        _notice(f"{backend.describe()}: {plan.n_resident}/{cfg.n_layer} layers resident, "
                f"{n_hot}/{cfg.n_ff * cfg.n_layer} FFN neurons on the device, output "
                f"{'on the device' if plan.output else 'on the CPU'}; "
                f"{model.device_bytes / GiB:.2f} of {budget / GiB:.2f} GiB")
    return model


def neuron_major_down(weights: ModelWeights) -> ModelWeights:
    """``weights`` with each layer's row-layout ``ffn_down`` (n_embd, n_ff) turned into the
    ``ffn_down_t`` (n_ff, n_embd) the GPU engine reads (a ``pyinfer-convert --dense`` file on the
    GPU; the CPU runs the row layout as it is). F32/F16 transpose exactly; a block type is
    dequantized, transposed and quantized again at its type (``QTensor.from_array``): a second
    rounding, as the converter's own ffn_down_t of a quantized source has. New memory of the
    down projections' size; the memory map is not touched."""
    import dataclasses

    from pyinfer.ops.cpu import QTensor
    from pyinfer.ops.reference import dequantize

    layers = [lw if lw.ffn_down_t is not None else dataclasses.replace(
        lw, ffn_down_t=QTensor.from_array(dequantize(lw.ffn_down).T, lw.ffn_down.qtype),
        ffn_down=None) for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers)


def sparse_mode(reader) -> str | None:
    """The file's sparse mode (``pyinfer.sparse.mode``), or None for a dense file."""
    return read_field(reader, C.K_SPARSE_MODE)
