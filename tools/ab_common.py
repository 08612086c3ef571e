"""Shared by the A/B and profile tools: load another kernel build, time a greedy decode."""
from __future__ import annotations

import importlib.util
import time
from types import ModuleType

import numpy as np


def load_kernels(path: str) -> ModuleType:
    """The compiled module at ``path`` (a ``_kernels*.so`` copied aside from a build), loaded under
    the name ``pyinfer.ops._kernels`` without replacing the imported one: a tool swaps it into
    ``pyinfer.ops.cpu._k`` to time that build. Raises ImportError/OSError for a bad file."""
    spec = importlib.util.spec_from_file_location("pyinfer.ops._kernels", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a loadable extension module: {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def greedy_decode(eng, ids, n_gen: int) -> tuple[float, list[int]]:
    """Reset ``eng`` (a pyinfer Engine), evaluate the prompt ``ids``, then take n_gen greedy
    steps; returns (decode tokens/s over those steps, wall clock; the greedy token ids)."""
    eng.reset()
    logits = eng.eval_prompt(ids)
    toks = []
    t0 = time.perf_counter()
    for _ in range(n_gen):
        toks.append(int(np.argmax(logits)))
        logits = eng.eval_token(toks[-1])
    return n_gen / (time.perf_counter() - t0), toks
