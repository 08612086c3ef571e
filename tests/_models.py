"""Builders of tiny random Hugging Face Llama models (weights + tokenizer) for tests.

``make_random_llama`` writes a directory that looks like a Hugging Face model repository:
config.json, model.safetensors (or shards + index), generation_config.json and, on request, a
tokenizer trained here in a fraction of a second:

- ``tokenizer="bpe"``: a byte-level BPE (``tokenizers``), saved through transformers'
  ``PreTrainedTokenizerFast`` -> tokenizer.json, tokenizer_config.json, chat_template.jinja.
  Special tokens ``<|endoftext|>`` (0, unk/pad), ``<|im_start|>`` (1, bos), ``<|im_end|>`` (2, eos),
  plus one non-special added token ``userword`` (user-defined, type 4). ChatML template.
- ``tokenizer="spm"``: a SentencePiece BPE model with byte fallback -> tokenizer.model, plus the
  tokenizer.json transformers converts from it; ``<unk>`` 0, ``<s>`` 1 (bos, added), ``</s>`` 2 (eos);
  the chat template lives in tokenizer_config.json.
- ``tokenizer=None``: no tokenizer files at all.

Needs torch, transformers, tokenizers and sentencepiece (the test extra). Everything is seeded:
the same arguments give the same files.
"""
from __future__ import annotations

import io
import json
import os
from typing import Optional

#: Text the test tokenizers are trained on: ASCII, digits, punctuation and multi-byte UTF-8.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sparse inference keeps only the hot neurons on the GPU; the cold ones stay on the CPU.",
    "In 2023, PowerInfer ran a 40B model on one consumer GPU at 11x the speed of llama.cpp.",
    "What is the capital of France? The capital of France is Paris.",
    "Héllo wörld! Ça va? Grüße aus Zürich. 日本語のテキスト。 Emoji: 🙂🚀",
    "def forward(self, x):\n    return self.down(relu(self.gate(x)) * self.up(x))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 -42 1e-5",
    "  leading spaces, trailing spaces  , tabs\tand\nnew lines\n\n",
]

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_USER_TOKEN = "userword"  # a non-special added token: token type 4 (user-defined)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}"
    "{{ eos_token }}{% endfor %}"
)


def _corpus(repeat: int = 20) -> list[str]:
    return [f"{line} ({i})" for i in range(repeat) for line in CORPUS]


def make_bpe_tokenizer(model_dir: str, vocab_size: int = 512) -> int:
    """Train a byte-level BPE and save it with transformers into ``model_dir``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_tokens([BPE_USER_TOKEN])
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(model_dir)
    return len(fast)


def make_spm_tokenizer(model_dir: str, vocab_size: int = 400) -> int:
    """Train a SentencePiece BPE (byte fallback) into ``model_dir``/tokenizer.model; returns its size.

    Also writes tokenizer_config.json (bos/eos/unk, add_bos_token, chat_template) and the
    tokenizer.json transformers converts from the model, as Llama-2 style repositories have.
    """
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        hard_vocab_limit=False, num_threads=1)
    os.makedirs(model_dir, exist_ok=True)
    model_path = os.path.join(model_dir, "tokenizer.model")
    with open(model_path, "wb") as f:
        f.write(buf.getvalue())
    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
            "add_eos_token": False, "tokenizer_class": "LlamaTokenizer", "chat_template": SPM_TEMPLATE}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tcfg, f, indent=2)
    try:  # transformers converts tokenizer.model -> tokenizer.json; keep our files as written
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(model_dir)
        hf.backend_tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    except Exception:  # pragma: no cover - an older/newer transformers without the converter
        pass
    return spm.SentencePieceProcessor(model_file=model_path).vocab_size()


def make_random_llama(
    tmpdir: str | os.PathLike,
    hidden_act: str = "silu",
    tied: bool = False,
    n_kv_heads: int = 2,
    tokenizer: Optional[str] = "bpe",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    head_dim: Optional[int] = None,
    vocab_size: Optional[int] = None,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    dtype: str = "float32",
    max_shard_size: Optional[str] = None,
    seed: int = 0,
    name: Optional[str] = None,
) -> str:
    """Write a random ``LlamaForCausalLM`` as a Hugging Face directory under ``tmpdir``; return its path.

    hidden_act: "silu" (SwiGLU) or "relu" (ReGLU, the PowerInfer case). tied: share lm_head with
    the embeddings (no ``lm_head.weight`` saved). n_kv_heads: GQA key/value heads (divides n_heads).
    tokenizer: "bpe", "spm" or None (see the module docstring). vocab_size: embedding rows,
    default the tokenizer's size (256 without a tokenizer); larger values leave ids without a token.
    dtype: "float32", "bfloat16" or "float16" for the saved weights. max_shard_size (e.g. "100KB"):
    save sharded safetensors with model.safetensors.index.json. Norm weights are randomised around
    1 (transformers initialises them to exactly 1, which would hide norm bugs).
    The directory is ``tmpdir/name`` (default: a name built from the arguments).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    name = name or f"llama-{hidden_act}-{'tied' if tied else 'untied'}-kv{n_kv_heads}-{tokenizer or 'notok'}-{dtype}"
    model_dir = os.path.join(os.fspath(tmpdir), name)
    os.makedirs(model_dir, exist_ok=True)
    n_tok = None
    if tokenizer == "bpe":
        n_tok = make_bpe_tokenizer(model_dir)
    elif tokenizer == "spm":
        n_tok = make_spm_tokenizer(model_dir)
    elif tokenizer is not None:
        raise ValueError(f"tokenizer must be 'bpe', 'spm' or None, not {tokenizer!r}")
    if vocab_size is None:
        vocab_size = n_tok or 256
    if n_tok is not None and vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n_tok}")
    bos, eos = (1, 2) if tokenizer else (None, None)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
        head_dim=head_dim or hidden_size // n_heads, hidden_act=hidden_act,
        tie_word_embeddings=tied, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=rope_theta, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=0 if tokenizer == "bpe" else None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(model_dir, **kwargs)
    return model_dir


def load_hf_state_dict(model_dir: str) -> dict:
    """{name: float32 numpy array} of the weights as transformers loads them (tied heads included;
    the class the config names: Llama, or Qwen2 with its biases)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def write_llamacpp_gguf(model_dir: str, out_path: str, qtype: str = "f32",
                        down_qtype: str | None = None, qtype_of=None, arch: str = "llama",
                        extra: dict | None = None) -> None:
    """Write ``model_dir`` (from `make_random_llama`) as llama.cpp's convert_hf_to_gguf.py would.

    Q/K rows permuted for llama.cpp's RoPE (its ``LlamaModel.permute``), ``ffn_down`` untransposed,
    no pyinfer keys; 2-D weights in ``qtype`` (a name of pyinfer.constants.OUTTYPES), ffn_down in
    ``down_qtype`` when given (a mix like llama.cpp's Q4_K_M, whose ffn_down is Q6_K), norms f32. The
    tokenizer keys are copied from a pyinfer conversion of the same directory, so this needs the
    converter (it is a fixture for testing the converter's GGUF path without llama.cpp).
    ``qtype_of(name, (rows, cols))``, when given, picks the type name of each 2-D tensor (None:
    the default above), for a per-tensor mix such as the one llama-quantize writes. ``arch``
    "qwen2": llama.cpp's Qwen2 (keys ``qwen2.*``, Q/K rows as in Hugging Face, q/k/v biases);
    "qwen3": llama.cpp's Qwen3 (keys ``qwen3.*``, Q/K rows as in Hugging Face, attn_q_norm /
    attn_k_norm). ``extra``: more metadata (or metadata written anew), key -> (value,
    gguf.GGUFValueType[, the element type of an array]).
    """
    import tempfile

    import gguf
    import numpy as np

    from convert.cli import convert
    from pyinfer import constants as C

    sd = load_hf_state_dict(model_dir)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w: "np.ndarray", n: int) -> "np.ndarray":  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    with tempfile.TemporaryDirectory() as tmp:  # borrow the tokenizer metadata of our own converter
        ours = os.path.join(tmp, "ours.gguf")
        convert(model_dir, ours, "f32", progress=False)
        reader = gguf.GGUFReader(ours)
        # Llama 3's RoPE divisors: llama.cpp's convert_hf_to_gguf.py stores them as rope_freqs
        rope_freqs = next((np.array(t.data, np.float32) for t in reader.tensors
                           if t.name == C.ROPE_FREQS), None)
        w = gguf.GGUFWriter(out_path, arch)
        for name, field in reader.fields.items():
            if name.startswith("tokenizer.") or name.startswith("llama."):
                v = field.contents()
                if name.startswith("llama."):
                    name = arch + name[len("llama"):]
                if name in (extra or {}):  # (given anew below)
                    continue
                if field.types[0] == gguf.GGUFValueType.ARRAY:
                    w.add_key_value(name, v, field.types[0], field.types[-1])
                else:
                    w.add_key_value(name, v, field.types[0])
        for name, (v, vtype, *sub) in (extra or {}).items():
            w.add_key_value(name, v, vtype, *sub)
        del reader
    from convert.writer import FILE_TYPES

    w.add_file_type(int(FILE_TYPES[qtype]))
    from pyinfer.quants import quantize

    qt = C.OUTTYPES[qtype]

    def add(name: str, arr: "np.ndarray", qt=qt) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype_of is not None and arr.ndim == 2 and qtype_of(name, arr.shape) is not None:
            qt = C.OUTTYPES[qtype_of(name, arr.shape)]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr, qt), raw_dtype=qt)

    add(C.TOKEN_EMBD, sd["model.embed_tokens.weight"])
    if rope_freqs is not None:
        add(C.ROPE_FREQS, rope_freqs)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(C.ATTN_NORM.format(bid=i), sd[p + "input_layernorm.weight"])
        qw, kw = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        neox = arch in ("qwen2", "qwen3")  # llama.cpp's NeoX RoPE: rows as in Hugging Face
        add(C.ATTN_Q.format(bid=i), qw if neox else permute(qw, n_head))
        add(C.ATTN_K.format(bid=i), kw if neox else permute(kw, n_kv))
        if arch == "qwen3":
            add(C.ATTN_Q_NORM.format(bid=i), sd[p + "self_attn.q_norm.weight"])
            add(C.ATTN_K_NORM.format(bid=i), sd[p + "self_attn.k_norm.weight"])
        if arch == "qwen2":
            for name, key in ((C.ATTN_Q_B, "q_proj"), (C.ATTN_K_B, "k_proj"), (C.ATTN_V_B, "v_proj")):
                add(name.format(bid=i), sd[p + f"self_attn.{key}.bias"])
        add(C.ATTN_V.format(bid=i), sd[p + "self_attn.v_proj.weight"])
        add(C.ATTN_OUT.format(bid=i), sd[p + "self_attn.o_proj.weight"])
        add(C.FFN_NORM.format(bid=i), sd[p + "post_attention_layernorm.weight"])
        add(C.FFN_GATE.format(bid=i), sd[p + "mlp.gate_proj.weight"])
        add(C.FFN_UP.format(bid=i), sd[p + "mlp.up_proj.weight"])
        add(C.SRC_FFN_DOWN.format(bid=i), sd[p + "mlp.down_proj.weight"],
            C.OUTTYPES[down_qtype or qtype])
    add(C.OUTPUT_NORM, sd["model.norm.weight"])
    if not cfg.get("tie_word_embeddings", False):
        add(C.OUTPUT, sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert_neuron_major(src: str, out: str, outtype: str = "f32") -> int:
    """Convert ``src`` without the offline stage into the neuron-major layout (``ffn_down_t``, no
    predictors): what ``pyinfer-convert --dense`` wrote before session 9, and the base the tests
    give synthetic predictors or sparse FFNs (--dense now keeps ffn_down in row layout, which the
    sparse FFN cannot read). Returns 0, as ``convert.cli.main`` does on success."""
    from convert.cli import convert

    convert(str(src), str(out), outtype, progress=False)
    return 0
