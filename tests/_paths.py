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
