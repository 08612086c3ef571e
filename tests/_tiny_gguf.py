"""A tiny but complete pyinfer GGUF written with ``gguf.GGUFWriter``, for tests of hostile files.

No torch and no converter: the fuzz test mutates this file hundreds of times, so it must be small
(about 45 KB) and quick to open. It has everything the engine reads: the Llama metadata, a
byte-level BPE vocabulary (256 byte tokens, 3 control tokens, a few merges), every weight type
pyinfer runs (F32 norms, F16 embeddings and output, Q8_0 attention, Q4_0 FFN), a predictor per
layer (fc1 F16, fc2 F32) and the sparse metadata that turns them on.

``tiny_fields`` lists the metadata keys and values, so a test can rewrite one of them
(``write_tiny_gguf(path, overrides={key: value})``) or drop it (value ``None``).
"""
from __future__ import annotations

import gguf
import numpy as np

from pyinfer import constants as C

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_LAYER, RANK = 32, 64, 4, 2, 2, 8
HEAD_DIM = N_EMBD // N_HEAD
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-in for each byte (the same table ``tokenizers`` ByteLevel uses)."""
    from pyinfer.tokenizer import _bytes_to_unicode

    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials first, then 256 bytes, then merged pieces."""
    merges = ["t h", "th e", "Ġ th", "Ġth e", "i n", "a n"]
    tokens = SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in merges]
    n_special = len(SPECIALS)
    types = [C.TOKEN_TYPE_CONTROL] * n_special + [C.TOKEN_TYPE_NORMAL] * (len(tokens) - n_special)
    return tokens, types, merges


def tiny_fields() -> dict[str, tuple[object, VT, VT | None]]:
    """Metadata key -> (value, value type, array element type or None)."""
    tokens, types, merges = tiny_vocab()
    return {
        C.K_NAME: ("tiny", VT.STRING, None),
        C.K_CONTEXT_LENGTH: (64, VT.UINT32, None),
        C.K_EMBEDDING_LENGTH: (N_EMBD, VT.UINT32, None),
        C.K_BLOCK_COUNT: (N_LAYER, VT.UINT32, None),
        C.K_FEED_FORWARD_LENGTH: (N_FF, VT.UINT32, None),
        C.K_HEAD_COUNT: (N_HEAD, VT.UINT32, None),
        C.K_HEAD_COUNT_KV: (N_HEAD_KV, VT.UINT32, None),
        C.K_ROPE_DIM: (HEAD_DIM, VT.UINT32, None),
        C.K_ROPE_FREQ_BASE: (10000.0, VT.FLOAT32, None),
        C.K_RMS_EPS: (1e-5, VT.FLOAT32, None),
        C.K_VOCAB_SIZE: (len(tokens), VT.UINT32, None),
        C.K_HIDDEN_ACT: ("silu", VT.STRING, None),
        C.K_FFN_LAYOUT: (C.FFN_LAYOUT_NEURON_MAJOR, VT.STRING, None),
        C.K_ROPE_LAYOUT: (C.ROPE_LAYOUT_NEOX, VT.STRING, None),
        C.K_TOK_MODEL: ("gpt2", VT.STRING, None),
        C.K_TOK_PRE: ("gpt2", VT.STRING, None),
        C.K_TOK_LIST: (tokens, VT.ARRAY, VT.STRING),
        C.K_TOK_TYPE: (types, VT.ARRAY, VT.INT32),
        C.K_TOK_MERGES: (merges, VT.ARRAY, VT.STRING),
        C.K_TOK_BOS: (1, VT.UINT32, None),
        C.K_TOK_EOS: (2, VT.UINT32, None),
        C.K_TOK_ADD_BOS: (False, VT.BOOL, None),
        C.K_CHAT_TEMPLATE: ("{% for m in messages %}{{ m['content'] }}{% endfor %}", VT.STRING,
                            None),
        C.K_SPARSE_MODE: (C.SPARSE_MODE_CATS, VT.STRING, None),
        C.K_ACT_THRESHOLD: ([0.01] * N_LAYER, VT.ARRAY, VT.FLOAT32),
        C.K_PRED_THRESHOLD: ([0.0] * N_LAYER, VT.ARRAY, VT.FLOAT32),
        C.K_PRED_CPU: ([1] * N_LAYER, VT.ARRAY, VT.INT32),
    }


def tiny_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, QT]]:
    """Tensor name -> (float32 array in numpy order (rows, cols), storage type)."""
    rng = np.random.default_rng(seed)
    n_vocab = len(tiny_vocab()[0])

    def mat(rows, cols, scale=0.2):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {C.TOKEN_EMBD: (mat(n_vocab, N_EMBD, 1.0), QT.F16),
         C.OUTPUT_NORM: (norm(N_EMBD), QT.F32),
         C.OUTPUT: (mat(n_vocab, N_EMBD), QT.F16)}
    for i in range(N_LAYER):
        t[C.ATTN_NORM.format(bid=i)] = (norm(N_EMBD), QT.F32)
        t[C.ATTN_Q.format(bid=i)] = (mat(N_HEAD * HEAD_DIM, N_EMBD), QT.Q8_0)
        t[C.ATTN_K.format(bid=i)] = (mat(N_HEAD_KV * HEAD_DIM, N_EMBD), QT.Q8_0)
        t[C.ATTN_V.format(bid=i)] = (mat(N_HEAD_KV * HEAD_DIM, N_EMBD), QT.Q8_0)
        t[C.ATTN_OUT.format(bid=i)] = (mat(N_EMBD, N_HEAD * HEAD_DIM), QT.Q8_0)
        t[C.FFN_NORM.format(bid=i)] = (norm(N_EMBD), QT.F32)
        t[C.FFN_GATE.format(bid=i)] = (mat(N_FF, N_EMBD), QT.Q4_0)
        t[C.FFN_UP.format(bid=i)] = (mat(N_FF, N_EMBD), QT.Q4_0)
        t[C.FFN_DOWN_T.format(bid=i)] = (mat(N_FF, N_EMBD), QT.Q4_0)
        t[C.FC1.format(bid=i)] = (mat(RANK, N_EMBD), QT.F16)
        t[C.FC2.format(bid=i)] = (mat(N_FF, RANK), QT.F32)
    return t


def _encode(a: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype in (QT.I32, QT.I16, QT.I8):  # integer tensors (act_count, gpu_idx) go in as they are
        return a
    if qtype == QT.F32:
        return a
    if qtype == QT.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)


def write_tiny_gguf(path: str, overrides: dict | None = None, tensors: dict | None = None,
                    seed: int = 0) -> str:
    """Write the tiny model to ``path``; returns path.

    overrides: key -> (value, value type, element type) replacing or adding a metadata field, or
    key -> None dropping it. tensors: name -> (array, type) replacing or adding a tensor, or
    name -> None dropping it; an array of dtype uint8 is written as raw bytes of that type.
    """
    fields = tiny_fields()
    for k, v in (overrides or {}).items():
        if v is None:
            fields.pop(k, None)
        else:
            fields[k] = v
    all_tensors = tiny_tensors(seed)
    for k, v in (tensors or {}).items():
        if v is None:
            all_tensors.pop(k, None)
        else:
            all_tensors[k] = v
    w = gguf.GGUFWriter(path, C.ARCH)
    for key, (value, vtype, sub) in fields.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, (a, qtype) in all_tensors.items():
        data = a if a.dtype == np.uint8 else _encode(a, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
