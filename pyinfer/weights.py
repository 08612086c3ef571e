"""Per-layer views of the weights inside the memory-mapped GGUF, never copies.

Like llama2.c's ``memory_map_weights``: every tensor stays where ``GGUFReader``'s memmap put it;
this module only names and shapes the views (see docs/design.md for the layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig, read_field
from pyinfer.errors import PyinferError
from pyinfer.ops.cpu import SUPPORTED, IBChunks, IBTensor, QTensor, ib_pad_outs, ib_type

QT = gguf.GGMLQuantizationType


@dataclass
class LayerWeights:
    """One layer's views. A file of sparse mode "input" stores the projections transposed (one row
    per input channel: ``attn_qkv_t``, ``attn_output_t``, ``ffn_gate_up_t``) instead of wq, wk,
    wv, wo, ffn_gate and ffn_up, which are then None."""

    attn_norm: np.ndarray  # (n_embd,) f32
    wq: QTensor | None  # (n_head * head_dim, n_embd)
    wk: QTensor | None  # (n_head_kv * head_dim, n_embd)
    wv: QTensor | None  # (n_head_kv * head_dim, n_embd)
    wo: QTensor | None  # (n_embd, n_head * head_dim)
    ffn_norm: np.ndarray  # (n_embd,) f32
    ffn_gate: QTensor | None  # (n_ff, n_embd) one row per neuron; None for a non-gated FFN or input mode
    ffn_up: QTensor | None  # (n_ff, n_embd) one row per neuron; None in input mode
    ffn_down_t: QTensor | None  # (n_ff, n_embd) ffn_down transposed: one row per neuron (None: see ffn_down)
    fc1: np.ndarray | None = None  # (rank, n_embd) f32 or f16 predictor, when the file has one
    fc2: np.ndarray | None = None  # (n_ff, rank) f32 or f16
    # optional biases (None when the file has none), f32
    attn_norm_b: np.ndarray | None = None  # (n_embd,) LayerNorm bias
    ffn_norm_b: np.ndarray | None = None  # (n_embd,)
    bq: np.ndarray | None = None  # (n_head * head_dim,)
    bk: np.ndarray | None = None  # (n_head_kv * head_dim,)
    bv: np.ndarray | None = None  # (n_head_kv * head_dim,)
    bo: np.ndarray | None = None  # (n_embd,)
    ffn_up_b: np.ndarray | None = None  # (n_ff,) one per neuron, added before the activation
    ffn_down_b: np.ndarray | None = None  # (n_embd,)
    # optional extra RMSNorms (Gemma 3), f32 weights with Gemma's +1 included
    attn_q_norm: np.ndarray | None = None  # (head_dim,) per head of Q, before RoPE
    attn_k_norm: np.ndarray | None = None  # (head_dim,) per head of K, before RoPE
    attn_post_norm: np.ndarray | None = None  # (n_embd,) on the attention output
    ffn_post_norm: np.ndarray | None = None  # (n_embd,) on the FFN output
    # ffn_down in llama.cpp's row layout, ffn_down_t then None: a llama.cpp file run as it is
    # (pyinfer.llamacpp) or a `pyinfer-convert --dense` file (pyinfer.ffn_layout "rows")
    ffn_down: QTensor | None = None  # (n_embd, n_ff) one row per output channel

    # sparse mode "input" (TEAL/WINA): one row per input channel, transposed (QTensor) or in the
    # input-block layout of q8_0 / q4_0 / q4_1 / q5_0 / q5_1 files (IBTensor, rows = input channels; ffn_down_t too)
    attn_qkv_t: QTensor | None = None  # (n_embd, n_embd_q + 2 n_embd_kv) = [wq; wk; wv]^T
    attn_output_t: QTensor | None = None  # (n_embd_q, n_embd) = wo^T
    ffn_gate_up_t: QTensor | None = None  # (n_embd, 2 n_ff) = [ffn_gate; ffn_up]^T
    in_scale: dict | None = None  # group -> (n_in,) f32 column norms (WINA files)

    @property
    def has_head_norms(self) -> bool:
        """True where Q and K get per-head RMSNorms before RoPE (Qwen3, Gemma 3)."""
        return self.attn_q_norm is not None or self.attn_k_norm is not None

    @property
    def has_extra_norms(self) -> bool:
        return self.has_head_norms or any(n is not None for n in (self.attn_post_norm,
                                                                  self.ffn_post_norm))

    @property
    def has_bias(self) -> bool:
        return any(b is not None for b in (self.attn_norm_b, self.ffn_norm_b, self.bq, self.bk,
                                           self.bv, self.bo, self.ffn_up_b, self.ffn_down_b))

    @property
    def has_qkv_bias(self) -> bool:
        return self.bq is not None or self.bk is not None or self.bv is not None

    def qkv_bias(self, cfg: ModelConfig) -> np.ndarray | None:
        """[bq; bk; bv] (n_embd_q + 2 n_embd_kv,) f32 where the layer has q/k/v biases (Qwen2; a
        missing one as zeros), else None: what a fused q/k/v projection's output gets added."""
        if not self.has_qkv_bias:
            return None
        return np.concatenate([np.zeros(n, np.float32) if b is None else np.asarray(b, np.float32)
                               for b, n in ((self.bq, cfg.n_embd_q), (self.bk, cfg.n_embd_kv),
                                            (self.bv, cfg.n_embd_kv))])


def fused_model(cfg, weights: "ModelWeights") -> bool:
    """True where the fused CPU kernels (``cpu.decode_attn`` / ``decode_ffn``) and sparse mode
    input run the model: Llama-shaped (``cfg.llama_plain``) with weights they take
    (``weights.llama_fused``: Llama 3's RoPE frequency divisors, Qwen2's q/k/v biases and
    Qwen3's head norms included). The one test the model, the converter's mode choice and the
    GPU engine share."""
    return cfg.llama_plain and weights.llama_fused


@dataclass
class ModelWeights:
    token_embd: QTensor  # (n_vocab, n_embd)
    output_norm: np.ndarray  # (n_embd,) f32
    output: QTensor  # (n_vocab, n_embd); token_embd itself when tied
    layers: list[LayerWeights]
    output_norm_b: np.ndarray | None = None  # (n_embd,) LayerNorm bias
    pos_embd: QTensor | None = None  # (n_ctx_train, n_embd) learned positions
    rope_freqs: np.ndarray | None = None  # (head_dim/2,) f32 divisors of RoPE's frequencies
    # sparse mode "input" with lm-head sparsity: the output matrix for input sparsity, in chunks
    output_ib: "IBChunks | None" = None  # rows n_embd, cols n_vocab
    output_in_scale: np.ndarray | None = None  # (n_embd,) f32 column norms (WINA files)

    @property
    def llama_plain(self) -> bool:
        """True where the weights are a plain Llama's: ``llama_fused`` without RoPE frequency
        divisors, q/k/v biases or head norms."""
        return (self.rope_freqs is None and self.llama_fused
                and not any(lw.has_qkv_bias or lw.has_head_norms for lw in self.layers))

    @property
    def llama_fused(self) -> bool:
        """True where the fused CPU kernels (``cpu.decode_attn`` / ``decode_ffn``, sparse mode
        input) compute these weights: a plain Llama's, or with RoPE frequency divisors (Llama 3's
        rope_freqs), q/k/v biases (Qwen2) and per-head Q/K norms (Qwen3), which those take; other
        biases and norms need the kernel-by-kernel loop."""
        return (self.pos_embd is None and self.output_norm_b is None
                and not any(lw.attn_post_norm is not None or lw.ffn_post_norm is not None
                            or (lw.attn_q_norm is None) != (lw.attn_k_norm is None)
                            or any(b is not None for b in (lw.attn_norm_b, lw.ffn_norm_b, lw.bo,
                                                           lw.ffn_up_b, lw.ffn_down_b))
                            or (lw.ffn_gate is None and lw.ffn_gate_up_t is None)
                            for lw in self.layers))

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, cfg: ModelConfig,
                  llamacpp: bool = False, qk_permuted: bool = True) -> "ModelWeights":
        """Map every tensor of ``reader`` by name (layers by number, never by sorted name).

        ``llamacpp``: a llama.cpp file (``pyinfer.llamacpp``): its permuted Q/K rows (unless
        ``qk_permuted`` is False: llama.cpp's Qwen2 / Qwen3, NeoX RoPE) are gathered back into
        Hugging Face order (a copy of those two matrices only) and ``ffn_down``
        (n_embd, n_ff) is mapped as stored in ``LayerWeights.ffn_down`` (``ffn_down_t`` None).
        A pyinfer file of ``pyinfer.ffn_layout`` "rows" (``pyinfer-convert --dense``) maps its
        ``ffn_down`` the same way; the others map ``ffn_down_t`` (n_ff, n_embd).

        Raises PyinferError for a missing tensor, a type pyinfer does not run, a shape that
        disagrees with ``cfg``, or a predictor (fc1 (rank, n_embd), fc2 (n_ff, rank), F32 or F16)
        of the wrong shape or type or without its other half.
        """
        by_name = {t.name: t for t in reader.tensors}

        def tensor(name, rows, cols):
            t = by_name.get(name)
            if t is None:
                raise PyinferError(f"tensor {name} is missing from the GGUF")
            if len(t.shape) != 2:
                raise PyinferError(f"tensor {name} has {len(t.shape)} dimensions, expected 2")
            try:
                q = QTensor.from_reader_tensor(t)
            except ValueError as e:  # an unsupported type or a row length its blocks do not fit
                hint = ("; pyinfer-convert re-encodes a llama.cpp file's other types (Q2_K, Q3_K "
                        "...) at types it runs" if llamacpp else "")
                raise PyinferError(f"tensor {name}: {e} (pyinfer runs "
                                   f"{', '.join(s.name for s in SUPPORTED)}{hint})") from None
            if (q.rows, q.cols) != (rows, cols):
                raise PyinferError(f"tensor {name} has shape ({q.rows}, {q.cols}), "
                                   f"expected ({rows}, {cols})")
            return q

        def in_matrix(i, g, t_name, n_in, n_out):
            """Layer i's matrix of input group g: the input-block tensor where the file has one
            (IBTensor), else the transposed one (QTensor (n_in, n_out))."""
            t = by_name.get(C.IB[g].format(bid=i))
            if t is None:
                return tensor(t_name.format(bid=i), n_in, n_out)
            name = C.IB[g].format(bid=i)
            try:
                ib = ib_type(t.tensor_type)
            except ValueError:
                raise PyinferError(f"tensor {name} is {QT(t.tensor_type).name}; an input-block "
                                   "tensor is Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1") from None
            shape = tuple(int(d) for d in t.shape[::-1])
            # the outputs' own layout, or with the zero outputs a file appends at widths whose
            # value rows alias in the caches (ib_pad_outs; files before session 22 lack them)
            padded = n_out + ib_pad_outs(ib, n_out)
            if shape not in ((n_in // 32, 32 * n_out), (n_in // 32, 32 * padded)):
                raise PyinferError(f"tensor {name} has shape {shape}, expected "
                                   f"({n_in // 32}, {32 * padded})")
            try:
                return IBTensor(np.asarray(t.data).reshape(n_in // 32, -1), ib, n_in, n_out)
            except ValueError as e:
                raise PyinferError(f"tensor {name}: {e}") from None

        def vector(name, n):
            t = by_name.get(name)
            if t is None:
                raise PyinferError(f"tensor {name} is missing from the GGUF")
            a = np.asarray(t.data)
            if a.dtype != np.float32 or a.size != n:
                raise PyinferError(f"tensor {name} must be f32 with {n} elements")
            return a.reshape(n)

        def bias(name, n):
            """An optional f32 vector: None when the file lacks it."""
            return vector(name, n) if name in by_name else None

        def predictor(i):
            """(fc1, fc2) of layer i, or (None, None) when the layer has no predictor."""
            n1, n2 = C.FC1.format(bid=i), C.FC2.format(bid=i)
            t1, t2 = by_name.get(n1), by_name.get(n2)
            if t1 is None and t2 is None:
                return None, None
            if t1 is None or t2 is None:
                raise PyinferError(f"layer {i} has {n1 if t2 is None else n2} without "
                                   f"{n2 if t2 is None else n1}")
            fc1, fc2 = predictor_half(n1, t1), predictor_half(n2, t2)
            rank = fc1.shape[0]
            if fc1.shape != (rank, E) or fc2.shape != (F, rank):
                raise PyinferError(f"layer {i} predictor shapes {n1} {fc1.shape} and {n2} "
                                   f"{fc2.shape} do not fit (rank, {E}) and ({F}, rank)")
            return fc1, fc2

        def predictor_half(name, t):
            if QT(t.tensor_type) not in (QT.F32, QT.F16):
                raise PyinferError(f"predictor tensor {name} is {QT(t.tensor_type).name}; "
                                   "it must be F32 or F16")
            a = np.asarray(t.data)
            if a.ndim != 2:
                raise PyinferError(f"predictor tensor {name} has {a.ndim} dimensions, expected 2")
            return a

        def qk(w, n_head):
            if not (llamacpp and qk_permuted):
                return w
            from pyinfer.llamacpp import unpermute_qk_rows

            return unpermute_qk_rows(w, n_head)

        # the down projection in llama.cpp's row layout (n_embd rows of n_ff) instead of ffn_down_t
        rows = llamacpp or read_field(reader, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
        E, F = cfg.n_embd, cfg.n_ff
        n_in = {"attn_qkv": E, "attn_output": cfg.n_embd_q, "ffn_gate_up": E, "ffn_down": F}
        layers = []
        for i in range(cfg.n_layer):
            fc1, fc2 = predictor(i)
            if (C.ATTN_QKV_T.format(bid=i) in by_name  # sparse mode "input": transposed layout
                    or C.IB["attn_qkv"].format(bid=i) in by_name):
                scales = {g: vector(C.IN_SCALE[g].format(bid=i), n_in[g]) for g in C.IN_GROUPS
                          if C.IN_SCALE[g].format(bid=i) in by_name}
                layers.append(LayerWeights(
                    attn_norm=vector(C.ATTN_NORM.format(bid=i), E),
                    wq=None, wk=None, wv=None, wo=None,
                    ffn_norm=vector(C.FFN_NORM.format(bid=i), E),
                    ffn_gate=None, ffn_up=None,
                    ffn_down_t=in_matrix(i, "ffn_down", C.FFN_DOWN_T, F, E),
                    attn_qkv_t=in_matrix(i, "attn_qkv", C.ATTN_QKV_T, E,
                                         cfg.n_embd_q + 2 * cfg.n_embd_kv),
                    attn_output_t=in_matrix(i, "attn_output", C.ATTN_OUT_T, cfg.n_embd_q, E),
                    ffn_gate_up_t=in_matrix(i, "ffn_gate_up", C.FFN_GATE_UP_T, E, 2 * F),
                    in_scale=scales or None,
                    bq=bias(C.ATTN_Q_B.format(bid=i), cfg.n_embd_q),  # Qwen2's q/k/v biases
                    bk=bias(C.ATTN_K_B.format(bid=i), cfg.n_embd_kv),
                    bv=bias(C.ATTN_V_B.format(bid=i), cfg.n_embd_kv),
                    attn_q_norm=bias(C.ATTN_Q_NORM.format(bid=i), cfg.head_dim),  # Qwen3's
                    attn_k_norm=bias(C.ATTN_K_NORM.format(bid=i), cfg.head_dim),
                ))
                continue
            layers.append(LayerWeights(
                attn_norm=vector(C.ATTN_NORM.format(bid=i), E),
                wq=qk(tensor(C.ATTN_Q.format(bid=i), cfg.n_embd_q, E), cfg.n_head),
                wk=qk(tensor(C.ATTN_K.format(bid=i), cfg.n_embd_kv, E), cfg.n_head_kv),
                wv=tensor(C.ATTN_V.format(bid=i), cfg.n_embd_kv, E),
                wo=tensor(C.ATTN_OUT.format(bid=i), E, cfg.n_embd_q),
                ffn_norm=vector(C.FFN_NORM.format(bid=i), E),
                ffn_gate=tensor(C.FFN_GATE.format(bid=i), F, E) if cfg.ffn_gated else None,
                ffn_up=tensor(C.FFN_UP.format(bid=i), F, E),
                ffn_down_t=None if rows else tensor(C.FFN_DOWN_T.format(bid=i), F, E),
                ffn_down=tensor(C.SRC_FFN_DOWN.format(bid=i), E, F) if rows else None,
                fc1=fc1,
                fc2=fc2,
                attn_norm_b=bias(C.ATTN_NORM_B.format(bid=i), E),
                ffn_norm_b=bias(C.FFN_NORM_B.format(bid=i), E),
                bq=bias(C.ATTN_Q_B.format(bid=i), cfg.n_embd_q),
                bk=bias(C.ATTN_K_B.format(bid=i), cfg.n_embd_kv),
                bv=bias(C.ATTN_V_B.format(bid=i), cfg.n_embd_kv),
                bo=bias(C.ATTN_OUT_B.format(bid=i), E),
                ffn_up_b=bias(C.FFN_UP_B.format(bid=i), F),
                ffn_down_b=bias(C.FFN_DOWN_B.format(bid=i), E),
                attn_q_norm=bias(C.ATTN_Q_NORM.format(bid=i), cfg.head_dim),
                attn_k_norm=bias(C.ATTN_K_NORM.format(bid=i), cfg.head_dim),
                attn_post_norm=bias(C.ATTN_POST_NORM.format(bid=i), E),
                ffn_post_norm=bias(C.FFN_POST_NORM.format(bid=i), E),
            ))
        for i, lw in enumerate(layers):  # the kernels normalise Q and K heads together
            for name, norm in ((C.ATTN_Q_NORM, lw.attn_q_norm), (C.ATTN_K_NORM, lw.attn_k_norm)):
                if cfg.family == "qwen3" and norm is None:  # (it would run as a plain Llama)
                    raise PyinferError(f"this qwen3 file has no tensor {name.format(bid=i)}")
            if (lw.attn_q_norm is None) != (lw.attn_k_norm is None):
                lone, other = ((C.ATTN_Q_NORM, C.ATTN_K_NORM) if lw.attn_k_norm is None
                               else (C.ATTN_K_NORM, C.ATTN_Q_NORM))
                raise PyinferError(f"layer {i} has {lone.format(bid=i)} but no "
                                   f"{other.format(bid=i)}")
        token_embd = tensor(C.TOKEN_EMBD, cfg.n_vocab, E)
        output = token_embd if cfg.tied_embeddings else tensor(C.OUTPUT, cfg.n_vocab, E)
        pos_embd = None
        if cfg.positions == "learned":
            t = by_name.get(C.POS_EMBD)
            if t is None:
                raise PyinferError(f"tensor {C.POS_EMBD} is missing from the GGUF")
            pos_embd = tensor(C.POS_EMBD, int(t.shape[-1]), E)
        rope_freqs = bias(C.ROPE_FREQS, cfg.head_dim // 2)
        if rope_freqs is not None and not (np.all(np.isfinite(rope_freqs)) and np.all(rope_freqs > 0)):
            raise PyinferError(f"tensor {C.ROPE_FREQS} must hold positive numbers")
        output_ib = None
        if C.OUTPUT_IB in by_name:
            t = by_name[C.OUTPUT_IB]
            chunk = read_field(reader, C.K_LM_HEAD_CHUNK)
            if not isinstance(chunk, int):
                raise PyinferError(f"tensor {C.OUTPUT_IB} needs {C.K_LM_HEAD_CHUNK}")
            try:  # (ib_type: ValueError for a type other than Q8_0 / Q4_0 / Q4_1)
                output_ib = IBChunks.from_raw(np.asarray(t.data).view(np.uint8),
                                              ib_type(t.tensor_type), E, cfg.n_vocab, chunk)
            except ValueError as e:
                raise PyinferError(f"tensor {C.OUTPUT_IB}: {e}") from None
        return cls(token_embd=token_embd, output_norm=vector(C.OUTPUT_NORM, E),
                   output=output, layers=layers, output_norm_b=bias(C.OUTPUT_NORM_B, E),
                   pos_embd=pos_embd, rope_freqs=rope_freqs, output_ib=output_ib,
                   output_in_scale=bias(C.OUTPUT_IN_SCALE, E))
