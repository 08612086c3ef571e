"""llama.cpp GGUF (architectures ``llama``, ``gemma3``, ``qwen2``) -> pyinfer tensors and metadata.

A tensor whose output type is its source type (``--outtype auto``, the default, keeps every
tensor of a quantized file at its type) is copied as stored, row by row: no requantization. The
others are dequantized with ``gguf.quants.dequantize`` (Q4_1, Q8_0, K-quants, ...) and re-encoded
in the output type; ``ffn_down_t``, a new layout, is always re-encoded (at the source's type
under ``auto``, with llama.cpp's fallback when n_embd is not a multiple of 256 for a K-quant).
Two layout changes (design.md):

- llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of Q and K for its interleaved RoPE:
  ``w.reshape(n, 2, rows/n/2, cols).swapaxes(1, 2)``; `unpermute_qk` inverts it, giving back the
  Hugging Face (rotate_half / NeoX) row order.
- ``ffn_down`` (n_embd, n_ff) becomes ``ffn_down_t`` (n_ff, n_embd), except with ``down_rows``
  (``pyinfer-convert --dense``): ``ffn_down`` then keeps llama.cpp's layout and, at its own type,
  its stored blocks (``pyinfer.ffn_layout`` "rows").

The tokenizer (``tokenizer.*`` keys, chat templates) is copied with its value types. A file that
pyinfer itself wrote (``pyinfer.rope_layout`` present) is re-encoded without either change.

Architecture ``gemma3`` (llama.cpp's Gemma 3) keeps Q/K as stored: llama.cpp's Gemma3Model does
not permute them (its RoPE is NeoX-style), and its norm weights already hold Gemma's +1. What the
file does not store comes from llama.cpp's loader (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``):
every 6th layer global, the others sliding with RoPE base 1e4, scores scaled by head_dim^-0.5
(n_embd/n_head for the 62-layer 27B), embeddings times sqrt(n_embd); keys present in the file win.

Architecture ``qwen2`` (llama.cpp's Qwen2) keeps Q/K as stored too (llama.cpp runs it with NeoX
RoPE, ``LLAMA_ROPE_TYPE_NEOX``, and its converter does not permute them) and brings the q/k/v
biases; like llama.cpp's loader it has no sliding window. A Llama 3 file's ``rope_freqs.weight``
(its RoPE frequency divisors) is copied.
"""
from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np

from pyinfer import __version__
from pyinfer import constants as C
from pyinfer.config import read_field, refuse_unsupported_kind
from pyinfer.errors import PyinferError
from pyinfer.gguf_check import check_gguf
from pyinfer.gguf_reader import GGUFReader
from pyinfer.llamacpp import ArchKeys, linear_rope_factor, scaled_rope_freqs
from pyinfer.ops.cpu import SUPPORTED

from . import warn
from .powerinfer import GPUIDX_SUFFIX, is_powerinfer, open_powerinfer, read_gpuidx, sparse_threshold
from .tokenizer import add_eot_id
from .writer import FILE_TYPES, VT, Metadata, TensorJob, matrix_qtype

GGUF_MAGIC = b"GGUF"
#: general.* keys worth carrying over (descriptive only)
_GENERAL_COPY = ("general.name", "general.organization", "general.basename", "general.finetune",
                 "general.size_label", "general.license", "general.type")


#: llama.cpp architectures pyinfer-convert reads
_GGUF_ARCHS = (C.ARCH, "gemma3", "qwen2", "qwen3")


def _gemma3_meta(reader, meta: Metadata, n_embd: int, n_head: int, n_layer: int,
                 head_dim: int) -> None:
    """Gemma 3's keys (see the module docstring for the defaults, llama.cpp's)."""
    meta.string(C.K_FAMILY, "gemma3")
    meta.f32(C.K_EMBD_SCALE, float(np.sqrt(np.float32(n_embd))))
    scale = _scalar(reader, C.K_ATTN_SCALE)
    if scale is None:
        scale = 1.0 / np.sqrt(n_embd / n_head if n_layer == 62 else head_dim)
    meta.f32(C.K_ATTN_SCALE, float(scale))
    meta.f32(C.K_ROPE_FREQ_BASE_SWA, float(_scalar(reader, C.K_ROPE_FREQ_BASE_SWA, 10000.0)))
    cap = _scalar(reader, C.K_FINAL_SOFTCAP)
    if cap:
        meta.f32(C.K_FINAL_SOFTCAP, float(cap))
    window = int(_scalar(reader, C.K_SLIDING_WINDOW, 0) or 0)
    pattern = _scalar(reader, C.K_SWA_PATTERN_SRC, 6)
    if isinstance(pattern, list):  # newer llama.cpp files: one bool per layer
        flags = [bool(v) for v in pattern]
        if len(flags) != n_layer:
            raise PyinferError(f"{C.K_SWA_PATTERN_SRC} has {len(flags)} entries for {n_layer} layers")
    else:  # llama.cpp's set_swa_pattern(n): layer il slides where il % n < n - 1
        flags = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
    if window and any(flags):
        meta.u32(C.K_SLIDING_WINDOW, window)
        meta.array(C.K_SWA_LAYERS, [int(f) for f in flags], VT.INT32)


def is_gguf(path: str) -> bool:
    """True when ``path`` starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_gguf_or_powerinfer(path: str) -> bool:
    """True for a GGUF file or an upstream PowerInfer one (``PWRI`` magic, convert/powerinfer.py)."""
    return is_gguf(path) or is_powerinfer(path)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp Q/K row order -> Hugging Face order. ``w`` (n_head * head_dim, cols)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face Q/K row order -> llama.cpp's (its ``LlamaModel.permute``); for tests."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_FLOATS = (C.QT.F32, C.QT.F16, C.QT.BF16)


def auto_qtype(src_type) -> C.QT:
    """``--outtype auto`` for one source matrix: a float (f32, f16, bf16) becomes f16, as
    llama.cpp's converter writes; a quantized type the kernels run stays; any other (Q2_K, Q3_K,
    IQ types) becomes Q4_K, the nearest type pyinfer runs."""
    src_type = C.QT(src_type)
    if src_type in _FLOATS:
        return C.QT.F16
    return src_type if src_type in SUPPORTED else C.QT.Q4_K


def open_gguf(path: str) -> gguf.GGUFReader:
    """GGUFReader over ``path``; PyinferError for a file that is not a complete GGUF (the header's
    counts, lengths and offsets are bounded first by ``pyinfer.gguf_check``, so a hostile file
    cannot make the reader loop or exhaust memory)."""
    check_gguf(path)
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
        raise PyinferError(f"{path} is not a valid GGUF file (truncated or damaged: {type(e).__name__})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise PyinferError(f"{path} is truncated (tensor {t.name} ends past the end of the file)")
    return reader


#: The stored kind each metadata key the conversion reads must have (config.read_field's check;
#: a string where a count belongs raised TypeError / ValueError / struct.error mid-conversion).
_KINDS = {**{k: str for k in (C.K_ARCH, C.K_ROPE_SCALING_TYPE, C.K_FAMILY, C.K_SPARSE_MODE,
                                C.K_HIDDEN_ACT, C.K_SOURCE)},
          **{k: int for k in (C.K_EMBEDDING_LENGTH, C.K_BLOCK_COUNT, C.K_FEED_FORWARD_LENGTH,
                                C.K_HEAD_COUNT, C.K_HEAD_COUNT_KV, C.K_KEY_LENGTH, C.K_ROPE_DIM,
                                C.K_FILE_TYPE, C.K_CONTEXT_LENGTH, C.K_VALUE_LENGTH,
                                C.K_SLIDING_WINDOW)},
          **{k: float for k in (C.K_RMS_EPS, C.K_ROPE_FREQ_BASE, C.K_ATTN_SCALE,
                                  C.K_ROPE_FREQ_BASE_SWA, C.K_FINAL_SOFTCAP)}}


def _scalar(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Metadata ``key``'s value, or ``default``; PyinferError when it is stored as another kind
    than _KINDS says."""
    return read_field(reader, key, default, kind=_KINDS.get(key))


def _check_tokenizer(reader) -> None:
    """PyinferError for tokenizer metadata the converted file's every run would refuse (an
    eos id outside the vocabulary, an unknown tokenizer model or pre-tokenizer, a chat template
    that is not a string): the engine's own reading of it, 0.2 s for SmolLM2's. A file with no
    tokenizer at all converts (its runs take token ids)."""
    from pyinfer.tokenizer import NoTokenizerError, Tokenizer

    try:
        Tokenizer.from_gguf(reader)
    except NoTokenizerError:
        pass


def _check_sizes(path: str, **sizes) -> None:
    """PyinferError unless every size is a positive integer below 2**31 (what the engine's
    loader requires of the converted file)."""
    for name, v in sizes.items():
        if not 0 < int(v) < 2**31:
            raise PyinferError(f"{path}: {name} is {v}; a model needs a positive count")


def _copy_field(meta: Metadata, field: Any) -> None:
    vtype = field.types[0]
    if vtype == VT.ARRAY:
        meta.set(field.name, field.contents(), VT.ARRAY, field.types[-1])
    else:
        meta.set(field.name, field.contents(), vtype)


def plan_gguf(path: str, outtype: str, allow_unused: bool = False,
              gpuidx: str | None = None, down_rows: bool = False) -> tuple[Metadata, list[TensorJob]]:
    """Metadata and tensor jobs for a llama.cpp (or pyinfer) GGUF file of architecture llama or
    gemma3, or an upstream PowerInfer file (``PWRI`` magic, architecture llama).

    A PowerInfer file keeps its predictors (``fc1``/``fc2``, F32/F16 as stored; other types become
    F16, or F32 under outtype f32) and its threshold, as pyinfer's sparse keys (mode relu), and
    its ReLU FFN. ``gpuidx``: its GPU split file (default: ``<path>.generated.gpuidx`` when that
    exists, as upstream's loader looks for it); the split is stored as pyinfer's.
    ``down_rows``: write the down projection as ``ffn_down`` (n_embd, n_ff) for a dense file (a
    source already in that layout at the output type is copied as stored), not ``ffn_down_t``.
    Raises PyinferError for a damaged file, another architecture, rope scaling, missing tensors,
    or (unless ``allow_unused``) tensors of layers beyond ``block_count`` (a truncated model).
    """
    pwri = is_powerinfer(path)
    if gpuidx is not None and not pwri:
        raise PyinferError("a GPU split file (--gpuidx) goes only with an upstream PowerInfer model file")
    if pwri and gpuidx is None and os.path.isfile(path + GPUIDX_SUFFIX):
        gpuidx = path + GPUIDX_SUFFIX
    reader = open_powerinfer(path) if pwri else open_gguf(path)
    arch = _scalar(reader, C.K_ARCH, "(none)")
    if pwri and arch != C.ARCH:
        raise PyinferError(f"unsupported PowerInfer architecture {arch} (supported: {C.ARCH})")
    if arch not in _GGUF_ARCHS:
        raise PyinferError(f"unsupported architecture {arch} (supported: {', '.join(_GGUF_ARCHS)})")
    _check_tokenizer(reader)
    refuse_unsupported_kind(reader)
    gemma3 = arch == "gemma3"
    qwen2 = arch == "qwen2"  # llama.cpp's Qwen2: q/k/v biases, NeoX RoPE (rows unpermuted)
    qwen3 = arch == "qwen3"  # llama.cpp's Qwen3: per-head Q/K norms, NeoX RoPE (rows unpermuted)
    if gemma3 or qwen2 or qwen3:  # the source's keys carry its architecture's prefix: read as llama.*
        reader = ArchKeys(reader, arch)
    rope_factor = linear_rope_factor(reader)  # (PyinferError for YaRN and the others)
    tensors = {t.name: t for t in reader.tensors}
    ours = C.K_ROPE_LAYOUT in reader.fields  # written by pyinfer: already neox / neuron-major
    family = _scalar(reader, C.K_FAMILY, "llama")
    if ours and (family != "llama" or any(k in reader.fields for k in (
            C.K_NORM, C.K_POSITIONS, C.K_PARALLEL_BLOCK, C.K_FFN_GATED, C.K_FFN_UP_ACT,
            C.K_ACT_SHIFT, C.K_SLIDING_WINDOW)) or any(".bias" in n for n in tensors)):
        raise PyinferError(f"re-converting a pyinfer {family} file is not supported (only Llama "
                           "files); convert from the Hugging Face directory instead")
    if ours and _scalar(reader, C.K_SPARSE_MODE, None) == C.SPARSE_MODE_INPUT:
        raise PyinferError("re-converting a sparse mode input file is not supported (its "
                           "projections are stored by input channel); convert the model it was "
                           "made from instead")
    # llama: SwiGLU; PowerInfer's sparse llama: ReLU (its llama.cpp, build_llama -> LLM_FFN_RELU)
    act = _scalar(reader, C.K_HIDDEN_ACT, "gelu_tanh" if gemma3 else "relu" if pwri else "silu")
    if act not in C.HIDDEN_ACTS:
        raise PyinferError(f"unsupported hidden_act {act!r}")

    def need(key: str) -> Any:
        v = _scalar(reader, key)
        if v is None:
            raise PyinferError(f"{path} lacks {key}")
        return v

    n_embd, n_layer, n_ff = need(C.K_EMBEDDING_LENGTH), need(C.K_BLOCK_COUNT), need(C.K_FEED_FORWARD_LENGTH)
    n_head = need(C.K_HEAD_COUNT)
    n_head_kv = _scalar(reader, C.K_HEAD_COUNT_KV, n_head)
    _check_sizes(path, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                 n_head_kv=n_head_kv)
    if n_head % n_head_kv:
        raise PyinferError(f"{path}: {n_head} attention heads do not share {n_head_kv} key/value "
                           "heads evenly")
    head_dim = _scalar(reader, C.K_KEY_LENGTH, _scalar(reader, C.K_ROPE_DIM, n_embd // n_head))
    rot = _scalar(reader, C.K_ROPE_DIM)
    if rot is not None and rot != head_dim:  # (the engine and llama.cpp refuse such a file)
        raise PyinferError(f"{path}: partial rotary embeddings (rope dimension_count {rot}, head "
                           f"dim {head_dim}) are not supported")
    n_ctx_train = _scalar(reader, C.K_CONTEXT_LENGTH, 2048)
    _check_sizes(path, head_dim=head_dim, context_length=n_ctx_train)
    for key, default in ((C.K_RMS_EPS, 1e-5), (C.K_ROPE_FREQ_BASE, 10000.0)):
        v = _scalar(reader, key, default)
        if not (np.isfinite(v) and v > 0):
            raise PyinferError(f"{path}: {key} is {v}; it must be a positive number")
    if C.TOKEN_EMBD not in tensors:
        raise PyinferError(f"{path} has no {C.TOKEN_EMBD}")
    n_vocab = int(tensors[C.TOKEN_EMBD].shape[1])  # GGUF shapes are (cols, rows)

    meta = Metadata()
    meta.string(C.K_ARCH, C.ARCH)
    for key in _GENERAL_COPY:  # descriptive only: one that is not a string is left out (every
        if key in reader.fields:  # run of the written file refused an array general.name)
            try:
                read_field(reader, key, kind=str)
            except PyinferError:
                continue
            _copy_field(meta, reader.fields[key])
    auto = outtype == C.OUTTYPE_AUTO
    if auto:
        # a quantized source keeps its file type; a float one becomes f16
        src_ft = _scalar(reader, C.K_FILE_TYPE)
        float_src = all(C.QT(t.tensor_type) in _FLOATS for t in reader.tensors)
        meta.u32(C.K_FILE_TYPE, FILE_TYPES["f16"] if float_src or src_ft is None else src_ft)
    else:
        meta.u32(C.K_FILE_TYPE, FILE_TYPES[outtype])
    if outtype not in ("f32", "f16", "bf16"):
        meta.u32("general.quantization_version", 2)
    meta.u32(C.K_CONTEXT_LENGTH, n_ctx_train)
    meta.u32(C.K_EMBEDDING_LENGTH, n_embd)
    meta.u32(C.K_BLOCK_COUNT, n_layer)
    meta.u32(C.K_FEED_FORWARD_LENGTH, n_ff)
    meta.u32(C.K_HEAD_COUNT, n_head)
    meta.u32(C.K_HEAD_COUNT_KV, n_head_kv)
    meta.f32(C.K_RMS_EPS, _scalar(reader, C.K_RMS_EPS, 1e-5))
    meta.f32(C.K_ROPE_FREQ_BASE, _scalar(reader, C.K_ROPE_FREQ_BASE, 10000.0))
    meta.u32(C.K_ROPE_DIM, _scalar(reader, C.K_ROPE_DIM, head_dim))
    meta.u32(C.K_KEY_LENGTH, head_dim)
    meta.u32(C.K_VALUE_LENGTH, _scalar(reader, C.K_VALUE_LENGTH, head_dim))
    meta.u32(C.K_VOCAB_SIZE, n_vocab)
    meta.string(C.K_PYINFER_VERSION, __version__)
    meta.string(C.K_HIDDEN_ACT, act)
    meta.string(C.K_FFN_LAYOUT, C.FFN_LAYOUT_ROWS if down_rows else C.FFN_LAYOUT_NEURON_MAJOR)
    meta.string(C.K_ROPE_LAYOUT, C.ROPE_LAYOUT_NEOX)
    meta.string(C.K_SOURCE, _scalar(reader, C.K_SOURCE) if ours else os.path.basename(path))
    if gemma3:
        _gemma3_meta(reader, meta, n_embd, n_head, n_layer, head_dim)
    if qwen2 or qwen3:  # llama.cpp runs Qwen2 without its sliding window; so does the converted file
        meta.string(C.K_FAMILY, arch)
    for name, field in reader.fields.items():
        if name.startswith(C.K_TOK_PREFIX) or name.startswith(C.K_CHAT_TEMPLATE_PREFIX) \
                or name == C.K_HF_TOKENIZER_JSON:
            _copy_field(meta, field)
    if C.K_TOK_LIST not in meta:
        warn(f"{os.path.basename(path)} has no tokenizer: writing none")
    elif len(meta.get(C.K_TOK_LIST)) != n_vocab:
        raise PyinferError(f"{path}: {len(meta.get(C.K_TOK_LIST))} tokens but {n_vocab} embeddings")
    else:
        add_eot_id(meta, meta.get(C.K_TOK_LIST))

    used: set[str] = set()

    def src(name: str, shape: tuple[int, ...]) -> Any:
        t = tensors.get(name)
        if t is None:
            raise PyinferError(f"{path} has no tensor {name}")
        if tuple(int(d) for d in t.shape[::-1]) != shape:
            raise PyinferError(f"tensor {name} has shape {tuple(int(d) for d in t.shape[::-1])}, "
                               f"expected {tuple(int(d) for d in shape)}")
        used.add(name)
        return t

    def load(t: Any) -> np.ndarray:
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(
            tuple(int(d) for d in t.shape[::-1]))

    def target(t: Any, cols: int) -> C.QT:
        return matrix_qtype(cols, auto_qtype(t.tensor_type) if auto else outtype)

    def stored(t: Any, rows: int) -> np.ndarray:
        """The tensor's rows as stored (uint8 blocks, or f32/f16 values), a memmap view."""
        return np.asarray(t.data).reshape(rows, -1)

    def mat(name: str, shape: tuple[int, int]) -> TensorJob:
        t = src(name, shape)
        qtype = target(t, shape[1])
        if qtype == t.tensor_type:  # copied as stored
            return TensorJob(name, shape, qtype, lambda: stored(t, shape[0]), raw=True)
        return TensorJob(name, shape, qtype, lambda: load(t))

    def qk(name: str, shape: tuple[int, int], n: int) -> TensorJob:
        if ours or gemma3 or qwen2 or qwen3:  # llama.cpp stores these Q/K unpermuted (NeoX)
            return mat(name, shape)
        t = src(name, shape)
        qtype = target(t, shape[1])
        if qtype == t.tensor_type:  # un-permuting moves whole rows: the stored bytes move as they are
            return TensorJob(name, shape, qtype, raw=True,
                             load=lambda: np.ascontiguousarray(unpermute_qk(stored(t, shape[0]), n)))
        return TensorJob(name, shape, qtype, lambda: np.ascontiguousarray(unpermute_qk(load(t), n)))

    def down(i: int) -> TensorJob:
        """Layer i's down projection in the output's layout, from whichever the source stores
        (llama.cpp's ffn_down, or ffn_down_t in a PowerInfer or neuron-major pyinfer file)."""
        rows, cols = C.SRC_FFN_DOWN.format(bid=i), C.FFN_DOWN_T.format(bid=i)
        name, shape = (rows, (n_embd, n_ff)) if down_rows else (cols, (n_ff, n_embd))
        if name in tensors:  # the source's own layout: copied as stored at its type
            return mat(name, shape)
        other = cols if down_rows else rows
        t = src(other, shape[::-1])  # the other layout: a transpose, re-encoded
        return TensorJob(name, shape, target(t, shape[1]),
                         lambda: np.ascontiguousarray(load(t).T))

    def norm(name: str, n: int = n_embd) -> TensorJob:
        t = src(name, (n,))
        return TensorJob(name, (n,), C.QT.F32, lambda: load(t))

    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    jobs = [mat(C.TOKEN_EMBD, (n_vocab, n_embd))]
    for i in range(n_layer):
        jobs += [
            norm(C.ATTN_NORM.format(bid=i)),
            qk(C.ATTN_Q.format(bid=i), (q_dim, n_embd), n_head),
            qk(C.ATTN_K.format(bid=i), (kv_dim, n_embd), n_head_kv),
            mat(C.ATTN_V.format(bid=i), (kv_dim, n_embd)),
            mat(C.ATTN_OUT.format(bid=i), (n_embd, q_dim)),
            norm(C.FFN_NORM.format(bid=i)),
            mat(C.FFN_GATE.format(bid=i), (n_ff, n_embd)),
            mat(C.FFN_UP.format(bid=i), (n_ff, n_embd)),
            down(i),
        ]
        if qwen2:
            jobs += [norm(C.ATTN_Q_B.format(bid=i), q_dim), norm(C.ATTN_K_B.format(bid=i), kv_dim),
                     norm(C.ATTN_V_B.format(bid=i), kv_dim)]
        if gemma3 or qwen3:
            jobs += [norm(C.ATTN_Q_NORM.format(bid=i), head_dim),
                     norm(C.ATTN_K_NORM.format(bid=i), head_dim)]
        if gemma3:
            jobs += [norm(C.ATTN_POST_NORM.format(bid=i)), norm(C.FFN_POST_NORM.format(bid=i))]
    jobs.append(norm(C.OUTPUT_NORM))
    if rope_factor is not None:  # linear scaling: written as divisors (over Llama 3's own)
        own = norm(C.ROPE_FREQS, head_dim // 2).load if C.ROPE_FREQS in tensors else (lambda: None)
        jobs.append(TensorJob(C.ROPE_FREQS, (head_dim // 2,), C.QT.F32,
                              lambda: scaled_rope_freqs(own(), rope_factor, head_dim)))
    elif C.ROPE_FREQS in tensors:  # Llama 3's RoPE frequency divisors, as llama.cpp stores them
        jobs.append(norm(C.ROPE_FREQS, head_dim // 2))
    if C.OUTPUT in tensors:
        jobs.append(mat(C.OUTPUT, (n_vocab, n_embd)))
    if pwri:
        jobs += _powerinfer_sparse(reader, meta, tensors, src, n_layer, n_embd, n_ff, outtype, gpuidx)
    ignored = sorted(set(tensors) - used)
    beyond = [n for n in ignored if n.startswith("blk.") and n.split(".")[1].isdigit()
              and int(n.split(".")[1]) >= n_layer]
    if beyond and not allow_unused:
        raise PyinferError(f"{path} has {len(beyond)} tensor(s) of layers beyond its block_count {n_layer} "
                           f"({', '.join(beyond[:3])}{' ...' if len(beyond) > 3 else ''}): the model would be "
                           "truncated; pass --allow-unused-tensors to convert anyway")
    if ignored:
        warn(f"ignoring {len(ignored)} tensor(s) the {arch} architecture does not use: {', '.join(ignored[:4])}"
             + (" ..." if len(ignored) > 4 else ""))
    return meta, jobs


def _powerinfer_sparse(reader, meta: Metadata, tensors: dict, src, n_layer: int, n_embd: int,
                       n_ff: int, outtype: str, gpuidx: str | None) -> list[TensorJob]:
    """A PowerInfer file's predictors, threshold and (from ``gpuidx``) GPU split, as pyinfer keys
    and tensor jobs (convert/powerinfer.py has the mapping and its sources)."""
    jobs, ranks = [], []

    def predictor(name: str, shape: tuple[int, int]) -> TensorJob:
        t = src(name, shape)
        if outtype == "f32":
            qtype = C.QT.F32
        elif outtype == C.OUTTYPE_AUTO and C.QT(t.tensor_type) in (C.QT.F32, C.QT.F16):
            qtype = C.QT(t.tensor_type)
        else:
            qtype = C.QT.F16
        if qtype == t.tensor_type:
            return TensorJob(name, shape, qtype, lambda: np.asarray(t.data).reshape(shape), raw=True)
        return TensorJob(name, shape, qtype, lambda: gguf.quants.dequantize(t.data, t.tensor_type)
                         .astype(np.float32, copy=False).reshape(shape))

    for i in range(n_layer):
        n1 = C.FC1.format(bid=i)
        t1 = tensors.get(n1)
        if t1 is None or len(t1.shape) != 2:
            raise PyinferError(f"PowerInfer file has no 2-D predictor {n1}")
        rank = int(t1.shape[1])  # GGUF shapes are (cols, rows): (n_embd, rank)
        jobs += [predictor(n1, (rank, n_embd)), predictor(C.FC2.format(bid=i), (n_ff, rank))]
        ranks.append(rank)
    meta.string(C.K_SPARSE_MODE, C.SPARSE_MODE_RELU)
    meta.array(C.K_PRED_THRESHOLD, [sparse_threshold(reader)] * n_layer, VT.FLOAT32)
    meta.array(C.K_PRED_RANK, ranks, VT.INT32)
    if gpuidx is not None:
        cap, masks, buckets = read_gpuidx(gpuidx, n_layer, n_ff)
        meta.set(C.K_VRAM_BUDGET, cap, VT.UINT64)
        for i, (mask, bucket) in enumerate(zip(masks, buckets)):
            jobs.append(TensorJob(C.GPU_IDX.format(bid=i), mask.shape, C.QT.I32, lambda a=mask: a))
            if bucket.size:  # GGUF holds no empty tensor: absence means "no GPU neurons"
                jobs.append(TensorJob(C.GPU_BUCKET.format(bid=i), bucket.shape, C.QT.I32,
                                      lambda a=bucket: a))
    return jobs
