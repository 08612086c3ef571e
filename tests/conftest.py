"""Shared fixtures: the real SmolLM2 model converted once per test session.

``smollm2_q8`` converts SmolLM2-135M-Instruct (tests/_paths.py finds the llama.cpp GGUF) to a
pyinfer GGUF with q8_0 weights, once per session, and returns its path; tests that use it skip with
the reason when the source file is absent. ``smollm2_llm`` is a ``pyinfer.LLM`` over it, shared by
the API tests (greedy results do not depend on what ran before: the cache only reuses a prefix,
and a prompt's last two tokens are always evaluated as a batch: Engine.eval_prompt).
"""
from __future__ import annotations

import os

import pytest

from tests._paths import smollm2_gguf_path

SMOLLM2_MISSING = ("SmolLM2 GGUF not found: run tools/fetch_smollm2.sh and set PYINFER_SMOLLM2_GGUF "
                   "(see tests/_paths.py)")


@pytest.fixture(scope="session")
def smollm2_q8(tmp_path_factory) -> str:
    """Path of SmolLM2-135M-Instruct converted by pyinfer-convert with ``--outtype q8_0``."""
    src = smollm2_gguf_path()
    if src is None:
        pytest.skip(SMOLLM2_MISSING)
    from convert.cli import convert

    out = str(tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct-q8_0.gguf")
    convert(src, out, "q8_0", progress=False)
    assert os.path.getsize(out) > 0
    return out


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_q8):
    """A ``pyinfer.LLM`` over ``smollm2_q8`` with a 1024-token context."""
    from pyinfer import LLM

    return LLM(smollm2_q8, n_ctx=1024, seed=0)
