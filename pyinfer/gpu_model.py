"""The GPU-resident forward pass: PowerInfer's hybrid engine (arXiv 2312.12456 §4-6).

The residual stream lives on the device. Layers 0..n_resident-1 are *resident*: their norms,
attention matrices, KV cache and predictor are on the device, and so are the rows of their
*hot* FFN neurons (the placement's ``gpu_bucket``). Per token and resident layer:

    GPU: rmsnorm -> fused q/k/v GEMV -> RoPE + KV store -> attention -> wo GEMV (+= x)
         rmsnorm -> predictor mask -> [h, mask down to pinned host memory, event]
         hot neurons: fused gate/up -> AXPY over their down rows (+= x)
    CPU: (waits for the event: the one per-layer sync) cold neurons of the same rule with the
         fused CPU kernels -> partial output (pinned) -> up -> GPU: x += partial

so the CPU works on the cold neurons while the GPU works on the hot ones, and only two n_embd
vectors (and the n_ff-byte mask) cross PCIe per split layer. A layer whose neurons are all hot
never waits for the CPU. Layers from n_resident on, when the budget does not hold them, run on the
CPU with the fused CPU kernels (``pyinfer.model.Model.run_layers``): the residual comes down once.
The logits come down once per token (the output matrix is on the device when it fits).

The calling thread is the CPU executor: kernel launches return at once, so after queueing a
layer's GPU work it computes the cold neurons (the Cython kernels release the GIL and run their
own OpenMP threads); a second Python thread would add a hand-off and no parallelism.

On a GPU, decode runs as CUDA graphs when every layer and the output are resident: one token's
launches are captured once (the position is read from device memory) and replayed, split where
the host joins in at a split layer; Python then launches a handful of graphs per token instead
of a dozen kernels per layer (``_capture``; measured in docs/benchmarks.md).

Prefill runs batched: GEMMs through cuBLAS (CuPy ``matmul``) on weights dequantized in bounded
chunks, attention over the cache in query chunks (``pyinfer.ops.xp``); the CPU's cold part loops
over the batch's tokens with the decode kernels, so prefill and decode compute one function.

Sparse mode "input" (TEAL-style input sparsity, ``pyinfer.input_sparse``) runs whole layers on
the device. Before each projection a mask kernel zeroes the inputs the CPU would skip
(``cuda.mask_inputs``, the CPU's rule) and writes the masked activation's q8 form and each
32-channel block's kept bits; the projection then reads only the kept channels' rows: q8_0, q4_0,
q4_1, q5_0 and q5_1 matrices in an input-block layout (``device.device_ib_layout``,
``cuda.ib_gemv``: the CPU's input-block sums, ibsum.h), f16/f32 ones transposed through the AXPY kernel, which skips
zero coefficients (the CPU's transposed sums). So the bytes read shrink with the sparsity, as on
the CPU.

Every step is written once over the device interface (``pyinfer.device``): with ``NumpyDevice``
the whole forward runs with NumPy on a machine without a GPU, which is how the tests check it
against the CPU ``Model``. Same function on every path: the same sparse rule ("relu"/"cats"/"glu"
as ``SparseFFN`` applies it, the file's per-layer choice of running the predictor), dense within
float tolerance.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig
from pyinfer.device import as_qtensor
from pyinfer.errors import PyinferError
from pyinfer.ffn import FFNStats, SparseFFN
from pyinfer.model import Model
from pyinfer.ops import cpu, cuda
from pyinfer.ops import xp as X
from pyinfer.weights import ModelWeights, fused_model

#: most rows of a weight dequantized at once for a prefill GEMM: bounds the scratch to
#: DEQUANT_CHUNK_ELEMS * 4 bytes (64 MiB)
DEQUANT_CHUNK_ELEMS = 16 << 20
#: prefill tokens per device pass (bounds the activations of a batch)
UBATCH = 256


def is_input_layer(lw) -> bool:
    """True for a layer of sparse mode "input" (transposed / input-block matrices)."""
    return lw.attn_qkv_t is not None


def _input_scale_bytes(lw) -> int:
    return sum(int(np.asarray(v).nbytes) for v in (lw.in_scale or {}).values())


def _dev_bytes(t) -> int:
    """Bytes of a sparse mode "input" matrix on the device (an input-block one without the zero
    outputs a file may append: ``cpu.IBTensor.device_nbytes``)."""
    return getattr(t, "device_nbytes", t.nbytes)


def layer_fixed_bytes(cfg: ModelConfig, lw, n_ctx: int, predictor) -> int:
    """Bytes a resident layer holds on the device before any FFN neuron: norms (Qwen3's head
    norms too), q/k/v/o as stored, the KV cache (2 * n_ctx * n_head_kv * head_dim f32) and the
    predictor (as stored);
    for a sparse mode "input" layer the attention matrices (the same bytes in the device's
    input-block or transposed layout) and the WINA column scales."""
    b = 2 * cfg.n_embd * 4
    if lw.has_qkv_bias:  # [bq; bk; bv] f32 (Qwen2)
        b += 4 * (cfg.n_embd_q + 2 * cfg.n_embd_kv)
    if lw.has_head_norms:  # attn_q_norm, attn_k_norm (head_dim,) f32 (Qwen3)
        b += 2 * cfg.head_dim * 4
    if is_input_layer(lw):
        b += _dev_bytes(lw.attn_qkv_t) + _dev_bytes(lw.attn_output_t) + _input_scale_bytes(lw)
    else:
        b += lw.wq.nbytes + lw.wk.nbytes + lw.wv.nbytes + lw.wo.nbytes
    b += 2 * n_ctx * cfg.n_embd_kv * 4
    if predictor is not None:
        b += predictor.fc1.nbytes + predictor.fc2.nbytes
    return b


def neuron_bytes(lw) -> int:
    """Bytes of one FFN neuron on the device: its ffn_gate, ffn_up and ffn_down_t rows (sparse
    mode "input": the FFN matrices' bytes over n_ff; its layers go on the device whole; a
    row-layout ffn_down, dense only: its bytes over n_ff, the same as the ffn_down_t rows')."""
    if is_input_layer(lw):
        return (_dev_bytes(lw.ffn_gate_up_t) + _dev_bytes(lw.ffn_down_t)) // lw.ffn_down_t.rows
    down = (lw.ffn_down_t.raw.shape[1] if lw.ffn_down_t is not None
            else lw.ffn_down.raw.nbytes // lw.ffn_gate.rows)
    return int(lw.ffn_gate.raw.shape[1] + lw.ffn_up.raw.shape[1] + down)


def rows_down(weights: ModelWeights) -> bool:
    """True where the layers hold ffn_down in row layout only (a ``pyinfer-convert --dense``
    file): the device's dense layers then run it as a GEMV (``_ResidentLayer.down_rows``), as the
    CPU and llama.cpp do, instead of the AXPY over neuron-major rows. Sparse plans need
    ffn_down_t (``hybrid.neuron_major_down``)."""
    return any(lw.ffn_down_t is None and lw.ffn_down is not None for lw in weights.layers)


def model_head(cpu_ffn, lm_head=None):
    """The lm head object over ``output_ib`` (``input_sparse.InputSparseHead``): ``lm_head`` when
    given (a two-stage head of a file of another sparse mode), sparse mode input's FFN, or None."""
    if lm_head is not None:
        return lm_head
    return cpu_ffn if getattr(cpu_ffn, "is_input_sparse", False) else None


def ib_head(head, weights: ModelWeights) -> bool:
    """True where the lm head is ``output_ib`` (``head``, an InputSparseHead, is on: input
    sparsity and/or the two-stage copy): on the device it runs as input-block GEMVs over its kept
    inputs, the two-stage head's K exact candidates rescored on the host."""
    return head is not None and head.head_on(weights)


def output_bytes(cfg: ModelConfig, weights: ModelWeights, head=None,
                 input_mode: bool = False) -> int:
    """Device bytes of the output norm and matrix (an ``ib_head``: ``output_ib``, its WINA scales,
    the partial sums of its GEMVs and, unless sparse mode input's buffers have them, its masked
    input, kept bits and counters; the two-stage head's exact rows stay on the host)."""
    if ib_head(head, weights):
        scale = weights.output_in_scale
        return ib_head_bytes(cfg, weights.output_ib.nbytes, weights.output_ib.chunk,
                             0 if scale is None else scale.nbytes, input_mode)
    return cfg.n_embd * 4 + weights.output.nbytes


def ib_head_bytes(cfg: ModelConfig, ib_nbytes: int, chunk: int, scale_nbytes: int = 0,
                  input_mode: bool = False) -> int:
    """``output_bytes`` of a head over ``output_ib`` from sizes alone (the converter places
    neurons before the file exists): the output norm, ``output_ib``'s ``ib_nbytes`` (cut in
    output chunks of ``chunk``), the f32 partial sums of its largest chunk's GEMV
    (``head_scratch_len``), its WINA scales' ``scale_nbytes`` and, unless sparse mode input's
    buffers have them, its masked input, kept bits and counters."""
    own = 0 if input_mode else (4 * cfg.n_embd + 4 * (q8_len(cfg) // 32) + 8 * N_KEPT)
    return (cfg.n_embd * 4 + ib_nbytes + 4 * _head_scratch(cfg.n_embd, cfg.n_vocab, chunk)
            + scale_nbytes + own)


def buffer_bytes(cfg: ModelConfig, n_ctx: int, rank: int, input_mode: bool = False,
                 down_rows: bool = False) -> int:
    """Bytes of the forward's own device buffers (GpuModel.__init__ allocates exactly these):
    one-token activations, the prefill dequantization chunk and the RoPE table (sparse mode
    "input": also its kept-channel counters and bits, gate|up, and the partial sums of its
    projections; ``down_rows`` (``rows_down``): the q8 buffer holds the down GEMV's input)."""
    E, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    decode = 4 * (3 * E + 2 * cfg.n_embd_q + 2 * cfg.n_embd_kv + rank + F + V) + F + 16 + 4
    decode += 4 * cuda.gate_up_list_len(F)  # the hot neurons' candidate list (two-launch form)
    nq8 = q8_len(cfg, input_mode or down_rows)
    if input_mode:  # kept counters (groups, head), kept bits, gate|up, masked head input, sums
        decode += 8 * N_KEPT + 4 * (nq8 // 32) + 4 * 2 * F + 4 * E + 4 * input_scratch_len(cfg)
    decode += nq8 + 4 * max(1, nq8 // 32)  # the q8 form of the quantized rows' activation
    decode += 4 * cuda.axpy_chunks(F) * E  # AXPY partial sums
    return decode + 4 * deq_len(cfg, input_mode) + 4 * n_ctx * cfg.head_dim


def deq_len(cfg: ModelConfig, input_mode: bool = False) -> int:
    """f32 values of prefill's dequantization chunk: the largest matrix, at most
    DEQUANT_CHUNK_ELEMS (sparse mode input's gate|up is n_embd x 2 n_ff)."""
    cols = max(cfg.n_embd, cfg.n_embd_q, cfg.n_ff * (2 if input_mode else 1))
    rows = max(cfg.n_embd_q + 2 * cfg.n_embd_kv, cfg.n_ff, cfg.n_vocab)
    return min(rows * cols, DEQUANT_CHUNK_ELEMS)


#: sparse mode input's device counters of kept channels: the four groups (C.IN_GROUPS), the head
N_KEPT = len(C.IN_GROUPS) + 1


def input_scratch_len(cfg: ModelConfig) -> int:
    """f32 partial sums a sparse mode input projection needs (``cuda.ib_gemv`` or the AXPY over
    a transposed f16/f32 matrix), the largest of the four."""
    from pyinfer.input_sparse import in_sizes

    return max(max(cuda.ib_scratch_len(n_in, n_out), cuda.axpy_chunks(n_in) * n_out)
               for n_in, n_out in in_sizes(cfg).values())


def head_scratch_len(weights: ModelWeights) -> int:
    """f32 partial sums of sparse mode input's lm head on the device (its largest chunk)."""
    ib = weights.output_ib
    return _head_scratch(ib.rows, ib.cols, ib.chunk)


def _head_scratch(n_in: int, n_out: int, chunk: int) -> int:
    """``head_scratch_len`` of an (n_out, n_in) head in output chunks of ``chunk``
    (``cpu.ib_chunks``), from its sizes alone (``ib_head_bytes`` counts it before the file
    exists)."""
    from pyinfer.ops.cpu import ib_chunks

    return max(cuda.ib_scratch_len(n_in, c1 - c0) for c0, c1 in ib_chunks(n_out, chunk))


def q8_len(cfg: ModelConfig, input_mode: bool = False) -> int:
    """Values of the q8 activation buffer: the widest input of a quantized decode GEMV (n_embd
    for q/k/v, gate/up and the output, n_head * head_dim for wo; sparse mode "input", or a
    row-layout ffn_down (``rows_down``): n_ff for the down projection's GEMV too), rounded up
    to 32."""
    return -(-max(cfg.n_embd, cfg.n_embd_q, cfg.n_ff if input_mode else 0) // 32) * 32


def prefill_reserve_bytes(cfg: ModelConfig, n_ctx: int) -> int:
    """Device memory left free for one UBATCH of prefill temporaries (CuPy takes them from its
    pool per batch): activations of UBATCH tokens and the scores of a 64-query attention chunk."""
    E, F, T = cfg.n_embd, cfg.n_ff, UBATCH
    att_chunk = 3 * 4 * 64 * cfg.n_head * n_ctx  # scores, their exp, the causal mask
    return 4 * T * (4 * E + 3 * cfg.n_embd_q + 7 * F) + att_chunk


def device_predictors(cpu_ffn, n_layer: int, dense: bool) -> list:
    """Per layer, the Predictor the device runs, or None: the file's per-layer choice
    (``SparseFFN.use_predictor``), so the device computes the CPU's function; none when dense."""
    if dense or not isinstance(cpu_ffn, SparseFFN) or cpu_ffn.predictors is None:
        return [None] * n_layer
    return [p if use else None for p, use in zip(cpu_ffn.predictors, cpu_ffn.use_predictor)]


def predictor_rank(preds: list) -> int:
    """Rows of the largest device predictor's fc1 (1 without any): the hidden buffer's size."""
    return max([p.fc1.rows for p in preds if p is not None] or [1])


@dataclass
class GpuPlan:
    """What goes on the device. n_resident: layers 0..n_resident-1 are resident (module
    docstring); output: the final norm and output matrix are on the device; hot: per layer, the
    sorted int32 ids of the neurons on the device (empty for non-resident layers); dense: every
    neuron of a layer is computed (no sparsity)."""

    n_resident: int
    output: bool
    hot: list[np.ndarray]
    dense: bool = False
    planned_bytes: int = 0
    notes: list[str] = field(default_factory=list)


class _ResidentLayer:
    """One resident layer's device arrays (shapes in comments)."""

    def __init__(self, dev, cfg: ModelConfig, lw, n_ctx: int, hot: np.ndarray, predictor):
        by_input = is_input_layer(lw)  # sparse mode "input": on the device whole
        if by_input and np.asarray(hot).size != cfg.n_ff:
            raise ValueError("a sparse mode input layer goes on the device whole")
        self.wqkv = self.wq = self.wk = self.wv = self.wo = None
        if by_input:  # the four matrices as the device reads them (rows = input channels)
            self.wqkv_t = _in_matrix(dev, lw.attn_qkv_t)  # (n_embd -> n_embd_q + 2 n_embd_kv)
            self.wo_t = _in_matrix(dev, lw.attn_output_t)  # (n_embd_q -> n_embd)
            self.gate_up_t = _in_matrix(dev, lw.ffn_gate_up_t)  # (n_embd -> 2 n_ff): gate | up
            self.down_t = _in_matrix(dev, lw.ffn_down_t)  # (n_ff -> n_embd)
        else:
            same = lw.wq.qtype == lw.wk.qtype == lw.wv.qtype
            if same:
                self.wqkv = dev.rows([lw.wq, lw.wk, lw.wv])  # (n_q + 2 n_kv, n_embd)
            else:
                self.wq, self.wk, self.wv = dev.rows([lw.wq]), dev.rows([lw.wk]), dev.rows([lw.wv])
            self.wo = dev.rows([lw.wo])  # (n_embd, n_head * head_dim)
        self.attn_norm = dev.array(np.asarray(lw.attn_norm, np.float32))  # (n_embd,)
        b = lw.qkv_bias(cfg)  # (n_q + 2 n_kv,) [bq; bk; bv] (Qwen2) or None
        self.bqkv = None if b is None else dev.array(b)
        # (head_dim,) per-head RMSNorm weights of Q and K, before RoPE (Qwen3), or None
        self.q_norm, self.k_norm = (None if n is None else dev.array(np.asarray(n, np.float32))
                                    for n in (lw.attn_q_norm, lw.attn_k_norm))
        self.ffn_norm = dev.array(np.asarray(lw.ffn_norm, np.float32))
        shape = (n_ctx, cfg.n_head_kv, cfg.head_dim)
        self.k = dev.empty(shape, np.float32)  # (n_ctx, n_head_kv, head_dim) KV cache
        self.v = dev.empty(shape, np.float32)
        # sparse mode "input": group -> (n_in,) f32 WINA column scales
        self.in_scale = {g: dev.array(np.asarray(v, np.float32))
                         for g, v in (lw.in_scale or {}).items()}
        self.fc1 = self.fc2 = None
        self.pred_thr = 0.0
        if predictor is not None:
            self.fc1 = dev.rows([as_qtensor(predictor.fc1.data)])  # (rank, n_embd) as stored
            self.fc2 = dev.rows([as_qtensor(predictor.fc2.data)])  # (n_ff, rank)
            self.pred_thr = predictor.threshold
        self.hot = np.asarray(hot, np.int32)  # (n_hot,) sorted neuron ids on the device
        self.n_hot = int(self.hot.size)
        self.down = self.down_rows = None
        cold = np.ones(cfg.n_ff, bool)
        cold[self.hot] = False
        self.cold_ids = np.flatnonzero(cold).astype(np.int32)  # (n_cold,) the CPU's neurons
        if self.n_hot:
            self.ids = dev.array(self.hot)  # (n_hot,) int32
            if not by_input:
                self.gate = dev.rows([lw.ffn_gate], self.hot)  # (n_hot, row_bytes), device layout
                self.up = dev.rows([lw.ffn_up], self.hot)
                if lw.ffn_down_t is not None:
                    self.down = dev.rows([lw.ffn_down_t], self.hot)  # (n_hot, n_embd)
                elif self.n_hot == cfg.n_ff:  # a --dense file: the GEMV over the rows as stored
                    self.down_rows = dev.rows([lw.ffn_down])  # (n_embd, n_ff)
                else:
                    raise ValueError("a row-layout ffn_down goes on the device whole (dense)")


def _in_matrix(dev, t):
    """A sparse mode input matrix on the device: an input-block one (q8_0/q4_0/q4_1/q5_0/q5_1) in
    the device's input-block layout (``dev.ib_rows``), a transposed f16/f32 one as stored (AXPY rows).
    ValueError for a transposed quantized one (no kernel sums it as the CPU does)."""
    if isinstance(t, cpu.IBTensor):
        return dev.ib_rows(t)
    if t.qtype in (cpu.QT.F32, cpu.QT.F16):
        return dev.rows([t])
    raise ValueError(f"no GPU kernel for a transposed {t.qtype.name} matrix")


def gpu_refusal(cfg: ModelConfig) -> str:
    """The one-line error for a model the GPU engine does not run (``weights.fused_model``)."""
    return (f"the GPU engine runs Llama-shaped files only (Llama, Llama 3, Mistral without "
            f"sliding windows, Qwen2, Qwen3); this {cfg.family} file needs --device cpu")


class GpuModel:
    """The model of ``pyinfer.model.Model`` (same ``forward``) with the GPU-resident plan.

    cfg, weights: the model. cpu_ffn: the CPU FFN (SparseFFN or DenseFFN) that defines the
    function and computes the cold neurons. dev: a ``pyinfer.device`` backend. plan: GpuPlan.
    Raises PyinferError for a model its kernels do not compute (``weights.fused_model``: the
    other families' layers) or when the device runs out of memory.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, n_ctx: int, n_threads: int,
                 cpu_ffn, dev, plan: GpuPlan, lm_head=None):
        if not fused_model(cfg, weights):  # (place_model falls back to the CPU before this)
            raise PyinferError(gpu_refusal(cfg))
        self.cfg, self.w, self.n_ctx, self.n_threads = cfg, weights, n_ctx, n_threads
        self.dev, self.plan = dev, plan
        self.cpu_ffn = cpu_ffn
        # sparse mode "input": masks before every projection (thresholds: cpu_ffn.thr)
        self.input = bool(getattr(cpu_ffn, "is_input_sparse", False))
        # the CPU model: embeddings, layers past n_resident, logits when the output stays here
        # f32 as the device's cache, so that a layer computes one function wherever it runs
        self.lm_head = model_head(cpu_ffn, lm_head)  # the head over output_ib, or None
        self.cpu = Model(cfg, weights, n_ctx, n_threads, ffn=cpu_ffn, cache_type="f32",
                         lm_head=self.lm_head)
        sparse = isinstance(cpu_ffn, SparseFFN) and not plan.dense
        self.sparse = sparse
        self.glu = sparse and cpu_ffn.glu
        self.silu = cfg.hidden_act == "silu"
        self.act_thr = (cpu_ffn.act_threshold if sparse
                        else np.full(cfg.n_layer, -1.0, np.float32))  # -1: keep every neuron
        preds = device_predictors(cpu_ffn, cfg.n_layer, plan.dense)
        self.use_pred = [p is not None for p in preds]
        before = dev.allocated_bytes
        self.layers = [_ResidentLayer(dev, cfg, weights.layers[i], n_ctx, plan.hot[i], preds[i])
                       for i in range(plan.n_resident)]
        self.output_norm = self.output = self.head_parts = self.head_scale = None
        if plan.output:
            self.output_norm = dev.array(np.asarray(weights.output_norm, np.float32))
            if ib_head(self.lm_head, weights):  # [(c0, chunk c0..)] input-block GEMVs
                self.head_parts = [(c0, dev.ib_rows(t)) for c0, t in weights.output_ib.parts]
                self._head_scratch = dev.empty(head_scratch_len(weights), np.float32)
                if weights.output_in_scale is not None:
                    self.head_scale = dev.array(np.asarray(weights.output_in_scale, np.float32))
            else:
                self.output = dev.rows([weights.output])  # (n_vocab, n_embd) as stored
        rank = predictor_rank(preds)
        E, F = cfg.n_embd, cfg.n_ff
        # one-token buffers, allocated once (llama2.c RunState)
        self._x = dev.empty((1, E), np.float32)  # (1, n_embd) residual stream
        self._h = dev.empty((1, E), np.float32)  # (1, n_embd) normed sublayer input
        self._qkv = dev.empty(cfg.n_embd_q + 2 * cfg.n_embd_kv, np.float32)  # (n_q + 2 n_kv,)
        self._attn = dev.empty(cfg.n_embd_q, np.float32)  # (n_head * head_dim,)
        self._hid = dev.empty(rank, np.float32)  # (rank,) predictor hidden layer
        self._mask = dev.empty(F, np.uint8)  # (n_ff,) predicted candidates
        self._coef = dev.empty(F, np.float32)  # (n_hot,) act(gate) * up, 0 where inactive
        self._cand = dev.empty(cuda.gate_up_list_len(F), np.int32)  # candidates (cuda.ffn_gate_up)
        self._partial = dev.empty(E, np.float32)  # (n_embd,) the CPU's partial FFN output
        self._logits = dev.empty(cfg.n_vocab, np.float32)  # (n_vocab,)
        nq8 = q8_len(cfg, self.input or rows_down(weights))
        # (n,) int8 and (n / 32,) f32: the q8 form of the activation that q8_0/q4_0 rows read
        # (cuda.quantize_q8), written by the kernel that makes the activation
        self._q8 = (dev.empty(nq8, np.int8), dev.empty(max(1, nq8 // 32), np.float32))
        self._counts = dev.array(np.zeros(2, np.uint64))  # [candidates, active] of hot neurons
        self._pos = dev.array(np.zeros(1, np.int32))  # (1,) position of the decoded token
        self._axpy = dev.empty(cuda.axpy_chunks(F) * E, np.float32)  # AXPY partial sums
        if self.input or self.head_parts is not None:
            # channels kept per group (C.IN_GROUPS order) in resident layers, and in the head
            self._kept = dev.array(np.zeros(N_KEPT, np.uint64))
            self._hm = dev.empty(E, np.float32)  # (n_embd,) the head's masked input
            # kept bits per 32-channel block (of the masked inputs: not the down rows' GEMV's)
            self._kmask = dev.empty(q8_len(cfg, self.input) // 32, np.uint32)
        if self.input:
            self._gu = dev.empty(2 * F, np.float32)  # (2 n_ff,) gate | up
            self._scratch = dev.empty(input_scratch_len(cfg), np.float32)  # partial sums
            self._in_total = 0  # weight elements a dense pass over the resident layers reads
        self._deq = dev.empty(deq_len(cfg, self.input), np.float32)  # prefill chunk
        self._cos_sin = dev.array(X.rope_cos_sin(n_ctx, cfg.head_dim, cfg.rope_freq_base,
                                                 weights.rope_freqs))
        self.device_bytes = dev.allocated_bytes - before
        # pinned host buffers for the per-layer transfers
        self._x_pin = dev.pinned((1, E), np.float32)
        self._hh_pin = dev.pinned(E, np.float32)  # the output-normed x (two-stage head)
        self._h_pin = dev.pinned((UBATCH, E), np.float32)
        self._mask_pin = dev.pinned((UBATCH, F), np.uint8)
        self._part_pin = dev.pinned((UBATCH, E), np.float32)
        self._logits_pin = dev.pinned(cfg.n_vocab, np.float32)
        self._pos_pin = dev.pinned(1, np.int32)
        # CUDA graphs for decode: every layer resident, the logits on the device, scores of the
        # whole context in shared memory (``_capture``)
        self._use_graphs = (getattr(dev, "graphs", False) and plan.n_resident == cfg.n_layer
                            and plan.output and n_ctx <= cuda.MAX_DECODE_ATTN_ROWS)
        self._graphs = None
        self._capturing = False
        self._decoded = False
        self._split_layers: list[int] = []
        self.graph_events = None  # set to a list to time each graph on the device (benchmarks)
        self._host_stats = FFNStats()  # cold neurons of resident layers + totals
        if self.input:  # weight reads, as InputSparseFFN counts them
            self.stats = _InputStats(cpu_ffn, self)
            self.input_sparse = cpu_ffn
        else:
            self.stats = _SumStats([cpu_ffn.stats, self._host_stats], self)
            self.input_sparse = None
        # the head over output_ib: the CPU's counts plus the device's
        self.head_stats = None if self.lm_head is None else _HeadStats(self.lm_head.head_stats, self)
        self._head_total = 0  # head inputs of the tokens whose logits the device made
        self.profile = Profile()

    # ---- the Model interface ----------------------------------------------------------------
    @property
    def cache(self):
        return self.cpu.cache

    @property
    def ffn(self):
        return self

    @property
    def is_sparse(self) -> bool:
        return self.sparse or (self.input and self.cpu_ffn.is_sparse)

    @property
    def is_input_sparse(self) -> bool:
        return self.input

    @property
    def n_hot(self) -> int:
        return sum(ly.n_hot for ly in self.layers)

    def device_counts(self) -> tuple[int, int]:
        c = np.zeros(2, np.uint64)
        self.dev.to_host(self._counts, c)
        return int(c[0]), int(c[1])

    def reset_device_counts(self) -> None:
        self.dev.upload(np.zeros(2, np.uint64), self._counts)

    def forward(self, tokens, n_past: int, all_logits: bool = False) -> np.ndarray:
        """As ``Model.forward``: logits (n_vocab,) of the last token, or (n_tok, n_vocab)."""
        x_host = self.cpu.embed(tokens, n_past)  # the embedding lookup stays on the CPU
        T = x_host.shape[0]
        if self.plan.n_resident == 0:
            self.cpu.run_layers(x_host, n_past, 0)
            return self.cpu.logits(x_host, all_logits)
        t0 = time.perf_counter()
        with self.dev.activate():
            if T == 1:
                out = self._decode(x_host, n_past, all_logits)
            else:
                out = self._prefill(x_host, n_past, all_logits)
        self.profile.tokens += T
        self.profile.wall_ms += (time.perf_counter() - t0) * 1e3
        return out

    # ---- one token --------------------------------------------------------------------------
    def _decode(self, x_host, n_past: int, all_logits: bool):
        dev = self.dev
        self._x_pin[...] = x_host
        self._pos_pin[0] = n_past
        dev.upload(self._x_pin, self._x)
        dev.upload(self._pos_pin, self._pos)
        if self._use_graphs and not all_logits:
            if self._graphs is None and self._decoded:  # the first token ran eagerly: caches warm
                self._capture()
            if self._graphs is not None:
                return self._replay()
        self._decoded = True
        self._layers_decode(n_past + 1)
        return self._finish(self._x, 1, n_past, all_logits)

    def _layers_decode(self, max_att: int) -> None:
        """Queue one token's resident layers (the host joins in at each split layer's sync).
        max_att: a bound of the cache rows attended (pos + 1; n_ctx when captured)."""
        cfg, dev = self.cfg, self.dev
        x, h = self._x, self._h
        nq, nkv, hd = cfg.n_embd_q, cfg.n_embd_kv, cfg.head_dim
        q = self._qkv[:nq].reshape(cfg.n_head, hd)
        k = self._qkv[nq:nq + nkv].reshape(cfg.n_head_kv, hd)
        v = self._qkv[nq + nkv:].reshape(cfg.n_head_kv, hd)
        for i, ly in enumerate(self.layers):
            # attention; the q8 form of an activation is made by the kernel that makes it,
            # where the rows that read it are quantized
            # (sparse mode input: the mask before the projection makes the q8 form)
            q8 = self._q8_for(*([ly.wqkv] if ly.wqkv is not None else [ly.wq, ly.wk, ly.wv]))
            dev.rmsnorm(x, ly.attn_norm, cfg.rms_eps, h, q8=q8)
            if self.input:
                self._proj_in(i, ly, "attn_qkv", ly.wqkv_t, h[0], self._qkv)
            elif ly.wqkv is not None:
                dev.gemv(ly.wqkv, h[0], self._qkv, q8=q8)
            else:
                dev.gemv(ly.wq, h[0], self._qkv[:nq], q8=self._q8_for(ly.wq))
                dev.gemv(ly.wk, h[0], self._qkv[nq:nq + nkv], q8=self._q8_for(ly.wk))
                dev.gemv(ly.wv, h[0], self._qkv[nq + nkv:], q8=self._q8_for(ly.wv))
            if ly.bqkv is not None:  # (Qwen2) the projections' biases, before RoPE
                dev.add(self._qkv, ly.bqkv)
            if ly.q_norm is not None:  # (Qwen3) each head's RMSNorm, in place, before RoPE
                dev.rmsnorm(q, ly.q_norm, cfg.rms_eps, q)
                dev.rmsnorm(k, ly.k_norm, cfg.rms_eps, k)
            dev.rope_store(q, k, v, ly.k, ly.v, self._cos_sin, self._pos)
            q8 = self._q8_for(ly.wo)
            dev.attn_decode(q, ly.k, ly.v, self._pos, self._attn.reshape(cfg.n_head, hd), max_att,
                            q8=q8)
            if self.input:
                self._proj_in(i, ly, "attn_output", ly.wo_t, self._attn, x[0], accumulate=True)
            else:
                dev.gemv(ly.wo, self._attn, x[0], accumulate=True, q8=q8)
            # feed-forward: hot neurons here, cold ones on the CPU meanwhile
            self._ffn_decode(i, ly, x, h)

    def _q8_for(self, *ws):
        """The q8 activation buffers when a kernel over ``ws`` reads them (quantized rows),
        else None. With mixed types (q/k/v of different types) the q8 form is made once."""
        return self._q8 if any(w is not None and cuda.reads_q8(w) for w in ws) else None

    def _mask_args(self, i: int, ly: _ResidentLayer, group: str):
        """(scale, threshold, kept counter) of group's mask in layer i: the CPU's selection
        (``cpu_ffn.thr``, the WINA column scales). A captured CUDA graph keeps the threshold it
        was captured with (the file's)."""
        g = C.IN_GROUPS.index(group)
        return ly.in_scale.get(group), float(self.cpu_ffn.thr[group][i]), self._kept[g:g + 1]

    def _proj_in(self, i: int, ly: _ResidentLayer, group: str, w, v, out,
                 accumulate: bool = False) -> None:
        """Sparse mode input, one token: v (n_in,) masked in place by group's rule, then out
        (n_out,) (+)= W v over the kept channels (``_apply_in``)."""
        ib = cuda.is_ib(w)
        self.dev.mask_inputs(v, *self._mask_args(i, ly, group), *self._q8_kmask(ib))
        self._apply_in(w, v, out, accumulate)

    def _q8_kmask(self, ib: bool):
        return (self._q8, self._kmask) if ib else (None, None)

    def _apply_in(self, w, v, out, accumulate: bool) -> None:
        """out (+)= W v for the masked v: an input-block GEMV over the kept channels' rows (their
        q8 form and bits from the mask), or an AXPY over a transposed float matrix's rows
        skipping zero coefficients."""
        if cuda.is_ib(w):
            self.dev.ib_gemv(w, v, out, self._q8, self._kmask, accumulate, self._scratch)
        else:
            self.dev.axpy_rows(w, v, out, skip_zero=True, accumulate=accumulate,
                               scratch=self._scratch)

    def _ffn_decode_input(self, i: int, ly: _ResidentLayer, x, h) -> None:
        """Sparse mode "input": masked FFN input -> gate|up over its kept channels -> act(gate) *
        up masked (``glu_mask``) -> the down projection over its kept channels (+= x): the CPU's
        ``decode_ffn_in``."""
        dev, F = self.dev, self.cfg.n_ff
        dev.rmsnorm(x, ly.ffn_norm, self.cfg.rms_eps, h)
        self._proj_in(i, ly, "ffn_gate_up", ly.gate_up_t, h[0], self._gu)
        scale, thr, kept = self._mask_args(i, ly, "ffn_down")
        dev.glu_mask(self._gu, F, self.cfg.hidden_act, scale, thr, self._coef, kept,
                     *self._q8_kmask(cuda.is_ib(ly.down_t)))
        self._apply_in(ly.down_t, self._coef, x[0], accumulate=True)
        if not self._capturing:
            self._in_total += self.cpu_ffn.dense_elems

    def _mask_in_batch(self, i: int, ly: _ResidentLayer, group: str, v):
        """Group's mask of a batch v (n_tok, n_in): the masked copy (``xp.mask_inputs``)."""
        scale, thr, kept = self._mask_args(i, ly, group)
        m, k = X.mask_inputs(v, scale, thr)
        kept += k.astype(kept.dtype)
        return m

    def _proj_in_batch(self, i: int, ly: _ResidentLayer, group: str, w, a):
        """``_proj_in`` for a batch a (n_tok, n_in) -> (n_tok, n_out): a GEMM over the masked
        inputs (an input-block matrix's against their q8 form, as decode's sums)."""
        am = self._mask_in_batch(i, ly, group, a)
        return self._linear_t(w, X.quantize_act_q8(am) if cuda.is_ib(w) else am)

    def _ffn_decode(self, i: int, ly: _ResidentLayer, x, h) -> None:
        if self.input:
            return self._ffn_decode_input(i, ly, x, h)
        dev, F, eps = self.dev, self.cfg.n_ff, self.cfg.rms_eps
        use_pred = self.use_pred[i]
        split = ly.n_hot < F
        q8 = self._q8_for(ly.gate) if ly.n_hot else None
        if use_pred:  # the predictor's hidden layer and the FFN norm in one launch
            dev.norm_fc1(ly.fc1, x[0], self._hid, ly.ffn_norm, eps, h[0], q8=q8)
            if split:  # the CPU's candidates; the hot rows evaluate fc2 inline
                dev.predict_fc2(ly.fc2, self._hid, ly.pred_thr, self._mask)
        else:
            dev.rmsnorm(x, ly.ffn_norm, eps, h, q8=q8)
        if split:  # the CPU's input goes down first, so it works while the GPU does the hot rows
            dev.download(h, self._h_pin[:1])
            if use_pred:
                dev.download(self._mask, self._mask_pin[:1])
            ready = self._segment_end() if self._capturing else dev.record()
        if ly.n_hot:
            dev.ffn_gate_up(ly.gate, ly.up, h[0], self._coef[:ly.n_hot], self._counts,
                            self.cfg.hidden_act, float(self.act_thr[i]), ids=ly.ids,
                            glu=self.glu,
                            pred=(ly.fc2, self._hid, ly.pred_thr) if use_pred else None, q8=q8,
                            scratch=self._cand)
            if ly.down_rows is not None:  # dense, row layout: x += ffn_down @ coef
                q8d = self._q8_for(ly.down_rows)
                if q8d is not None:
                    dev.quantize_q8(self._coef, q8d)
                dev.gemv(ly.down_rows, self._coef, x[0], accumulate=True, q8=q8d)
            else:
                dev.axpy_rows(ly.down, self._coef[:ly.n_hot], x[0], skip_zero=self.sparse,
                              accumulate=True, scratch=self._axpy)
        if self._capturing:
            if split:
                self._segment_end()
                self._split_layers.append(i)
        else:
            self._host_stats.total += F
            if split:
                self._host_part(i, ly, ready)
        if split:  # the CPU's partial output goes up and is added on the device
            dev.upload(self._part_pin[:1], self._partial)
            dev.add(x[0], self._partial)

    def _host_part(self, i: int, ly: _ResidentLayer, ready, n_tok: int = 1) -> None:
        """Wait for the layer's FFN input of n_tok tokens (the one per-layer sync) and compute
        their cold neurons into the pinned partial-output buffer, token by token."""
        t0 = time.perf_counter()
        self.dev.wait(ready)
        t1 = time.perf_counter()
        for t in range(n_tok):
            mask = self._mask_pin[t] if self.use_pred[i] else None
            self._cold(i, ly, self._h_pin[t], mask, self._part_pin[t])
        self.profile.wait_ms += (t1 - t0) * 1e3
        self.profile.cold_ms += (time.perf_counter() - t1) * 1e3
        self.profile.syncs += 1

    # ---- CUDA graphs: one token's launches captured once, replayed per token ----------------
    def _segment_end(self):
        """While capturing: close the current graph at a point where the host joins in, open the
        next one."""
        stream = self.dev.stream
        self._graphs.append(stream.end_capture())
        stream.begin_capture()

    def _capture(self) -> None:
        """Record one token's device work as CUDA graphs, split where the host joins in: per
        split layer, [work up to its FFN input going down] and [its hot neurons]; then the rest
        and the logits going down. The position comes from device memory (``self._pos``), so
        the graphs replay for any token. Launch overhead per layer drops from one Python call
        per kernel to one graph launch per segment (PowerInfer's per-layer sync remains)."""
        stream = self.dev.stream
        self._graphs, self._split_layers = [], []
        self._capturing = True
        try:
            stream.begin_capture()
            self._layers_decode(self.n_ctx)
            self._head(self._x)
            self._graphs.append(stream.end_capture())
        except Exception as e:  # a driver or CuPy that cannot capture: stay eager
            try:
                if stream.is_capturing():
                    stream.end_capture()
            except Exception:
                pass
            self._graphs, self._use_graphs = None, False
            print(f"pyinfer: CUDA graph capture failed ({type(e).__name__}: {e}); decoding "
                  "without graphs", file=sys.stderr)
        finally:
            self._capturing = False

    def _replay(self) -> np.ndarray:
        dev, stream, F = self.dev, self.dev.stream, self.cfg.n_ff
        g = self._graphs
        ev = self.graph_events  # benchmarks: a list collects (start, end) events per graph

        def launch(graph):
            e0 = stream.record() if ev is not None else None
            graph.launch(stream)
            if ev is not None:
                ev.append((e0, stream.record()))
        for j, i in enumerate(self._split_layers):
            launch(g[2 * j])
            ready = dev.record()
            launch(g[2 * j + 1])
            self._host_part(i, self.layers[i], ready)
        launch(g[-1])
        dev.synchronize()
        logits = self._logits_pin.copy()
        self._rescore(logits)
        self._host_stats.total += F * len(self.layers)
        if self.input:
            self._in_total += self.cpu_ffn.dense_elems * len(self.layers)
        return logits

    def _cold(self, i: int, ly: _ResidentLayer, h: np.ndarray, mask, out: np.ndarray) -> None:
        """The cold neurons of layer i for one token, with SparseFFN's rule (``cpu.cold_ffn``,
        equal to ``pyinfer.ffn.sparse_step`` on the candidates): out (n_embd,) f32 = their down
        projection."""
        lw = self.w.layers[i]
        # dense: the GLU rule with a negative threshold keeps every candidate
        n_cand, n = cpu.cold_ffn(lw.ffn_gate, lw.ffn_up, lw.ffn_down_t, h, ly.cold_ids, mask,
                                 self.silu, self.glu or not self.sparse, float(self.act_thr[i]),
                                 out, self.n_threads)
        self._host_stats.candidates += n_cand
        self._host_stats.active += n

    def _finish(self, x, T: int, n_past: int, all_logits: bool):
        """Layers past the resident ones on the CPU, then the logits (brought down once)."""
        dev, cfg = self.dev, self.cfg
        if self.plan.n_resident < cfg.n_layer or not self.plan.output:
            x_host = np.empty((T, cfg.n_embd), np.float32)
            dev.to_host(x, x_host)
            self.cpu.run_layers(x_host, n_past, self.plan.n_resident)
            return self.cpu.logits(x_host, all_logits)
        if not all_logits:
            self._head(x[T - 1:T])
            dev.synchronize()
            logits = self._logits_pin.copy()
            self._rescore(logits)
            return logits
        hn = X.rmsnorm(x, self.output_norm, cfg.rms_eps)
        logits = np.empty((T, cfg.n_vocab), np.float32)
        if self.head_parts is None:
            return dev.to_host(self._linear(self.output, hn), logits)
        # sparse mode input's head: GEMMs over the masked batch, chunk by chunk
        scale, thr, kept = self.head_scale, self.lm_head.lm_head_thr, self._kept[-1:]
        hm, k = X.mask_inputs(hn, scale, thr)
        kept += k.astype(kept.dtype)
        self._head_total += T * cfg.n_embd
        q = X.quantize_act_q8(hm)
        out = dev.xp.empty((T, cfg.n_vocab), dev.xp.float32)
        for c0, part in self.head_parts:
            out[:, c0:c0 + part.cols] = self._linear_t(part, q)
        dev.to_host(out, logits)
        if self.lm_head.head_candidates:
            hh = np.empty((T, cfg.n_embd), np.float32)
            dev.to_host(hn, hh)
            for t in range(T):
                self.lm_head._rescore(self.w, hh[t], logits[t], self.n_threads)
        return logits

    def _head(self, x) -> None:
        """Queue one token's logits of x (1, n_embd) into the pinned ``_logits_pin``: the output
        norm and GEMV, or sparse mode input's head (its inputs masked, input-block GEMVs over
        each chunk of outputs; for the two-stage head the normed x goes down too, for
        ``_rescore``). Captured in the decode graph."""
        dev, cfg = self.dev, self.cfg
        h = self._h
        if self.head_parts is None:
            q8 = self._q8_for(self.output)
            dev.rmsnorm(x, self.output_norm, cfg.rms_eps, h, q8=q8)
            dev.gemv(self.output, h[0], self._logits, q8=q8)
        else:
            dev.rmsnorm(x, self.output_norm, cfg.rms_eps, h)
            dev.copy(self._hm, h[0])
            dev.mask_inputs(self._hm, self.head_scale, self.lm_head.lm_head_thr, self._kept[-1:],
                            self._q8, self._kmask)
            for c0, part in self.head_parts:
                dev.ib_gemv(part, self._hm, self._logits[c0:c0 + part.cols], self._q8,
                            self._kmask, False, self._head_scratch)
            if self.lm_head.head_candidates:
                dev.download(h[0], self._hh_pin)
        dev.download(self._logits, self._logits_pin)

    def _rescore(self, logits: np.ndarray) -> None:
        """After ``_head`` has landed: sparse mode input's two-stage head on the host (the exact
        head's rows for the K best of the copy's logits: ``InputSparseHead._rescore``, the CPU's
        own step), and the head's input count."""
        if self.head_parts is None:
            return
        self._head_total += self.cfg.n_embd
        if self.lm_head.head_candidates:
            self.lm_head._rescore(self.w, self._hh_pin, logits, self.n_threads)

    # ---- a batch of tokens (prefill) --------------------------------------------------------
    def _prefill(self, x_host, n_past: int, all_logits: bool):
        T = x_host.shape[0]
        if T > UBATCH:  # bounded device temporaries: one UBATCH at a time
            outs = []
            for t0 in range(0, T, UBATCH):
                part = self._prefill(x_host[t0:t0 + UBATCH], n_past + t0, all_logits)
                outs.append(part if all_logits else None)
            return np.concatenate(outs) if all_logits else part
        cfg, dev, xp = self.cfg, self.dev, self.dev.xp
        x = dev.xp.asarray(x_host)  # (T, n_embd) residual stream on the device
        nq, nkv, hd = cfg.n_embd_q, cfg.n_embd_kv, cfg.head_dim
        for i, ly in enumerate(self.layers):
            h = X.rmsnorm(x, ly.attn_norm, cfg.rms_eps)
            if self.input:
                qkv = self._proj_in_batch(i, ly, "attn_qkv", ly.wqkv_t, h)
            elif ly.wqkv is not None:
                qkv = self._linear(ly.wqkv, h)
            else:
                qkv = xp.concatenate([self._linear(w, h) for w in (ly.wq, ly.wk, ly.wv)], axis=1)
            if ly.bqkv is not None:
                qkv += ly.bqkv
            q = xp.ascontiguousarray(qkv[:, :nq]).reshape(T, cfg.n_head, hd)
            k = xp.ascontiguousarray(qkv[:, nq:nq + nkv]).reshape(T, cfg.n_head_kv, hd)
            if ly.q_norm is not None:  # (Qwen3) each head's RMSNorm before RoPE
                X.rmsnorm(q, ly.q_norm, cfg.rms_eps, q)
                X.rmsnorm(k, ly.k_norm, cfg.rms_eps, k)
            X.rope(q, self._cos_sin, n_past)
            X.rope(k, self._cos_sin, n_past)
            ly.k[n_past:n_past + T] = k
            ly.v[n_past:n_past + T] = qkv[:, nq + nkv:].reshape(T, cfg.n_head_kv, hd)
            attn = X.attention(q, ly.k, ly.v, n_past).reshape(T, nq)
            if self.input:
                x += self._proj_in_batch(i, ly, "attn_output", ly.wo_t, attn)
            else:
                x += self._linear(ly.wo, attn)
            h = X.rmsnorm(x, ly.ffn_norm, cfg.rms_eps)
            if self.input:
                self._ffn_prefill_input(i, ly, x, h)
            else:
                self._ffn_prefill(i, ly, x, h)
        return self._finish(x, T, n_past, all_logits)

    def _ffn_prefill(self, i: int, ly: _ResidentLayer, x, h) -> None:
        dev, xp, F = self.dev, self.dev.xp, self.cfg.n_ff
        T = x.shape[0]
        use_pred = self.use_pred[i]
        cand = None
        if use_pred:
            hid = xp.maximum(self._linear(ly.fc1, x), 0.0)
            cand = self._linear(ly.fc2, hid) >= ly.pred_thr  # (T, n_ff) bool
        split = ly.n_hot < F
        if split:
            dev.download(h, self._h_pin[:T])
            if use_pred:
                dev.download(cand.astype(xp.uint8), self._mask_pin[:T])
            ready = dev.record()
        if ly.n_hot:
            g = self._linear(ly.gate, h)  # (T, n_hot)
            a = X.act(g, self.silu)
            u = self._linear(ly.up, h)
            c = a * u
            keep = ~(xp.abs(c if self.glu else a) <= xp.float32(self.act_thr[i]))  # NaN kept
            if cand is not None:
                mine = cand[:, ly.ids]
                keep &= mine
                self._counts[0] += mine.sum().astype(xp.uint64)
            else:
                self._counts[0] += xp.uint64(T * ly.n_hot)
            self._counts[1] += keep.sum().astype(xp.uint64)
            c = xp.where(keep, c, xp.float32(0.0)).astype(xp.float32)
            x += (self._linear(ly.down_rows, c) if ly.down_rows is not None
                  else self._linear_t(ly.down, c))
        self._host_stats.total += T * F
        if split:
            self._host_part(i, ly, ready, T)
            x += dev.xp.asarray(self._part_pin[:T])

    def _ffn_prefill_input(self, i: int, ly: _ResidentLayer, x, h) -> None:
        """``_ffn_decode_input`` for a batch: GEMMs over the masked inputs."""
        F = self.cfg.n_ff
        gu = self._proj_in_batch(i, ly, "ffn_gate_up", ly.gate_up_t, h)
        c = X.act(gu[:, :F], self.silu) * gu[:, F:]
        x += self._proj_in_batch(i, ly, "ffn_down", ly.down_t, c)
        self._in_total += x.shape[0] * self.cpu_ffn.dense_elems

    def _linear(self, w, a):
        """a (T, cols) @ w.T -> (T, rows) f32: w dequantized in chunks, GEMM (cuBLAS on a GPU).
        q8_0/q4_0 rows meet a's q8 form, as in decode and on the CPU."""
        xp = self.dev.xp
        T = a.shape[0]
        if cuda.reads_q8(w):
            a = X.quantize_act_q8(a)
        out = xp.empty((T, w.rows), xp.float32)
        step = max(1, DEQUANT_CHUNK_ELEMS // w.cols)
        for r0 in range(0, w.rows, step):
            n = min(step, w.rows - r0)
            self.dev.dequant(w, r0, n, self._deq)
            out[:, r0:r0 + n] = a @ self._deq[:n * w.cols].reshape(n, w.cols).T
        return out

    def _linear_t(self, w, a):
        """a (T, rows) @ w -> (T, cols) f32 (the neuron-major down projection), in chunks."""
        xp = self.dev.xp
        out = xp.zeros((a.shape[0], w.cols), xp.float32)
        step = max(1, DEQUANT_CHUNK_ELEMS // w.cols)
        for r0 in range(0, w.rows, step):
            n = min(step, w.rows - r0)
            self.dev.dequant(w, r0, n, self._deq)
            out += a[:, r0:r0 + n] @ self._deq[:n * w.cols].reshape(n, w.cols)
        return out


@dataclass
class Profile:
    """Where a GpuModel's time went since the last reset (host clock, milliseconds): ``cold_ms``
    computing cold neurons on the CPU, ``wait_ms`` blocked on the GPU at the per-layer sync,
    ``wall_ms`` whole forward calls; ``syncs`` per-layer syncs; ``tokens`` evaluated."""

    wall_ms: float = 0.0
    cold_ms: float = 0.0
    wait_ms: float = 0.0
    syncs: int = 0
    tokens: int = 0

    def reset(self):
        self.wall_ms = self.cold_ms = self.wait_ms = 0.0
        self.syncs = self.tokens = 0


class _InputStats:
    """FFNStats-shaped view of sparse mode "input"'s weight reads (``InputSparseFFN.stats``:
    elements of the projection rows read, of those a dense pass reads): the CPU's layers' counts
    plus the resident layers' (kept channels per group, read from the device, times the outputs
    per channel)."""

    def __init__(self, isp, model: GpuModel):
        self._isp, self._model = isp, model

    @property
    def total(self) -> int:
        return self._isp.stats.total + self._model._in_total

    candidates = total

    @property
    def active(self) -> int:
        kept = np.zeros(len(C.IN_GROUPS), np.uint64)
        self._model.dev.to_host(self._model._kept, kept)
        return self._isp.stats.active + sum(int(k) * n for k, n in zip(kept, self._isp.row_elems))

    @property
    def sparsity(self) -> float:
        total = self.total
        return 1.0 - self.active / total if total else 0.0

    def reset(self):
        self._isp.stats.reset()
        self._model._in_total = 0
        self._model.dev.upload(np.zeros(len(C.IN_GROUPS), np.uint64), self._model._kept)
        self._model.profile.reset()


class _HeadStats:
    """FFNStats-shaped view of sparse mode input's lm-head counts: the CPU's (head on the host)
    plus the device's (inputs of the tokens it made logits for, kept ones read from the device)."""

    def __init__(self, base: FFNStats, model: GpuModel):
        self._base, self._model = base, model

    @property
    def total(self) -> int:
        return self._base.total + self._model._head_total

    @property
    def active(self) -> int:
        if not hasattr(self._model, "_kept"):  # the head is the CPU's
            return self._base.active
        kept = np.zeros(N_KEPT, np.uint64)
        self._model.dev.to_host(self._model._kept, kept)
        return self._base.active + int(kept[-1])

    @property
    def sparsity(self) -> float:
        total = self.total
        return 1.0 - self.active / total if total else 0.0

    def reset(self):
        self._base.reset()
        self._model._head_total = 0
        if hasattr(self._model, "_kept"):
            self._model.dev.upload(np.zeros(1, np.uint64), self._model._kept[-1:])


class _SumStats:
    """FFNStats-shaped view over the CPU FFN's counters, the cold-neuron counters and the
    device's hot-neuron counters (read from the device on access)."""

    def __init__(self, parts: list[FFNStats], model: GpuModel):
        self._parts, self._model = parts, model

    @property
    def total(self) -> int:
        return sum(p.total for p in self._parts)

    def _dev(self):
        return self._model.device_counts() if self._model.n_hot else (0, 0)

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
        self._model.reset_device_counts()
        self._model.profile.reset()
