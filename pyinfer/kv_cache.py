"""The key/value cache: one preallocated f32 block per layer, filled as tokens are evaluated."""
from __future__ import annotations

import numpy as np

from pyinfer.config import ModelConfig


class KVCache:
    """Keys and values of every evaluated position, allocated once (llama2.c ``RunState``).

    ``k[layer]`` and ``v[layer]`` are (n_ctx, n_head_kv, head_dim) float32 views; memory is
    2 * n_layer * n_ctx * n_head_kv * head_dim * 4 bytes.
    """

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        shape = (cfg.n_layer, n_ctx, cfg.n_head_kv, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)  # (n_layer, n_ctx, n_head_kv, head_dim)
        self.v = np.zeros(shape, dtype=np.float32)  # (n_layer, n_ctx, n_head_kv, head_dim)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
