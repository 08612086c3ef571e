"""Hugging Face Llama directory (config.json + *.safetensors) -> pyinfer tensors and metadata.

Safetensors files are parsed here directly (8-byte header length, JSON header, raw data) and
memory-mapped, so bf16 weights need neither torch nor a copy of the whole file: each tensor is
read and widened to float32 only when the writer asks for it.
Names and layouts follow llama.cpp's ``convert_hf_to_gguf.py`` for ``LlamaForCausalLM``, except that
Q/K keep their Hugging Face row order and ``down_proj`` is stored transposed (design.md), or,
with ``down_rows`` (``pyinfer-convert --dense``), as it is: llama.cpp's ``ffn_down`` (n_embd, n_ff).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from pyinfer import __version__
from pyinfer import constants as C
from pyinfer.config import FamilyTraits
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
        if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            files = ["model.safetensors"]  # transformers' order: the single file before an index
        elif os.path.isfile(index):
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

    def same(self, a: str, b: str, chunk: int = 1 << 24) -> bool:
        """Do tensors ``a`` and ``b`` hold the same values? Compared stored byte for byte when
        their dtypes agree (in 16 MiB slices of the memory maps: no float32 copy of a head of
        a billion values), else as float32."""
        ea, eb = self.entries[a], self.entries[b]
        if ea.shape != eb.shape:
            return False
        if ea.dtype != eb.dtype:
            return bool(np.array_equal(self.load(a), self.load(b)))
        ma = np.memmap(ea.path, dtype=np.uint8, mode="r", offset=ea.offset, shape=(ea.nbytes,))
        mb = np.memmap(eb.path, dtype=np.uint8, mode="r", offset=eb.offset, shape=(eb.nbytes,))
        return all(np.array_equal(ma[i:i + chunk], mb[i:i + chunk]) for i in range(0, ea.nbytes, chunk))

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


def _rope_theta(cfg: dict[str, Any], head_dim: int) -> tuple[float, np.ndarray | None]:
    """(rope_theta, rope_freqs) from a transformers 4 (``rope_theta``/``rope_scaling``) or 5
    (``rope_parameters``) config. rope_freqs: None, or (head_dim/2,) f32 divisors of the default
    inverse frequencies for rope_type "linear" (all = factor) and "llama3" (transformers'
    ``_compute_llama3_parameters``, after Meta's Llama 3.1 reference code); llama.cpp stores
    Llama 3's the same way (``rope_freqs.weight``). Other rope types: PyinferError."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    chosen = None
    for key, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(p, dict):
            raise PyinferError(f"config.json: {key} must be an object, got {p!r}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in (None, "default", "linear", "llama3"):
            raise PyinferError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
        if kind in ("linear", "llama3") and chosen is None:
            chosen = (kind, p)
    # every rope_theta given (either form) must be a number; transformers 5's wins
    top = _cfg_float(cfg, "rope_theta", cfg.get("rope_theta"), 10000.0)
    theta = top
    if "rope_theta" in params:
        theta = _cfg_float(params, "rope_theta", params["rope_theta"], 10000.0)
    if chosen is None:
        return theta, None
    kind, p = chosen
    factor = _cfg_float(p, "factor", p.get("factor"), 1.0)
    half = head_dim // 2
    if kind == "linear":
        return theta, np.full(half, factor, np.float32)
    low = _cfg_float(p, "low_freq_factor", p.get("low_freq_factor"), 1.0)
    high = _cfg_float(p, "high_freq_factor", p.get("high_freq_factor"), 4.0)
    if high <= low:
        raise PyinferError(f"config.json: llama3 rope high_freq_factor {high} must exceed low_freq_factor {low}")
    old_ctx = _cfg_int(p, "original_max_position_embeddings", _cfg_int(cfg, "max_position_embeddings", 8192))
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    scaled = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return theta, (inv_freq / scaled).astype(np.float32)


def _layer_windows(cfg: dict[str, Any], family: str, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    """(sliding_window, per-layer flags): Mistral slides every layer when ``sliding_window`` is
    set; Qwen2 and Qwen3 where ``use_sliding_window`` and the layer index >=
    ``max_window_layers``; a ``layer_types`` list (transformers 5) wins. (0, ()) for full
    attention everywhere."""
    if family not in ("mistral", "qwen2", "qwen3"):
        return 0, ()
    qwen = family in ("qwen2", "qwen3")
    window = cfg.get("sliding_window")
    if qwen and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return 0, ()
    window = _cfg_int(cfg, "sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n_layer:
        flags = tuple(t == "sliding_attention" for t in types)
    elif qwen:
        first = _cfg_int(cfg, "max_window_layers", 28, lo=0)
        flags = tuple(i >= first for i in range(n_layer))
    else:
        flags = (True,) * n_layer
    return (window, flags) if any(flags) else (0, ())


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE bases of a Gemma 3 config: transformers 5's ``rope_parameters``
    {"full_attention": {...}, "sliding_attention": {...}}, or transformers 4's ``rope_theta`` and
    ``rope_local_base_freq``; defaults 1e6 and 1e4 (Gemma3TextConfig.default_theta). Only the
    default rope type: PyinferError for scaling (the 4B+ models scale their global layers only)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        raise PyinferError(f"unsupported: Gemma 3 rope_scaling {scaling!r}")
    if params is None:
        return (_cfg_float(cfg, "rope_theta", cfg.get("rope_theta"), 1e6),
                _cfg_float(cfg, "rope_local_base_freq", cfg.get("rope_local_base_freq"), 1e4))
    if not isinstance(params, dict):
        raise PyinferError(f"config.json: rope_parameters must be an object, got {params!r}")
    bases = []
    for kind, default in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        p = params.get(kind, {})
        if not isinstance(p, dict):
            raise PyinferError(f"config.json: rope_parameters.{kind} must be an object")
        if p.get("rope_type", "default") not in ("default", None):
            raise PyinferError(f"unsupported: Gemma 3 rope_type {p.get('rope_type')!r} for {kind}")
        bases.append(_cfg_float(p, "rope_theta", p.get("rope_theta"), default))
    return bases[0], bases[1]


#: the config.json ``model_type`` of each family (transformers builds the model from it:
#: Gemma 3's text-only checkpoints say gemma3_text, Falcon's first ones RefinedWeb*)
_MODEL_TYPES = {"llama": ("llama",), "mistral": ("mistral",), "qwen2": ("qwen2",),
                "qwen3": ("qwen3",), "opt": ("opt",),
                "falcon": ("falcon", "RefinedWeb", "RefinedWebModel"),
                "gemma3": ("gemma3_text", "gemma3")}


def _family(cfg: Any) -> str:
    """The pyinfer family of a parsed config.json, or PyinferError naming what is supported.
    ``architectures[0]`` names it (or, where the config has none, ``model_type``, as
    transformers' AutoModelForCausalLM reads it); a ``model_type`` of another family is refused
    (transformers would build that family's model: a Llama architecture with model_type
    mistral and a sliding window gave other logits)."""
    if not isinstance(cfg, dict):
        raise PyinferError(f"config.json must be a JSON object, not a {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise PyinferError(f"config.json: model_type must be a name, got {mt!r}")
    by_type = {t: fam for fam, types in _MODEL_TYPES.items() for t in types}
    archs = cfg.get("architectures")
    if not archs and mt in by_type:
        return by_type[mt]
    archs = archs or ["(none)"]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise PyinferError(f"config.json: architectures must be a list of names, got {archs!r}")
    if archs[0] not in C.HF_ARCHITECTURES:
        raise PyinferError(f"unsupported architecture {archs[0]} "
                           f"(supported: {', '.join(C.HF_ARCHITECTURES)})")
    family = C.HF_ARCHITECTURES[archs[0]]
    if mt is not None and mt not in _MODEL_TYPES[family]:
        raise PyinferError(f"config.json: model_type {mt!r} is not {archs[0]}'s "
                           f"({' or '.join(_MODEL_TYPES[family])}): transformers would build a "
                           f"{mt} model from it; fix one of the two")
    return family


def _cfg_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise PyinferError(f"config.json: {key} must be true or false, got {v!r}")
    return v


@dataclass(frozen=True)
class LlamaHParams(FamilyTraits):
    """Hyper-parameters of every family pyinfer converts (named after the one it started with).

    ``FamilyTraits`` (shared with the runtime's ``ModelConfig``) say where a family departs from
    Llama; ``attn_bias`` / ``attn_out_bias`` / ``ffn_bias``: which linear layers carry biases."""

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
    attn_bias: bool = False
    attn_out_bias: bool = False
    ffn_bias: bool = False
    rope_freqs: Any = None  # (head_dim/2,) f32 or None
    falcon_qkv: str = ""  # Falcon's fused QKV layout: "grouped" (new arch), "mqa", "interleaved"
    falcon_norms: int = 0  # Falcon: 2 = ln_attn + ln_mlp, 1 = input_layernorm shared by both

    @classmethod
    def from_config(cls, cfg: Any) -> "LlamaHParams":
        """Hyperparameters from a parsed config.json. Raises PyinferError for an unsupported
        architecture, activation, rope scaling or option, a missing key, or a value of the wrong
        type or range."""
        family = _family(cfg)
        if family == "opt":
            return cls._opt(cfg)
        if family == "falcon":
            return cls._falcon(cfg)
        if family == "gemma3":
            return cls._gemma3(cfg)
        act = cfg.get("hidden_act", "silu")
        if act == "swish":  # transformers' ACT2FN: another name of SiLU
            act = "silu"
        up_act, shift = "", 0.0
        if act == "drelu":  # dReLU (TurboSparse, Bamboo): relu on gate and on up
            act, up_act = "relu", "relu"
        if not isinstance(act, str) or act not in ("silu", "relu", "fatrelu"):
            raise PyinferError(f"unsupported hidden_act {act!r} (pyinfer supports silu, relu, "
                               "drelu, fatrelu for this family)")
        if act == "fatrelu":  # ProSparse / MiniCPM spell the threshold hidden_act_param
            shift = cfg.get("hidden_act_param", 0.0)
            if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not 0 <= shift < 1e30:
                raise PyinferError(f"config.json: hidden_act_param must be a number >= 0, got {shift!r}")
        if cfg.get("mlp_bias"):
            raise PyinferError("unsupported: MLP biases in a gated FFN (mlp_bias)")
        # Llama, Qwen3: attention_bias puts biases on q, k, v and o (Qwen2: q/k/v ones always)
        attn_bias = (_cfg_bool(cfg, "attention_bias", False) if family in ("llama", "qwen3")
                     else False)
        n_embd = _cfg_int(cfg, "hidden_size")
        n_head = _cfg_int(cfg, "num_attention_heads")
        # absent: Qwen3Config's default 128; LlamaConfig / MistralConfig / Qwen2Config derive it
        head_dim = _cfg_int(cfg, "head_dim", 128 if family == "qwen3" else None)
        if head_dim is None:
            if n_embd % n_head:
                raise PyinferError(f"config.json: hidden_size {n_embd} is not a multiple of "
                                   f"num_attention_heads {n_head} (and there is no head_dim)")
            head_dim = n_embd // n_head
        n_head_kv = _cfg_int(cfg, "num_key_value_heads", n_head)
        if n_head % n_head_kv:
            raise PyinferError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                               f"num_key_value_heads {n_head_kv}")
        tied = _cfg_bool(cfg, "tie_word_embeddings", False)
        n_layer = _cfg_int(cfg, "num_hidden_layers")
        theta, freqs = _rope_theta(cfg, head_dim)
        window, flags = _layer_windows(cfg, family, n_layer)
        return cls(
            n_embd=n_embd,
            n_ff=_cfg_int(cfg, "intermediate_size"),
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=_cfg_int(cfg, "vocab_size"),
            n_ctx=_cfg_int(cfg, "max_position_embeddings", 2048),
            rms_eps=_cfg_float(cfg, "rms_norm_eps", cfg.get("rms_norm_eps"), 1e-6),
            rope_theta=theta,
            hidden_act=act,
            tied=tied,
            family=family,
            ffn_up_act=up_act,
            act_shift=float(shift),
            sliding_window=window,
            swa_layers=flags,
            attn_bias=attn_bias or family == "qwen2",  # Qwen2: q/k/v biases, none on o_proj
            attn_out_bias=attn_bias,
            rope_freqs=freqs,
        )

    @classmethod
    def _gemma3(cls, cfg: dict[str, Any]) -> "LlamaHParams":
        """Gemma3ForCausalLM (transformers' modeling_gemma3.py): GeGLU (gelu_pytorch_tanh),
        embeddings times sqrt(hidden_size), q/k RMSNorms, norms after each sublayer too, scores
        scaled by query_pre_attn_scalar^-0.5, sliding-window layers by ``layer_types`` (else
        every ``sliding_window_pattern``-th layer is global) with their own RoPE base, optional
        final logit softcapping. transformers' Gemma3Attention does not apply
        ``attn_logit_softcapping`` (nor does llama.cpp's gemma3): it is ignored here too."""
        if _cfg_bool(cfg, "use_bidirectional_attention", False):
            raise PyinferError("unsupported: Gemma 3 with use_bidirectional_attention (an encoder)")
        if _cfg_bool(cfg, "attention_bias", False):
            raise PyinferError("unsupported: Gemma 3 with attention_bias")
        act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
        acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
                "relu": "relu", "silu": "silu"}
        if not isinstance(act, str) or act not in acts:
            raise PyinferError(f"unsupported Gemma 3 hidden_activation {act!r} ({', '.join(acts)})")
        n_embd = _cfg_int(cfg, "hidden_size")
        n_head = _cfg_int(cfg, "num_attention_heads", 8)
        n_head_kv = _cfg_int(cfg, "num_key_value_heads", n_head)
        if n_head % n_head_kv:
            raise PyinferError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                               f"num_key_value_heads {n_head_kv}")
        head_dim = _cfg_int(cfg, "head_dim", 256)
        n_layer = _cfg_int(cfg, "num_hidden_layers")
        theta, theta_swa = _gemma3_rope(cfg)
        # transformers' Gemma3TextConfig default: without the key the local layers still slide
        # (and take the local RoPE base); a null one transformers cannot run: refused
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            raise PyinferError("config.json: Gemma 3's sliding_window is null (transformers "
                               "cannot run that either); give the window in tokens")
        window = _cfg_int(cfg, "sliding_window", 4096, lo=0)
        types = cfg.get("layer_types")
        if types is not None:
            if not (isinstance(types, list) and len(types) == n_layer and all(
                    t in ("sliding_attention", "full_attention") for t in types)):
                raise PyinferError(f"config.json: layer_types must list {n_layer} of "
                                   "sliding_attention / full_attention")
            flags = tuple(t == "sliding_attention" for t in types)
        else:  # transformers' Gemma3TextConfig: every pattern-th layer is global
            pattern = _cfg_int(cfg, "sliding_window_pattern", 6)
            flags = tuple(bool((i + 1) % pattern) for i in range(n_layer))
        if not window or not any(flags):
            window, flags = 0, ()
        scalar = _cfg_float(cfg, "query_pre_attn_scalar", cfg.get("query_pre_attn_scalar"), 256.0)
        cap = cfg.get("final_logit_softcapping")
        cap = 0.0 if cap is None else _cfg_float(cfg, "final_logit_softcapping", cap, 0.0)
        return cls(n_embd=n_embd, n_ff=_cfg_int(cfg, "intermediate_size"), n_layer=n_layer,
                   n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_vocab=_cfg_int(cfg, "vocab_size"),
                   n_ctx=_cfg_int(cfg, "max_position_embeddings", 131072),
                   rms_eps=_cfg_float(cfg, "rms_norm_eps", cfg.get("rms_norm_eps"), 1e-6),
                   rope_theta=theta, hidden_act=acts[act],
                   tied=_cfg_bool(cfg, "tie_word_embeddings", True), family="gemma3",
                   sliding_window=window, swa_layers=flags,
                   embd_scale=float(np.float32(n_embd ** 0.5)), attn_scale=scalar ** -0.5,
                   final_softcap=cap, rope_freq_base_swa=theta_swa)

    @classmethod
    def _opt(cls, cfg: dict[str, Any]) -> "LlamaHParams":
        """OPTForCausalLM: LayerNorm (eps 1e-5, torch's default), learned positions, a
        non-gated ReLU FFN (fc1, fc2), biases everywhere unless enable_bias is false."""
        if not _cfg_bool(cfg, "do_layer_norm_before", True):
            raise PyinferError("unsupported: OPT with do_layer_norm_before false (opt-350m)")
        n_embd = _cfg_int(cfg, "hidden_size")
        if _cfg_int(cfg, "word_embed_proj_dim", n_embd) != n_embd:
            raise PyinferError("unsupported: OPT with word_embed_proj_dim != hidden_size (opt-350m)")
        if not _cfg_bool(cfg, "layer_norm_elementwise_affine", True):
            raise PyinferError("unsupported: OPT without LayerNorm weights")
        act = cfg.get("activation_function", "relu")
        if act not in ("relu", "gelu"):
            raise PyinferError(f"unsupported OPT activation_function {act!r} (relu, gelu)")
        n_head = _cfg_int(cfg, "num_attention_heads")
        if n_embd % n_head:
            raise PyinferError(f"config.json: hidden_size {n_embd} is not a multiple of "
                               f"num_attention_heads {n_head}")
        bias = _cfg_bool(cfg, "enable_bias", True)
        return cls(n_embd=n_embd, n_ff=_cfg_int(cfg, "ffn_dim"),
                   n_layer=_cfg_int(cfg, "num_hidden_layers"), n_head=n_head, n_head_kv=n_head,
                   head_dim=n_embd // n_head, n_vocab=_cfg_int(cfg, "vocab_size"),
                   n_ctx=_cfg_int(cfg, "max_position_embeddings", 2048), rms_eps=1e-5,
                   rope_theta=10000.0, hidden_act=act,
                   tied=_cfg_bool(cfg, "tie_word_embeddings", True), family="opt", norm="layer",
                   positions="learned", ffn_gated=False, attn_bias=bias, attn_out_bias=bias,
                   ffn_bias=bias)

    @classmethod
    def _falcon(cls, cfg: dict[str, Any]) -> "LlamaHParams":
        """FalconForCausalLM, 7B layout (multi-query, one LayerNorm for a parallel block) and
        40B "new decoder architecture" (grouped KV, ln_attn + ln_mlp): LayerNorm, RoPE, fused QKV
        split at conversion, non-gated GELU/ReLU FFN, biases where ``bias`` is true."""
        if cfg.get("alibi"):
            raise PyinferError("unsupported: Falcon with ALiBi positions (alibi true)")
        n_embd = _cfg_int(cfg, "hidden_size")
        n_head = _cfg_int(cfg, "num_attention_heads")
        if n_embd % n_head:
            raise PyinferError(f"config.json: hidden_size {n_embd} is not a multiple of "
                               f"num_attention_heads {n_head}")
        new_arch = _cfg_bool(cfg, "new_decoder_architecture", False)
        parallel = _cfg_bool(cfg, "parallel_attn", True)
        if new_arch:
            n_head_kv = _cfg_int(cfg, "num_kv_heads", n_head)
            layout = "grouped"
            n_ln = _cfg_int(cfg, "num_ln_in_parallel_attn", 2)
            if n_ln not in (1, 2):
                raise PyinferError(f"config.json: num_ln_in_parallel_attn must be 1 or 2, got {n_ln}")
            if n_ln == 1 and not parallel:
                raise PyinferError("unsupported: Falcon with one LayerNorm and parallel_attn false")
            parallel = True
        elif _cfg_bool(cfg, "multi_query", True):
            n_head_kv, layout, n_ln = 1, "mqa", 1
        else:
            n_head_kv, layout, n_ln = n_head, "interleaved", 1
        if n_head % n_head_kv:
            raise PyinferError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                               f"num_kv_heads {n_head_kv}")
        act = cfg.get("activation", "gelu")
        if act not in ("gelu", "relu"):
            raise PyinferError(f"unsupported Falcon activation {act!r} (gelu, relu)")
        bias = _cfg_bool(cfg, "bias", False)
        theta, freqs = _rope_theta(cfg, n_embd // n_head)
        if freqs is not None:
            raise PyinferError("unsupported: rope scaling in a Falcon model")
        return cls(n_embd=n_embd, n_ff=_cfg_int(cfg, "ffn_hidden_size", 4 * n_embd),
                   n_layer=_cfg_int(cfg, "num_hidden_layers"), n_head=n_head,
                   n_head_kv=n_head_kv, head_dim=n_embd // n_head,
                   n_vocab=_cfg_int(cfg, "vocab_size"),
                   n_ctx=_cfg_int(cfg, "max_position_embeddings", 2048),
                   rms_eps=_cfg_float(cfg, "layer_norm_epsilon", cfg.get("layer_norm_epsilon"), 1e-5),
                   rope_theta=theta, hidden_act=act,
                   tied=_cfg_bool(cfg, "tie_word_embeddings", True), family="falcon",
                   norm="layer", parallel_block=parallel, ffn_gated=False, attn_bias=bias,
                   attn_out_bias=bias, ffn_bias=bias, falcon_qkv=layout,
                   falcon_norms=2 if new_arch and n_ln == 2 else 1)


def _check_shape(st: SafetensorsDir, name: str, shape: tuple[int, ...], model_dir: str) -> None:
    st.used.add(name)
    if name not in st:
        raise PyinferError(f"missing tensor {name} in {model_dir}")
    if st.shape(name) != shape:
        raise PyinferError(f"tensor {name} has shape {st.shape(name)}, config.json implies {shape}")


#: Checkpoint tensors that carry no weights the conversion needs (older transformers saved RoPE's
#: inverse frequencies; llama.cpp's converter skips them too).
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


def _check_all_used(st: SafetensorsDir, used: set[str], hp: LlamaHParams, allow_unused: bool,
                    tied: bool) -> None:
    """Refuse a checkpoint with tensors the conversion leaves out: a config.json whose
    num_hidden_layers is smaller than the checkpoint would otherwise give a truncated model."""
    unused = sorted(n for n in st.entries if n not in used and not n.endswith(_IGNORABLE_SUFFIXES)
                    and not (n == "lm_head.weight" and tied))  # tied: a copy of the embeddings
    if not unused:
        return
    listed = ", ".join(unused[:3]) + (" ..." if len(unused) > 3 else "")
    msg = (f"the checkpoint has {len(unused)} tensor(s) the conversion would leave out ({listed}); "
           f"config.json says num_hidden_layers {hp.n_layer}")
    if not allow_unused:
        raise PyinferError(msg + ": fix config.json, or pass --allow-unused-tensors to convert anyway")
    warn(msg + ": converting anyway (--allow-unused-tensors)")


#: Checkpoint tensor names per family: embeddings, layer prefix, final norm.
_NAMES = {
    "llama": ("model.embed_tokens.weight", "model.layers.{i}.", "model.norm"),
    "opt": ("model.decoder.embed_tokens.weight", "model.decoder.layers.{i}.",
            "model.decoder.final_layer_norm"),
    "falcon": ("transformer.word_embeddings.weight", "transformer.h.{i}.", "transformer.ln_f"),
}


def plan_hf(model_dir: str, outtype: str, allow_unused: bool = False,
            down_rows: bool = False) -> tuple[Metadata, list[TensorJob]]:
    """Metadata and tensor jobs for a Hugging Face directory of a supported architecture
    (``C.HF_ARCHITECTURES``: Llama, Mistral, Qwen2, Qwen3, OPT, Falcon, Gemma 3).

    ``down_rows``: write the down projection as ``ffn_down`` (n_embd, n_ff), the checkpoint's own
    layout (``pyinfer.ffn_layout`` "rows", for a dense file), instead of ``ffn_down_t``.

    Raises PyinferError for a directory without config.json or weights, another architecture,
    an unsupported activation or rope scaling, tensors whose shapes disagree with config.json,
    or (unless ``allow_unused``) tensors the conversion would leave out.
    """
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise PyinferError(f"no config.json in {model_dir}")
    hp = LlamaHParams.from_config(_read_json(cfg_path))
    st = SafetensorsDir(model_dir)

    embd, prefix, final_norm = _NAMES.get(hp.family, _NAMES["llama"])
    _check_shape(st, embd, (hp.n_vocab, hp.n_embd), model_dir)
    tied = hp.tied
    if not tied and "lm_head.weight" not in st:
        warn("tie_word_embeddings is false but there is no lm_head.weight: using the embeddings")
        tied = True
    elif tied and "lm_head.weight" in st and st.shape("lm_head.weight") == st.shape(embd) and \
            not st.same("lm_head.weight", embd):
        # transformers 5 leaves such a pair untied ("both are present in the checkpoints with
        # different values, so we will NOT tie them"): its lm_head is the checkpoint's own
        warn("tie_word_embeddings is true but lm_head.weight differs from the embeddings: using "
             "lm_head.weight, as transformers does")
        tied = False

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
    if hp.norm == "layer":
        meta.f32(C.K_LN_EPS, hp.rms_eps)
        meta.string(C.K_NORM, "layer")
    else:
        meta.f32(C.K_RMS_EPS, hp.rms_eps)
    meta.f32(C.K_ROPE_FREQ_BASE, hp.rope_theta)
    meta.u32(C.K_ROPE_DIM, hp.head_dim)
    meta.u32(C.K_KEY_LENGTH, hp.head_dim)
    meta.u32(C.K_VALUE_LENGTH, hp.head_dim)
    meta.u32(C.K_VOCAB_SIZE, hp.n_vocab)
    meta.string(C.K_PYINFER_VERSION, __version__)
    meta.string(C.K_HIDDEN_ACT, hp.hidden_act)
    meta.string(C.K_FFN_LAYOUT, C.FFN_LAYOUT_ROWS if down_rows else C.FFN_LAYOUT_NEURON_MAJOR)
    meta.string(C.K_ROPE_LAYOUT, C.ROPE_LAYOUT_NEOX)
    meta.string(C.K_SOURCE, os.path.basename(os.path.abspath(model_dir)))
    if hp.family != "llama":
        meta.string(C.K_FAMILY, hp.family)
    if hp.positions != "rope":
        meta.string(C.K_POSITIONS, hp.positions)
    if hp.parallel_block:
        meta.boolean(C.K_PARALLEL_BLOCK, True)
    if not hp.ffn_gated:
        meta.boolean(C.K_FFN_GATED, False)
    if hp.ffn_up_act:
        meta.string(C.K_FFN_UP_ACT, hp.ffn_up_act)
    if hp.hidden_act == "fatrelu":
        meta.f32(C.K_ACT_SHIFT, hp.act_shift)
    if hp.family == "gemma3":
        meta.f32(C.K_EMBD_SCALE, hp.embd_scale)
        meta.f32(C.K_ATTN_SCALE, hp.attn_scale)
        meta.f32(C.K_ROPE_FREQ_BASE_SWA, hp.rope_freq_base_swa)
        if hp.final_softcap:
            meta.f32(C.K_FINAL_SOFTCAP, hp.final_softcap)
    if hp.sliding_window:
        meta.u32(C.K_SLIDING_WINDOW, hp.sliding_window)
        meta.array(C.K_SWA_LAYERS, [int(f) for f in hp.swa_layers], gguf.GGUFValueType.INT32)

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

    def down(i: int, src: str) -> TensorJob:
        """Layer i's down projection from the checkpoint's (n_embd, n_ff) ``src``."""
        if down_rows:
            return mat(C.SRC_FFN_DOWN.format(bid=i), src, (hp.n_embd, hp.n_ff))
        return mat(C.FFN_DOWN_T.format(bid=i), src, (hp.n_ff, hp.n_embd), transpose=True)

    def vec(out_name: str, src: str, n: int, shift: float = 0.0) -> TensorJob:
        _check_shape(st, src, (n,), model_dir)
        return TensorJob(out_name, (n,), C.QT.F32, lambda: st.load(src) + np.float32(shift))

    #: Gemma's RMSNorm computes x * (1 + w): the +1 goes into the stored weight (llama.cpp's
    #: convert_hf_to_gguf.py does the same), so the runtime's RMSNorm is the Llama one
    norm_shift = 1.0 if hp.family == "gemma3" else 0.0

    def norm(out_name: str, src: str, n: int = hp.n_embd) -> list[TensorJob]:
        """A norm's weight, and its bias for LayerNorm (src without .weight/.bias)."""
        jobs = [vec(out_name, src + ".weight", n, norm_shift)]
        if hp.norm == "layer":
            jobs.append(vec(out_name.replace(".weight", ".bias"), src + ".bias", hp.n_embd))
        return jobs

    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    jobs = [mat(C.TOKEN_EMBD, embd, (hp.n_vocab, hp.n_embd))]
    if hp.family == "opt":  # OPT's learned positions start at row 2 (OPTLearnedPositionalEmbedding)
        src = "model.decoder.embed_positions.weight"
        _check_shape(st, src, (hp.n_ctx + 2, hp.n_embd), model_dir)
        jobs.append(TensorJob(C.POS_EMBD, (hp.n_ctx, hp.n_embd),
                              matrix_qtype(hp.n_embd, outtype), lambda: st.load(src)[2:]))
    if hp.rope_freqs is not None:
        freqs = hp.rope_freqs
        jobs.append(TensorJob(C.ROPE_FREQS, (hp.head_dim // 2,), C.QT.F32, lambda: freqs))
    for i in range(hp.n_layer):
        p = prefix.format(i=i)
        if hp.family == "opt":
            jobs += _opt_layer(i, p, hp, mat, vec, norm, down)
        elif hp.family == "falcon":
            jobs += _falcon_layer(i, p, hp, st, model_dir, mat, vec, norm, outtype, down)
        else:
            jobs += norm(C.ATTN_NORM.format(bid=i), p + "input_layernorm")
            for name, proj, rows in ((C.ATTN_Q, "q_proj", q_dim), (C.ATTN_K, "k_proj", kv_dim),
                                     (C.ATTN_V, "v_proj", kv_dim)):
                jobs.append(mat(name.format(bid=i), p + f"self_attn.{proj}.weight", (rows, hp.n_embd)))
                if hp.attn_bias:
                    jobs.append(vec(name.format(bid=i).replace(".weight", ".bias"),
                                    p + f"self_attn.{proj}.bias", rows))
            jobs.append(mat(C.ATTN_OUT.format(bid=i), p + "self_attn.o_proj.weight", (hp.n_embd, q_dim)))
            if hp.attn_out_bias:
                jobs.append(vec(C.ATTN_OUT_B.format(bid=i), p + "self_attn.o_proj.bias", hp.n_embd))
            if hp.family in ("gemma3", "qwen3"):  # per-head RMSNorms of Q and K before RoPE
                jobs += norm(C.ATTN_Q_NORM.format(bid=i), p + "self_attn.q_norm", hp.head_dim)
                jobs += norm(C.ATTN_K_NORM.format(bid=i), p + "self_attn.k_norm", hp.head_dim)
            if hp.family == "gemma3":
                jobs += norm(C.ATTN_POST_NORM.format(bid=i), p + "post_attention_layernorm")
                jobs += norm(C.FFN_NORM.format(bid=i), p + "pre_feedforward_layernorm")
                jobs += norm(C.FFN_POST_NORM.format(bid=i), p + "post_feedforward_layernorm")
            else:
                jobs += norm(C.FFN_NORM.format(bid=i), p + "post_attention_layernorm")
            jobs += [
                mat(C.FFN_GATE.format(bid=i), p + "mlp.gate_proj.weight", (hp.n_ff, hp.n_embd)),
                mat(C.FFN_UP.format(bid=i), p + "mlp.up_proj.weight", (hp.n_ff, hp.n_embd)),
                down(i, p + "mlp.down_proj.weight"),
            ]
    jobs += norm(C.OUTPUT_NORM, final_norm)
    if not tied:
        jobs.append(mat(C.OUTPUT, "lm_head.weight", (hp.n_vocab, hp.n_embd)))
    _check_all_used(st, st.used, hp, allow_unused, tied)
    return meta, jobs


def _opt_layer(i, p, hp, mat, vec, norm, down) -> list[TensorJob]:
    """One OPT decoder layer: attention with biases, fc1 (up) / fc2 (down, ``down``'s layout)."""
    E, F = hp.n_embd, hp.n_ff
    jobs = norm(C.ATTN_NORM.format(bid=i), p + "self_attn_layer_norm")
    for name, bname, proj in ((C.ATTN_Q, C.ATTN_Q_B, "q_proj"), (C.ATTN_K, C.ATTN_K_B, "k_proj"),
                              (C.ATTN_V, C.ATTN_V_B, "v_proj"), (C.ATTN_OUT, C.ATTN_OUT_B, "out_proj")):
        jobs.append(mat(name.format(bid=i), p + f"self_attn.{proj}.weight", (E, E)))
        if hp.attn_bias:
            jobs.append(vec(bname.format(bid=i), p + f"self_attn.{proj}.bias", E))
    jobs += norm(C.FFN_NORM.format(bid=i), p + "final_layer_norm")
    jobs.append(mat(C.FFN_UP.format(bid=i), p + "fc1.weight", (F, E)))
    jobs.append(down(i, p + "fc2.weight"))
    if hp.ffn_bias:
        jobs.append(vec(C.FFN_UP_B.format(bid=i), p + "fc1.bias", F))
        jobs.append(vec(C.FFN_DOWN_B.format(bid=i), p + "fc2.bias", E))
    return jobs


def _falcon_qkv_rows(hp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices of Q, K and V inside Falcon's fused query_key_value weight (FalconAttention.
    _split_heads): "grouped" (new decoder architecture): per KV group, its query heads then one
    K and one V head; "mqa": all query heads, then K, then V; "interleaved": per head q, k, v."""
    hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
    heads = np.arange(hd)
    if hp.falcon_qkv == "grouped":
        per = nh // nkv + 2
        q = [(g * per + j) * hd + heads for g in range(nkv) for j in range(per - 2)]
        k = [(g * per + per - 2) * hd + heads for g in range(nkv)]
        v = [(g * per + per - 1) * hd + heads for g in range(nkv)]
    elif hp.falcon_qkv == "mqa":
        q = [j * hd + heads for j in range(nh)]
        k, v = [nh * hd + heads], [(nh + 1) * hd + heads]
    else:
        q = [(3 * j) * hd + heads for j in range(nh)]
        k = [(3 * j + 1) * hd + heads for j in range(nh)]
        v = [(3 * j + 2) * hd + heads for j in range(nh)]
    return np.concatenate(q), np.concatenate(k), np.concatenate(v)


def _falcon_layer(i, p, hp, st, model_dir, mat, vec, norm, outtype, down) -> list[TensorJob]:
    """One Falcon layer: the fused QKV split into attn_q/k/v rows, dense (attn_output),
    dense_h_to_4h (up) / dense_4h_to_h (down, ``down``'s layout), its LayerNorm(s)."""
    E, F = hp.n_embd, hp.n_ff
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    if hp.falcon_norms == 2:
        jobs = norm(C.ATTN_NORM.format(bid=i), p + "ln_attn")
        jobs += norm(C.FFN_NORM.format(bid=i), p + "ln_mlp")
    elif hp.parallel_block:  # one LayerNorm feeds both halves: written as both norms
        jobs = norm(C.ATTN_NORM.format(bid=i), p + "input_layernorm")
        jobs += norm(C.FFN_NORM.format(bid=i), p + "input_layernorm")
    else:
        jobs = norm(C.ATTN_NORM.format(bid=i), p + "input_layernorm")
        jobs += norm(C.FFN_NORM.format(bid=i), p + "post_attention_layernorm")
    fused = p + "self_attention.query_key_value."
    _check_shape(st, fused + "weight", (q_dim + 2 * kv_dim, E), model_dir)
    rows = _falcon_qkv_rows(hp)
    for name, bname, r in zip((C.ATTN_Q, C.ATTN_K, C.ATTN_V), (C.ATTN_Q_B, C.ATTN_K_B, C.ATTN_V_B),
                              rows):
        jobs.append(TensorJob(name.format(bid=i), (len(r), E), matrix_qtype(E, outtype),
                              lambda r=r: st.load(fused + "weight")[r]))
        if hp.attn_bias:
            _check_shape(st, fused + "bias", (q_dim + 2 * kv_dim,), model_dir)
            jobs.append(TensorJob(bname.format(bid=i), (len(r),), C.QT.F32,
                                  lambda r=r: st.load(fused + "bias")[r]))
    jobs.append(mat(C.ATTN_OUT.format(bid=i), p + "self_attention.dense.weight", (E, q_dim)))
    jobs.append(mat(C.FFN_UP.format(bid=i), p + "mlp.dense_h_to_4h.weight", (F, E)))
    jobs.append(down(i, p + "mlp.dense_4h_to_h.weight"))
    if hp.attn_bias:
        jobs.append(vec(C.ATTN_OUT_B.format(bid=i), p + "self_attention.dense.bias", E))
        jobs.append(vec(C.FFN_UP_B.format(bid=i), p + "mlp.dense_h_to_4h.bias", F))
        jobs.append(vec(C.FFN_DOWN_B.format(bid=i), p + "mlp.dense_4h_to_h.bias", E))
    return jobs
