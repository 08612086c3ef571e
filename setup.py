"""Builds the Cython kernels in cython/ into pyinfer.ops.

OpenMP and the x86 SIMD flags are optional: each is probed with the compiler first, and the
build goes on without it (with a warning), as scikit-learn's build treats OpenMP.
"""
import glob
import os
import subprocess
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup


def _compiler_accepts(flags, code="int main(void){return 0;}\n", link=True):
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(code)
        cmd = [cc, src, "-o", os.path.join(tmp, "probe")] + flags
        if not link:
            cmd.insert(1, "-c")
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


compile_args = ["-O3", "-fno-strict-aliasing"]
link_args = []
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

if os.environ.get("PYINFER_NO_OPENMP") != "1" and _compiler_accepts(["-fopenmp"]):
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")
else:
    print("warning: building pyinfer kernels without OpenMP: -t has no effect", file=sys.stderr)

# SIMD: only what this CPU has (the package is built where it runs; -march=native would
# emit AVX-512 that other CPUs lack, and -mavx2 -mfma -mf16c measured as fast: FACTS.md).
# Two switches build paths this CPU would not take otherwise (the tests build them that way):
# PYINFER_NO_AVX512=1 the AVX2 paths alone (no AVX-512, no VNNI); PYINFER_AVX2_VNNI=1 the
# 256-bit paths with the 256-bit VNNI dot of an AVX-VNNI CPU (on a CPU with AVX512-VNNI its
# EVEX form, without AVX-512 BW, so no 512-bit path).
_flags = _cpu_flags()
_no512 = os.environ.get("PYINFER_NO_AVX512") == "1"
_avx2_vnni = os.environ.get("PYINFER_AVX2_VNNI") == "1"
if os.environ.get("PYINFER_NO_SIMD") != "1" and {"avx2", "fma", "f16c"} <= _flags:
    if _compiler_accepts(["-mavx2", "-mfma", "-mf16c"]):
        compile_args += ["-mavx2", "-mfma", "-mf16c"]
        # 512-bit AXPY (simd.h pi_axpy4_row_512) where the CPU has AVX-512 F and BW
        if (not (_no512 or _avx2_vnni) and {"avx512f", "avx512bw"} <= _flags
                and _compiler_accepts(["-mavx512f", "-mavx512bw"])):
            compile_args += ["-mavx512f", "-mavx512bw"]
        # 256-bit VNNI (u8 x s8 dot products into s32, simd.h PI_VNNI256) for the quantized
        # dots: AVX512-VNNI with VL, else AVX-VNNI (Intel Alder Lake and later, Zen 5)
        if not _no512 and {"avx512_vnni", "avx512vl"} <= _flags and (
                not _avx2_vnni or "avx_vnni" not in _flags) and _compiler_accepts(
                    ["-mavx512vnni", "-mavx512vl"]):
            compile_args += ["-mavx512vnni", "-mavx512vl"]
        elif not _no512 and "avx_vnni" in _flags and _compiler_accepts(["-mavxvnni"]):
            compile_args += ["-mavxvnni"]
        elif _avx2_vnni:
            print("warning: PYINFER_AVX2_VNNI=1, but this CPU or compiler has no VNNI: "
                  "building the AVX2 paths", file=sys.stderr)

extensions = [
    Extension(
        "pyinfer.ops._kernels",
        ["cython/kernels.pyx"],
        include_dirs=[np.get_include(), "cython"],
        # the SIMD headers: build_ext recompiles when one is newer than the built module
        depends=sorted(glob.glob(os.path.join("cython", "*.h"))),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=macros,
    ),
    Extension(  # the K-quant quantizers of the converter (pyinfer/quants.py)
        "pyinfer.ops._quantize",
        ["cython/quantize.pyx"],
        include_dirs=["cython"],
        depends=["cython/kquant.h", "cython/simd.h"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
