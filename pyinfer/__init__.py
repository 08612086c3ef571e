"""pyinfer: PowerInfer-style sparse LLM inference in Python, Cython and CuPy."""
import os as _os

# One threading layer: the Cython kernels own the cores (-t); BLAS must not fight them (FACTS.md).
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name):
    # Lazy: `import pyinfer` stays cheap (the CLIs and converter import submodules directly).
    if name == "LLM":
        from pyinfer.api import LLM

        return LLM
    raise AttributeError(f"module 'pyinfer' has no attribute {name!r}")
