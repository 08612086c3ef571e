#!/usr/bin/env python3
"""Run one of the GPU tools on the CuPy stand-in of ``tests/test_cuda_launches.py``, without a
GPU: a dry run of the tool's Python before device time is spent on it (issue 10).

The stand-in's kernels are the entry points NVRTC finds in pyinfer's CUDA sources (and in a
tool's own variant sources), each launch checked against the kernel's PTX parameter list and
launch bound; the kernels do not run, so every time and value the tool prints is meaningless.
What it shows: the tool runs to its end, prints every table, and launches nothing that does not
match its kernel. Needs NVRTC (the test extra's ``nvidia-cuda-nvrtc-cu12``).

    python tools/gpu_standin.py ffn_variants_gpu --shape 7b --reps 1 --l2-bytes 1
    python tools/gpu_standin.py bench_gpu --shape 7b --layers 2 --tokens 3 --budgets 1.0,0.5 --forms-ab
    python tools/gpu_standin.py profile_gpu --shape 7b --layers 2 --no-ceilings
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    import numpy as np

    import nvrtc_check
    import test_cuda_launches as standin
    from pyinfer.ops import cuda

    if nvrtc_check.find_nvrtc() is None:
        print("gpu_standin: libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)",
              file=sys.stderr)
        return 2
    fake = standin.FakeCupy()
    cuda.cupy = fake
    cuda._AVAILABLE, cuda._REASON = True, ""
    sys.modules["cupyx"] = SimpleNamespace(
        empty_pinned=lambda shape, dtype: np.zeros(shape, dtype).view(standin.Pinned))
    tool = importlib.import_module(argv[0])
    rc = tool.main(argv[1:])
    names = sorted({launch.name for launch in fake.launches})
    print(f"\ngpu_standin: {len(fake.launches)} launches checked ({len(names)} kernels: "
          f"{', '.join(names)}); times and values above are the stand-in's", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
