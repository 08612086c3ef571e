"""Upstream PowerInfer's files -> pyinfer's predictors, threshold and GPU split.

Format facts, from SJTU-IPADS/PowerInfer (read, not copied):

- The model file is a GGUF v3 whose first 4 bytes are overwritten with ``PWRI`` after writing
  (``convert.py`` ``main``: "write another unique file header"); ``ggml.c`` ``gguf_init_from_file``
  takes ``PWRI`` as "sparse inference" and reads the rest as GGUF. Its ``llama`` architecture is
  ReLU-gated (``llama.cpp`` ``build_llama`` calls ``llm_build_ffn_sparse`` with ``LLM_FFN_RELU``).
- Q/K rows are permuted as llama.cpp's converter permutes them; ``ffn_down`` is stored transposed as
  ``blk.N.ffn_down_t.weight`` (``postprocess_transpose``), numpy shape (n_ff, n_embd) - pyinfer's
  own layout.
- Predictors ``blk.N.fc1.weight`` (rank, n_embd) and ``blk.N.fc2.weight`` (n_ff, rank); the
  predictor reads the FFN input before ``ffn_norm`` and ``fc2 @ relu(fc1 @ x)``; a neuron is
  skipped where its logit ``< powerinfer.sparse_threshold`` (f32, one for all layers; 0.0 when
  absent, ``ggml.c`` ``sparse_pred_threshold``). pyinfer's rule is the same (runs where >=), so
  the threshold goes into ``pyinfer.predictor.threshold`` once per layer.
- The GPU split lives beside the model as ``<model>.generated.gpuidx`` (``llama.cpp``
  ``llm_load_gpu_split_with_budget``), written by ``powerinfer-py/export_split.py``: a GGUF with
  ``PWRI`` magic, per layer ``blk.N.gpu_idx`` (I32 0/1 mask, n_ff) then ``blk.N.gpu_bucket`` (I32
  sorted hot ids), and ``split.vram_capacity`` (u64 bytes the split was solved for) -> pyinfer's
  ``pyinfer.placement.vram_budget``. Upstream stores no activation counts, so a pyinfer GPU engine
  can use the split as stored but cannot re-solve it for another budget.

``PowerInferReader`` is gguf-py's ``GGUFReader`` (memory-mapped, no copy) that accepts ``PWRI``
in place of the GGUF magic; everything after the magic is parsed by gguf-py unchanged.
"""
from __future__ import annotations

import os

import gguf
import numpy as np

from pyinfer import constants as C
from pyinfer.errors import PyinferError
from pyinfer.gguf_check import check_gguf

PWRI_MAGIC = b"PWRI"
K_SPARSE_THRESHOLD = "powerinfer.sparse_threshold"  # upstream gguf-py Keys.PowerInfer
K_SPLIT_VRAM_CAPACITY = "split.vram_capacity"  # upstream gguf-py Keys.Split
GPUIDX_SUFFIX = ".generated.gpuidx"  # upstream llama.cpp: <model path> + this
_GGUF_MAGIC_U32 = int.from_bytes(b"GGUF", "little")
_PWRI_MAGIC_U32 = int.from_bytes(PWRI_MAGIC, "little")


def is_powerinfer(path: str) -> bool:
    """True when ``path`` starts with upstream PowerInfer's ``PWRI`` magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == PWRI_MAGIC
    except OSError:
        return False


class PowerInferReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a file whose magic is ``PWRI``: the reader's one magic check (the
    uint32 read at offset 0) sees the GGUF magic; the memory map and every other read are gguf-py's."""

    def _get(self, offset, dtype, count=1, override_order=None):
        arr = super()._get(offset, dtype, count, override_order)
        if offset == 0 and np.dtype(dtype) == np.uint32 and count == 1 and arr[0] == _PWRI_MAGIC_U32:
            return np.array([_GGUF_MAGIC_U32], np.uint32)
        return arr


def open_powerinfer(path: str, allow_empty: bool = False) -> gguf.GGUFReader:
    """A reader over a PowerInfer file; PyinferError (one line) for a damaged or truncated one.
    allow_empty: tensors of 0 elements pass (``check_gguf``), as in a GPU split file."""
    check_gguf(path, magic=PWRI_MAGIC, allow_empty=allow_empty)
    try:
        reader = PowerInferReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/... on damaged files
        raise PyinferError(f"{path} is not a valid PowerInfer file (truncated or damaged: "
                           f"{type(e).__name__})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise PyinferError(f"{path} is truncated (tensor {t.name} ends past the end of the file)")
    return reader


def sparse_threshold(reader) -> float:
    """Upstream's ``powerinfer.sparse_threshold`` (0.0 when absent, as upstream's ggml.c defaults);
    PyinferError when it is not a finite number."""
    f = reader.fields.get(K_SPARSE_THRESHOLD)
    thr = 0.0 if f is None else f.contents()
    if not isinstance(thr, (int, float)) or not np.isfinite(thr):
        raise PyinferError(f"{K_SPARSE_THRESHOLD} is {thr!r}, not a finite number")
    return float(thr)


def read_gpuidx(path: str, n_layer: int, n_ff: int) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
    """(vram_capacity bytes, per-layer gpu_idx int32 (n_ff,), per-layer gpu_bucket int32 (n_hot,))
    from a ``.generated.gpuidx`` file. Raises PyinferError for a damaged file, a layer count or
    n_ff that does not fit the model, a mask that is not 0/1, or a bucket that is not the mask's
    sorted hot ids."""
    # (upstream's export_split writes every layer's gpu_bucket, empty where no neuron is hot)
    reader = open_powerinfer(path, allow_empty=True) if is_powerinfer(path) else None
    if reader is None:
        raise PyinferError(f"{path} is not a PowerInfer GPU split file (no PWRI magic)")
    cap = reader.fields.get(K_SPLIT_VRAM_CAPACITY)
    if cap is None:
        raise PyinferError(f"{path} lacks {K_SPLIT_VRAM_CAPACITY}")
    cap = int(cap.contents())
    by_name = {t.name: t for t in reader.tensors}
    masks, buckets = [], []
    for i in range(n_layer):
        t = by_name.get(C.GPU_IDX.format(bid=i))
        if t is None:
            raise PyinferError(f"{path} has no {C.GPU_IDX.format(bid=i)} (the model has {n_layer} layers)")
        if C.QT(t.tensor_type) != C.QT.I32:
            raise PyinferError(f"{path}: {t.name} is {C.QT(t.tensor_type).name}, not I32")
        mask = np.array(t.data, np.int32).reshape(-1)
        if mask.size != n_ff or not np.isin(mask, (0, 1)).all():
            raise PyinferError(f"{path}: {t.name} must be {n_ff} values of 0 or 1")
        b = by_name.get(C.GPU_BUCKET.format(bid=i))
        bucket = np.zeros(0, np.int32) if b is None else np.array(b.data, np.int32).reshape(-1)
        if not np.array_equal(bucket, np.flatnonzero(mask).astype(np.int32)):
            raise PyinferError(f"{path}: layer {i}'s gpu_bucket is not the sorted ids of its gpu_idx")
        masks.append(mask)
        buckets.append(bucket)
    extra = [n for n in by_name if n.startswith("blk.") and n.split(".")[1].isdigit()
             and int(n.split(".")[1]) >= n_layer]
    if extra:
        raise PyinferError(f"{path} splits more layers than the model has ({n_layer}): {extra[0]}")
    return cap, masks, buckets
