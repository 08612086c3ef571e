"""Per-layer views of the weights inside the memory-mapped GGUF, never copies.

Like llama2.c's ``memory_map_weights``: every tensor stays where ``GGUFReader``'s memmap put it;
this module only names and shapes the views (see docs/design.md for the layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig
from pyinfer.errors import PyinferError
from pyinfer.ops.cpu import QTensor


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (n_embd,) f32
    wq: QTensor  # (n_head * head_dim, n_embd)
    wk: QTensor  # (n_head_kv * head_dim, n_embd)
    wv: QTensor  # (n_head_kv * head_dim, n_embd)
    wo: QTensor  # (n_embd, n_head * head_dim)
    ffn_norm: np.ndarray  # (n_embd,) f32
    ffn_gate: QTensor  # (n_ff, n_embd) one row per neuron
    ffn_up: QTensor  # (n_ff, n_embd) one row per neuron
    ffn_down_t: QTensor  # (n_ff, n_embd) ffn_down transposed: one row per neuron
    fc1: np.ndarray | None = None  # (rank, n_embd) f32 or f16 predictor, when the file has one
    fc2: np.ndarray | None = None  # (n_ff, rank) f32 or f16


@dataclass
class ModelWeights:
    token_embd: QTensor  # (n_vocab, n_embd)
    output_norm: np.ndarray  # (n_embd,) f32
    output: QTensor  # (n_vocab, n_embd); token_embd itself when tied
    layers: list[LayerWeights]

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, cfg: ModelConfig) -> "ModelWeights":
        """Map every tensor of ``reader`` by name (layers by number, never by sorted name).

        Raises PyinferError for a missing tensor or a shape that disagrees with ``cfg``.
        """
        by_name = {t.name: t for t in reader.tensors}

        def tensor(name, rows, cols):
            t = by_name.get(name)
            if t is None:
                raise PyinferError(f"tensor {name} is missing from the GGUF")
            q = QTensor.from_reader_tensor(t)
            if (q.rows, q.cols) != (rows, cols):
                raise PyinferError(f"tensor {name} has shape ({q.rows}, {q.cols}), "
                                   f"expected ({rows}, {cols})")
            return q

        def vector(name, n):
            t = by_name.get(name)
            if t is None:
                raise PyinferError(f"tensor {name} is missing from the GGUF")
            a = np.asarray(t.data)
            if a.dtype != np.float32 or a.size != n:
                raise PyinferError(f"tensor {name} must be f32 with {n} elements")
            return a.reshape(n)

        def optional_float(name):
            t = by_name.get(name)
            if t is None:
                return None
            a = np.asarray(t.data)
            return a if a.dtype in (np.float32, np.float16) else a.astype(np.float32)

        E, F = cfg.n_embd, cfg.n_ff
        layers = []
        for i in range(cfg.n_layer):
            layers.append(LayerWeights(
                attn_norm=vector(C.ATTN_NORM.format(bid=i), E),
                wq=tensor(C.ATTN_Q.format(bid=i), cfg.n_embd_q, E),
                wk=tensor(C.ATTN_K.format(bid=i), cfg.n_embd_kv, E),
                wv=tensor(C.ATTN_V.format(bid=i), cfg.n_embd_kv, E),
                wo=tensor(C.ATTN_OUT.format(bid=i), E, cfg.n_embd_q),
                ffn_norm=vector(C.FFN_NORM.format(bid=i), E),
                ffn_gate=tensor(C.FFN_GATE.format(bid=i), F, E),
                ffn_up=tensor(C.FFN_UP.format(bid=i), F, E),
                ffn_down_t=tensor(C.FFN_DOWN_T.format(bid=i), F, E),
                fc1=optional_float(C.FC1.format(bid=i)),
                fc2=optional_float(C.FC2.format(bid=i)),
            ))
        token_embd = tensor(C.TOKEN_EMBD, cfg.n_vocab, E)
        output = token_embd if cfg.tied_embeddings else tensor(C.OUTPUT, cfg.n_vocab, E)
        return cls(token_embd=token_embd, output_norm=vector(C.OUTPUT_NORM, E),
                   output=output, layers=layers)
