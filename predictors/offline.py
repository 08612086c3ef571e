"""The offline stage of ``pyinfer-convert`` (PowerInfer arXiv 2312.12456 §5): calibrate, profile,
train one activation predictor per layer, place hot neurons, and pack it all into the GGUF.

Flow (one function, :func:`convert_sparse`):

1. the dense conversion goes to a staging file ``.<out>.<random>.dense.tmp`` beside ``out``
   (``convert.cli.convert``);
2. a dense ``Engine`` over it produces the calibration tokens (``--calib`` files, or the model's own
   text: predictors/calibrate.py) and the profile (predictors/profile.py): per layer the FFN input
   x and |act(gate)| of every neuron;
3. per layer: the active mask (ReLU: act > 0; SwiGLU: |silu(gate)| above the target-sparsity
   quantile of |silu(gate) * up|), activation counts, and a predictor ``fc2 @ relu(fc1 @ x) >= threshold``
   trained for the target recall (predictors/train.py);
4. with ``--vram-budget``, the GPU split (pyinfer/placement.py, predictors/solver.py);
5. the final file: the converter's metadata and tensor jobs (re-planned from the source) plus
   the new keys and tensors, through ``convert.writer.write_gguf`` (a unique temporary file, then rename).

Sparse mode ``input`` (Llama-shaped SwiGLU files; TEAL/WINA input sparsity of every projection,
predictors/input_sparse.py) replaces steps 2-4: after step 2's calibration text it calibrates
thresholds and writes the transposed layout, with no predictors, counts or split. It is the
default where it makes the CPU run faster (:func:`default_mode`: a Llama-shaped SwiGLU model whose
projections are q8_0, q4_0 or f16, no ``--vram-budget``); other SwiGLU models, and any with a
VRAM budget, take ``glu`` (the predictor path above, which the GPU engine needs): on SmolLM2 a
glu q8_0 file decodes slower than its dense file on the CPU, an input file at the default 25%
1.1-1.3x faster at +1% perplexity (docs/benchmarks.md, session 17).

The staging file is removed in a ``finally``; ``write_gguf`` removes its temporary file on any
exception, so an interrupted or failed conversion leaves no partial file. Layers are always
paired by number.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from pyinfer import constants as C
from pyinfer.errors import PyinferError
from pyinfer.ops.cpu import default_n_threads
from pyinfer.options import arg_type, check_optional, threads_arg
from predictors.train import TRAIN_DEVICES

DEFAULT_CALIB_TOKENS = 4096  # SmolLM2-135M: about 2 min of generation + 1 min profiling, 1 thread
# Predictor recall by sparse mode. ReLU: 0.95, the default (the fixture loses 0.9% perplexity
# at 87% sparsity). SwiGLU ("glu"): every missed neuron carries a non-zero output, and on SmolLM2
# 0.95 cost 22% perplexity where 0.99 cost 4.7% at 44% sparsity (docs/benchmarks.md).
DEFAULT_TARGET_RECALL = {C.SPARSE_MODE_RELU: 0.95, C.SPARSE_MODE_GLU: 0.99}
# SwiGLU only, by sparse mode. glu: the fraction of FFN neurons under the activation threshold
# (docs/benchmarks.md "Offline stage (issue 3)"); input: the fraction of projection weight reads
# skipped, 25% where SmolLM2 loses about 1% perplexity on held-out text at q8_0 (2% at q4_0; 30%
# already costs 3.4-3.8%: docs/benchmarks.md, session 16's curve).
DEFAULT_TARGET_SPARSITY = {C.SPARSE_MODE_GLU: 0.40, C.SPARSE_MODE_INPUT: 0.25}
# Sparse mode "input" (predictors/input_sparse.py) needs only activation quantiles: fewer tokens
# (the self-generated text is most of the stage's time) set its thresholds as well.
DEFAULT_INPUT_CALIB_TOKENS = 1024
# Magnitude (TEAL) beat WINA at every target with the uniform allocation on SmolLM2 q8_0 held-out
# perplexity (+1.4% against +2.3% at 25%, +17% against +27% at 40%; docs/benchmarks.md, session 6)
# and stores no column norms.
DEFAULT_INPUT_SCORE = "magnitude"
# Uniform beat TEAL's block-wise greedy at every target on SmolLM2 q8_0 held-out perplexity (+1.6%
# against +3.2-4.0% at 25%) and needs no block evaluation (docs/benchmarks.md, "Input sparsity").
# The shrunken Fisher allocation (below) beat uniform on three held-out texts of 4,080 tokens each:
# -4.2 to -5.1% perplexity at 40% (the default target), -1.4 to -1.6% at 35%, a tie at 30%
# (docs/benchmarks.md, "Input sparsity quality (issue 12), session 8"); it needs PyTorch, so
# without it the stage falls back to uniform and says so.
DEFAULT_INPUT_ALLOC = "fisher"
FALLBACK_INPUT_ALLOC = "uniform"
#: --sparse-alloc fisher: each unit half-way from uniform to its Fisher level (SmolLM2: better than
#: the unshrunk Fisher levels at 30/35/40% on two held-out texts; docs/benchmarks.md, session 8)
DEFAULT_FISHER_WEIGHT = 0.5
#: sparse mode input: fraction of the lm head's input channels skipped where the head is q8_0 /
#: q4_0 (docs/benchmarks.md "lm-head input sparsity (issue 12), session 12")
DEFAULT_LM_HEAD_SPARSITY = 0.1
#: sparse mode input: the two-stage lm head's candidates where the head is wider than 4 bits (a
#: q4_1 copy picks them, the exact head computes them; SmolLM2's Q8_0 head: -0.0% / +0.2%
#: perplexity on the q4_1 / q8_0 files against the exact copy, 12 of its 30 MB a token unread,
#: decode 1.07x: docs/benchmarks.md, session 18); 0 turns it off
DEFAULT_LM_HEAD_CANDIDATES = 256
#: the lm head's input sparsity where the two-stage head is on: its error reaches only the
#: copy's choice of candidates and the logits outside them (SmolLM2 q4_1: 0.2 costs +0.0-0.1%
#: perplexity against 0.1 on two held-out texts and decodes 1.05x; 0.3 +0.3%; 0.5 +4.5%)
DEFAULT_LM_HEAD_SPARSITY_TWO_STAGE = 0.2
DEFAULT_SEED = 0
DEFAULT_MAX_EPOCHS = 12  # SmolLM2: ~6 s of one core per layer; most layers stop by patience
DEFAULT_PATIENCE = 3
# Time to gather a weight row by index / time to stream it in a dense GEMV, from DRAM. Measured on
# the 2-core EPYC box at SmolLM2's 612-byte q8_0 rows and about 56% of rows read, 2 threads:
# 21.0 GB/s dense against 12.6 GB/s gathered (docs/benchmarks.md, "Gather and AXPY from memory").
GATHER_COST = 1.7
CHUNK_LEN = 512  # tokens per profiling prefill chunk and per generated calibration sequence
MIN_CALIB_TOKENS = 64


@dataclass
class OfflineOptions:
    """Settings of the offline stage (the ``pyinfer-convert`` flags of the same names).

    vram_budget_gib: None stores no GPU split (activation counts are always stored, so a GPU
    engine can solve for its own budget at load time). predictor_rank: "auto" (choose_rank) or a
    positive int. n_threads: kernel and torch threads (None: the physical cores this process may
    use, ``pyinfer.ops.cpu.default_n_threads``)."""

    calib_files: list[str] = field(default_factory=list)
    calib_tokens: int | None = None  # None: DEFAULT_CALIB_TOKENS, or DEFAULT_INPUT_CALIB_TOKENS in mode "input"
    seed: int = DEFAULT_SEED
    target_recall: float | None = None  # None: DEFAULT_TARGET_RECALL of the model's sparse mode
    target_sparsity: float | None = None  # None: DEFAULT_TARGET_SPARSITY of the sparse mode
    vram_budget_gib: float | None = None
    predictor_rank: str | int = "auto"
    n_threads: int | None = None
    max_epochs: int = DEFAULT_MAX_EPOCHS
    patience: int = DEFAULT_PATIENCE
    progress: bool | None = None
    sparse_mode: str | None = None  # SwiGLU models: "glu", "input" or None (default_mode decides)
    input_score: str = DEFAULT_INPUT_SCORE  # mode "input": "wina" or "magnitude" (TEAL)
    # mode "input": "uniform", "greedy" (TEAL block-wise) or "fisher"; None: DEFAULT_INPUT_ALLOC
    # where PyTorch is installed, else FALLBACK_INPUT_ALLOC (check() resolves it and says so)
    input_alloc: str | None = None
    fisher_weight: float | None = None  # "fisher" (check() sets None to DEFAULT_FISHER_WEIGHT); 0.5: half-way to uniform
    # mode "input": the lm head's fraction of input channels skipped (None: DEFAULT_LM_HEAD_SPARSITY
    # where the head's type allows it, else a dense head; a value given is an error there)
    lm_head_sparsity: float | None = None
    # mode "input": the two-stage head's candidates K (None: DEFAULT_LM_HEAD_CANDIDATES where the
    # head is wider than 4 bits, else 0; 0: output_ib is the exact head in its own type)
    lm_head_candidates: int | None = None
    # where PyTorch trains the predictors and runs the Fisher pass: "auto" (CUDA where PyTorch
    # sees a GPU), "cpu" or "cuda" (predictors.train.torch_device)
    train_device: str = "auto"
    # mode "input" and --dense: quantize q4_0 / q5_0 projections and lm head with importance-
    # weighted scales from the calibration inputs (quants.quantize_weighted); False: round-to-
    # nearest, as gguf does
    imatrix: bool = True
    # the flags the user gave (``given_flags``: names as OFFLINE_FLAGS spells them), for
    # check_flags; empty for options built in code
    given: frozenset = frozenset()
    # check(): the allocation fell back to FALLBACK_INPUT_ALLOC for want of PyTorch (said once
    # the mode is known to be "input")
    _alloc_fallback: bool = field(default=False, repr=False, compare=False)

    def check_flags(self, mode: str | None, why_none: str | None = None) -> None:
        """Raise PyinferError for a flag in ``given`` that the conversion's sparse ``mode``
        would ignore (None: no offline stage, ``--dense`` or a model without a default sparse
        mode): the predictor flags outside glu / relu, the input-sparsity flags outside input,
        and under ``--dense`` all but the calibration flags its importance matrix reads
        (``why_none``: what the message says such a flag needs, for mode None)."""
        if mode is None:
            unused = [f for f in self.given if f not in DENSE_FLAGS]
            why = why_none or "the offline stage, which --dense skips"
        elif mode == C.SPARSE_MODE_INPUT:
            unused = [f for f in self.given if f in PREDICTOR_FLAGS]
            why = "predictors (--sparse-mode glu, or a ReLU model), which sparse mode input has none of"
        else:
            unused = [f for f in self.given if f in INPUT_FLAGS]
            why = "--sparse-mode input (this conversion makes predictors: mode " + mode + ")"
        if unused:
            names = sorted(unused)
            raise PyinferError(f"{', '.join(names)} need{'s' if len(names) == 1 else ''} {why}")

    def check(self) -> None:
        """Raise PyinferError for a setting outside its range (before any work is done)."""
        if not 0 <= self.seed < 2**32:
            raise PyinferError(f"--calib-seed must be an integer in 0..{2**32 - 1}, got {self.seed}")
        if self.target_recall is not None and not 0.0 < self.target_recall < 1.0:
            raise PyinferError(f"--target-recall must be in (0, 1), got {self.target_recall}")
        if self.target_sparsity is not None and not 0.0 < self.target_sparsity < 1.0:
            raise PyinferError(f"--target-sparsity must be in (0, 1), got {self.target_sparsity}")
        check_optional("vram_budget", self.vram_budget_gib, "--vram-budget")  # GiB
        for p in self.calib_files or ():  # read later (if at all: --dense f16 reads none), but a
            if not os.path.exists(p):     # missing one is a mistake to say now
                raise PyinferError(f"cannot read calibration file {p}: No such file or directory")
        if self.max_epochs < 1:
            raise PyinferError(f"--epochs must be >= 1, got {self.max_epochs}")
        if self.train_device not in TRAIN_DEVICES:
            raise PyinferError(f"--train-device must be one of {', '.join(TRAIN_DEVICES)}, "
                               f"got {self.train_device!r}")
        if self.train_device == "cuda":  # asked for by name: it must be there before any work
            from predictors.train import _import_torch, torch_device

            torch_device(_import_torch(), self.train_device)
        if self.sparse_mode not in (None, C.SPARSE_MODE_INPUT, C.SPARSE_MODE_GLU):
            raise PyinferError(f"--sparse-mode must be input or glu, got {self.sparse_mode!r}")
        if self.input_score not in C.IN_SCORES:
            raise PyinferError(f"--sparsity-score must be one of {', '.join(C.IN_SCORES)}, "
                               f"got {self.input_score!r}")
        if self.input_alloc is None:
            self.input_alloc = DEFAULT_INPUT_ALLOC if _have_torch() else FALLBACK_INPUT_ALLOC
            self._alloc_fallback = self.input_alloc != DEFAULT_INPUT_ALLOC
            if self.sparse_mode == C.SPARSE_MODE_INPUT:
                self.note_alloc_fallback()
        if self.input_alloc not in C.IN_ALLOCS:
            raise PyinferError(f"--sparse-alloc must be one of {', '.join(C.IN_ALLOCS)}, "
                               f"got {self.input_alloc!r}")
        if self.lm_head_sparsity is not None:
            if not 0.0 <= self.lm_head_sparsity < 1.0:
                raise PyinferError(f"--lm-head-sparsity must be in [0, 1), got {self.lm_head_sparsity}")
            if self.sparse_mode == C.SPARSE_MODE_GLU:
                raise PyinferError("--lm-head-sparsity needs --sparse-mode input")
        if self.lm_head_candidates is not None:
            if self.lm_head_candidates < 0:
                raise PyinferError(f"--lm-head-candidates must be >= 0, got {self.lm_head_candidates}")
            if self.lm_head_candidates > 0 and self.lm_head_sparsity == 0.0:  # (it was dropped)
                raise PyinferError("--lm-head-candidates goes with an input-sparse lm head: "
                                   "--lm-head-sparsity 0 asks for the exact head alone")
        if self.fisher_weight is not None:
            if self.input_alloc != "fisher":
                raise PyinferError("--fisher-weight needs --sparse-alloc fisher")
            if not 0.0 <= self.fisher_weight <= 1.0:
                raise PyinferError(f"--fisher-weight must be in [0, 1], got {self.fisher_weight}")
        elif self.input_alloc == "fisher":
            self.fisher_weight = DEFAULT_FISHER_WEIGHT
        if self.calib_tokens is not None and self.calib_tokens < MIN_CALIB_TOKENS:
            raise PyinferError(f"--calib-tokens must be at least {MIN_CALIB_TOKENS}, got {self.calib_tokens}")
        if self.predictor_rank != "auto":
            try:
                rank = int(self.predictor_rank)
            except (TypeError, ValueError):
                raise PyinferError(f"--predictor-rank must be 'auto' or a positive integer, "
                                   f"got {self.predictor_rank!r}") from None
            if rank < 1:
                raise PyinferError(f"--predictor-rank must be >= 1, got {rank}")
            self.predictor_rank = rank

    def note_alloc_fallback(self) -> None:
        """Say on stderr (one line) that the allocation fell back to FALLBACK_INPUT_ALLOC because
        PyTorch is missing; nothing where it did not."""
        if self._alloc_fallback:
            print(f"pyinfer-convert: PyTorch is not installed: --sparse-alloc "
                  f"{self.input_alloc} (the default, {DEFAULT_INPUT_ALLOC}, needs PyTorch: "
                  "pip install torch)", file=sys.stderr, flush=True)


#: default_mode's answer for a SwiGLU model that no sparse mode makes faster: a dense file
NO_SPARSE_MODE = "dense"


def cpu_note_input(weights) -> str:
    """A clause for the converter's sparse-mode-input notice where the kernels have no 512-bit
    path (a CPU without AVX-512, e.g. Intel's desktop cores) and ``weights`` (ModelWeights, the
    staging file's) hold a 5-bit projection (Q5_0, Q5_1, or Q5_K, stored as q5_1): their input
    files decoded 0.94-1.09x their dense files on an AVX2 build. Input files of the 4- and 8-bit
    types decode 1.14-1.26x there (docs/benchmarks.md, session 28; session 26 had measured
    0.93-1.07x before the 256-bit sums were made faster), so they get no clause; nor does a
    build with AVX-512 or without SIMD. Measured with AVX2 builds on an AVX-512 CPU."""
    from pyinfer.ops import cpu
    from pyinfer.ops.cpu import QT
    from pyinfer.quants import Q5_TYPES

    if not cpu.simd_enabled() or "AVX512" in cpu.simd_features():
        return ""
    lw = weights.layers[0]
    five_bit = Q5_TYPES + (QT.Q5_K,)
    projections = (lw.wq, lw.wk, lw.wv, lw.wo, lw.ffn_gate, lw.ffn_up, lw.ffn_down_t,
                   lw.ffn_down)
    if not any(w is not None and w.qtype in five_bit for w in projections):
        return ""
    return ("; on this CPU (no AVX-512) a 5-bit input file decodes about as fast as a dense file "
            "(docs/benchmarks.md, session 28): --dense keeps full quality")


#: ffn_down_t types whose re-encoding along the transposed rows costs noticeable accuracy
_FOUR_FIVE_BIT = tuple(C.QT[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"))

#: families the GPU engine never runs, whatever their weights (``weights.fused_model`` says so
#: after the staging conversion; this list lets --vram-budget be refused before it)
_NOT_GPU_FAMILIES = ("opt", "falcon", "gemma3")


def _refuse_budget_early(src: str, outtype: str, allow_unused: bool,
                         down_type: str | None) -> None:
    """PyinferError for --vram-budget on a source the GPU engine cannot run, as far as its plan
    (the metadata, no weights read) tells: a family in ``_NOT_GPU_FAMILIES`` or sliding-window
    layers. The full check after the staging conversion (``weights.fused_model``) catches the
    rest."""
    from convert.cli import plan

    meta, _ = plan(src, outtype, allow_unused, None, down_type)
    family = meta.get(C.K_FAMILY, "llama")
    if family in _NOT_GPU_FAMILIES or C.K_SLIDING_WINDOW in meta:
        raise PyinferError(_BUDGET_REFUSAL.format(family=family))


_BUDGET_REFUSAL = ("--vram-budget places neurons for the GPU engine, which does not run this "
                   "{family} model (Llama-shaped files only); leave it out")


def input_mode_model(cfg, weights) -> bool:
    """True where sparse mode input (and the GPU engine) can run the model
    (``pyinfer.weights.fused_model``)."""
    from pyinfer.weights import fused_model

    return fused_model(cfg, weights)


def default_mode(cfg, weights, outtype: str, opts: OfflineOptions,
                 down_type: str | None = None) -> str:
    """The sparse mode of a run without ``--sparse-mode``: "relu" for a ReLU model; for a
    SwiGLU one "input" where that mode runs faster than glu on the CPU (a Llama-shaped model,
    ``input_mode_model``: Llama 3, Qwen2 and Qwen3 files too, whose projections are all q8_0 / q4_0 /
    q4_1 / q5_0 / q5_1 in the input-block layout or f16: ``input_sparse.input_mode_pays``) and
    no ``--vram-budget`` asks for the GPU split (which needs glu's predictors); ``NO_SPARSE_MODE`` for a model that is not
    Llama-shaped without ``--vram-budget`` (the GPU engine runs Llama-shaped files only, so glu's
    predictors would serve no engine, and on the CPU glu decodes no faster than a dense file at
    a cost in quality: Gemma-3-270M +6-9% perplexity, docs/benchmarks.md session 20); "glu"
    otherwise. ``weights`` are the staging file's (dense, neuron-major), ``outtype`` the
    conversion's, ``down_type`` its ``--down-type``."""
    from predictors.input_sparse import input_mode_pays
    from predictors.profile import sparse_mode

    mode = sparse_mode(cfg)
    if mode != C.SPARSE_MODE_GLU or opts.vram_budget_gib is not None:
        return mode
    if not input_mode_model(cfg, weights):
        return NO_SPARSE_MODE
    if input_mode_pays(weights, cfg, outtype, down_type):
        return C.SPARSE_MODE_INPUT
    return mode


def _stage(src: str, staging: str, out: str, outtype: str, progress, allow_unused: bool,
           down_type: str | None) -> None:
    """The dense conversion of ``src`` to the staging file; a failed write names ``out`` (the
    staging file is a hidden file beside it the user never asked for)."""
    from convert.cli import convert
    from convert.writer import WriteError

    try:
        convert(src, staging, outtype, progress=progress, allow_unused=allow_unused,
                down_type=down_type)
    except WriteError as e:
        raise WriteError(out, f"{e.reason}, writing its dense staging copy "
                              f"{os.path.basename(staging)} beside it") from None


def _staging_engine(staging: str, src: str, n_threads: int):
    """The dense engine over the staging file ``staging`` (f32 keys and values: the calibration
    records the model's own activations). NoTokenizerError naming the source ``src`` where it
    has no tokenizer: the calibration text is made of tokens (the staging file's own error named
    a file the user never gave)."""
    from pyinfer.engine import Engine
    from pyinfer.tokenizer import NoTokenizerError

    try:
        return Engine(staging, n_ctx=None, n_threads=n_threads, dense=True, cache_type="f32")
    except NoTokenizerError:
        raise NoTokenizerError(f"{src} has no tokenizer (tokenizer.json or tokenizer.model): the "
                               "offline stage makes its calibration tokens with it; --dense "
                               "converts without one") from None


def _have_torch() -> bool:
    """True when PyTorch can be imported (found without importing it: it takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _log(msg: str, progress) -> None:
    if progress is not False:
        print(msg, file=sys.stderr, flush=True)


def convert_sparse(src: str, out: str, outtype: str = C.OUTTYPE_AUTO, opts: OfflineOptions | None = None,
                   allow_unused: bool = False, down_type: str | None = None) -> dict:
    """Convert ``src`` to ``out`` with the offline stage (module docstring).

    Returns a summary dict: ``rows`` (list of report.LayerReport), ``mode``, ``calib_source``,
    ``seconds`` per step. Raises PyinferError for user errors (see OfflineOptions.check, calibration
    files, budget, a model too small for the sparsity); nothing is left at ``out`` on failure.
    """
    from convert.cli import convert, plan
    from convert.writer import VT, TensorJob, write_gguf
    from pyinfer.placement import budget_bytes, model_gpu_bytes, placement_ctx, solve, tensor_sizes
    from predictors.calibrate import calibration_tokens, read_calib_files
    from predictors.profile import profile, sparse_mode
    from predictors.report import format_table
    from predictors.solver import DEFAULT_GROUP_SIZE

    from convert.powerinfer import is_powerinfer

    if is_powerinfer(src):
        raise PyinferError(f"{src} is an upstream PowerInfer file: it brings its own predictors, "
                           "convert it without the offline stage (convert.cli.convert)")
    from convert.cli import check_paths

    check_paths(src, out)
    opts = opts or OfflineOptions()
    if opts.sparse_mode is not None:  # the mode is known: its unused flags before any work
        opts.check_flags(opts.sparse_mode)
    opts.check()
    if opts.vram_budget_gib is not None:  # before the staging conversion (minutes on a model)
        _refuse_budget_early(src, outtype, allow_unused, down_type)
    calib_text = read_calib_files(opts.calib_files) if opts.calib_files else None
    from convert.writer import temp_path_beside

    staging = temp_path_beside(out, ".dense.tmp")  # unique: never a file of the user's
    secs: dict[str, float] = {}
    eng = None
    k_cand = 0  # the two-stage lm head's candidates
    try:
        t0 = time.perf_counter()
        _stage(src, staging, out, outtype, opts.progress, allow_unused, down_type)
        secs["dense conversion"] = time.perf_counter() - t0
        n_threads = opts.n_threads or default_n_threads()
        # f32 keys and values: the calibration records the model's own activations (and the
        # files it writes do not depend on the run's --cache-type)
        eng = _staging_engine(staging, src, n_threads)
        cfg = eng.cfg
        from predictors.input_sparse import check_candidates

        check_candidates(cfg, opts.lm_head_candidates)  # before calibration, not at the final write
        if opts.predictor_rank != "auto" and int(opts.predictor_rank) > cfg.n_embd:
            # fc1 (rank, n_embd): a wider hidden layer than its input only costs bytes
            raise PyinferError(f"--predictor-rank {opts.predictor_rank} is wider than the "
                               f"model's n_embd ({cfg.n_embd}); give at most {cfg.n_embd}")
        chunk_len = min(CHUNK_LEN, eng.n_ctx)
        if opts.vram_budget_gib is not None and not input_mode_model(cfg, eng.weights):
            raise PyinferError(_BUDGET_REFUSAL.format(family=cfg.family))
        mode = sparse_mode(cfg)
        if opts.sparse_mode == C.SPARSE_MODE_INPUT:
            if mode != C.SPARSE_MODE_GLU or not input_mode_model(cfg, eng.weights):
                raise PyinferError("--sparse-mode input needs a Llama-shaped SwiGLU model "
                                   "(biases on q/k/v at most; this file runs sparse mode "
                                   f"{mode}{'' if cfg.llama_plain else ' with its own family layers'})")
            mode = C.SPARSE_MODE_INPUT
        elif opts.sparse_mode is None:
            mode = default_mode(cfg, eng.weights, outtype, opts, down_type)
        elif opts.sparse_mode == C.SPARSE_MODE_GLU and mode == C.SPARSE_MODE_RELU:
            raise PyinferError(f"--sparse-mode glu is for SwiGLU models; this one's activation is "
                               f"{cfg.hidden_act}, with exact zeros: it takes sparse mode relu "
                               "(leave --sparse-mode out)")
        if mode == C.SPARSE_MODE_RELU and opts.target_sparsity is not None:
            raise PyinferError("--target-sparsity sets the sparsity of sparse modes glu and input; "
                               f"a {cfg.hidden_act} model's zeros are its own (leave it out)")
        if mode == NO_SPARSE_MODE:  # a dense file (row-layout ffn_down), the two-stage head
            opts.check_flags(None, "a sparse mode, which this model takes none of by default "
                                   "(--sparse-mode glu)")
            if opts.lm_head_sparsity is not None:
                raise PyinferError("--lm-head-sparsity needs --sparse-mode input")
            _log("no sparse mode for this model by default: the GPU engine does not run it (not "
                 "Llama-shaped), so glu's predictors would serve no "
                 "engine, and on the CPU glu decodes no faster than a dense file (sparse mode "
                 "input takes q8_0, q4_0, q4_1, q5_0, q5_1 or f16 Llama-shaped models); writing "
                 "a dense file with the "
                 "two-stage lm head where the head is wider than 4 bits (--sparse-mode glu for "
                 "the predictors anyway)", opts.progress)
            eng = None
            t0 = time.perf_counter()
            convert(src, out, outtype, progress=opts.progress, allow_unused=allow_unused,
                    down_type=down_type, down_rows=True, lm_head_candidates=opts.lm_head_candidates)
            secs["dense conversion"] += time.perf_counter() - t0
            return {"rows": [], "mode": None, "calib_source": None, "seconds": secs,
                    "placement": None}
        opts.check_flags(mode)
        from predictors.input_sparse import MAX_LEVEL

        if mode == C.SPARSE_MODE_INPUT and opts.input_alloc != "uniform" and \
                (opts.target_sparsity or 0) * 100 > MAX_LEVEL:
            raise PyinferError(f"--target-sparsity {opts.target_sparsity} is above what the "
                               f"{opts.input_alloc} allocation reaches ({MAX_LEVEL / 100:.2f}: no "
                               "projection skips more than that); --sparse-alloc uniform goes higher")
        if mode == C.SPARSE_MODE_GLU and opts.lm_head_sparsity is not None:
            raise PyinferError("--lm-head-sparsity needs --sparse-mode input (this model takes glu "
                               "by default: its projections are not all q8_0, q4_0, q4_1, "
                               "q5_0, q5_1 or f16, "
                               "or --vram-budget was given)")
        if mode in (C.SPARSE_MODE_GLU, C.SPARSE_MODE_RELU) and down_type is None:
            down_t = eng.weights.layers[0].ffn_down_t
            if down_t is not None and down_t.qtype in _FOUR_FIVE_BIT:
                _log(f"ffn_down_t is stored at {down_t.qtype.name} along its transposed rows; from "
                     "a 4/5-bit source that is a second rounding, which costs accuracy (SmolLM2's "
                     "Q4_1: +1.6% perplexity, docs/benchmarks.md session 5); --down-type q8_0 "
                     "keeps it for about 12% more bytes", opts.progress)
        if opts.sparse_mode is None:  # say which mode the default chose, and what it means
            if mode == C.SPARSE_MODE_INPUT:
                opts.note_alloc_fallback()
                _log("sparse mode input (the default for a Llama-shaped SwiGLU model in q8_0, q4_0, "
                     "q4_1, q5_0, q5_1, f16, q4_k (stored as q4_1), q5_k (as q5_1) or q6_k (as q8_0); "
                     "the GPU engine runs it as whole layers; --sparse-mode glu or --vram-budget "
                     "for its hot-neuron split)" + cpu_note_input(eng.weights), opts.progress)
            elif mode == C.SPARSE_MODE_GLU and opts.vram_budget_gib is None:
                hint = ("; --outtype q8_0, q4_0, q4_1, q5_0, q5_1 or f16 takes sparse mode input, "
                        "which is faster"
                        if input_mode_model(cfg, eng.weights) else "")
                _log("sparse mode glu (predictors for the GPU engine): on the CPU this file runs "
                     f"no faster than a --dense one (glu reads gate and up in full){hint}",
                     opts.progress)
        if opts.target_sparsity is None and mode in DEFAULT_TARGET_SPARSITY:
            opts = dataclasses.replace(opts, target_sparsity=DEFAULT_TARGET_SPARSITY[mode])
        if opts.calib_tokens is None:
            opts = dataclasses.replace(opts, calib_tokens=DEFAULT_INPUT_CALIB_TOKENS
                                       if mode == C.SPARSE_MODE_INPUT else DEFAULT_CALIB_TOKENS)
        if opts.target_recall is None and mode != C.SPARSE_MODE_INPUT:
            opts = dataclasses.replace(opts, target_recall=DEFAULT_TARGET_RECALL[mode])
        if mode == C.SPARSE_MODE_INPUT and opts.vram_budget_gib is not None:
            raise PyinferError("--vram-budget solves the hot-neuron split of --sparse-mode glu: sparse "
                               "mode input has none (the GPU engine places its layers whole at run "
                               "time: pyinfer-run --vram-budget / -ngl)")
        if mode == C.SPARSE_MODE_GLU and round(cfg.n_ff * (1 - opts.target_sparsity)) < 1:
            raise PyinferError(f"the model is too small for --target-sparsity {opts.target_sparsity}: "
                               f"its {cfg.n_ff} FFN neurons per layer would leave none active")
        sizes = tensor_sizes(eng.reader)
        budget = None if opts.vram_budget_gib is None else budget_bytes(opts.vram_budget_gib)

        # 1. calibration text, 2. profile
        t0 = time.perf_counter()
        seqs, source = calibration_tokens(eng, opts.calib_files, opts.calib_tokens, opts.seed,
                                          chunk_len, opts.progress, text=calib_text)
        secs["calibration text"] = time.perf_counter() - t0
        if mode == C.SPARSE_MODE_INPUT:
            from predictors.input_sparse import input_stage

            summary = input_stage(src, out, outtype, opts, eng, seqs, source, secs, allow_unused,
                                  plan, n_threads, down_type=down_type)
            _log(summary["table"], opts.progress)
            _log("offline stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items())
                 + f"; calibration {sum(len(s) for s in seqs)} tokens ({source})", opts.progress)
            return summary
        t0 = time.perf_counter()
        prof = profile(eng, seqs, chunk_len, opts.progress)
        secs["profiling"] = time.perf_counter() - t0

        # 3. per-layer activity and predictors; f16 predictors unless the file is f32 (half the
        # bytes each token reads; the threshold was calibrated in f32, f16 rounding moves the
        # logits by about 1e-3 of their scale)
        t0 = time.perf_counter()
        rows, preds, counts, act_thr = _train_layers(prof, cfg, mode, opts, n_threads)
        pred_qtype = C.QT.F32 if outtype == "f32" else C.QT.F16
        pred_elt = C.QK_BLOCK[pred_qtype][1]  # bytes per predictor weight: 4 or 2
        row_bytes = sizes[C.FFN_UP.format(bid=0)] // cfg.n_ff  # bytes of one neuron's up row
        for r, (fc1, fc2, _) in zip(rows, preds):
            pred_bytes = (fc1.size + fc2.size) * pred_elt
            r.cpu_predictor = predictor_pays(mode, r.predicted_sparsity, pred_bytes, row_bytes, cfg.n_ff)
        secs["predictor training"] = time.perf_counter() - t0
        del prof

        meta, jobs = plan(src, outtype, allow_unused, down_type=down_type)
        # 4. placement, counting what the GPU engine will put on the device (pyinfer.hybrid):
        # the predictors about to be written that it runs (the layers whose CPU decode runs
        # them), and the two-stage head's copy in place of the exact head where the final
        # write adds one
        placement = None
        if budget is not None:
            t0 = time.perf_counter()
            device_preds = [bool(r.cpu_predictor) for r in rows]
            for i, (fc1, fc2, _) in enumerate(preds):
                sizes[C.FC1.format(bid=i)] = fc1.size * pred_elt
                sizes[C.FC2.format(bid=i)] = fc2.size * pred_elt
            rank = max([int(fc1.shape[0]) for (fc1, _, _), on in zip(preds, device_preds) if on]
                       or [1])
            head = _two_stage_head_bytes(jobs, cfg, opts.lm_head_candidates)
            placement = solve(counts, sizes, cfg, budget, group_size=DEFAULT_GROUP_SIZE, rank=rank,
                              device_predictors=device_preds, head_bytes=head)
            for r, b in zip(rows, placement.gpu_bucket):
                r.gpu = int(b.size)
            total = model_gpu_bytes(sizes, cfg, rank=rank, device_predictors=device_preds,
                                    head_bytes=head)
            if budget >= total:
                _log(f"--vram-budget {opts.vram_budget_gib:g} GiB holds the whole model with the "
                     f"GPU engine's buffers ({total / 2**30:.4g} GiB at a {placement_ctx(cfg)}-token "
                     "context): every neuron is placed on the GPU", opts.progress)
            secs["placement"] = time.perf_counter() - t0
        # the importance matrix for q4_0 / q5_0 scales (input_sparse.weighted_jobs): the rows
        # whose inputs lie along them; ffn_down_t's blocks run along outputs, where it is flat
        if opts.imatrix and input_mode_model(cfg, eng.weights):
            from predictors.input_sparse import importance, takes_weighted_scales, weighted_jobs

            if takes_weighted_scales(jobs):
                t0 = time.perf_counter()
                jobs = weighted_jobs(jobs, *importance(eng, seqs, n_threads))
                secs["importance matrix"] = time.perf_counter() - t0
        eng = None  # drop the staging memmap before the final write

        # 5. the final file
        t0 = time.perf_counter()
        meta.string(C.K_SPARSE_MODE, mode)
        meta.array(C.K_ACT_THRESHOLD, [float(t) for t in act_thr], VT.FLOAT32)
        meta.array(C.K_PRED_THRESHOLD, [float(p[2]) for p in preds], VT.FLOAT32)
        meta.array(C.K_PRED_RANK, [int(p[0].shape[0]) for p in preds], VT.INT32)
        meta.array(C.K_PRED_CPU, [int(r.cpu_predictor) for r in rows], VT.INT32)
        meta.array(C.K_PRED_RECALL, [r.recall for r in rows], VT.FLOAT32)
        meta.array(C.K_PRED_PRECISION, [r.precision for r in rows], VT.FLOAT32)
        meta.f32(C.K_TARGET_RECALL, opts.target_recall)
        if mode != C.SPARSE_MODE_RELU:
            meta.f32(C.K_TARGET_SPARSITY, opts.target_sparsity)
        meta.string(C.K_CALIB_SOURCE, source)
        meta.u32(C.K_CALIB_TOKENS, sum(len(s) for s in seqs))
        meta.u32(C.K_CALIB_SEED, opts.seed)
        new_jobs = []
        for i, (fc1, fc2, _) in enumerate(preds):
            new_jobs.append(TensorJob(C.FC1.format(bid=i), fc1.shape, pred_qtype, lambda a=fc1: a))
            new_jobs.append(TensorJob(C.FC2.format(bid=i), fc2.shape, pred_qtype, lambda a=fc2: a))
            new_jobs.append(TensorJob(C.ACT_COUNT.format(bid=i), counts[i].shape, C.QT.I32,
                                      lambda a=counts[i]: a))
        if placement is not None:
            meta.set(C.K_VRAM_BUDGET, int(budget), VT.UINT64)
            meta.u32(C.K_GROUP_SIZE, DEFAULT_GROUP_SIZE)
            for i, (mask, bucket) in enumerate(zip(placement.gpu_idx, placement.gpu_bucket)):
                new_jobs.append(TensorJob(C.GPU_IDX.format(bid=i), mask.shape, C.QT.I32, lambda a=mask: a))
                if bucket.size:  # GGUF holds no empty tensor: absence means "no GPU neurons"
                    new_jobs.append(TensorJob(C.GPU_BUCKET.format(bid=i), bucket.shape, C.QT.I32,
                                              lambda a=bucket: a))
        # the two-stage lm head (a q4_1 copy picks the candidates the exact head computes)
        from predictors.input_sparse import two_stage_head

        jobs, k_cand = two_stage_head(meta, jobs, cfg, opts.lm_head_candidates)
        write_gguf(out, meta, list(jobs) + new_jobs, progress=opts.progress)
        secs["final write"] = time.perf_counter() - t0
    finally:
        eng = None
        try:
            os.remove(staging)
        except FileNotFoundError:
            pass
    table = format_table(rows, mode, cfg.n_ff)
    if k_cand:
        table += (f"\nlm head: two-stage, a 4-bit copy picks {k_cand} candidates, the exact head "
                  "computes them (--lm-head-candidates 0: the exact head alone)")
    _log(table, opts.progress)
    _log("offline stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items())
         + f"; calibration {sum(len(s) for s in seqs)} tokens ({source})", opts.progress)
    return {"rows": rows, "mode": mode, "calib_source": source, "seconds": secs, "placement": placement}


def _two_stage_head_bytes(jobs, cfg, asked: int | None) -> int | None:
    """The GPU engine's device bytes of the two-stage lm head the final write adds to a file of
    sparse mode relu / glu (``input_sparse.two_stage_head``; ``gpu_model.ib_head_bytes``), or
    None where it adds none (the exact head goes on the device)."""
    from convert.writer import tensor_nbytes
    from pyinfer.gpu_model import ib_head_bytes
    from predictors.input_sparse import head_candidates, head_copy_type, lm_head_jobs

    if not head_candidates(jobs, cfg, asked):
        return None
    (copy,) = lm_head_jobs(jobs, cfg, C.LM_HEAD_CHUNK, None, head_copy_type(jobs, cfg))
    return ib_head_bytes(cfg, tensor_nbytes(copy.shape, copy.qtype), C.LM_HEAD_CHUNK)


def dense_importance(src: str, out: str, outtype: str, opts: OfflineOptions | None = None,
                     allow_unused: bool = False, down_type: str | None = None):
    """The importance matrices a ``--dense`` conversion weighs its q4_0 / q5_0 scales by
    (``predictors.input_sparse.importance``): ``src`` converted round-to-nearest to a staging
    file beside ``out`` (removed after), the calibration text (``--calib`` files or the model's
    own, ``opts.calib_tokens`` or DEFAULT_INPUT_CALIB_TOKENS tokens) run through it. Returns
    (per layer {group: (n_in,) E[x_j^2]}, (n_embd,) the lm head input's), or None for a model
    whose layers the calibration pass does not run (not Llama-shaped: it says so and the file
    is quantized round-to-nearest) or where no tensor is quantized to q4_0 / q5_0 from floats
    (a source of that type is copied as stored: no pass). Raises PyinferError as the
    conversion does."""
    from convert.cli import plan
    from convert.writer import temp_path_beside
    from pyinfer.tokenizer import NoTokenizerError
    from predictors.calibrate import calibration_tokens, read_calib_files
    from predictors.input_sparse import importance, takes_weighted_scales

    from convert.from_gguf import is_gguf_or_powerinfer

    opts = opts or OfflineOptions()
    if not (os.path.isdir(src) or (os.path.isfile(src) and is_gguf_or_powerinfer(src))):
        return None  # the conversion itself says what is wrong with the source
    jobs = plan(src, outtype, allow_unused, down_type=down_type, down_rows=True)[1]
    if not takes_weighted_scales(jobs):  # nothing quantized to q4_0 / q5_0 from floats (e.g. a
        # q4_0 source's blocks): no calibration, so its flags would go unread
        unread = sorted(f for f in opts.given if f in CALIB_FLAGS)
        if unread:
            raise PyinferError(f"{', '.join(unread)}: this --dense conversion quantizes no tensor "
                               "to q4_0 / q5_0 from floats, so it runs no calibration")
        return None
    calib_text = read_calib_files(opts.calib_files) if opts.calib_files else None
    staging = temp_path_beside(out, ".dense.tmp")
    t0 = time.perf_counter()
    try:
        _stage(src, staging, out, outtype, opts.progress, allow_unused, down_type)
        n_threads = opts.n_threads or default_n_threads()
        try:
            eng = _staging_engine(staging, src, n_threads)
        except NoTokenizerError:
            _log(f"{outtype} scales by round-to-nearest: {src} has no tokenizer for the "
                 "importance matrix's calibration pass", opts.progress)
            return None
        if not input_mode_model(eng.cfg, eng.weights):
            _log(f"{outtype} scales by round-to-nearest: the importance matrix's calibration pass "
                 "runs Llama-shaped models only", opts.progress)
            return None
        n_tok = opts.calib_tokens or DEFAULT_INPUT_CALIB_TOKENS
        seqs, source = calibration_tokens(eng, opts.calib_files, n_tok, opts.seed,
                                          min(CHUNK_LEN, eng.n_ctx), opts.progress, text=calib_text)
        im = importance(eng, seqs, n_threads)
        eng = None
    finally:
        try:
            os.remove(staging)
        except FileNotFoundError:
            pass
    _log(f"importance matrix for the {outtype} scales: {sum(len(q) for q in seqs)} calibration "
         f"tokens ({source}) in {time.perf_counter() - t0:.1f} s (--no-imatrix: round-to-nearest)",
         opts.progress)
    return im


def predictor_pays(mode: str, skipped: float, predictor_bytes: int, row_bytes: int, n_ff: int) -> bool:
    """Whether running a layer's predictor on the CPU reads less than not running it.

    Without it, decode reads every gate row (and in "glu" mode every up row) with the dense GEMV;
    with it, the predictor's own bytes plus the candidates' rows, gathered at ``GATHER_COST``
    times the dense cost per byte. Rows read after the activation threshold (up rows in
    "relu"/"cats" mode, down rows) are the same either way and cancel. ``skipped``: fraction of
    neurons the predictor rules out (held-out); ``row_bytes``: one weight row in the file's type.
    """
    rows_per_neuron = 2 if mode == C.SPARSE_MODE_GLU else 1
    without = rows_per_neuron * n_ff * row_bytes
    with_pred = predictor_bytes + (1.0 - skipped) * without * GATHER_COST
    return with_pred < without


def _train_layers(prof, cfg, mode: str, opts: OfflineOptions, n_threads: int):
    """Per layer: (report rows, [(fc1, fc2, threshold)], counts int32 (n_ff,), act thresholds)."""
    from predictors.profile import activity
    from pyinfer.progress import progress_bar
    from predictors.report import LayerReport
    from predictors.train import MIN_RANK, choose_rank, train_predictor

    rows, preds, counts, thrs = [], [], [], []
    for i in progress_bar(range(cfg.n_layer), desc="predictors", unit="layer", enabled=opts.progress):
        active, thr = activity(prof.act[i], mode, opts.target_sparsity)
        x = prof.x[i]
        counts.append(active.sum(0).astype(np.int32))
        thrs.append(thr)
        sparsity = 1.0 - float(active.mean())
        rank = choose_rank(active, cfg.n_embd) if opts.predictor_rank == "auto" else int(opts.predictor_rank)
        if not active.any():
            # A dead layer: predict nothing (logits are 0 < threshold 1).
            rank = MIN_RANK if opts.predictor_rank == "auto" else rank
            fc1 = np.zeros((rank, cfg.n_embd), np.float32)
            fc2 = np.zeros((cfg.n_ff, rank), np.float32)
            preds.append((fc1, fc2, 1.0))
            rows.append(LayerReport(i, sparsity, thr, rank, 1.0, 1.0, 1.0, 0, 0.0))
            continue
        res = train_predictor(x, active, rank, target_recall=opts.target_recall, seed=opts.seed + i,
                              max_epochs=opts.max_epochs, patience=opts.patience, n_threads=n_threads,
                              device=opts.train_device)
        preds.append((res.fc1, res.fc2, res.threshold))
        rows.append(LayerReport(i, sparsity, thr, res.rank, res.recall, res.precision,
                                res.predicted_sparsity, res.epochs, res.train_seconds))
    return rows, preds, counts, thrs


def add_arguments(parser) -> None:
    """The offline stage's ``pyinfer-convert`` flags."""
    g = parser.add_argument_group("offline stage (predictors and neuron placement; skipped with --dense)")
    g.add_argument("--dense", action="store_true",
                   help="convert only: no calibration, predictors or placement")
    g.add_argument("--calib", action="append", default=[], metavar="FILE",
                   help="plain-text calibration file (repeatable); default: text the model generates "
                        "itself from fixed seed prompts. Never pass held-out evaluation text")
    g.add_argument("--calib-tokens", type=int, default=None, metavar="N",
                   help=f"calibration tokens to profile (default {DEFAULT_CALIB_TOKENS}; "
                        f"{DEFAULT_INPUT_CALIB_TOKENS} in sparse mode input)")
    g.add_argument("--calib-seed", type=int, default=DEFAULT_SEED, metavar="SEED",
                   help="seed of the self-generated calibration text and of training (default 0)")
    g.add_argument("--target-recall", type=float, default=None, metavar="R",
                   help="held-out recall each layer's predictor threshold is tuned to "
                        "(default 0.95 for ReLU models, 0.99 for SwiGLU models)")
    g.add_argument("--target-sparsity", type=float, default=None, metavar="S",
                   help="SwiGLU models: model-wide fraction of projection weight reads skipped "
                        f"(sparse mode input, default {DEFAULT_TARGET_SPARSITY[C.SPARSE_MODE_INPUT]}); "
                        "in mode glu the fraction of FFN neurons below the activation threshold "
                        f"(default {DEFAULT_TARGET_SPARSITY[C.SPARSE_MODE_GLU]}). ReLU models use their exact zeros")
    g.add_argument("--sparse-mode", choices=[C.SPARSE_MODE_INPUT, C.SPARSE_MODE_GLU], default=None,
                   help="SwiGLU models: input (skip small input channels of every projection, "
                        "TEAL/WINA; the GPU engine places its layers whole; the default for "
                        "Llama-shaped models in q8_0, q4_0, q4_1, q5_0, q5_1, f16, q4_k, q5_k "
                        "or q6_k without --vram-budget) or glu (predictors and a GPU split; the "
                        "default for Llama-shaped models in f32 or bf16, or with --vram-budget). "
                        "A model that is not Llama-shaped converts by default to a dense file "
                        "with the two-stage lm head; a ReLU model takes relu, its own")
    g.add_argument("--sparsity-score", choices=list(C.IN_SCORES), default=DEFAULT_INPUT_SCORE,
                   help="sparse mode input: rank input channels by |x| * column norm (wina, "
                        f"default {DEFAULT_INPUT_SCORE}) or by |x| (magnitude, TEAL)")
    g.add_argument("--sparse-alloc", choices=list(C.IN_ALLOCS), default=None,
                   help="sparse mode input: split the target model-wide by an end-of-model "
                        "Fisher estimate (fisher, the default; needs PyTorch, one backward pass "
                        "over 256 calibration tokens; on SmolLM2 with --fisher-weight 0.5, 4-5%% "
                        "lower perplexity than uniform at 40%%, 1.5%% at 35%%, a tie at 30%%), "
                        "uniformly (uniform, the default without PyTorch: every projection skips "
                        "the target fraction of its inputs) or by TEAL's block-wise greedy "
                        "(greedy; slower, and more perplexity lost on SmolLM2)")
    g.add_argument("--fisher-weight", type=float, default=None, metavar="W",
                   help="with --sparse-alloc fisher: move each projection's sparsity from the "
                        "uniform level towards its Fisher level by W in [0, 1] (default "
                        f"{DEFAULT_FISHER_WEIGHT:g}: half-way; 1: the Fisher levels), same model-wide target")
    g.add_argument("--lm-head-sparsity", type=float, default=None, metavar="S",
                   help="sparse mode input: fraction of the lm head's input channels skipped, "
                        "calibrated like the projections' and not counted in --target-sparsity "
                        f"(default {DEFAULT_LM_HEAD_SPARSITY_TWO_STAGE:g} with --lm-head-candidates, "
                        f"else {DEFAULT_LM_HEAD_SPARSITY:g} where the head is q8_0, q4_0, q4_1, "
                        "q5_0 or q5_1; "
                        "0: the dense head)")
    g.add_argument("--lm-head-candidates", type=int, default=None, metavar="K",
                   help="the two-stage lm head: a copy of the head (q4_1 where the head is wider than "
                        "4 bits, else its own numbers; input-sparse in sparse mode input) picks the "
                        "K largest logits, which the exact head then computes (default "
                        f"{DEFAULT_LM_HEAD_CANDIDATES} where the head is wider than 4 bits, e.g. "
                        "q8_0, in every sparse mode; with --dense only when asked for; 0: the "
                        "exact head, or input mode's copy in the head's own type)")
    g.add_argument("--no-imatrix", dest="imatrix", action="store_false",
                   help="quantize q4_0 / q5_0 projections and lm head by round-to-nearest (as "
                        "gguf and llama-quantize without an importance matrix do) instead of the "
                        "default's scales weighted by the calibration inputs' mean squares "
                        "(SmolLM2 q4_0: 12-17%% lower perplexity; a --dense conversion then runs "
                        "no calibration pass)")
    g.add_argument("--vram-budget", type=arg_type("vram_budget"), default=None, metavar="GiB",
                   help="GiB of GPU memory to store a hot/cold neuron split for (default: no split "
                        "stored; activation counts are always stored so the GPU engine can solve at load)")
    g.add_argument("--predictor-rank", default="auto", metavar="auto|K",
                   help="predictor hidden width: auto (per layer, from sparsity and skew) or K")
    g.add_argument("--epochs", type=int, default=DEFAULT_MAX_EPOCHS,
                   help=f"max predictor training epochs per layer (default {DEFAULT_MAX_EPOCHS})")
    g.add_argument("--train-device", choices=list(TRAIN_DEVICES), default="auto",
                   help="where PyTorch trains the predictors and runs the Fisher pass: auto (a CUDA "
                        "GPU when PyTorch sees one, default), cpu or cuda")
    g.add_argument("-t", "--threads", type=threads_arg, default=None,
                   help="threads for profiling and training (default, or 0 or less: the physical cores this process may use)")


#: the offline stage's flags by argparse dest (add_arguments), as a user spells them
OFFLINE_FLAGS = {"calib": "--calib", "calib_tokens": "--calib-tokens", "calib_seed": "--calib-seed",
                 "target_recall": "--target-recall", "target_sparsity": "--target-sparsity",
                 "sparsity_score": "--sparsity-score", "sparse_alloc": "--sparse-alloc",
                 "fisher_weight": "--fisher-weight", "lm_head_sparsity": "--lm-head-sparsity",
                 "lm_head_candidates": "--lm-head-candidates", "imatrix": "--no-imatrix",
                 "vram_budget": "--vram-budget", "predictor_rank": "--predictor-rank",
                 "epochs": "--epochs", "train_device": "--train-device"}
#: what a --dense conversion reads: the importance matrix's calibration, the two-stage head
DENSE_FLAGS = frozenset({"--calib", "--calib-tokens", "--calib-seed", "--no-imatrix",
                         "--lm-head-candidates"})
#: the calibration text's flags (what --dense reads only for its importance matrix)
CALIB_FLAGS = frozenset({"--calib", "--calib-tokens", "--calib-seed"})
#: read only where predictors are trained (modes glu, relu)
PREDICTOR_FLAGS = frozenset({"--target-recall", "--predictor-rank", "--epochs"})
#: read only by sparse mode input
INPUT_FLAGS = frozenset({"--sparsity-score", "--sparse-alloc", "--fisher-weight",
                         "--lm-head-sparsity"})


def given_flags(parser, args) -> frozenset:
    """The OFFLINE_FLAGS the command line set to something other than their defaults."""
    return frozenset(flag for dest, flag in OFFLINE_FLAGS.items()
                     if getattr(args, dest) != parser.get_default(dest))


def options_from_args(args) -> OfflineOptions:
    return OfflineOptions(given=getattr(args, "given", frozenset()),
                          calib_files=list(args.calib), calib_tokens=args.calib_tokens, seed=args.calib_seed,
                          target_recall=args.target_recall, target_sparsity=args.target_sparsity,
                          vram_budget_gib=args.vram_budget, predictor_rank=args.predictor_rank,
                          n_threads=args.threads, max_epochs=args.epochs,
                          sparse_mode=args.sparse_mode, input_score=args.sparsity_score,
                          input_alloc=args.sparse_alloc, fisher_weight=args.fisher_weight,
                          lm_head_sparsity=args.lm_head_sparsity,
                          lm_head_candidates=args.lm_head_candidates,
                          train_device=args.train_device, imatrix=args.imatrix)
