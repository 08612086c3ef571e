#!/usr/bin/env python3
"""A model file as users hold it (llama.cpp's Q4_K_M, Q5_K_M, Q6_K...): its size after
``pyinfer-convert`` and the speed of pyinfer and llama.cpp on it (issue 11, "The types users hold").

    python tools/bench_llamacpp_file.py --types Q4_K_M Q5_K_M Q6_K --workdir /tmp/kq \
        --llama-quantize BUILD/bin/llama-quantize --llama-bench BUILD/bin/llama-bench \
        [--source models/SmolLM2-135M-Instruct.Q4_1.gguf] [--threads 2 1] [--reps 5]

For each llama.cpp type name (llama-quantize's spelling: Q4_K_M, Q5_K_M, Q6_K, Q4_0, Q8_0...):

1. **build** ``WORKDIR/<source stem>.<TYPE>.gguf`` from ``--source`` with llama.cpp's own quantizer,
   re-quantizing an already quantized source as llama.cpp allows (``--allow-requantize``): the
   ``llama-quantize`` binary when ``--llama-quantize`` is given, else llama-cpp-python's
   ``llama_model_quantize`` when ``llama_cpp`` imports. A file already there is reused.
2. **convert** it with ``pyinfer-convert`` at the default ``--outtype auto`` and ``--dense`` (every
   tensor keeps its stored type and bytes, ``ffn_down`` included: a dense file keeps llama.cpp's
   row layout) and report both sizes, their ratio (the issue's target: within 10%) and the tensor
   types each file holds.
3. **bench** decode and prefill tokens/s, interleaved round by round (tools/bench.py's runners):
   pyinfer on the converted file, pyinfer on the llama.cpp file as it is (``pyinfer/llamacpp.py``;
   ``--no-direct`` skips it) and llama.cpp on the same llama.cpp file (``llama-bench -p 0 -n N`` for
   decode, ``-p N -n 0`` for prefill, each call one repetition after llama-bench's own warm-up; or
   llama-cpp-python when importable and no ``--llama-bench`` is given). ``--no-bench`` stops
   after step 2.

Time it at normal priority on an otherwise idle machine; at 2 threads set GOMP_SPINCOUNT (e.g.
300000) so pyinfer's OpenMP threads spin between kernels as llama.cpp's thread pool does.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import gguf  # noqa: E402

from pyinfer.errors import PyinferError  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_SOURCE = os.environ.get("PYINFER_SMOLLM2_GGUF") or os.path.join(
    ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_path(workdir: str, source: str, ftype: str) -> str:
    """WORKDIR/<source file name without .gguf and without a trailing .TYPE>.<ftype>.gguf"""
    stem = os.path.basename(source)
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    head, _, tail = stem.rpartition(".")
    if head and tail.upper() in gguf.GGMLQuantizationType.__members__:
        stem = head
    return os.path.join(workdir, f"{stem}.{ftype}.gguf")


def quantize_command(binary: str, source: str, out: str, ftype: str, n_threads: int) -> list[str]:
    """llama-quantize's command line: ``[--allow-requantize] SRC OUT TYPE NTHREADS``."""
    return [binary, "--allow-requantize", source, out, ftype, str(n_threads)]


def build(source: str, out: str, ftype: str, llama_quantize: str | None = None,
          n_threads: int = 2) -> str:
    """Write llama.cpp's ``ftype`` version of ``source`` to ``out`` (kept when it exists) and
    return ``out``. Uses the binary ``llama_quantize`` when given, else llama-cpp-python.

    The binary writes to a temporary name that is renamed onto ``out`` on success. Raises
    PyinferError when neither quantizer is available, the type is unknown to llama-cpp-python,
    or the quantizer fails (its last output line in the message)."""
    if os.path.exists(out):
        return out
    tmp = out + ".part"
    try:
        if llama_quantize:
            env = dict(os.environ)
            libdir = os.path.dirname(os.path.abspath(llama_quantize))
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
            p = subprocess.run(quantize_command(llama_quantize, source, tmp, ftype, n_threads),
                               capture_output=True, text=True, env=env)
            if p.returncode != 0:
                last = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
                raise PyinferError(f"llama-quantize {ftype} failed (exit {p.returncode}): {last[0]}")
        else:
            try:
                import llama_cpp
            except ImportError:
                raise PyinferError("no llama.cpp quantizer: give --llama-quantize BINARY or "
                                   "install llama-cpp-python") from None
            code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
            if code is None:
                raise PyinferError(f"llama-cpp-python has no file type {ftype!r}")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize, params.nthread = code, True, n_threads
            if llama_cpp.llama_model_quantize(source.encode(), tmp.encode(), params) != 0:
                raise PyinferError(f"llama_model_quantize {ftype} failed")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def type_census(path: str) -> dict[str, collections.Counter]:
    """{tensor kind: Counter of GGML type names} of a GGUF file; the kind is the name without
    ``blk.N.`` and ``.weight`` (``ffn_down``, ``ffn_down_t``, ``token_embd``...)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            parts = parts[2:]
        if parts[-1] == "weight":
            parts = parts[:-1]
        out[".".join(parts)][t.tensor_type.name] += 1
    return dict(out)


def census_text(census: dict[str, collections.Counter], skip_f32: bool = True) -> str:
    """'attn_q Q5_0 x30, ffn_down Q4_K x16 + Q6_K x14, ...' (F32 norms left out)."""
    items = []
    for kind in sorted(census):
        c = census[kind]
        if skip_f32 and set(c) == {"F32"}:
            continue
        items.append(kind + " " + " + ".join(f"{t} x{n}" for t, n in sorted(c.items())))
    return ", ".join(items)


def convert(src: str, out: str, rows: bool = True) -> float:
    """``pyinfer-convert SRC OUT --dense`` at the default --outtype auto; returns seconds.

    ``rows``: as ``--dense`` writes it, ffn_down in llama.cpp's row layout, copied as stored;
    False: the neuron-major layout of a sparse conversion (ffn_down_t, re-encoded at ffn_down's
    type with llama.cpp's fallback), without the offline stage."""
    from convert.cli import convert as _convert

    t0 = time.perf_counter()
    _convert(src, out, progress=False, down_rows=rows)
    return time.perf_counter() - t0


def size_report(src: str, out: str) -> tuple[int, int, float]:
    """(bytes of src, bytes of out, out / src)."""
    a, b = os.path.getsize(src), os.path.getsize(out)
    return a, b, b / a


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=DEFAULT_SOURCE,
                    help="GGUF that llama.cpp re-quantizes (default: $PYINFER_SMOLLM2_GGUF, else "
                         "models/SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"],
                    help="llama-quantize type names (default Q4_K_M)")
    ap.add_argument("--workdir", required=True, help="folder for the files made")
    ap.add_argument("--llama-quantize", help="path of llama.cpp's llama-quantize binary")
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--n-prompt", type=int, nargs="+", default=[128])
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-direct", action="store_true",
                    help="do not also run pyinfer on the llama.cpp file as it is")
    ap.add_argument("--no-bench", action="store_true", help="build and convert only")
    args = ap.parse_args(argv)
    try:
        if not os.path.isfile(args.source):
            raise PyinferError(f"source {args.source} not found")
        os.makedirs(args.workdir, exist_ok=True)
        pairs = []
        print("| type | llama.cpp file MB | pyinfer file MB | pyinfer / llama.cpp | convert s |")
        print("|---|---|---|---|---|")
        for ftype in args.types:
            lc = build(args.source, build_path(args.workdir, args.source, ftype), ftype,
                       args.llama_quantize)
            py = os.path.join(args.workdir, f"pyinfer.{ftype}.gguf")
            secs = convert(lc, py)
            a, b, r = size_report(lc, py)
            print(f"| {ftype} | {a / 1e6:.2f} | {b / 1e6:.2f} | {r:.3f}x | {secs:.1f} |", flush=True)
            pairs.append((ftype, lc, py))
        for ftype, lc, py in pairs:
            print(f"\n{ftype} tensor types:\n- llama.cpp: {census_text(type_census(lc))}\n"
                  f"- pyinfer:   {census_text(type_census(py))}")
        if args.no_bench:
            return 0
        import bench as B

        n_gen = args.n_gen
        n_ctx = max(512, max(args.n_prompt) + n_gen + 8)
        pp_cols = " | ".join(f"prefill {n} tok/s" for n in args.n_prompt)
        print(f"\n| type | engine | threads | {pp_cols} | decode tok/s | decode vs llama.cpp |")
        print("|---|---|---|" + "---|" * len(args.n_prompt) + "---|---|")
        for t in args.threads:
            for ftype, lc, py in pairs:
                runners = [B.PyinferRunner(py, t, n_ctx)]
                runners[0].name = "pyinfer (converted)"
                if not args.no_direct:
                    runners.append(B.PyinferRunner(lc, t, n_ctx))
                    runners[-1].name = "pyinfer (llama.cpp file)"
                if args.llama_bench:
                    runners.append(B.LlamaBenchRunner(args.llama_bench, lc, t))
                    runners[-1].name = "llama.cpp (llama-bench)"
                else:
                    try:
                        runners.append(B.LlamaCppRunner(lc, t, n_ctx))
                        runners[-1].name = "llama.cpp (llama-cpp-python)"
                    except ImportError:
                        pass
                res = B.run(runners, args.n_prompt, n_gen, args.reps)
                ref = res[runners[-1]][1] if len(runners) > 1 + (not args.no_direct) else None
                for r in runners:
                    pps, tg = res[r]
                    rel = f"{tg / ref:.2f}x" if ref else "-"
                    pp = " | ".join(f"{v:.1f}" for v in pps)
                    print(f"| {ftype} | {r.name} | {t} | {pp} | {tg:.1f} | {rel} |", flush=True)
    except PyinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
