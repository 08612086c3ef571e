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


class TeamProbe:
    """How much faster a team of ``n_threads`` runs a compute-bound kernel than one thread: a
    prefill GEMM of 16 tokens over a 512 x 512 q8_0 matrix (256 KiB, cache-resident), 20 calls
    each way, about 2 ms. Near ``n_threads`` where the machine gives the team its own cores;
    near 1 where it does not. The project's 2-core microVM (its kernel booted with
    ``sched_vcpu_pack``) runs both vCPUs on one core's worth of compute for 10-45 s at a time:
    there the probe gives 1.2-1.3 against 1.8 (docs/benchmarks.md, session 38), a 2-thread
    input-sparse decode runs at its 1-thread speed, and a memory-bound dense one barely slows."""

    def __init__(self, n_threads: int, calls: int = 20):
        from pyinfer import constants as C
        from pyinfer.ops import cpu
        from pyinfer.quants import quantize

        w = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
        self._cpu, self.n_threads, self.calls = cpu, n_threads, calls
        self._w = cpu.QTensor(quantize(w, C.QT.Q8_0).reshape(512, -1), C.QT.Q8_0, 512, 512)
        self._a = np.random.default_rng(1).random((16, 512), np.float32)
        self._out = np.empty((16, 512), np.float32)

    def _time(self, nt: int) -> float:
        self._cpu.matmul(self._w, self._a, self._out, nt)
        t0 = time.perf_counter()
        for _ in range(self.calls):
            self._cpu.matmul(self._w, self._a, self._out, nt)
        return time.perf_counter() - t0

    def speedup(self) -> float:
        """One-thread time over team time, now."""
        return self._time(1) / self._time(self.n_threads)
