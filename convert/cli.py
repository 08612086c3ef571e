"""``pyinfer-convert SRC OUT [--outtype auto|f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k]
[--down-type TYPE] [offline-stage flags] [--dense]``.

By default the offline stage (calibration, profiling, predictors, placement: predictors/offline.py)
runs after the conversion and its results go into the same file; ``--dense`` skips it and keeps
the down projection in llama.cpp's row layout, ``ffn_down`` (n_embd, n_ff), whose dense GEMV
streams faster than the sum of ``ffn_down_t`` rows sparse decoding needs (docs/benchmarks.md,
issue 11 session 9). An upstream PowerInfer source keeps ``ffn_down_t`` (it brings predictors).

SRC is a Hugging Face ``LlamaForCausalLM`` directory (config.json + *.safetensors + tokenizer files)
or a llama.cpp GGUF file of architecture ``llama``, or an upstream PowerInfer file (``PWRI`` magic:
its predictors, threshold and ``--gpuidx`` / ``SRC.generated.gpuidx`` split are kept, and the offline
stage is skipped; convert/powerinfer.py). OUT is written atomically (a uniquely named
temporary file beside it, then a rename); on failure nothing is left behind and no other file is
touched. User errors print ``error: <message>`` and exit 1.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time

from pyinfer import constants as C
from pyinfer.constants import OUTTYPE_AUTO, OUTTYPES
from pyinfer.errors import EXIT_INTERRUPTED, PyinferError, exit_code_of


def with_down_type(jobs: list, down_type: str) -> list:
    """``jobs`` with every down projection (``ffn_down_t``, or ``ffn_down`` in a dense file's row
    layout) written as ``down_type`` (a name of OUTTYPES; K-quant rows that are not whole
    super-blocks fall back as ``matrix_qtype`` says). ffn_down_t is a new layout, re-encoded from
    floats whatever its type, so this costs no extra requantization; a job that copies stored
    blocks (a quantized ffn_down, or a pyinfer file re-converted) is dequantized first.

    Why: llama.cpp's Q4_K_M and Q5_K_M keep ffn_down at a wider type than the rest, because the
    down projection's errors reach the residual stream directly; ``--down-type q8_0`` does the
    same for a source held at one 4-bit type (docs/benchmarks.md, issue 11 session 5)."""
    import dataclasses
    import re

    from .writer import job_floats, matrix_qtype

    pat = re.compile("|".join(re.escape(n).replace(r"\{bid\}", r"\d+") + "$"
                              for n in (C.FFN_DOWN_T, C.SRC_FFN_DOWN)))
    out = []
    for j in jobs:
        if pat.match(j.name):
            qtype = matrix_qtype(j.shape[1], down_type)
            if qtype != j.qtype:
                j = dataclasses.replace(j, qtype=qtype, load=lambda j=j: job_floats(j), raw=False)
        out.append(j)
    return out


def written_types(path: str) -> str:
    """The weight types of the GGUF at ``path``, largest share of bytes first ("q8_0", "q4_0 +
    q8_0"), for the success line (``auto`` resolves per tensor); 1-D tensors (norms) left out."""
    from pyinfer.gguf_reader import GGUFReader  # (gguf's own took 2 s of a 2.8 s conversion)

    by = {}
    for t in GGUFReader(path).tensors:
        if len(t.shape) > 1:
            by[t.tensor_type.name.lower()] = by.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
    return " + ".join(sorted(by, key=by.get, reverse=True)) or "no weights"


def check_paths(src: str, out: str) -> None:
    """Raise PyinferError unless ``src`` exists and ``out`` can be written as a new file: it names
    a file, its directory exists, it is not a directory nor an existing device, FIFO or socket
    (or a link to one), it is not the source itself (by path or, where
    both exist, by inode: a link to the source), and for a source directory it is not one of
    its existing files other than a .gguf (model.safetensors, config.json, tokenizer.json ...
    were replaced by the output). A symbolic link OUT is judged by what it points to (the
    output is written through it); a loop of links is refused. Every conversion runs it before
    any work."""
    if not os.path.exists(src):
        raise PyinferError(f"{src} does not exist")
    from pyinfer.engine import check_readable_file

    check_readable_file(src)  # (a FIFO: every later look at it would wait for a writer)
    if not out or out.endswith((os.sep, os.altsep or os.sep)):
        raise PyinferError(f"the output {out!r} does not name a file")
    try:
        os.stat(out)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PyinferError(f"{out} is a loop of symbolic links") from None
    # a symbolic link OUT is written through (convert/writer.py): what it names is the output
    real_out = os.path.realpath(out)
    if os.path.exists(out) and not os.path.isdir(out) and not os.path.isfile(out):
        # a device (/dev/null), FIFO or socket, or a link to one: the finished file would
        # replace it (os.replace), which for /dev/null as root breaks the whole system
        raise PyinferError(f"{out} exists and is not a regular file; name a new file")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise PyinferError(f"output directory {out_dir} does not exist")
    if os.path.islink(out) and not os.path.isdir(os.path.dirname(real_out)):  # (found only at the end)
        raise PyinferError(f"{out} is a symbolic link into {os.path.dirname(real_out)}, which "
                           "does not exist")
    if os.path.isdir(out):
        raise PyinferError(f"{out} is a directory")
    if os.path.abspath(src) == os.path.abspath(out) or (
            os.path.isfile(out) and os.path.samefile(src, out)):
        raise PyinferError("the output would overwrite the source file")
    if os.path.isdir(src) and os.path.isfile(out) and not real_out.lower().endswith(".gguf"):
        inside = os.path.commonpath([os.path.realpath(src), real_out])
        if inside == os.path.realpath(src):  # weights, config, tokenizer: what the source is
            raise PyinferError(f"the output would overwrite {out}, a file of the source "
                               "directory; name a new file (e.g. ending in .gguf)")


def plan(src: str, outtype: str, allow_unused: bool = False, gpuidx: str | None = None,
         down_type: str | None = None, down_rows: bool = False):
    """(metadata, tensor jobs) of converting ``src`` (an HF directory, a GGUF or an upstream
    PowerInfer file) at ``outtype`` (already checked); the other arguments as ``convert``'s.
    The one place that picks the source's planner: ``convert`` and the offline stage
    (predictors/offline.py) both plan through it. Raises PyinferError for a source that is
    neither, or a ``gpuidx`` that is missing or given for another kind of source."""
    from .from_gguf import is_gguf_or_powerinfer, plan_gguf
    from .hf import plan_hf

    if gpuidx is not None and not os.path.isfile(gpuidx):
        raise PyinferError(f"{gpuidx} does not exist")
    if os.path.isdir(src):
        if gpuidx is not None:
            raise PyinferError("--gpuidx goes only with an upstream PowerInfer model file")
        meta, jobs = plan_hf(src, outtype, allow_unused, down_rows=down_rows)
    elif is_gguf_or_powerinfer(src):
        from .powerinfer import is_powerinfer

        meta, jobs = plan_gguf(src, outtype, allow_unused, gpuidx=gpuidx,
                               down_rows=down_rows and not is_powerinfer(src))
    else:
        raise PyinferError(f"{src} is neither a model directory nor a GGUF file")
    if down_type is not None:
        jobs = with_down_type(jobs, down_type)
    return meta, jobs


def convert(src: str, out: str, outtype: str = OUTTYPE_AUTO, progress: bool | None = None,
            allow_unused: bool = False, gpuidx: str | None = None,
            down_type: str | None = None, down_rows: bool = False,
            lm_head_candidates: int | None = 0, imatrix=None) -> None:
    """Convert ``src`` (HF directory, GGUF file, or upstream PowerInfer file) to the pyinfer GGUF ``out``.

    ``gpuidx``: an upstream PowerInfer GPU split file for a PowerInfer ``src`` (default: the
    ``<src>.generated.gpuidx`` beside it, if any; convert/powerinfer.py).
    ``allow_unused``: convert even when the source has tensors the conversion leaves out (by
    default that is an error: a config whose layer count is too small truncates the model).
    ``down_type``: a name of OUTTYPES for every ``ffn_down_t`` (None: as ``outtype``, which under
    ``auto`` is the source's own ffn_down type, as llama.cpp's mixes choose it).
    ``down_rows``: a dense file: the down projection as ``ffn_down`` (n_embd, n_ff), llama.cpp's
    row layout (``pyinfer.ffn_layout`` "rows"); ignored for an upstream PowerInfer source, whose
    predictors need ``ffn_down_t``.
    ``lm_head_candidates``: K > 0 adds the two-stage lm head (``predictors.input_sparse.
    two_stage_head``: a copy picks K candidates, the exact head computes them); None: its default
    (K = 256 where the head is wider than 4 bits); 0: the exact head alone (``--dense``'s default).
    ``imatrix``: (per layer {group: E[x_j^2]}, the lm head input's) from
    ``predictors.input_sparse.importance``: q4_0 / q5_0 projections and head quantized from
    floats take ``quants.quantize_weighted``'s scales (``input_sparse.weighted_jobs``).
    Raises PyinferError for anything the user can fix (missing or unsupported input, bad path).
    """
    from .writer import write_gguf

    check_paths(src, out)
    if outtype != OUTTYPE_AUTO and outtype not in OUTTYPES:
        raise PyinferError(f"unknown outtype {outtype!r} (choose from {OUTTYPE_AUTO}, "
                           f"{', '.join(OUTTYPES)})")
    if down_type is not None and down_type not in OUTTYPES:
        raise PyinferError(f"unknown down type {down_type!r} (choose from {', '.join(OUTTYPES)})")
    meta, jobs = plan(src, outtype, allow_unused, gpuidx, down_type, down_rows)
    if imatrix is not None:
        from predictors.input_sparse import weighted_jobs

        jobs = weighted_jobs(jobs, *imatrix)
    if lm_head_candidates != 0:
        from types import SimpleNamespace

        from predictors.input_sparse import lm_head_source, two_stage_head

        n_vocab, n_embd = lm_head_source(jobs).shape
        jobs, _k = two_stage_head(meta, jobs, SimpleNamespace(n_vocab=n_vocab, n_embd=n_embd),
                                  lm_head_candidates)
    write_gguf(out, meta, jobs, progress=progress)


def _interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    """Ctrl-C or `kill`: stop the conversion (its temporary file is removed), unless the output
    is already written whole (the rename done: write_gguf's COMPLETED), where there is nothing
    left to stop and the conversion ends as a success."""
    from .writer import COMPLETED

    if _OUTPUT[0] is not None and os.path.abspath(_OUTPUT[0]) in COMPLETED:
        return
    _SIGNAL[0] = signum
    raise KeyboardInterrupt


_OUTPUT: list = [None]  # the running conversion's output path, for _interrupt
_SIGNAL: list = [None]  # the signal that stopped it (its exit status: 128 + its number)
#: what stops a conversion and removes its temporary file: Ctrl-C, `kill`, a closed terminal
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))


def main(argv: list[str] | None = None) -> int:
    from pyinfer.options import Parser, add_version

    parser = Parser(  # a bad flag: one "error:" line and status 1, as the other commands
        prog="pyinfer-convert",
        description="Convert a Hugging Face Llama directory or a llama.cpp GGUF to a pyinfer GGUF.")

    add_version(parser)
    parser.add_argument("src", nargs="?", help="Hugging Face model directory or llama.cpp .gguf file")
    parser.add_argument("out", nargs="?",
                        help="output .gguf path (written to a temporary file beside it, then renamed)")
    parser.add_argument("-m", "--model", dest="model_opt", metavar="SRC",
                        help="the source, as llama.cpp's tools spell it: pyinfer-convert -m SRC OUT")
    parser.add_argument("--outtype", choices=[OUTTYPE_AUTO, *OUTTYPES], default=OUTTYPE_AUTO,
                        metavar="TYPE",
                        help="type of the 2-D weights (norms stay f32): auto (default: a quantized "
                             "GGUF keeps each tensor's type, copied as stored; f32/bf16/f16 "
                             "sources become f16), " + ", ".join(OUTTYPES) + ". K-quant rows "
                             "not a multiple of 256 fall back as llama.cpp's do (q4_k->q5_0, "
                             "q5_k->q5_1, q6_k->q8_0)")
    parser.add_argument("--down-type", choices=list(OUTTYPES), default=None, metavar="TYPE",
                        help="type of the down projection (ffn_down_t, re-encoded whatever "
                             "its type; with --dense ffn_down in row layout; in sparse mode "
                             "input ffn_down_ib, where a K-quant is stored as sparse mode input "
                             "stores K-quants): " + ", ".join(OUTTYPES) + ". Default: as "
                             "--outtype (auto: the source's own ffn_down type, so a Q4_K_M "
                             "file keeps its Q6_K). q8_0 is more accurate for a source held at "
                             "one 4-bit type, at about +12%% file size on SmolLM2 "
                             "(docs/benchmarks.md)")
    parser.add_argument("--allow-unused-tensors", action="store_true",
                        help="convert even when the source has tensors the model leaves out "
                             "(e.g. more layers than config.json's num_hidden_layers)")
    parser.add_argument("--gpuidx", metavar="FILE", default=None,
                        help="upstream PowerInfer's GPU split file for a PowerInfer (PWRI) SRC "
                             "(default: SRC.generated.gpuidx when it exists)")
    from predictors.offline import add_arguments

    add_arguments(parser)  # the offline stage's flags (--dense skips it)
    args = parser.parse_intermixed_args(argv)  # SRC OUT may follow the options
    from predictors.offline import given_flags

    args.given = given_flags(parser, args)
    if args.model_opt is not None:  # -m SRC OUT: the one positional given is OUT
        if args.out is not None:
            parser.error("give the source once: pyinfer-convert -m SRC OUT or pyinfer-convert SRC OUT")
        args.src, args.out = args.model_opt, args.src
    if args.src is None or args.out is None:
        parser.error("the source and the output are required: pyinfer-convert SRC OUT")
    # `kill` cleans up the temporary file like Ctrl-C, while this runs (the caller's handlers
    # after; a signal that comes while they are put back is dropped: the run has ended)
    from .writer import COMPLETED, signals_held

    COMPLETED.discard(os.path.abspath(args.out))
    _OUTPUT[0], _SIGNAL[0] = args.out, None
    old = tuple(signal.getsignal(sig) for sig in STOP_SIGNALS)
    for sig, was in zip(STOP_SIGNALS, old):
        if was is not signal.SIG_IGN:  # (a background job's ignored SIGINT stays ignored; nohup's SIGHUP)
            signal.signal(sig, _interrupt)
    try:
        status = exit_code_of(_run, args)
        if status == EXIT_INTERRUPTED and _SIGNAL[0] not in (None, signal.SIGINT):
            status = 128 + _SIGNAL[0]  # (the shell's status of a process a signal ended)
        return status
    finally:
        with signals_held():
            for sig, was in zip(STOP_SIGNALS, old):
                signal.signal(sig, was)
            _OUTPUT[0] = None
            pending = signal.sigpending() & set(STOP_SIGNALS)
            while pending:
                pending.discard(signal.sigwait(pending))


def _run(args) -> int:
    from predictors.offline import options_from_args

    from .powerinfer import is_powerinfer

    t0 = time.perf_counter()
    check_paths(args.src, args.out)
    if args.dense and args.sparse_mode is not None:
        raise PyinferError(f"--sparse-mode {args.sparse_mode} needs the offline stage, which "
                           "--dense skips (a dense file keeps ffn_down in row layout)")
    opts = options_from_args(args)
    if args.dense:
        opts.check_flags(None)
        opts.check()
        from predictors.offline import CALIB_FLAGS

        unread = sorted(f for f in opts.given if f in CALIB_FLAGS)
        if unread and not args.imatrix:
            raise PyinferError(f"{', '.join(unread)} need{'s' if len(unread) == 1 else ''} the "
                               "importance matrix's calibration, which --no-imatrix turns off")
    elif is_powerinfer(args.src):
        opts.check_flags(None, "the offline stage, which an upstream PowerInfer file skips (it "
                               "brings its own predictors)")
    if args.dense or is_powerinfer(args.src):  # a PowerInfer file brings its own predictors and split
        imatrix = None
        if args.dense and args.imatrix and not is_powerinfer(args.src):
            from predictors.offline import dense_importance

            imatrix = dense_importance(args.src, args.out, args.outtype, opts,
                                       allow_unused=args.allow_unused_tensors,
                                       down_type=args.down_type)
        convert(args.src, args.out, args.outtype, allow_unused=args.allow_unused_tensors,
                gpuidx=args.gpuidx, down_type=args.down_type, down_rows=args.dense,
                lm_head_candidates=args.lm_head_candidates or 0, imatrix=imatrix)
    else:
        from predictors.offline import convert_sparse

        if args.gpuidx is not None:
            raise PyinferError("--gpuidx goes only with an upstream PowerInfer model file")
        convert_sparse(args.src, args.out, args.outtype, opts,
                       allow_unused=args.allow_unused_tensors, down_type=args.down_type)
    size = os.path.getsize(args.out) / 2**20
    print(f"wrote {args.out} ({written_types(args.out)}, {size:.1f} MiB) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
