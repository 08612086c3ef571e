"""Where the tests find the real model. The one place that knows the path (the lead may move it)."""
from __future__ import annotations

import os

#: where tools/fetch_smollm2.sh (run by `make test` and `make demo`) puts the model
DEFAULT_SMOLLM2_GGUF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_gguf_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf ($PYINFER_SMOLLM2_GGUF, else the default), or None if absent."""
    path = os.environ.get("PYINFER_SMOLLM2_GGUF", DEFAULT_SMOLLM2_GGUF)
    return path if os.path.isfile(path) else None


#: where tools/fetch_gemma3.sh puts Gemma-3-270M (Q4_K_M, llama.cpp's gemma3 GGUF)
DEFAULT_GEMMA3_GGUF = os.path.join(os.path.dirname(DEFAULT_SMOLLM2_GGUF), "gemma-3-270m-q4_k_m.gguf")


def gemma3_gguf_path() -> str | None:
    """Path of gemma-3-270m-q4_k_m.gguf ($PYINFER_GEMMA3_GGUF, else the default), or None if absent."""
    path = os.environ.get("PYINFER_GEMMA3_GGUF", DEFAULT_GEMMA3_GGUF)
    return path if os.path.isfile(path) else None
