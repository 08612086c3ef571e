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
#
# Not on a machine with an NVIDIA GPU: there the hybrid engine's CPU threads compute the cold
# neurons of every layer while the GPU runs the layer's hot ones, so they are woken up once or
# twice per layer, every 50-200 us; sleeping threads cost a futex wake-up each time. On an H100
# host (16 cores) passive waiting doubled the cold neurons' time per layer (665 vs 311 us,
# 7B-shaped f16, docs/benchmarks.md "GPU (issue 10)"). There libgomp keeps its default: spin a
# while (GOMP_SPINCOUNT), then sleep, so an idle REPL or server does not burn the cores.
_GPU_HOST = _os.path.exists("/dev/nvidiactl") or _os.path.exists("/proc/driver/nvidia/version")
if ("OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ
        and not _GPU_HOST):
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name):
    # Lazy: `import pyinfer` stays cheap (the CLIs and converter import submodules directly).
    if name == "LLM":
        from pyinfer.api import LLM

        return LLM
    raise AttributeError(f"module 'pyinfer' has no attribute {name!r}")
