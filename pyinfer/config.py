"""The model's hyper-parameters, read once from GGUF metadata into a frozen dataclass.

Shaped like gpt-fast's ``ModelArgs``: stored fields come from the file, derived sizes are
computed in ``__post_init__``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gguf

from pyinfer import constants as C
from pyinfer.errors import PyinferError


def read_field(reader: gguf.GGUFReader, key: str, default=None):
    """Return the decoded value of metadata ``key`` (str, number, list), or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family model as pyinfer runs it.

    Sizes are counts (not bytes). ``hidden_act`` is "silu" (SwiGLU FFN) or "relu" (ReLU-gated FFN).
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
        if self.n_head % self.n_head_kv:
            raise PyinferError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        object.__setattr__(self, "n_gqa", self.n_head // self.n_head_kv)
        object.__setattr__(self, "n_embd_q", self.n_head * self.head_dim)
        object.__setattr__(self, "n_embd_kv", self.n_head_kv * self.head_dim)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> "ModelConfig":
        """Build the config from a pyinfer GGUF's metadata.

        Raises PyinferError when the file is not a pyinfer Llama file (wrong architecture, missing
        key, or a llama.cpp file that still needs ``pyinfer-convert``).
        """
        arch = read_field(reader, C.K_ARCH)
        if arch != C.ARCH:
            raise PyinferError(f"unsupported architecture {arch!r} (pyinfer runs '{C.ARCH}')")
        if read_field(reader, C.K_FFN_LAYOUT) != C.FFN_LAYOUT_NEURON_MAJOR:
            raise PyinferError("this GGUF was not written by pyinfer-convert "
                               "(no neuron-major FFN); convert it first: pyinfer-convert SRC out.gguf")

        def need(key):
            v = read_field(reader, key)
            if v is None:
                raise PyinferError(f"GGUF metadata key {key!r} is missing")
            return v

        n_embd = int(need(C.K_EMBEDDING_LENGTH))
        n_head = int(need(C.K_HEAD_COUNT))
        names = {t.name for t in reader.tensors}
        embd = next((t for t in reader.tensors if t.name == C.TOKEN_EMBD), None)
        if embd is None:
            raise PyinferError(f"tensor {C.TOKEN_EMBD} is missing")
        n_vocab = int(read_field(reader, C.K_VOCAB_SIZE, embd.shape[-1]))
        hidden_act = str(read_field(reader, C.K_HIDDEN_ACT, "silu"))
        if hidden_act not in C.HIDDEN_ACTS:
            raise PyinferError(f"unsupported hidden_act {hidden_act!r}")
        return cls(
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=int(need(C.K_BLOCK_COUNT)),
            n_ff=int(need(C.K_FEED_FORWARD_LENGTH)),
            n_head=n_head,
            n_head_kv=int(read_field(reader, C.K_HEAD_COUNT_KV, n_head)),
            head_dim=int(read_field(reader, C.K_ROPE_DIM, n_embd // n_head)),
            n_ctx_train=int(read_field(reader, C.K_CONTEXT_LENGTH, 2048)),
            rope_freq_base=float(read_field(reader, C.K_ROPE_FREQ_BASE, 10000.0)),
            rms_eps=float(read_field(reader, C.K_RMS_EPS, 1e-5)),
            hidden_act=hidden_act,
            tied_embeddings=C.OUTPUT not in names,
            name=str(read_field(reader, C.K_NAME, "")),
        )
