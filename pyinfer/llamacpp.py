"""Run a llama.cpp GGUF (architecture ``llama``) as it is: dense, on the CPU, no conversion.

A file ``pyinfer-convert`` wrote stores PowerInfer's layout (design.md); a llama.cpp file differs
in two places, both handled at load without copying the memory map:

- Q and K rows: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders them for
  its interleaved RoPE, ``w.reshape(n, 2, rows/n/2, cols).swapaxes(1, 2)``. pyinfer's kernels
  rotate halves (Hugging Face's ``rotate_half``), so the rows are gathered back once at load:
  reshape (n, rows/n/2, 2, cols) -> swap axes 1 and 2 -> reshape back (FACTS.md). A row gather
  moves whole quantized rows as stored; it copies attn_q and attn_k only (for SmolLM2-135M Q4_1,
  2.5 MB of 98 MB).
- ``ffn_down`` is (n_embd, n_ff), one row per output channel; pyinfer stores its transpose
  ``ffn_down_t``. The dense FFN runs a GEMV over ``ffn_down``'s rows as stored
  (``pyinfer.ffn.down_proj``) instead.

What a llama.cpp file does not have is what ``pyinfer-convert`` adds: predictors and the
activation statistics behind sparse decoding and the GPU split. So these files run dense, on the
CPU; the engine says so once on stderr.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import gguf
import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig, read_field
from pyinfer.errors import PyinferError
from pyinfer.ops.cpu import QTensor
from pyinfer.weights import ModelWeights

_noticed: set[str] = set()  # paths whose notice was printed (once per process)


def is_llamacpp(reader: gguf.GGUFReader) -> bool:
    """True for a GGUF of architecture ``llama`` that pyinfer did not write (no
    ``pyinfer.ffn_layout`` key) and that stores llama.cpp's ``blk.0.ffn_down.weight``."""
    if read_field(reader, C.K_ARCH) != C.ARCH or C.K_FFN_LAYOUT in reader.fields:
        return False
    return any(t.name == C.SRC_FFN_DOWN.format(bid=0) for t in reader.tensors)


def qk_row_order(rows: int, n_head: int) -> np.ndarray:
    """(rows,) int64: row ``i`` of the Hugging Face order is row ``order[i]`` of llama.cpp's.

    rows = n_head * head_dim. The inverse of llama.cpp's ``LlamaModel.permute`` (module docstring).
    Raises PyinferError when rows is not a multiple of 2 * n_head."""
    if n_head < 1 or rows % (2 * n_head):
        raise PyinferError(f"{rows} Q/K rows do not split into {n_head} heads of pairs")
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def unpermute_qk_rows(w: QTensor, n_head: int) -> QTensor:
    """``w`` (n_head * head_dim, cols) in llama.cpp's Q/K row order -> a new QTensor in Hugging
    Face order: the stored rows (quantized blocks or floats) gathered as they are, no
    requantization. Copies w (its rows only)."""
    order = qk_row_order(w.rows, n_head)
    return QTensor(np.ascontiguousarray(w.data[order]), w.qtype, w.rows, w.cols)


def load(reader: gguf.GGUFReader, path: str = "") -> tuple[ModelConfig, ModelWeights]:
    """(config, weights) of a llama.cpp file (``is_llamacpp``), laid out for the dense CPU path.

    head_dim is ``attention.key_length`` when present (llama.cpp's ``n_embd_head_k``), else
    n_embd / n_head. Raises PyinferError for what pyinfer does not compute: rope scaling other
    than frequency factors (``rope_freqs.weight``), partial rotary (rope dimension_count !=
    head_dim), a value length != key length, or a tensor missing or of an unsupported type.
    """
    scaling = read_field(reader, C.K_ROPE_SCALING_TYPE, "none", kind=str)
    if scaling not in ("none", ""):
        raise PyinferError(f"unsupported rope scaling {scaling!r} in this llama.cpp file")
    cfg = ModelConfig.from_gguf(reader, llamacpp=True)
    key_len = read_field(reader, C.K_KEY_LENGTH, kind=int)
    if key_len is not None and key_len != cfg.head_dim:
        rot = read_field(reader, C.K_ROPE_DIM, kind=int)
        if rot is not None and rot != key_len:
            raise PyinferError(f"partial rotary embeddings (rope dimension_count {rot}, head "
                               f"dim {key_len}) are not supported")
        cfg = dataclasses.replace(cfg, head_dim=key_len)
    val_len = read_field(reader, C.K_VALUE_LENGTH, kind=int)
    if val_len is not None and val_len != cfg.head_dim:
        raise PyinferError(f"value length {val_len} differs from key length {cfg.head_dim}")
    weights = ModelWeights.from_gguf(reader, cfg, llamacpp=True)
    if path and path not in _noticed:
        _noticed.add(path)
        name = os.path.basename(path)
        print(f"pyinfer: {name} is a llama.cpp GGUF: running it dense on the CPU (Q/K rows "
              f"reordered at load, ffn_down read as stored); `pyinfer-convert {name} out.gguf` "
              "adds sparse decoding and the GPU split", file=sys.stderr)
    return cfg, weights
