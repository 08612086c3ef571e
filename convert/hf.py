"""Hugging Face Llama directory (config.json + *.safetensors) -> pyinfer tensors and metadata.

Safetensors files are parsed here directly (8-byte header length, JSON header, raw data) and
memory-mapped, so bf16 weights need neither torch nor a copy of the whole file: each tensor is
read and widened to float32 only when the writer asks for it.
Names and layouts follow llama.cpp's ``convert_hf_to_gguf.py`` for ``LlamaForCausalLM``, except that
Q/K keep their Hugging Face row order and ``down_proj`` is stored transposed (design.md).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyinfer import __version__
from pyinfer import constants as C
from pyinfer.errors import PyinferError

from . import warn
from .tokenizer import hf_tokenizer_metadata
from .writer import FILE_TYPES, Metadata, TensorJob, matrix_qtype

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


@dataclass(frozen=True)
class _STEntry:
    path: str
    dtype: str  # safetensors spelling: F32, F16, BF16, F64
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsDir:
    """Every tensor of the *.safetensors files of one directory, read lazily as float32."""

    def __init__(self, model_dir: str) -> None:
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            idx = _read_json(index)
            wmap = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wmap, dict) or not all(isinstance(v, str) and os.path.basename(v) == v
                                                     for v in wmap.values()):
                raise PyinferError(f"{index}: 'weight_map' must map tensor names to file names")
            files = sorted(set(wmap.values()))
        else:
            files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        if not files:
            raise PyinferError(f"no *.safetensors weights in {model_dir}")
        self.entries: dict[str, _STEntry] = {}
        self.used: set[str] = set()  # names a conversion asked for (plan_hf's unused-tensor check)
        for name in files:
            self._read_header(os.path.join(model_dir, name))

    def _read_header(self, path: str) -> None:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > size - 8:
                    raise ValueError("header length past the end of the file")
                header = json.loads(f.read(hlen))
        except (OSError, ValueError, struct.error) as e:
            raise PyinferError(f"cannot read safetensors file {path}: {e}") from None
        if not isinstance(header, dict):
            raise PyinferError(f"{path}: the safetensors header is not a JSON object")
        base = 8 + hlen
        for name, info in header.items():
            if name == "__metadata__":
                continue
            self.entries[name] = self._entry(path, name, info, base, size)

    @staticmethod
    def _entry(path: str, name: str, info: Any, base: int, size: int) -> _STEntry:
        """One header entry, checked: a known dtype, a shape of non-negative ints, offsets
        ``0 <= begin <= end`` within the file, and exactly the bytes the shape needs."""
        def bad(why: str) -> PyinferError:
            return PyinferError(f"{path}: tensor {name}: {why} (a damaged safetensors header)")

        if not isinstance(info, dict):
            raise bad("the entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad("no dtype")
        if dtype not in _ST_DTYPES:
            raise PyinferError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise bad(f"data_offsets {offsets!r} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise bad(f"data_offsets [{begin}, {end}] are reversed or negative")
        if base + end > size:
            raise PyinferError(f"{path} is truncated (tensor {name} ends past the end of the file)")
        need = int(np.prod(shape, dtype=object)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if need != end - begin:
            raise bad(f"shape {tuple(shape)} of {dtype} needs {need} bytes, its data has {end - begin}")
        return _STEntry(path, dtype, tuple(shape), base + begin, end - begin)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def load(self, name: str) -> np.ndarray:
        """The tensor as a float32 array (one copy; the file itself is memory-mapped)."""
        e = self.entries[name]
        raw = np.memmap(e.path, dtype=np.uint8, mode="r", offset=e.offset, shape=(e.nbytes,))
        arr = raw.view(_ST_DTYPES[e.dtype]).reshape(e.shape)
        if e.dtype == "BF16":  # bf16 is the high half of an f32
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise PyinferError(f"cannot read {path}: {e}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _cfg_int(cfg: dict[str, Any], key: str, default: Any = KeyError, lo: int = 1) -> int:
    """config.json's integer ``key`` (``default`` when absent or null; KeyError: required) in
    lo..2**32-1.
    A string, float or bool is refused rather than guessed at (PyinferError)."""
    v = cfg.get(key)
    if v is None:
        if default is KeyError:
            raise PyinferError(f"config.json lacks {key}")
        return default
    if not _is_int(v) or not lo <= v < 2**32:  # GGUF stores them as uint32
        raise PyinferError(f"config.json: {key} must be an integer in {lo}..{2**32 - 1}, got {v!r}")
    return v


def _cfg_float(cfg: dict[str, Any], key: str, value: Any, default: float) -> float:
    """A positive finite number from config.json (``default`` when absent); PyinferError otherwise."""
    if key not in cfg and value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
        raise PyinferError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta from a transformers 4 (``rope_theta``/``rope_scaling``) or 5 (``rope_parameters``) config."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for key, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(p, dict):
            raise PyinferError(f"config.json: {key} must be an object, got {p!r}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in (None, "default"):
            raise PyinferError(f"unsupported rope scaling {kind!r}")
    # every rope_theta given (either form) must be a number; transformers 5's wins
    top = _cfg_float(cfg, "rope_theta", cfg.get("rope_theta"), 10000.0)
    if "rope_theta" in params:
        return _cfg_float(params, "rope_theta", params["rope_theta"], 10000.0)
    return top


@dataclass(frozen=True)
class LlamaHParams:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    hidden_act: str
    tied: bool

    @classmethod
    def from_config(cls, cfg: Any) -> "LlamaHParams":
        """Hyperparameters from a parsed config.json. Raises PyinferError for another
        architecture, a missing key, or a value of the wrong type or range."""
        if not isinstance(cfg, dict):
            raise PyinferError(f"config.json must be a JSON object, not a {type(cfg).__name__}")
        archs = cfg.get("architectures") or ["(none)"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise PyinferError(f"config.json: architectures must be a list of names, got {archs!r}")
        if archs[0] not in C.HF_ARCHITECTURES:
            raise PyinferError(f"unsupported architecture {archs[0]}")
        act = cfg.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in C.HIDDEN_ACTS:
            raise PyinferError(f"unsupported hidden_act {act!r} (pyinfer supports {', '.join(C.HIDDEN_ACTS)})")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise PyinferError("unsupported: attention or MLP biases")
        n_embd = _cfg_int(cfg, "hidden_size")
        n_head = _cfg_int(cfg, "num_attention_heads")
        head_dim = _cfg_int(cfg, "head_dim", None)
        if head_dim is None:
            if n_embd % n_head:
                raise PyinferError(f"config.json: hidden_size {n_embd} is not a multiple of "
                                   f"num_attention_heads {n_head} (and there is no head_dim)")
            head_dim = n_embd // n_head
        n_head_kv = _cfg_int(cfg, "num_key_value_heads", n_head)
        if n_head % n_head_kv:
            raise PyinferError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                               f"num_key_value_heads {n_head_kv}")
        tied = cfg.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise PyinferError(f"config.json: tie_word_embeddings must be true or false, got {tied!r}")
        return cls(
            n_embd=n_embd,
            n_ff=_cfg_int(cfg, "intermediate_size"),
            n_layer=_cfg_int(cfg, "num_hidden_layers"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=_cfg_int(cfg, "vocab_size"),
            n_ctx=_cfg_int(cfg, "max_position_embeddings", 2048),
            rms_eps=_cfg_float(cfg, "rms_norm_eps", cfg.get("rms_norm_eps"), 1e-6),
            rope_theta=_rope_theta(cfg),
            hidden_act=act,
            tied=tied,
        )


def _check_shape(st: SafetensorsDir, name: str, shape: tuple[int, ...], model_dir: str) -> None:
    st.used.add(name)
    if name not in st:
        raise PyinferError(f"missing tensor {name} in {model_dir}")
    if st.shape(name) != shape:
        raise PyinferError(f"tensor {name} has shape {st.shape(name)}, config.json implies {shape}")


#: Checkpoint tensors that carry no weights the conversion needs (older transformers saved RoPE's
#: inverse frequencies; llama.cpp's converter skips them too).
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


def _check_all_used(st: SafetensorsDir, used: set[str], hp: LlamaHParams, allow_unused: bool) -> None:
    """Refuse a checkpoint with tensors the conversion leaves out: a config.json whose
    num_hidden_layers is smaller than the checkpoint would otherwise give a truncated model."""
    unused = sorted(n for n in st.entries if n not in used and not n.endswith(_IGNORABLE_SUFFIXES)
                    and not (n == "lm_head.weight" and hp.tied))  # tied: a copy of the embeddings
    if not unused:
        return
    listed = ", ".join(unused[:3]) + (" ..." if len(unused) > 3 else "")
    msg = (f"the checkpoint has {len(unused)} tensor(s) the conversion would leave out ({listed}); "
           f"config.json says num_hidden_layers {hp.n_layer}")
    if not allow_unused:
        raise PyinferError(msg + ": fix config.json, or pass --allow-unused-tensors to convert anyway")
    warn(msg + ": converting anyway (--allow-unused-tensors)")


def plan_hf(model_dir: str, outtype: str, allow_unused: bool = False) -> tuple[Metadata, list[TensorJob]]:
    """Metadata and tensor jobs for a Hugging Face ``LlamaForCausalLM`` directory.

    Raises PyinferError for a directory without config.json or weights, another architecture,
    an unsupported activation or rope scaling, tensors whose shapes disagree with config.json,
    or (unless ``allow_unused``) tensors the conversion would leave out.
    """
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise PyinferError(f"no config.json in {model_dir}")
    hp = LlamaHParams.from_config(_read_json(cfg_path))
    st = SafetensorsDir(model_dir)

    embd = "model.embed_tokens.weight"
    _check_shape(st, embd, (hp.n_vocab, hp.n_embd), model_dir)
    tied = hp.tied
    if not tied and "lm_head.weight" not in st:
        warn("tie_word_embeddings is false but there is no lm_head.weight: using the embeddings")
        tied = True

    meta = Metadata()
    meta.string(C.K_ARCH, C.ARCH)
    meta.string(C.K_NAME, os.path.basename(os.path.abspath(model_dir)))
    if outtype == C.OUTTYPE_AUTO:  # the checkpoint holds f32/bf16/f16: f16, as llama.cpp's converter
        outtype = "f16"
    meta.u32(C.K_FILE_TYPE, FILE_TYPES[outtype])
    if outtype not in ("f32", "f16", "bf16"):
        meta.u32("general.quantization_version", 2)  # gguf.GGML_QUANT_VERSION
    meta.u32(C.K_CONTEXT_LENGTH, hp.n_ctx)
    meta.u32(C.K_EMBEDDING_LENGTH, hp.n_embd)
    meta.u32(C.K_BLOCK_COUNT, hp.n_layer)
    meta.u32(C.K_FEED_FORWARD_LENGTH, hp.n_ff)
    meta.u32(C.K_HEAD_COUNT, hp.n_head)
    meta.u32(C.K_HEAD_COUNT_KV, hp.n_head_kv)
    meta.f32(C.K_RMS_EPS, hp.rms_eps)
    meta.f32(C.K_ROPE_FREQ_BASE, hp.rope_theta)
    meta.u32(C.K_ROPE_DIM, hp.head_dim)
    meta.u32(C.K_KEY_LENGTH, hp.head_dim)
    meta.u32(C.K_VALUE_LENGTH, hp.head_dim)
    meta.u32(C.K_VOCAB_SIZE, hp.n_vocab)
    meta.string(C.K_PYINFER_VERSION, __version__)
    meta.string(C.K_HIDDEN_ACT, hp.hidden_act)
    meta.string(C.K_FFN_LAYOUT, C.FFN_LAYOUT_NEURON_MAJOR)
    meta.string(C.K_ROPE_LAYOUT, C.ROPE_LAYOUT_NEOX)
    meta.string(C.K_SOURCE, os.path.basename(os.path.abspath(model_dir)))

    tok = hf_tokenizer_metadata(model_dir, hp.n_vocab)
    if tok is None:
        warn(f"no tokenizer.json or tokenizer.model in {model_dir}: writing no tokenizer")
    else:
        meta.items.update(tok.items)

    def mat(out_name: str, src: str, shape: tuple[int, int], transpose: bool = False) -> TensorJob:
        _check_shape(st, src, shape[::-1] if transpose else shape, model_dir)
        if transpose:
            def load() -> np.ndarray:
                return np.ascontiguousarray(st.load(src).T)
        else:
            def load() -> np.ndarray:
                return st.load(src)
        return TensorJob(out_name, shape, matrix_qtype(shape[1], outtype), load)

    def norm(out_name: str, src: str) -> TensorJob:
        _check_shape(st, src, (hp.n_embd,), model_dir)
        return TensorJob(out_name, (hp.n_embd,), C.QT.F32, lambda: st.load(src))

    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    jobs = [mat(C.TOKEN_EMBD, embd, (hp.n_vocab, hp.n_embd))]
    for i in range(hp.n_layer):
        p = f"model.layers.{i}."
        jobs += [
            norm(C.ATTN_NORM.format(bid=i), p + "input_layernorm.weight"),
            mat(C.ATTN_Q.format(bid=i), p + "self_attn.q_proj.weight", (q_dim, hp.n_embd)),
            mat(C.ATTN_K.format(bid=i), p + "self_attn.k_proj.weight", (kv_dim, hp.n_embd)),
            mat(C.ATTN_V.format(bid=i), p + "self_attn.v_proj.weight", (kv_dim, hp.n_embd)),
            mat(C.ATTN_OUT.format(bid=i), p + "self_attn.o_proj.weight", (hp.n_embd, q_dim)),
            norm(C.FFN_NORM.format(bid=i), p + "post_attention_layernorm.weight"),
            mat(C.FFN_GATE.format(bid=i), p + "mlp.gate_proj.weight", (hp.n_ff, hp.n_embd)),
            mat(C.FFN_UP.format(bid=i), p + "mlp.up_proj.weight", (hp.n_ff, hp.n_embd)),
            mat(C.FFN_DOWN_T.format(bid=i), p + "mlp.down_proj.weight", (hp.n_ff, hp.n_embd), transpose=True),
        ]
    jobs.append(norm(C.OUTPUT_NORM, "model.norm.weight"))
    if not tied:
        jobs.append(mat(C.OUTPUT, "lm_head.weight", (hp.n_vocab, hp.n_embd)))
    _check_all_used(st, st.used, hp, allow_unused)
    return meta, jobs
