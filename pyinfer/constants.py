"""GGUF key and tensor-name templates, quant block sizes and architectures.

This is the only module that spells a tensor name or a metadata key (gguf-py keeps its
``Keys`` / ``TENSOR_NAMES`` the same way in ``gguf/constants.py``). Standard llama.cpp keys
come from ``gguf.Keys``; pyinfer's own keys live under the ``pyinfer.`` prefix.
"""
from __future__ import annotations

import gguf

GGUF_VERSION = 3
ARCH = "llama"  # the only GGUF architecture pyinfer writes and reads
#: Hugging Face architectures pyinfer-convert takes -> the family name stored in K_FAMILY.
#: Every family is written as GGUF architecture ``llama`` (pyinfer's own neuron-major layout) with
#: the keys and tensors below describing where it departs from Llama.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "OPTForCausalLM": "opt",
                    "FalconForCausalLM": "falcon", "Gemma3ForCausalLM": "gemma3"}
#: llama.cpp architectures besides ``llama`` that pyinfer runs as they are (pyinfer.llamacpp)
LLAMACPP_RUN_ARCHS = ("qwen2", "qwen3")
#: FFN activations: silu (SwiGLU), relu (ReGLU; also dReLU with K_FFN_UP_ACT), gelu (exact, erf),
#: fatrelu (ProSparse's shifted ReLU: g if g > K_ACT_SHIFT else 0), gelu_tanh (GeGLU with the
#: tanh approximation, Gemma's gelu_pytorch_tanh).
HIDDEN_ACTS = ("silu", "relu", "gelu", "fatrelu", "gelu_tanh")

# ---- weight types -------------------------------------------------------------------------
QT = gguf.GGMLQuantizationType
#: pyinfer-convert --outtype names -> the type of the 2-D weights (all run natively by the kernels)
OUTTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0,
            "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K,
            "q6_k": QT.Q6_K}
#: --outtype auto: a quantized GGUF source keeps each tensor's type, float sources become f16
OUTTYPE_AUTO = "auto"
#: (elements per block, bytes per block), as ggml defines them (ggml-common.h).
QK_BLOCK = {t: gguf.GGML_QUANT_SIZES[t] for t in OUTTYPES.values()}
#: a K-quant row whose length is not a multiple of 256 gets the type llama.cpp falls back to
#: (llama-quant.cpp, "using fallback quantization"); f16 when that does not fit either
K_QUANT_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}

# ---- metadata keys --------------------------------------------------------------------------
K_ARCH = gguf.Keys.General.ARCHITECTURE
K_NAME = gguf.Keys.General.NAME
K_FILE_TYPE = gguf.Keys.General.FILE_TYPE
K_CONTEXT_LENGTH = gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=ARCH)
K_EMBEDDING_LENGTH = gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=ARCH)
K_BLOCK_COUNT = gguf.Keys.LLM.BLOCK_COUNT.format(arch=ARCH)
K_FEED_FORWARD_LENGTH = gguf.Keys.LLM.FEED_FORWARD_LENGTH.format(arch=ARCH)
K_VOCAB_SIZE = gguf.Keys.LLM.VOCAB_SIZE.format(arch=ARCH)
K_HEAD_COUNT = gguf.Keys.Attention.HEAD_COUNT.format(arch=ARCH)
K_HEAD_COUNT_KV = gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=ARCH)
K_RMS_EPS = gguf.Keys.Attention.LAYERNORM_RMS_EPS.format(arch=ARCH)
K_ROPE_FREQ_BASE = gguf.Keys.Rope.FREQ_BASE.format(arch=ARCH)
K_ROPE_DIM = gguf.Keys.Rope.DIMENSION_COUNT.format(arch=ARCH)

# pyinfer's own keys
K_PYINFER_VERSION = "pyinfer.version"
K_HIDDEN_ACT = "pyinfer.hidden_act"  # "silu" | "relu"
K_FFN_LAYOUT = "pyinfer.ffn_layout"  # how a pyinfer file stores the down projection:
FFN_LAYOUT_NEURON_MAJOR = "neuron_major"  # ffn_down_t (n_ff, n_embd): sparse decoding sums its rows
# ffn_down (n_embd, n_ff) as llama.cpp stores it: `pyinfer-convert --dense` files, whose dense
# down projection is a GEMV over these rows (faster than the AXPY over ffn_down_t, issue 11)
FFN_LAYOUT_ROWS = "rows"
FFN_LAYOUTS = (FFN_LAYOUT_NEURON_MAJOR, FFN_LAYOUT_ROWS)
K_ROPE_LAYOUT = "pyinfer.rope_layout"  # "neox": Q/K rows in Hugging Face order (rotate_half)
ROPE_LAYOUT_NEOX = "neox"
K_FAMILY = "pyinfer.family"  # HF family the file came from (a value of HF_ARCHITECTURES)
K_NORM = "pyinfer.norm"  # "rms" (default) | "layer" (LayerNorm with bias, eps in K_LN_EPS)
K_LN_EPS = gguf.Keys.Attention.LAYERNORM_EPS.format(arch=ARCH)
K_POSITIONS = "pyinfer.positions"  # "rope" (default) | "learned" (position_embd.weight)
K_PARALLEL_BLOCK = "pyinfer.parallel_block"  # bool: x + attn(norm(x)) + ffn(norm2(x)) (Falcon)
K_FFN_GATED = "pyinfer.ffn_gated"  # bool, default true; false: act(up h + b) down (OPT, Falcon)
K_FFN_UP_ACT = "pyinfer.ffn_up_act"  # "relu": dReLU, relu(gate h) * relu(up h) (TurboSparse)
K_ACT_SHIFT = "pyinfer.act_shift"  # f32 threshold of hidden_act "fatrelu" (ProSparse), >= 0
K_SLIDING_WINDOW = gguf.Keys.Attention.SLIDING_WINDOW.format(arch=ARCH)  # keys kept: pos-i < W
K_SWA_LAYERS = "pyinfer.attention.swa_layers"  # i32[n_layer] 1 = sliding window (absent: all)
# Gemma 3 (llama.cpp's key names where llama.cpp has one)
K_EMBD_SCALE = "pyinfer.embedding_scale"  # f32: token embeddings times this (Gemma: sqrt(n_embd))
K_ATTN_SCALE = gguf.Keys.Attention.SCALE.format(arch=ARCH)  # f32 score scale (absent: head_dim^-0.5)
K_FINAL_SOFTCAP = gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=ARCH)  # cap * tanh(logit / cap)
K_ROPE_FREQ_BASE_SWA = gguf.Keys.Rope.FREQ_BASE_SWA.format(arch=ARCH)  # RoPE base of sliding layers
K_SWA_PATTERN_SRC = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=ARCH)  # read, not written
K_SOURCE = "pyinfer.source"  # where the weights came from (HF dir name or GGUF file name)
K_HF_TOKENIZER_JSON = "pyinfer.tokenizer.huggingface_json"  # verbatim tokenizer.json, if any

# tokenizer keys (llama.cpp's spelling)
K_TOK_MODEL = gguf.Keys.Tokenizer.MODEL
K_TOK_PRE = gguf.Keys.Tokenizer.PRE
K_TOK_LIST = gguf.Keys.Tokenizer.LIST
K_TOK_TYPE = gguf.Keys.Tokenizer.TOKEN_TYPE
K_TOK_SCORES = gguf.Keys.Tokenizer.SCORES
K_TOK_MERGES = gguf.Keys.Tokenizer.MERGES
K_TOK_BOS = gguf.Keys.Tokenizer.BOS_ID
K_TOK_EOS = gguf.Keys.Tokenizer.EOS_ID
K_TOK_UNK = gguf.Keys.Tokenizer.UNK_ID
K_TOK_PAD = gguf.Keys.Tokenizer.PAD_ID
K_TOK_EOT = gguf.Keys.Tokenizer.EOT_ID
K_TOK_EOM = gguf.Keys.Tokenizer.EOM_ID
K_TOK_FIM_PAD = gguf.Keys.Tokenizer.FIM_PAD_ID
K_TOK_FIM_REP = gguf.Keys.Tokenizer.FIM_REP_ID
K_TOK_FIM_SEP = gguf.Keys.Tokenizer.FIM_SEP_ID
K_TOK_ADD_BOS = gguf.Keys.Tokenizer.ADD_BOS
K_TOK_ADD_EOS = gguf.Keys.Tokenizer.ADD_EOS
K_TOK_ADD_SPACE_PREFIX = gguf.Keys.Tokenizer.ADD_PREFIX
K_CHAT_TEMPLATE = gguf.Keys.Tokenizer.CHAT_TEMPLATE

# ---- tensor names (llama.cpp spelling; ffn_down_t, fc1/fc2, gpu_* are PowerInfer's) --------
TOKEN_EMBD = "token_embd.weight"  # (n_vocab, n_embd)
OUTPUT_NORM = "output_norm.weight"  # (n_embd,)
OUTPUT = "output.weight"  # (n_vocab, n_embd); absent when embeddings are tied
ATTN_NORM = "blk.{bid}.attn_norm.weight"  # (n_embd,)
ATTN_Q = "blk.{bid}.attn_q.weight"  # (n_head * head_dim, n_embd), HF row order
ATTN_K = "blk.{bid}.attn_k.weight"  # (n_head_kv * head_dim, n_embd), HF row order
ATTN_V = "blk.{bid}.attn_v.weight"  # (n_head_kv * head_dim, n_embd)
ATTN_OUT = "blk.{bid}.attn_output.weight"  # (n_embd, n_head * head_dim)
FFN_NORM = "blk.{bid}.ffn_norm.weight"  # (n_embd,)
FFN_GATE = "blk.{bid}.ffn_gate.weight"  # (n_ff, n_embd): one row per neuron
FFN_UP = "blk.{bid}.ffn_up.weight"  # (n_ff, n_embd): one row per neuron
FFN_DOWN_T = "blk.{bid}.ffn_down_t.weight"  # (n_ff, n_embd): ffn_down transposed
# input sparsity (sparse mode "input"): matrices stored transposed, one row per input channel
ATTN_QKV_T = "blk.{bid}.attn_qkv_t.weight"  # (n_embd, n_embd_q + 2 n_embd_kv): [wq; wk; wv]^T
ATTN_OUT_T = "blk.{bid}.attn_output_t.weight"  # (n_embd_q, n_embd): attn_output transposed
FFN_GATE_UP_T = "blk.{bid}.ffn_gate_up_t.weight"  # (n_embd, 2 n_ff): [ffn_gate; ffn_up]^T
# the same four matrices in the input-block layout (cython/ibsum.h) where the type is q8_0, q4_0 or
# q4_1: stored as Q8_0 / Q4_0 / Q4_1 of shape (n_in / 32, 32 n_out) (numpy order), one row per 32
# input channels holding the row-major matrix's scales and values regrouped (pyinfer.ops.cpu.IBTensor)
IB = {"attn_qkv": "blk.{bid}.attn_qkv_ib.weight", "attn_output": "blk.{bid}.attn_output_ib.weight",
      "ffn_gate_up": "blk.{bid}.ffn_gate_up_ib.weight", "ffn_down": "blk.{bid}.ffn_down_ib.weight"}
# the lm head under input sparsity (q8_0 / q4_0 / q4_1 / q5_0 / q5_1, n_vocab a multiple of 64):
# the output matrix in the input-block layout cut into chunks of K_LM_HEAD_CHUNK outputs
# (pyinfer.ops.cpu.IBChunks), stored as Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 of shape
# (n_embd / 32, 32 n_vocab); token_embd stays for the embedding lookup
OUTPUT_IB = "output_ib.weight"
OUTPUT_IN_SCALE = "output.in_scale"  # (n_embd,) f32 column norms of the lm head (WINA files)
#: per input channel column norms of each group's matrix (WINA's score |x_j| * ||W[:, j]||), f32
IN_SCALE = {"attn_qkv": "blk.{bid}.attn_qkv_t.in_scale", "attn_output": "blk.{bid}.attn_output_t.in_scale",
            "ffn_gate_up": "blk.{bid}.ffn_gate_up_t.in_scale", "ffn_down": "blk.{bid}.ffn_down_t.in_scale"}
# optional tensors of the non-Llama families (llama.cpp spelling)
POS_EMBD = "position_embd.weight"  # (n_ctx_train, n_embd): learned positions (OPT, offset removed)
ROPE_FREQS = "rope_freqs.weight"  # (head_dim/2,) f32: divisors of RoPE's frequencies (llama3, linear)
OUTPUT_NORM_B = "output_norm.bias"  # (n_embd,)
ATTN_NORM_B = "blk.{bid}.attn_norm.bias"  # (n_embd,)
FFN_NORM_B = "blk.{bid}.ffn_norm.bias"  # (n_embd,)
ATTN_Q_B = "blk.{bid}.attn_q.bias"  # (n_head * head_dim,)
ATTN_K_B = "blk.{bid}.attn_k.bias"  # (n_head_kv * head_dim,)
ATTN_V_B = "blk.{bid}.attn_v.bias"  # (n_head_kv * head_dim,)
ATTN_OUT_B = "blk.{bid}.attn_output.bias"  # (n_embd,)
FFN_UP_B = "blk.{bid}.ffn_up.bias"  # (n_ff,): one per neuron
FFN_DOWN_B = "blk.{bid}.ffn_down.bias"  # (n_embd,)
# Gemma 3: RMSNorm weights stored with Gemma's +1 already added (as llama.cpp stores them)
ATTN_Q_NORM = "blk.{bid}.attn_q_norm.weight"  # (head_dim,) per-head RMSNorm of Q, before RoPE
ATTN_K_NORM = "blk.{bid}.attn_k_norm.weight"  # (head_dim,)
ATTN_POST_NORM = "blk.{bid}.post_attention_norm.weight"  # (n_embd,) on the attention output
FFN_POST_NORM = "blk.{bid}.post_ffw_norm.weight"  # (n_embd,) on the FFN output
FC1 = "blk.{bid}.fc1.weight"  # (rank, n_embd) predictor
FC2 = "blk.{bid}.fc2.weight"  # (n_ff, rank) predictor
GPU_IDX = "blk.{bid}.gpu_idx"  # (n_ff,) I32 0/1 mask
GPU_BUCKET = "blk.{bid}.gpu_bucket"  # (n_hot,) I32 sorted hot neuron ids
ACT_COUNT = "blk.{bid}.act_count"  # (n_ff,) I32 per-neuron activation counts (profiler)

# llama.cpp's source-file tensor name we un-transpose from
SRC_FFN_DOWN = "blk.{bid}.ffn_down.weight"  # (n_embd, n_ff)

# ---- appended by convert/ ---------------------------------------------------------------------
K_KEY_LENGTH = gguf.Keys.Attention.KEY_LENGTH.format(arch=ARCH)  # head_dim of K (written always)
K_VALUE_LENGTH = gguf.Keys.Attention.VALUE_LENGTH.format(arch=ARCH)  # head_dim of V (written always)
K_ROPE_SCALING_TYPE = gguf.Keys.Rope.SCALING_TYPE.format(arch=ARCH)  # read from sources: none or linear
K_ROPE_SCALING_FACTOR = gguf.Keys.Rope.SCALING_FACTOR.format(arch=ARCH)  # a source's linear factor
K_ROPE_SCALE_LINEAR = f"{ARCH}.rope.scale_linear"  # its older spelling (llama.cpp LLM_KV_ROPE_SCALE_LINEAR)
K_TOK_SEP = gguf.Keys.Tokenizer.SEP_ID
K_TOK_PREFIX = "tokenizer.ggml."  # every llama.cpp tokenizer key starts with this
K_CHAT_TEMPLATE_PREFIX = "tokenizer.chat_template"  # also matches named templates (.tool_use, ...)
# SentencePiece / llama.cpp token types (gguf.TokenType)
TOKEN_TYPE_NORMAL = int(gguf.TokenType.NORMAL)  # 1
TOKEN_TYPE_UNKNOWN = int(gguf.TokenType.UNKNOWN)  # 2
TOKEN_TYPE_CONTROL = int(gguf.TokenType.CONTROL)  # 3
TOKEN_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)  # 4
TOKEN_TYPE_UNUSED = int(gguf.TokenType.UNUSED)  # 5
TOKEN_TYPE_BYTE = int(gguf.TokenType.BYTE)  # 6

# ---- the offline stage's metadata (pyinfer's own keys) -----------------------------------
K_SPARSE_MODE = "pyinfer.sparse.mode"  # "relu" | "cats" (|act(gate)|) | "glu" (|act(gate)*up|) | "input"
K_ACT_THRESHOLD = "pyinfer.sparse.act_threshold"  # f32[n_layer]: CATS threshold on |act(gate)|
K_PRED_THRESHOLD = "pyinfer.predictor.threshold"  # f32[n_layer]: neuron runs where logit >= this
K_PRED_RANK = "pyinfer.predictor.rank"  # i32[n_layer]
K_PRED_CPU = "pyinfer.predictor.cpu"  # i32[n_layer]: 1 = CPU decode runs the predictor (absent: all 1)
K_PRED_RECALL = "pyinfer.predictor.recall"  # f32[n_layer], held-out
K_PRED_PRECISION = "pyinfer.predictor.precision"  # f32[n_layer], held-out
K_TARGET_RECALL = "pyinfer.target_recall"
K_TARGET_SPARSITY = "pyinfer.target_sparsity"
K_CALIB_SOURCE = "pyinfer.calib.source"
K_CALIB_TOKENS = "pyinfer.calib.tokens"
K_CALIB_SEED = "pyinfer.calib.seed"
K_VRAM_BUDGET = "pyinfer.placement.vram_budget"  # bytes the stored gpu split was solved for
K_GROUP_SIZE = "pyinfer.placement.group_size"
SPARSE_MODE_RELU = "relu"
SPARSE_MODE_CATS = "cats"
SPARSE_MODE_GLU = "glu"
SPARSE_MODE_INPUT = "input"  # TEAL/WINA input sparsity of every projection (SwiGLU models)
SPARSE_MODES = (SPARSE_MODE_RELU, SPARSE_MODE_CATS, SPARSE_MODE_GLU, SPARSE_MODE_INPUT)
#: the projection groups of input sparsity: each shares one input and one threshold per layer
IN_GROUPS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")
K_IN_SCORE = "pyinfer.sparse.input_score"  # "magnitude" (TEAL) | "wina" (|x_j| * column norm)
IN_SCORES = ("magnitude", "wina")
#: how a layer's target sparsity is split among its groups: "uniform" (every group of every layer
#: skips the target fraction of its calibration pairs), "greedy" (TEAL's block-wise greedy) or
#: "fisher" (model-wide, by an end-of-model Fisher estimate: predictors/input_fisher.py)
K_IN_ALLOC = "pyinfer.sparse.input_alloc"
IN_ALLOCS = ("uniform", "greedy", "fisher")
#: "fisher" only: how far each unit's level moves from the uniform level towards its Fisher level
#: (1: the Fisher allocation, 0.5: half-way; predictors/input_sparse.py ``blend_levels``)
K_IN_FISHER_WEIGHT = "pyinfer.sparse.input_fisher_weight"
K_IN_THRESHOLD = "pyinfer.sparse.input_threshold.{group}"  # f32[n_layer]; < 0 keeps every input
K_IN_SPARSITY = "pyinfer.sparse.input_sparsity.{group}"  # f32[n_layer], calibrated fraction skipped
K_LM_HEAD_THRESHOLD = "pyinfer.sparse.input_threshold.output"  # f32: the lm head's input threshold
K_LM_HEAD_SPARSITY = "pyinfer.sparse.input_sparsity.output"  # f32: its calibrated fraction skipped
K_LM_HEAD_CHUNK = "pyinfer.sparse.output_chunk"  # u32: outputs per chunk of OUTPUT_IB
# u32 K: OUTPUT_IB is a copy of the head (q4_1 for a head wider than 4 bits, else its own numbers)
# that picks the K largest logits, which the exact
# head (``output.weight`` / tied ``token_embd``) then computes (absent or 0: OUTPUT_IB is exact)
K_LM_HEAD_CANDIDATES = "pyinfer.sparse.output_candidates"
LM_HEAD_CHUNK = 3072  # SmolLM2: 16 chunks; 6144 and wider left the f32 sums out of L1 (docs/benchmarks.md "lm-head input sparsity")
