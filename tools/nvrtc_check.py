#!/usr/bin/env python3
"""Compile pyinfer's CUDA sources with NVRTC on a machine without a GPU (issue 10).

NVRTC, NVIDIA's runtime compiler (the one CuPy's ``RawModule`` calls on a device), is a plain
shared library: it compiles CUDA C++ to PTX and, with a real architecture (``sm_90``), through
ptxas to a cubin, with no driver and no device. The ``nvidia-cuda-nvrtc-cu12`` wheel (PyPI; the
test extra installs it on x86-64 Linux) ships it, so CI and a CPU-only session can check every
kernel of ``pyinfer.ops.cuda.SOURCES`` compiles, count its entry points, and read ptxas' register
and spill counts (``-Xptxas -v``) for kernels written before a GPU is lent.

    python tools/nvrtc_check.py [--arch sm_90] [--source gather]   # a table: kernel, registers, spills

Calls follow the NVRTC API (docs.nvidia.com/cuda/nvrtc): nvrtcCreateProgram, nvrtcCompileProgram,
nvrtcGetProgramLogSize / nvrtcGetProgramLog, nvrtcDestroyProgram.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_nvrtc() -> str | None:
    """Path of libnvrtc: the nvidia-cuda-nvrtc wheel's, else the system's (None where neither)."""
    try:
        import nvidia.cuda_nvrtc as pkg
        for d in pkg.__path__:
            libs = sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.*")))
            if libs:
                return libs[0]
    except ImportError:
        pass
    return ctypes.util.find_library("nvrtc")


@dataclass
class Kernel:
    """One entry point as ptxas reports it: registers a thread, spill stores / loads (bytes)."""
    name: str
    registers: int
    spill_stores: int
    spill_loads: int


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message is its log."""


def _nvrtc(src: str, name: str, opts: list[str], lib: str | None) -> tuple[str, str]:
    """(log, PTX) of NVRTC compiling src with opts; raises as compile_source."""
    path = lib or find_nvrtc()
    if path is None:
        raise OSError("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)")
    nv = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if rc:
        raise CompileError(f"nvrtcCreateProgram returned {rc}")
    try:
        b = [o.encode() for o in opts]
        rc = nv.nvrtcCompileProgram(prog, len(b), (ctypes.c_char_p * len(b))(*b))
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        ptx = ""
        if rc == 0:
            nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode(errors="replace")
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc:
        raise CompileError(log)
    return log, ptx


@dataclass
class Signature:
    """One entry point's parameters as PTX declares them (``u32``: an int, ``f32``: a float,
    ``u64``: a pointer or a long long, ...) and its launch bound (``.maxntid``; 0: none)."""
    params: list[str]
    max_threads: int


def ptx_signatures(src: str, name: str = "src.cu", lib: str | None = None,
                   options: tuple[str, ...] = ("-std=c++14",)) -> dict[str, Signature]:
    """Every entry point of ``src`` (compiled by NVRTC to PTX for compute_90): its parameter
    types and launch bound. Raises CompileError, OSError as compile_source."""
    _log, ptx = _nvrtc(src, name, list(options) + ["--gpu-architecture=compute_90"], lib)
    out = {}
    for fn, params, tail in re.findall(r"\.entry (\w+)\(\s*(.*?)\)(.*?)\{", ptx, re.S):
        nt = re.search(r"\.maxntid (\d+)", tail)
        out[fn] = Signature(re.findall(r"\.param \.(\w+)", params), int(nt.group(1)) if nt else 0)
    return out


def compile_source(src: str, name: str = "src.cu", arch: str = "sm_90", lib: str | None = None,
                   options: tuple[str, ...] = ("-std=c++14",)) -> list[Kernel]:
    """Compile ``src`` with NVRTC for ``arch`` (with CuPy's options as pyinfer passes them) and
    return its entry points as ptxas reports them. Raises CompileError with NVRTC's log when the
    source does not compile, OSError when no libnvrtc is found."""
    log, _ptx = _nvrtc(src, name, list(options) + [f"--gpu-architecture={arch}", "-Xptxas", "-v"],
                       lib)
    out = []
    for fn, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)",
                               log, re.S):
        regs = re.search(r"Used (\d+) registers", body)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        out.append(Kernel(fn, int(regs.group(1)) if regs else -1,
                          int(spill.group(1)) if spill else 0, int(spill.group(2)) if spill else 0))
    return out


def main(argv=None) -> int:
    from pyinfer.ops import cuda

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90",
                    help="a real architecture (ptxas runs): sm_80, sm_89, sm_90")
    ap.add_argument("--source", action="append", choices=sorted(cuda.SOURCES),
                    help="only these sources (default: all)")
    args = ap.parse_args(argv)
    if find_nvrtc() is None:
        print("nvrtc_check: libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)",
              file=sys.stderr)
        return 2
    bad = 0
    print("| source | kernel | registers | spill stores / loads (bytes) |")
    print("|---|---|---|---|")
    for name in args.source or sorted(cuda.SOURCES):
        try:
            kernels = compile_source(cuda.SOURCES[name], f"{name}.cu", args.arch)
        except CompileError as e:
            print(f"nvrtc_check: {name} does not compile:\n{e}", file=sys.stderr)
            bad += 1
            continue
        for k in sorted(kernels, key=lambda k: k.name):
            print(f"| {name} | {k.name} | {k.registers} | {k.spill_stores} / {k.spill_loads} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
