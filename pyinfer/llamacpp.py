"""Run a llama.cpp GGUF (architecture ``llama``, ``qwen2`` or ``qwen3``) as it is: dense, on the
CPU, no conversion.

A file ``pyinfer-convert`` wrote stores PowerInfer's layout (design.md); a llama.cpp file differs
in two places, both handled at load without copying the memory map (and a ``qwen2`` / ``qwen3``
file's keys carry its architecture's name, read through ``ArchKeys``; their Q/K rows are stored
unpermuted, as llama.cpp runs them with NeoX RoPE; Qwen2's q/k/v biases and Qwen3's
``attn_q_norm`` / ``attn_k_norm`` have the names pyinfer's files use):

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
import math
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

#: llama.cpp architectures run as they are; the Qwen ones store Q/K rows unpermuted (NeoX RoPE)
RUN_ARCHS = (C.ARCH, *C.LLAMACPP_RUN_ARCHS)
#: the tensors each layer of those must have beyond Llama's (llama.cpp's loader requires them;
#: Qwen3's head norms: ModelWeights.from_gguf, for every qwen3 file)
_ARCH_TENSORS = {"qwen2": (C.ATTN_Q_B, C.ATTN_K_B, C.ATTN_V_B)}


class ArchKeys:
    """A GGUFReader whose ``fields`` answer pyinfer's ``llama.*`` key names with the source
    architecture's (``qwen3.context_length`` for ``llama.context_length``); ``tensors`` as the
    reader's."""

    def __init__(self, reader: gguf.GGUFReader, arch: str):
        self.tensors = reader.tensors
        prefix = arch + "."
        self.fields = {(C.ARCH + "." + k[len(prefix):] if k.startswith(prefix) else k): f
                       for k, f in reader.fields.items()}


def is_llamacpp(reader: gguf.GGUFReader) -> bool:
    """True for a GGUF of an architecture in ``RUN_ARCHS`` that pyinfer did not write (no
    ``pyinfer.ffn_layout`` key) and that stores llama.cpp's ``blk.0.ffn_down.weight``."""
    if read_field(reader, C.K_ARCH) not in RUN_ARCHS or C.K_FFN_LAYOUT in reader.fields:
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


def linear_rope_factor(reader) -> float | None:
    """The linear RoPE scaling factor of a llama.cpp file, or None (none, or a factor of 1):
    ``rope.scaling.factor`` (or the older ``rope.scale_linear``) with ``rope.scaling.type``
    linear, none or unset, as llama.cpp's loader reads them (its type defaults to linear, and
    ``rope_freq_scale_train`` = 1 / factor); positions are divided by the factor. PyinferError
    for another scaling type (YaRN ...) or a factor that is not a positive number. ``reader``
    reads the llama.* keys (``ArchKeys`` for other architectures)."""
    kind = read_field(reader, C.K_ROPE_SCALING_TYPE, None, kind=str)
    if kind not in (None, "", "none", "linear"):
        raise PyinferError(f"unsupported rope scaling {kind!r} in this llama.cpp file "
                           "(pyinfer computes linear scaling and Llama 3's frequency factors)")
    factor = read_field(reader, C.K_ROPE_SCALING_FACTOR, None, kind=float)
    if factor is None:
        factor = read_field(reader, C.K_ROPE_SCALE_LINEAR, None, kind=float)
    if factor is None or factor in (0.0, 1.0):  # (llama.cpp: 0 means none)
        return None
    if not (math.isfinite(factor) and factor > 0):
        raise PyinferError(f"rope scaling factor {factor} must be a positive number")
    return factor


def scaled_rope_freqs(freqs, factor: float, head_dim: int) -> np.ndarray:
    """RoPE's frequency divisors (head_dim/2,) f32 with a linear ``factor`` applied (over the
    file's own ``rope_freqs``, which llama.cpp applies beside it)."""
    base = np.ones(head_dim // 2, np.float32) if freqs is None else np.asarray(freqs, np.float32)
    return (base * np.float32(factor)).astype(np.float32)


def load(reader: gguf.GGUFReader, path: str = "") -> tuple[ModelConfig, ModelWeights]:
    """(config, weights) of a llama.cpp file (``is_llamacpp``), laid out for the dense CPU path.

    head_dim is ``attention.key_length`` when present (llama.cpp's ``n_embd_head_k``), else
    n_embd / n_head. Raises PyinferError for what pyinfer does not compute: rope scaling other
    than frequency factors (``rope_freqs.weight``), partial rotary (rope dimension_count !=
    head_dim), a value length != key length, or a tensor missing or of an unsupported type.
    """
    arch = read_field(reader, C.K_ARCH)
    if arch != C.ARCH:  # qwen2 / qwen3: their keys read as llama.*, the family theirs
        reader = ArchKeys(reader, arch)
    factor = linear_rope_factor(reader)
    cfg = ModelConfig.from_gguf(reader, llamacpp=True)
    if arch != C.ARCH:  # (llama.cpp runs Qwen2 without its sliding window: so does pyinfer)
        cfg = dataclasses.replace(cfg, family=arch)
        names = {t.name for t in reader.tensors}
        for i in range(cfg.n_layer):
            for tmpl in _ARCH_TENSORS.get(arch, ()):
                if tmpl.format(bid=i) not in names:
                    raise PyinferError(f"this llama.cpp {arch} file has no tensor "
                                       f"{tmpl.format(bid=i)}")
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
    weights = ModelWeights.from_gguf(reader, cfg, llamacpp=True, qk_permuted=arch == C.ARCH)
    if factor is not None:
        weights.rope_freqs = scaled_rope_freqs(weights.rope_freqs, factor, cfg.head_dim)
    if path and path not in _noticed:
        _noticed.add(path)
        name = os.path.basename(path)
        rows = "Q/K rows reordered at load, " if arch == C.ARCH else ""
        print(f"pyinfer: {name} is a llama.cpp GGUF: running it dense on the CPU ({rows}ffn_down "
              f"read as stored); `pyinfer-convert {name} out.gguf` adds sparse decoding and the GPU split",
              file=sys.stderr)
    return cfg, weights
