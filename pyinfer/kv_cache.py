"""The key/value cache: one preallocated block per layer (f16 or f32), filled as tokens are
evaluated."""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig

#: ``--cache-type`` values (llama.cpp's ``--cache-type-k/-v`` names) and their numpy dtypes;
#: "auto" is f32 for a file whose weights are f32, f16 otherwise (``cache_dtype``).
CACHE_TYPES = {"f16": np.float16, "f32": np.float32}
CACHE_TYPE_AUTO = "auto"


def cache_dtype(cache_type: str, weights_f32: bool) -> type:
    """The numpy dtype of the KV cache for ``--cache-type`` (``auto``, ``f16`` or ``f32``):
    auto is f32 where the file's weights are f32 (the reference-accuracy format: logits within
    1e-3 of transformers' f32 forward) and f16 otherwise, as llama.cpp's default cache.
    ValueError for any other name."""
    if cache_type == CACHE_TYPE_AUTO:
        return np.float32 if weights_f32 else np.float16
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"cache type {cache_type!r}: expected one of "
                         f"{', '.join([CACHE_TYPE_AUTO, *CACHE_TYPES])}")
    return CACHE_TYPES[cache_type]


class KVCache:
    """Keys and values of every evaluated position, allocated once (llama2.c ``RunState``).

    ``k[layer]`` and ``v[layer]`` are (n_ctx, n_head_kv, head_dim) views of dtype ``dtype``
    (float16 or float32); memory is 2 * n_layer * n_ctx * n_head_kv * head_dim * itemsize
    bytes. f16 is llama.cpp's default cache type: a decode step reads every cached row of every
    layer (at 480 positions SmolLM2's f32 cache is 22 MB a token, more than the q4_0 weights of
    its FFNs), and f16 halves that for a rounding of at most 2^-11 of each value (logits moved
    up to 3e-3 relative against transformers' f32 forward on the random test models). f16
    values are stored rounded to nearest even, by numpy's astype in prefill and by F16C's
    vcvtps2ph in the decode kernels (the same bits).
    """

    def __init__(self, cfg: ModelConfig, n_ctx: int, dtype: type = np.float16):
        if np.dtype(dtype) not in (np.dtype(np.float16), np.dtype(np.float32)):
            raise ValueError(f"a KV cache is float16 or float32, not {np.dtype(dtype)}")
        self.n_ctx = n_ctx
        shape = (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim)
        try:
            self.k = np.zeros(shape, dtype=dtype)  # (n_layer, n_ctx, n_head_kv, head_dim)
            self.v = np.zeros(shape, dtype=dtype)  # (n_layer, n_ctx, n_head_kv, head_dim)
        except MemoryError:
            from pyinfer.errors import PyinferError

            need = 2 * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            raise PyinferError(f"out of memory for the KV cache of {n_ctx} tokens "
                               f"({need / 2**30:.1f} GiB); lower -c/--ctx-size") from None

    @property
    def dtype(self) -> np.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
