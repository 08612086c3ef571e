"""The model's hyper-parameters, read once from GGUF metadata into a frozen dataclass.

Shaped like gpt-fast's ``ModelArgs``: stored fields come from the file, derived sizes are
computed in ``__post_init__``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import gguf

from pyinfer import constants as C
from pyinfer.errors import PyinferError

_VT = gguf.GGUFValueType
_INTEGER_TYPES = frozenset({_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32,
                            _VT.UINT64, _VT.INT64})
#: Python kind -> the GGUF value types that may hold it (a float may be stored as an integer).
_TYPES_OF_KIND = {int: _INTEGER_TYPES, float: _INTEGER_TYPES | {_VT.FLOAT32, _VT.FLOAT64},
                  str: frozenset({_VT.STRING}), bool: frozenset({_VT.BOOL})}
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a bool"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "bools"}


def read_field(reader: gguf.GGUFReader, key: str, default=None, kind: type | None = None,
               item: type | None = None):
    """Return the decoded value of metadata ``key`` (str, number, list), or ``default``.

    kind: int, float, str, bool or list: the value must be stored as that (a float may be stored
    as an integer; it is returned as float); item: for ``kind=list``, the kind of its elements.
    Raises PyinferError when the stored type differs, or a string is not UTF-8 (gguf decodes
    strings lazily, on this call).
    """
    f = reader.fields.get(key)
    if f is None:
        return default
    if kind is int and key.endswith(PER_LAYER_KEYS) and list(f.types[:1]) == [_VT.ARRAY]:
        return _uniform(f, key)
    if kind is not None:
        _check_kind(f, key, kind, item)
    try:
        value = f.contents()
    except UnicodeDecodeError:
        raise PyinferError(f"GGUF metadata {key!r} holds a string that is not UTF-8") from None
    if kind is float:
        value = float(value)
    elif kind is list and item is float:
        value = [float(v) for v in value]
    return value


#: keys llama.cpp reads as one number or one per layer (``get_key_or_arr``)
PER_LAYER_KEYS = (".feed_forward_length", ".attention.head_count", ".attention.head_count_kv")


def _uniform(f, key: str) -> int:
    """A per-layer array's one value (every layer the same: what pyinfer computes); PyinferError
    for values that differ by layer or are not integers."""
    if len(f.types) < 2 or f.types[-1] not in _TYPES_OF_KIND[int]:
        raise PyinferError(f"GGUF metadata {key!r} is an array of non-integers")
    values = [int(v) for v in f.contents()]
    if not values or any(v != values[0] for v in values):
        raise PyinferError(f"GGUF metadata {key!r} differs from layer to layer ({values[:8]}"
                           f"{' ...' if len(values) > 8 else ''}): not supported")
    return values[0]


def refuse_unsupported_kind(reader) -> None:
    """PyinferError, saying what it is, for a GGUF that is one part of a gguf-split set (its
    tensors spread over several files: runs failed on a "missing" tensor) or a mixture of experts
    (Mixtral-style ``*_exps`` tensors: the error suggested converting it, which failed too)."""
    n_split = read_field(reader, "split.count", 0, kind=int) or 0
    if n_split > 1:
        part = read_field(reader, "split.no", 0, kind=int) or 0
        raise PyinferError(f"this GGUF is part {part + 1} of {n_split} of a split model "
                           "(gguf-split): merge the parts into one file first "
                           "(llama-gguf-split --merge FIRST-PART OUT.gguf)")
    arch = read_field(reader, "general.architecture")
    experts = read_field(reader, f"{arch}.expert_count", 0) if isinstance(arch, str) else 0
    if (isinstance(experts, int) and experts > 0) or any(
            t.name.endswith(("_exps.weight", "_exps.bias")) for t in reader.tensors):
        raise PyinferError(f"mixture-of-experts models ({experts or 'several'} experts a layer) "
                           "are not supported")


def _check_kind(f, key: str, kind: type, item: type | None):
    types = list(f.types)
    stored = " of ".join(_VT(t).name for t in types) if types else "empty"
    if kind is list:
        ok = bool(types) and types[0] == _VT.ARRAY and (
            item is None or len(types) == 1 or types[-1] in _TYPES_OF_KIND[item])
        want = "an array" + (f" of {_PLURALS[item]}" if item is not None else "")
    else:
        ok = len(types) == 1 and types[0] in _TYPES_OF_KIND[kind]
        want = _KIND_NAMES[kind]
    if not ok:
        raise PyinferError(f"GGUF metadata {key!r} is stored as {stored}, expected {want}")


@dataclass(frozen=True, kw_only=True)
class FamilyTraits:
    """Where a model family departs from Llama: the fields pyinfer's converter (``convert.hf``'s
    ``LlamaHParams``) and runtime (``ModelConfig``) share, with Llama's values as defaults.

    ``norm``: "rms" or "layer" (LayerNorm). ``positions``: "rope" or "learned" (position_embd
    rows, OPT). ``parallel_block``: x + attn(norm(x)) + ffn(norm2(x)) (Falcon). ``ffn_gated``
    False: down(act(up h + b)) + b (OPT, Falcon). ``ffn_up_act`` "relu": relu on up too (dReLU).
    ``act_shift``: fatrelu's threshold (ProSparse). ``sliding_window`` W > 0: a query at position p
    sees keys at p-W+1..p in the layers where ``swa_layers`` is set (transformers' ``kv_idx >
    q_idx - sliding_window``). Gemma 3: ``embd_scale`` multiplies the token embeddings
    (sqrt(n_embd)); ``attn_scale`` is the attention score scale (0: head_dim^-0.5; Gemma:
    query_pre_attn_scalar^-0.5); ``final_softcap`` c > 0 gives logits c * tanh(logits / c);
    ``rope_freq_base_swa`` (0: rope_freq_base) is the RoPE base of the sliding-window layers.
    """

    family: str = "llama"
    norm: str = "rms"
    positions: str = "rope"
    parallel_block: bool = False
    ffn_gated: bool = True
    ffn_up_act: str = ""
    act_shift: float = 0.0
    sliding_window: int = 0
    swa_layers: tuple = ()  # (n_layer,) bools; () = every layer when sliding_window > 0
    embd_scale: float = 1.0
    attn_scale: float = 0.0
    final_softcap: float = 0.0
    rope_freq_base_swa: float = 0.0


@dataclass(frozen=True)
class ModelConfig(FamilyTraits):
    """Hyper-parameters of a decoder-only model as pyinfer runs it: Llama's, and the
    ``FamilyTraits`` of the families that depart from it.

    Sizes are counts (not bytes). ``hidden_act``: "silu" (SwiGLU), "relu" (ReGLU, or dReLU when
    ``ffn_up_act`` is "relu"), "gelu" (exact, erf) or "fatrelu" (g if g > act_shift else 0,
    ProSparse). ``rms_eps`` is the epsilon of the model's norm, RMSNorm or (``norm`` "layer")
    LayerNorm. Gemma 3's q/k and post-sublayer norms live in the weights.
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float
    hidden_act: str
    tied_embeddings: bool
    name: str = ""
    n_gqa: int = field(init=False)  # query heads per KV head
    n_embd_q: int = field(init=False)  # n_head * head_dim
    n_embd_kv: int = field(init=False)  # n_head_kv * head_dim

    def __post_init__(self):
        for name in ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim",
                     "n_ctx_train"):
            if getattr(self, name) < 1:
                raise PyinferError(f"{name} is {getattr(self, name)}; it must be at least 1")
        if self.head_dim % 2:  # RoPE rotates pairs of dimensions
            raise PyinferError(f"head_dim {self.head_dim} is odd")
        if not (math.isfinite(self.rope_freq_base) and self.rope_freq_base > 0):
            raise PyinferError(f"rope_freq_base {self.rope_freq_base} is not a positive number")
        if not (math.isfinite(self.rms_eps) and self.rms_eps >= 0):
            raise PyinferError(f"rms_eps {self.rms_eps} is not a non-negative number")
        if self.n_head % self.n_head_kv:
            raise PyinferError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.norm not in ("rms", "layer"):
            raise PyinferError(f"unsupported norm {self.norm!r} (rms or layer)")
        if self.positions not in ("rope", "learned"):
            raise PyinferError(f"unsupported positions {self.positions!r} (rope or learned)")
        if self.ffn_up_act not in ("", "relu"):
            raise PyinferError(f"unsupported ffn_up_act {self.ffn_up_act!r}")
        if self.ffn_up_act and not self.ffn_gated:
            raise PyinferError("ffn_up_act needs a gated FFN")
        if not (math.isfinite(self.act_shift) and self.act_shift >= 0):
            raise PyinferError(f"act_shift {self.act_shift} is not a non-negative number")
        if self.sliding_window < 0:
            raise PyinferError(f"sliding_window {self.sliding_window} is negative")
        if self.swa_layers and len(self.swa_layers) != self.n_layer:
            raise PyinferError(f"{len(self.swa_layers)} sliding-window flags for {self.n_layer} layers")
        for name in ("embd_scale", "attn_scale", "final_softcap", "rope_freq_base_swa"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise PyinferError(f"{name} {v} is not a non-negative number")
        object.__setattr__(self, "n_gqa", self.n_head // self.n_head_kv)
        object.__setattr__(self, "n_embd_q", self.n_head * self.head_dim)
        object.__setattr__(self, "n_embd_kv", self.n_head_kv * self.head_dim)

    @property
    def llama_plain(self) -> bool:
        """True where the fused Llama kernels (cpu.decode_attn / decode_ffn) and the GPU engine
        compute this model: RMSNorm, RoPE, sequential block, gated silu/relu FFN, full attention
        (biases and RoPE frequency factors live in the weights: see ModelWeights.llama_plain)."""
        return (self.norm == "rms" and self.positions == "rope" and not self.parallel_block
                and self.ffn_gated and not self.ffn_up_act and self.hidden_act in ("silu", "relu")
                and not any(self.window(i) for i in range(self.n_layer))
                and self.embd_scale == 1.0 and not self.attn_scale and not self.final_softcap)

    def window(self, layer: int) -> int:
        """Sliding window of ``layer`` in tokens, 0 for full causal attention."""
        if not self.sliding_window or (self.swa_layers and not self.swa_layers[layer]):
            return 0
        return self.sliding_window

    def rope_base(self, layer: int) -> float:
        """RoPE frequency base of ``layer`` (Gemma 3's sliding layers have their own)."""
        if self.rope_freq_base_swa and self.window(layer):
            return self.rope_freq_base_swa
        return self.rope_freq_base

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, llamacpp: bool = False) -> "ModelConfig":
        """Build the config from a pyinfer GGUF's metadata (``llamacpp``: from a llama.cpp file
        run as it is, see ``pyinfer.llamacpp``; pyinfer's own keys then take their defaults).

        Raises PyinferError when the file is not a pyinfer Llama file (wrong architecture, missing
        key, or, without ``llamacpp``, a llama.cpp file).
        """
        arch = read_field(reader, C.K_ARCH)
        refuse_unsupported_kind(reader)
        if arch != C.ARCH and not (llamacpp and arch in C.LLAMACPP_RUN_ARCHS):
            hint = "; pyinfer-convert SRC out.gguf converts it" if arch == "gemma3" else ""
            raise PyinferError(f"unsupported architecture {arch!r} (pyinfer runs '{C.ARCH}' files, "
                               f"llama.cpp's llama, qwen2 and qwen3 ones as they are{hint})")
        layout = read_field(reader, C.K_FFN_LAYOUT)
        if not llamacpp and layout not in C.FFN_LAYOUTS:
            raise PyinferError("this GGUF was not written by pyinfer-convert "
                               f"({C.K_FFN_LAYOUT} is {layout!r}, not one of "
                               f"{', '.join(C.FFN_LAYOUTS)}); convert it first: "
                               "pyinfer-convert SRC out.gguf")

        def need(key, kind=int):
            v = read_field(reader, key, kind=kind)
            if v is None:
                raise PyinferError(f"GGUF metadata key {key!r} is missing")
            return v

        def get(key, default, kind=int):
            return read_field(reader, key, default, kind=kind)

        n_embd = need(C.K_EMBEDDING_LENGTH)
        n_head = need(C.K_HEAD_COUNT)
        if n_head <= 0:
            raise PyinferError(f"{C.K_HEAD_COUNT} is {n_head}; it must be at least 1")
        names = {t.name for t in reader.tensors}
        embd = next((t for t in reader.tensors if t.name == C.TOKEN_EMBD), None)
        if embd is None:
            raise PyinferError(f"tensor {C.TOKEN_EMBD} is missing")
        hidden_act = get(C.K_HIDDEN_ACT, "silu", str)
        if hidden_act not in C.HIDDEN_ACTS:
            raise PyinferError(f"unsupported hidden_act {hidden_act!r}")
        norm = get(C.K_NORM, "rms", str)
        swa = read_field(reader, C.K_SWA_LAYERS, None, kind=list, item=int)
        return cls(
            # (a llama.cpp file: its embedding rows, as llama.cpp sizes the model by its tokens
            # and reads vocab_size only to name the model type; a file whose key disagreed was
            # refused, though llama.cpp runs it)
            n_vocab=int(embd.shape[-1]) if llamacpp else get(C.K_VOCAB_SIZE, int(embd.shape[-1])),
            n_embd=n_embd,
            n_layer=need(C.K_BLOCK_COUNT),
            n_ff=need(C.K_FEED_FORWARD_LENGTH),
            n_head=n_head,
            n_head_kv=get(C.K_HEAD_COUNT_KV, n_head),
            head_dim=get(C.K_ROPE_DIM, n_embd // n_head),
            n_ctx_train=get(C.K_CONTEXT_LENGTH, 2048),
            rope_freq_base=get(C.K_ROPE_FREQ_BASE, 10000.0, float),
            rms_eps=(get(C.K_LN_EPS, 1e-5, float) if norm == "layer"
                     else get(C.K_RMS_EPS, 1e-5, float)),
            hidden_act=hidden_act,
            tied_embeddings=C.OUTPUT not in names,
            name=get(C.K_NAME, "", str),
            family=get(C.K_FAMILY, "llama", str),
            norm=norm,
            positions=get(C.K_POSITIONS, "rope", str),
            parallel_block=get(C.K_PARALLEL_BLOCK, False, bool),
            ffn_gated=get(C.K_FFN_GATED, True, bool),
            ffn_up_act=get(C.K_FFN_UP_ACT, "", str),
            act_shift=get(C.K_ACT_SHIFT, 0.0, float),
            sliding_window=get(C.K_SLIDING_WINDOW, 0),
            swa_layers=tuple(bool(v) for v in swa) if swa is not None else (),
            embd_scale=get(C.K_EMBD_SCALE, 1.0, float),
            attn_scale=get(C.K_ATTN_SCALE, 0.0, float),
            final_softcap=get(C.K_FINAL_SOFTCAP, 0.0, float),
            rope_freq_base_swa=get(C.K_ROPE_FREQ_BASE_SWA, 0.0, float),
        )
