"""pyinfer: PowerInfer-style sparse LLM inference in Python, Cython and CuPy."""
import os as _os

# One threading layer: the Cython kernels own the cores (-t); BLAS must not fight them (FACTS.md).
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

__version__ = "0.1.0"
