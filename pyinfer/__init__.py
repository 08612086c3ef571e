"""pyinfer: PowerInfer-style sparse LLM inference in Python, Cython and CuPy."""
import os as _os

# One threading layer: the Cython kernels own the cores (-t); BLAS must not fight them (FACTS.md).
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

# Waiting OpenMP threads sleep at once instead of spinning (issue 9). libgomp's default spins
# 300,000 times before it sleeps: beside other work a spinning thread holds the core its
# preempted partner needs, and decode at -t 2 fell to 1-2 tokens/s next to one CPU hog; passive
# kept ~50 (docs/benchmarks.md, "A busy machine"); shorter spins (1,000 to 30,000) were worse than
# either. libgomp reads this once, when it loads with pyinfer.ops._kernels, hence here, before
# any kernel import; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name):
    # Lazy: `import pyinfer` stays cheap (the CLIs and converter import submodules directly).
    if name == "LLM":
        from pyinfer.api import LLM

        return LLM
    raise AttributeError(f"module 'pyinfer' has no attribute {name!r}")
