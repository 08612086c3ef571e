"""pyinfer: PowerInfer-style sparse LLM inference in Python, Cython and CuPy."""
import os as _os

# One threading layer: the Cython kernels own the cores (-t); BLAS must not fight them (FACTS.md).
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

# OpenMP's wait policy: pyinfer keeps libgomp's default (a waiting thread spins about 300,000
# times, then sleeps), so an idle REPL or server does not burn the cores and a decode step's ~150
# parallel regions do not each pay a thread wake-up. Measured on the 2-core box (SmolLM2 q8_0,
# 2 threads, docs/benchmarks.md "Wait policy (session 6)"): decode 90 tokens/s spinning against
# 21-25 with OMP_WAIT_POLICY=PASSIVE, which pyinfer set from issue 9 to session 5. Spinning
# beside other runnable work is what collapsed issue 9's busy machine; pyinfer.threads now keeps
# the team within the free CPUs instead. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name):
    # Lazy: `import pyinfer` stays cheap (the CLIs and converter import submodules directly).
    if name == "LLM":
        from pyinfer.api import LLM

        return LLM
    raise AttributeError(f"module 'pyinfer' has no attribute {name!r}")
