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
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        if not files:
            raise PyinferError(f"no *.safetensors weights in {model_dir}")
        self.entries: dict[str, _STEntry] = {}
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
        base = 8 + hlen
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            if info["dtype"] not in _ST_DTYPES:
                raise PyinferError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            if base + end > size:
                raise PyinferError(f"{path} is truncated (tensor {name} ends past the end of the file)")
            self.entries[name] = _STEntry(path, info["dtype"], tuple(info["shape"]), base + begin, end - begin)

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


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise PyinferError(f"cannot read {path}: {e}") from None


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta from a transformers 4 (``rope_theta``/``rope_scaling``) or 5 (``rope_parameters``) config."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in (None, "default"):
            raise PyinferError(f"unsupported rope scaling {kind!r}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


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
    def from_config(cls, cfg: dict[str, Any]) -> "LlamaHParams":
        archs = cfg.get("architectures") or ["(none)"]
        if archs[0] not in C.HF_ARCHITECTURES:
            raise PyinferError(f"unsupported architecture {archs[0]}")
        act = cfg.get("hidden_act", "silu")
        if act not in C.HIDDEN_ACTS:
            raise PyinferError(f"unsupported hidden_act {act!r} (pyinfer supports {', '.join(C.HIDDEN_ACTS)})")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise PyinferError("unsupported: attention or MLP biases")
        try:
            n_embd = int(cfg["hidden_size"])
            n_head = int(cfg["num_attention_heads"])
            return cls(
                n_embd=n_embd,
                n_ff=int(cfg["intermediate_size"]),
                n_layer=int(cfg["num_hidden_layers"]),
                n_head=n_head,
                n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
                head_dim=int(cfg.get("head_dim") or n_embd // n_head),
                n_vocab=int(cfg["vocab_size"]),
                n_ctx=int(cfg.get("max_position_embeddings", 2048)),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(cfg),
                hidden_act=act,
                tied=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise PyinferError(f"config.json lacks {e.args[0]}") from None


def _check_shape(st: SafetensorsDir, name: str, shape: tuple[int, ...], model_dir: str) -> None:
    if name not in st:
        raise PyinferError(f"missing tensor {name} in {model_dir}")
    if st.shape(name) != shape:
        raise PyinferError(f"tensor {name} has shape {st.shape(name)}, config.json implies {shape}")


def plan_hf(model_dir: str, outtype: str) -> tuple[Metadata, list[TensorJob]]:
    """Metadata and tensor jobs for a Hugging Face ``LlamaForCausalLM`` directory.

    Raises PyinferError for a directory without config.json or weights, another architecture,
    an unsupported activation or rope scaling, or tensors whose shapes disagree with config.json.
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
    meta.u32(C.K_FILE_TYPE, FILE_TYPES[outtype])
    if outtype not in ("f32", "f16"):
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
    return meta, jobs
