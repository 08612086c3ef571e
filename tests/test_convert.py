"""pyinfer-convert: random HF Llama models and llama.cpp-style GGUFs in, checked with gguf's reader.

References nobody here wrote: transformers (weights as it loads them), sentencepiece and tokenizers
(vocabularies), gguf-py (reading the file, dequantizing). The SmolLM2 test compares the un-permuted
Q/K with what transformers makes of the same llama.cpp file.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C
from pyinfer.config import read_field
from pyinfer.errors import EXIT_INTERRUPTED

from tests._models import (BPE_SPECIALS, BPE_USER_TOKEN, CHATML_TEMPLATE, SPM_TEMPLATE,
                           load_hf_state_dict, make_random_llama, write_llamacpp_gguf)
from tests._paths import smollm2_gguf_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL = smollm2_gguf_path() or "(SmolLM2 GGUF not found: see tests/_paths.py)"
QT = gguf.GGMLQuantizationType

pytest.importorskip("torch")
pytest.importorskip("transformers")


# ---------------------------------------------------------------- helpers
def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "convert.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def convert(src: str, out: str, outtype: str = "f32", down_rows: bool = False) -> gguf.GGUFReader:
    from convert.cli import convert as _convert

    _convert(src, out, outtype, progress=False, down_rows=down_rows)
    leftovers = [n for n in os.listdir(os.path.dirname(out) or ".")
                 if n.startswith("." + os.path.basename(out)) and n.endswith(".tmp")]
    assert not leftovers, leftovers
    return gguf.GGUFReader(out)


def field(r: gguf.GGUFReader, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def tensors(r: gguf.GGUFReader) -> dict:
    return {t.name: t for t in r.tensors}


def deq(t) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in t.shape[::-1]))


def hf_expected(sd: dict, n_layer: int, tied: bool) -> dict:
    """pyinfer tensor name -> the float32 array it must hold."""
    out = {C.TOKEN_EMBD: sd["model.embed_tokens.weight"], C.OUTPUT_NORM: sd["model.norm.weight"]}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        out[C.ATTN_NORM.format(bid=i)] = sd[p + "input_layernorm.weight"]
        out[C.ATTN_Q.format(bid=i)] = sd[p + "self_attn.q_proj.weight"]
        out[C.ATTN_K.format(bid=i)] = sd[p + "self_attn.k_proj.weight"]
        out[C.ATTN_V.format(bid=i)] = sd[p + "self_attn.v_proj.weight"]
        out[C.ATTN_OUT.format(bid=i)] = sd[p + "self_attn.o_proj.weight"]
        out[C.FFN_NORM.format(bid=i)] = sd[p + "post_attention_layernorm.weight"]
        out[C.FFN_GATE.format(bid=i)] = sd[p + "mlp.gate_proj.weight"]
        out[C.FFN_UP.format(bid=i)] = sd[p + "mlp.up_proj.weight"]
        out[C.FFN_DOWN_T.format(bid=i)] = sd[p + "mlp.down_proj.weight"].T
    if not tied:
        out[C.OUTPUT] = sd["lm_head.weight"]
    return out


# ---------------------------------------------------------------- fixtures (built once)
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {
        "bpe": make_random_llama(base, "relu", False, 2, "bpe"),
        "spm": make_random_llama(base, "silu", True, 4, "spm"),
        "notok": make_random_llama(base, "relu", True, 1, None),
        "bf16": make_random_llama(base, "silu", False, 2, "bpe", dtype="bfloat16", max_shard_size="100KB",
                                  vocab_size=520, name="bf16-sharded"),
        "odd": make_random_llama(base, "relu", False, 2, None, hidden_size=48, head_dim=16, name="odd"),
    }


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    """The bpe model converted once to f32 (a valid pyinfer file for the error/requantize tests)."""
    out = str(tmp_path_factory.mktemp("conv") / "bpe-f32.gguf")
    convert(models["bpe"], out, "f32")
    return out


# ---------------------------------------------------------------- HF directory -> f32: exact
@pytest.mark.parametrize("key", ["bpe", "spm", "notok", "bf16"])
def test_hf_f32_exact(models, tmp_path, key):
    model_dir = models[key]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    tied = cfg["tie_word_embeddings"]
    r = convert(model_dir, str(tmp_path / "m.gguf"), "f32")
    n_head, n_kv, n_embd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg["head_dim"]
    assert field(r, C.K_ARCH) == "llama"
    assert field(r, C.K_FILE_TYPE) == gguf.LlamaFileType.ALL_F32
    assert field(r, C.K_EMBEDDING_LENGTH) == n_embd
    assert field(r, C.K_BLOCK_COUNT) == cfg["num_hidden_layers"]
    assert field(r, C.K_FEED_FORWARD_LENGTH) == cfg["intermediate_size"]
    assert field(r, C.K_HEAD_COUNT) == n_head and field(r, C.K_HEAD_COUNT_KV) == n_kv
    assert field(r, C.K_CONTEXT_LENGTH) == cfg["max_position_embeddings"]
    assert field(r, C.K_ROPE_DIM) == head_dim and field(r, C.K_KEY_LENGTH) == head_dim
    assert field(r, C.K_ROPE_FREQ_BASE) == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert field(r, C.K_RMS_EPS) == pytest.approx(cfg["rms_norm_eps"])
    assert field(r, C.K_VOCAB_SIZE) == cfg["vocab_size"]
    assert field(r, C.K_HIDDEN_ACT) == cfg["hidden_act"]
    assert field(r, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_NEURON_MAJOR
    assert field(r, C.K_ROPE_LAYOUT) == C.ROPE_LAYOUT_NEOX
    assert field(r, C.K_SOURCE) == os.path.basename(model_dir)
    assert field(r, C.K_PYINFER_VERSION)

    expected = hf_expected(load_hf_state_dict(model_dir), cfg["num_hidden_layers"], tied)
    got = tensors(r)
    assert set(got) == set(expected)
    assert (C.OUTPUT in got) == (not tied)
    for name, want in expected.items():
        t = got[name]
        assert t.tensor_type == QT.F32, name
        assert t.data.shape == want.shape, name
        np.testing.assert_array_equal(t.data, want, err_msg=name)  # bf16 -> f32 is exact too
    assert got[C.ATTN_Q.format(bid=0)].data.shape == (n_head * head_dim, n_embd)
    assert got[C.ATTN_K.format(bid=0)].data.shape == (n_kv * head_dim, n_embd)


@pytest.mark.parametrize("outtype,qtype,rel", [("f16", QT.F16, 1e-3), ("q8_0", QT.Q8_0, 1 / 100),
                                               ("q4_0", QT.Q4_0, 1 / 6)])
def test_hf_quantized(models, tmp_path, outtype, qtype, rel):
    model_dir = models["bpe"]
    r = convert(model_dir, str(tmp_path / "m.gguf"), outtype)
    assert field(r, C.K_FILE_TYPE) == {"f16": 1, "q8_0": 7, "q4_0": 2}[outtype]
    expected = hf_expected(load_hf_state_dict(model_dir), 2, tied=False)
    bytes_per_row = {QT.F16: 64 * 2, QT.Q8_0: 2 * 34, QT.Q4_0: 2 * 18}[qtype]
    for name, t in tensors(r).items():
        want = expected[name]
        if want.ndim == 1:
            assert t.tensor_type == QT.F32
            np.testing.assert_array_equal(t.data, want)
            continue
        assert t.tensor_type == qtype, name
        assert t.data.shape[0] == want.shape[0]
        if qtype != QT.F16:
            assert t.data.dtype == np.uint8 and t.data.shape[1] * 64 == bytes_per_row * want.shape[1], name
        err = np.abs(deq(t) - want)
        # each block's error is at most a fraction of its largest magnitude (q4_0: d/2 = amax/16)
        blocks = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=2, keepdims=True)
        assert (err.reshape(blocks.shape[0], -1, 32) <= rel * blocks + 1e-7).all(), name


def test_row_length_not_multiple_of_32_falls_back_to_f16(models, tmp_path):
    r = convert(models["odd"], str(tmp_path / "m.gguf"), "q4_0")  # n_embd 48, q dim 64
    got = tensors(r)
    assert got[C.ATTN_Q.format(bid=0)].tensor_type == QT.F16  # rows of 48
    assert got[C.FFN_DOWN_T.format(bid=0)].tensor_type == QT.F16
    assert got[C.TOKEN_EMBD].tensor_type == QT.F16
    assert got[C.ATTN_OUT.format(bid=0)].tensor_type == QT.Q4_0  # rows of 64
    assert got[C.ATTN_NORM.format(bid=0)].tensor_type == QT.F32


# ---------------------------------------------------------------- tokenizers
def test_bpe_tokenizer(models, tmp_path):
    from transformers import AutoTokenizer

    model_dir = models["bf16"]  # vocab padded from 513 to 520
    r = convert(model_dir, str(tmp_path / "m.gguf"), "q8_0")
    hf = AutoTokenizer.from_pretrained(model_dir)
    n_tok = len(hf)
    tokens, types = field(r, C.K_TOK_LIST), field(r, C.K_TOK_TYPE)
    assert field(r, C.K_TOK_MODEL) == "gpt2"
    assert field(r, C.K_TOK_PRE) == "gpt-2"
    assert len(tokens) == len(types) == 520
    assert tokens[:n_tok] == hf.convert_ids_to_tokens(list(range(n_tok)))
    assert tokens[n_tok:] == [f"[PAD{i}]" for i in range(n_tok, 520)]
    assert set(types[n_tok:]) == {C.TOKEN_TYPE_UNUSED}
    for i, text in enumerate(tokens[:n_tok]):
        want = (C.TOKEN_TYPE_CONTROL if text in BPE_SPECIALS else
                C.TOKEN_TYPE_USER_DEFINED if text == BPE_USER_TOKEN else C.TOKEN_TYPE_NORMAL)
        assert types[i] == want, text
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj_text = f.read()
    tj = json.loads(tj_text)
    assert field(r, C.K_TOK_MERGES) == [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert field(r, C.K_HF_TOKENIZER_JSON) == tj_text
    assert field(r, C.K_TOK_BOS) == hf.bos_token_id == 1
    assert field(r, C.K_TOK_EOS) == hf.eos_token_id == 2
    assert field(r, C.K_TOK_UNK) == 0 and field(r, C.K_TOK_PAD) == 0
    assert field(r, C.K_TOK_EOT) == 2  # <|im_end|>
    assert field(r, C.K_TOK_ADD_BOS) is False and field(r, C.K_TOK_ADD_EOS) is False
    assert field(r, C.K_CHAT_TEMPLATE) == CHATML_TEMPLATE


def test_spm_tokenizer(models, tmp_path):
    import sentencepiece as spm

    model_dir = models["spm"]
    r = convert(model_dir, str(tmp_path / "m.gguf"), "f16")
    sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "tokenizer.model"))
    n = sp.vocab_size()
    assert field(r, C.K_TOK_MODEL) == "llama"
    assert field(r, C.K_TOK_LIST) == [sp.id_to_piece(i) for i in range(n)]
    np.testing.assert_allclose(field(r, C.K_TOK_SCORES), [sp.get_score(i) for i in range(n)])
    types = field(r, C.K_TOK_TYPE)
    assert types[0] == C.TOKEN_TYPE_UNKNOWN and types[1] == types[2] == C.TOKEN_TYPE_CONTROL
    assert all(types[i] == C.TOKEN_TYPE_BYTE for i in range(n) if sp.is_byte(i))
    assert types.count(C.TOKEN_TYPE_BYTE) == 256
    assert field(r, C.K_TOK_BOS) == 1 and field(r, C.K_TOK_EOS) == 2 and field(r, C.K_TOK_UNK) == 0
    assert field(r, C.K_TOK_ADD_BOS) is True and field(r, C.K_TOK_ADD_EOS) is False
    assert field(r, C.K_TOK_ADD_SPACE_PREFIX) is True
    assert field(r, C.K_CHAT_TEMPLATE) == SPM_TEMPLATE
    assert field(r, C.K_HF_TOKENIZER_JSON) is not None  # transformers' tokenizer.json is kept too


def test_no_tokenizer_warns(models, tmp_path):
    """A directory without a tokenizer converts with --dense (one warning, not one per plan of
    the source; q4_0 falls back to round-to-nearest scales, its calibration pass needing tokens),
    and the offline stage says the directory has none (it blamed 'the GGUF file', its own
    staging file; QA)."""
    out = str(tmp_path / "m.gguf")
    for outtype in ("q8_0", "q4_0"):
        p = run_cli(models["notok"], out, "--outtype", outtype, "--dense")
        assert p.returncode == 0, p.stderr
        assert p.stderr.count("warning: no tokenizer") == 1, p.stderr
        r = gguf.GGUFReader(out)
        assert not [k for k in r.fields if k.startswith("tokenizer.") or k == C.K_HF_TOKENIZER_JSON]
    assert "round-to-nearest" in p.stderr
    p = run_cli(models["notok"], str(tmp_path / "s.gguf"), "--outtype", "q8_0")
    assert p.returncode == 1 and f"{models['notok']} has no tokenizer" in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "s.gguf")


# ---------------------------------------------------------------- GGUF sources
@pytest.mark.parametrize("key,src_type", [("bpe", "f32"), ("spm", "q8_0")])
def test_llamacpp_gguf_source(models, tmp_path, key, src_type):
    """A llama.cpp-style file (Q/K permuted, ffn_down) converts back to the HF layout."""
    src = str(tmp_path / "llamacpp.gguf")
    write_llamacpp_gguf(models[key], src, src_type)
    r = convert(src, str(tmp_path / "out.gguf"), "f32")
    with open(os.path.join(models[key], "config.json")) as f:
        cfg = json.load(f)
    expected = hf_expected(load_hf_state_dict(models[key]), cfg["num_hidden_layers"], cfg["tie_word_embeddings"])
    src_t = tensors(gguf.GGUFReader(src))
    got = tensors(r)
    assert set(got) == set(expected)
    for name, want in expected.items():
        if src_type == "f32":
            np.testing.assert_array_equal(got[name].data, want, err_msg=name)
        else:  # exactly what the quantized source holds, after the same layout changes
            srcname = name.replace("ffn_down_t", "ffn_down")
            base = deq(src_t[srcname])
            if "ffn_down_t" in name:
                base = base.T
            elif "attn_q" in name or "attn_k" in name:
                from convert.from_gguf import unpermute_qk
                base = unpermute_qk(base, cfg["num_attention_heads" if "attn_q" in name else "num_key_value_heads"])
            np.testing.assert_array_equal(got[name].data, base, err_msg=name)
            np.testing.assert_allclose(got[name].data, want, atol=np.abs(want).max() / 100)
    assert field(r, C.K_TOK_LIST) == field(gguf.GGUFReader(src), C.K_TOK_LIST)
    assert field(r, C.K_SOURCE) == "llamacpp.gguf"
    assert field(r, C.K_HIDDEN_ACT) == "silu"  # llama.cpp's llama architecture is SwiGLU


@pytest.mark.parametrize("src_type,dims", [("q4_1", {}), ("q6_k", dict(hidden_size=256, intermediate_size=512,
                                                                        head_dim=64))])
def test_llamacpp_gguf_auto_keeps_types(tmp_path, src_type, dims):
    """--outtype auto (the default): every matrix keeps the source's type; those whose layout does
    not change are copied byte for byte (Q/K rows moved whole), ffn_down_t is quantized again at
    the source type, within that type's rounding of the source's values."""
    model_dir = make_random_llama(tmp_path / "hf", "silu", False, 2, "bpe", **dims)
    src = str(tmp_path / "llamacpp.gguf")
    write_llamacpp_gguf(model_dir, src, src_type)
    out = str(tmp_path / "out.gguf")
    r = convert(src, out, "auto")
    qt = C.OUTTYPES[src_type]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    src_t, got = tensors(gguf.GGUFReader(src)), tensors(r)
    assert field(r, C.K_FILE_TYPE) == field(gguf.GGUFReader(src), C.K_FILE_TYPE)
    assert abs(os.path.getsize(out) / os.path.getsize(src) - 1) < 0.05
    for name, t in got.items():
        if t.data.ndim == 1 or t.tensor_type == QT.F32:
            continue
        assert t.tensor_type == qt, name
        if "ffn_down_t" in name:
            base = deq(src_t[name.replace("ffn_down_t", "ffn_down")]).T
            err = np.sqrt(np.mean((deq(t) - base) ** 2) / np.mean(base ** 2))
            assert err < {"q4_1": 0.12, "q6_k": 0.03}[src_type], (name, err)
            continue
        want = np.asarray(src_t[name].data)
        if "attn_q" in name or "attn_k" in name:
            from convert.from_gguf import unpermute_qk
            n = cfg["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            want = unpermute_qk(want.reshape(t.data.shape[0], -1), n)
        np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want, err_msg=name)


@pytest.mark.parametrize("key", ["bpe", "spm"])
def test_hf_dense_keeps_down_rows(models, tmp_path, key):
    """--dense (down_rows): ffn_down is transformers' down_proj as it is, (n_embd, n_ff) in numpy
    order, no ffn_down_t, pyinfer.ffn_layout "rows"; every other tensor as the default writes it."""
    model_dir = models[key]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    r = convert(model_dir, str(tmp_path / "rows.gguf"), "f32", down_rows=True)
    assert field(r, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
    expected = hf_expected(load_hf_state_dict(model_dir), cfg["num_hidden_layers"],
                           cfg["tie_word_embeddings"])
    expected = {n.replace("ffn_down_t", "ffn_down"): (w.T if "ffn_down_t" in n else w)
                for n, w in expected.items()}
    got = tensors(r)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert tuple(int(d) for d in got[name].shape[::-1]) == want.shape, name
        np.testing.assert_array_equal(got[name].data, want, err_msg=name)
    down = got[C.SRC_FFN_DOWN.format(bid=0)]
    assert down.data.shape == (cfg["hidden_size"], cfg["intermediate_size"])


@pytest.mark.parametrize("src_type", ["q4_0", "q8_0", "q4_1"])
def test_llamacpp_gguf_dense_copies_ffn_down(tmp_path, src_type):
    """A quantized llama.cpp file with --dense: ffn_down keeps its layout and type, so its blocks
    are copied byte for byte (no requantization), as every other tensor whose layout does not
    change; the file is the source's size. A re-conversion of that file to the neuron-major
    layout transposes it back (the values of the source, within the type's rounding)."""
    model_dir = make_random_llama(tmp_path / "hf", "silu", False, 2, "bpe")
    src = str(tmp_path / "llamacpp.gguf")
    write_llamacpp_gguf(model_dir, src, src_type)
    out = str(tmp_path / "dense.gguf")
    p = run_cli(src, out, "--dense")
    assert p.returncode == 0, p.stderr
    src_t, got = tensors(gguf.GGUFReader(src)), tensors(gguf.GGUFReader(out))
    assert field(gguf.GGUFReader(out), C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
    assert not [n for n in got if "ffn_down_t" in n]
    downs = [n for n in got if n.endswith(".ffn_down.weight")]
    assert len(downs) == 2
    for n in downs:
        assert got[n].tensor_type == src_t[n].tensor_type == C.OUTTYPES[src_type]
        assert got[n].data.shape == src_t[n].data.shape
        np.testing.assert_array_equal(np.asarray(got[n].data), np.asarray(src_t[n].data), n)
    assert abs(os.path.getsize(out) / os.path.getsize(src) - 1) < 0.05
    back = tensors(convert(out, str(tmp_path / "nm.gguf"), "auto"))
    for n in downs:
        t = back[n.replace("ffn_down", "ffn_down_t")]
        base = deq(src_t[n]).T
        err = np.sqrt(np.mean((deq(t) - base) ** 2) / np.mean(base ** 2))
        assert t.tensor_type == C.OUTTYPES[src_type] and err < 0.12, (n, err)


def test_dense_with_sparse_mode_is_an_error(models, tmp_path):
    """--sparse-mode needs the offline stage, which --dense skips: one line, exit 1, no file."""
    out = str(tmp_path / "x.gguf")
    p = run_cli(models["notok"], out, "--dense", "--sparse-mode", "glu")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--dense" in lines[0], p.stderr
    assert not os.path.exists(out)


def test_down_type(tmp_path):
    """A Q4_K_M-like mix (ffn_down Q6_K, the rest Q4_K): auto keeps each tensor's own type, so
    ffn_down_t stays Q6_K; --down-type q8_0 changes ffn_down_t alone (the other tensors are the
    same bytes); on a pyinfer file whose ffn_down_t is stored blocks, the blocks are dequantized
    and re-encoded. Values checked against gguf's dequantization of the source."""
    from convert.cli import convert as _convert

    dims = dict(hidden_size=256, intermediate_size=512, head_dim=64)
    model_dir = make_random_llama(tmp_path / "hf", "silu", False, 2, "bpe", **dims)
    src = str(tmp_path / "q4_k_m.gguf")
    write_llamacpp_gguf(model_dir, src, "q4_k", down_qtype="q6_k")
    src_t = tensors(gguf.GGUFReader(src))
    auto = tensors(convert(src, str(tmp_path / "auto.gguf"), "auto"))
    q8 = str(tmp_path / "down_q8.gguf")
    _convert(src, q8, "auto", progress=False, down_type="q8_0")
    q8_t = tensors(gguf.GGUFReader(q8))
    assert auto.keys() == q8_t.keys()
    for name, t in auto.items():
        if "ffn_down_t" in name:
            assert t.tensor_type == QT.Q6_K and q8_t[name].tensor_type == QT.Q8_0, name
            base = deq(src_t[name.replace("ffn_down_t", "ffn_down")]).T
            for got, bound in ((t, 0.03), (q8_t[name], 0.01)):
                err = np.sqrt(np.mean((deq(got) - base) ** 2) / np.mean(base ** 2))
                assert err < bound, (name, got.tensor_type, err)
        else:
            assert t.tensor_type == q8_t[name].tensor_type
            assert t.tensor_type in (QT.F32, QT.Q4_K), name
            np.testing.assert_array_equal(np.asarray(t.data), np.asarray(q8_t[name].data), name)
    # a pyinfer file in, its stored Q6_K ffn_down_t blocks out at q8_0
    again = str(tmp_path / "again.gguf")
    _convert(str(tmp_path / "auto.gguf"), again, "auto", progress=False, down_type="q8_0")
    for name, t in tensors(gguf.GGUFReader(again)).items():
        if "ffn_down_t" in name:
            assert t.tensor_type == QT.Q8_0
            base = deq(auto[name])
            assert np.sqrt(np.mean((deq(t) - base) ** 2) / np.mean(base ** 2)) < 0.01
    # the command line: listed in --help, a type it does not know is one error line, status 1
    # (argparse's usage block and status 2 before; every other pyinfer command says one line)
    assert "--down-type" in run_cli("--help").stdout
    p = run_cli(src, str(tmp_path / "bad.gguf"), "--dense", "--down-type", "q3_k")
    assert p.returncode == 1 and "--down-type" in p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: ")
    assert not os.path.exists(tmp_path / "bad.gguf")
    # --dense keeps ffn_down in row layout: its Q6_K blocks copied as stored, or at --down-type
    p = run_cli(src, str(tmp_path / "cli.gguf"), "--dense", "--down-type", "q8_0")
    assert p.returncode == 0, p.stderr
    got = tensors(gguf.GGUFReader(str(tmp_path / "cli.gguf")))
    downs = [n for n in got if n.endswith(".ffn_down.weight")]
    assert len(downs) == 2 and not [n for n in got if "ffn_down_t" in n]
    assert {got[n].tensor_type for n in downs} == {QT.Q8_0}
    for n in downs:
        base = deq(src_t[n])
        assert np.sqrt(np.mean((deq(got[n]) - base) ** 2) / np.mean(base ** 2)) < 0.01
    p = run_cli(src, str(tmp_path / "cli6.gguf"), "--dense")
    assert p.returncode == 0, p.stderr
    got = tensors(gguf.GGUFReader(str(tmp_path / "cli6.gguf")))
    for n in downs:
        assert got[n].tensor_type == QT.Q6_K
        np.testing.assert_array_equal(np.asarray(got[n].data), np.asarray(src_t[n].data), n)


def test_auto_outtype_of_hf_source_is_f16(models, tmp_path):
    r = convert(models["bf16"], str(tmp_path / "out.gguf"), "auto")
    assert field(r, C.K_FILE_TYPE) == 1  # MOSTLY_F16, as llama.cpp's converter writes
    assert {t.tensor_type for t in r.tensors if len(t.shape) == 2} == {QT.F16}


def test_k_quant_fallback_types():
    """llama.cpp's fallback (llama-quant.cpp) for K-quant rows not a multiple of 256."""
    from convert.writer import matrix_qtype

    assert matrix_qtype(512, "q4_k") == QT.Q4_K
    assert [matrix_qtype(576, t) for t in ("q4_k", "q5_k", "q6_k")] == [QT.Q5_0, QT.Q5_1, QT.Q8_0]
    assert matrix_qtype(48, "q4_k") == QT.F16 and matrix_qtype(48, "bf16") == QT.BF16


def test_unpermute_inverts_permute():
    from convert.from_gguf import permute_qk, unpermute_qk

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_pyinfer_gguf_requantizes(converted, tmp_path):
    r = convert(converted, str(tmp_path / "q8.gguf"), "q8_0")
    src = tensors(gguf.GGUFReader(converted))
    for name, t in tensors(r).items():
        assert t.tensor_type == (QT.F32 if src[name].data.ndim == 1 else QT.Q8_0)
        np.testing.assert_allclose(deq(t), src[name].data, atol=np.abs(src[name].data).max() / 100)
    assert field(r, C.K_HIDDEN_ACT) == "relu"  # kept from the pyinfer file
    assert field(r, C.K_HF_TOKENIZER_JSON) == field(gguf.GGUFReader(converted), C.K_HF_TOKENIZER_JSON)


# ---------------------------------------------------------------- errors
def _expect_error(tmp_path, src: str, out: str | None = None, contains: str = "") -> str:
    out = out or str(tmp_path / "out.gguf")
    p = run_cli(src, out, "--dense")
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert contains in lines[0], lines[0]
    out_dir = os.path.dirname(out)
    assert not os.path.exists(out)
    assert not os.path.isdir(out_dir) or not [n for n in os.listdir(out_dir) if n.endswith(".tmp")]
    return lines[0]


def _copy_with_config(models, tmp_path, **changes) -> str:
    d = tmp_path / "edited"
    shutil.copytree(models["notok"], d)
    with open(d / "config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(d)


def test_error_src_missing(tmp_path):
    _expect_error(tmp_path, str(tmp_path / "nope"), contains="does not exist")


def test_error_no_config(tmp_path):
    (tmp_path / "d").mkdir()
    _expect_error(tmp_path, str(tmp_path / "d"), contains="no config.json")


def test_error_no_weights(models, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(os.path.join(models["notok"], "config.json"), d)
    _expect_error(tmp_path, str(d), contains=f"no *.safetensors weights in {d}")


def test_error_architecture(models, tmp_path):
    d = _copy_with_config(models, tmp_path, architectures=["GPT2LMHeadModel"])
    _expect_error(tmp_path, d, contains="unsupported architecture GPT2LMHeadModel (supported: "
                                        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                        "Qwen3ForCausalLM")


def test_error_hidden_act(models, tmp_path):
    d = _copy_with_config(models, tmp_path, hidden_act="gelu")
    _expect_error(tmp_path, d, contains="unsupported hidden_act")


def test_error_rope_scaling(models, tmp_path):
    d = _copy_with_config(models, tmp_path, rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0})
    _expect_error(tmp_path, d, contains="unsupported rope scaling")


def test_error_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"PK\x03\x04 definitely not a gguf" * 10)
    _expect_error(tmp_path, str(f), contains="neither a model directory nor a GGUF file")


def test_error_gguf_architecture(tmp_path):
    f = str(tmp_path / "phi3.gguf")
    w = gguf.GGUFWriter(f, "phi3")
    w.add_tensor(C.TOKEN_EMBD, np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_error(tmp_path, f, contains="unsupported architecture phi3 (supported: llama, gemma3, qwen2, qwen3)")


@pytest.mark.parametrize("frac", [0.001, 0.5, 0.999])
def test_error_truncated_gguf(converted, tmp_path, frac):
    data = open(converted, "rb").read()
    f = tmp_path / "trunc.gguf"
    f.write_bytes(data[: max(8, int(len(data) * frac))])
    _expect_error(tmp_path, str(f), contains="trunc.gguf")


def test_error_out_dir_missing(converted, tmp_path):
    _expect_error(tmp_path, converted, out=str(tmp_path / "nodir" / "out.gguf"), contains="does not exist")


def test_output_is_never_the_source(converted, tmp_path):
    """Every mode refuses to write over its source before any work (the default offline stage
    replaced the source file until session 31: its check saw only the staging path), by path
    or through a link, and refuses a directory as OUT at once."""
    import shutil

    src = str(tmp_path / "src.gguf")
    shutil.copy(converted, src)
    before = open(src, "rb").read()
    os.symlink(src, str(tmp_path / "link.gguf"))
    for out, extra in ((src, []), (src, ["--dense"]), (str(tmp_path / "link.gguf"), []),
                       (src, ["--sparse-mode", "glu"])):
        p = run_cli(src, out, "--outtype", "f32", *extra)
        assert p.returncode == 1 and p.stderr.strip() == "error: the output would overwrite the source file", p.stderr
    p = run_cli(src, str(tmp_path), "--outtype", "f32")
    assert p.returncode == 1 and p.stderr.strip() == f"error: {tmp_path} is a directory", p.stderr
    assert open(src, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["link.gguf", "src.gguf"]


def test_output_must_name_a_regular_file(converted, tmp_path):
    """An existing OUT that is a device, FIFO or socket was replaced by the finished file (as
    root, ``pyinfer-convert SRC /dev/null`` left /dev/null a regular file: a broken system); an
    empty OUT or one ending in a separator failed only at the final write, after the offline
    stage. All refused before any work, in every mode, the node left as it was."""
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    for out, what in ((fifo, "exists and is not a regular file"),
                      ("", "does not name a file"), (str(tmp_path / "sub") + os.sep, "does not name a file")):
        for extra in ([], ["--dense"]):
            p = run_cli(converted, out, "--outtype", "f32", *extra)
            assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
            assert what in p.stderr, p.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]
    from convert.cli import check_paths

    os.symlink(str(tmp_path / "nowhere.gguf"), str(tmp_path / "dangling.gguf"))
    check_paths(converted, str(tmp_path / "dangling.gguf"))  # a dangling link is a new file


def test_a_linked_output_is_written_through(converted, tmp_path):
    """OUT a symbolic link (an existing file's, or a dangling one's): the file it points to gets
    the conversion and the link stays a link, as llama.cpp's tools write through it (pyinfer
    replaced the link by the file until session 36)."""
    d = tmp_path / "store"
    d.mkdir()
    old = d / "model.gguf"
    old.write_bytes(b"old")
    for target, link in ((old, tmp_path / "link.gguf"), (d / "new.gguf", tmp_path / "dangling.gguf")):
        os.symlink(str(target), str(link))
        p = run_cli(converted, str(link), "--outtype", "f32", "--dense")
        assert p.returncode == 0, p.stderr
        assert os.path.islink(link) and os.readlink(link) == str(target)
        assert gguf.GGUFReader(str(target)).tensors  # a whole GGUF, read through gguf
    assert sorted(os.listdir(d)) == ["model.gguf", "new.gguf"]  # no temporary file left

def test_a_linked_output_never_writes_over_the_source_directory(models, tmp_path):
    """A .gguf-named link to a file of the source directory (its weights, its config) was
    written through, the checkpoint lost (QA): the link is judged by its target, refused before
    any work; a loop of links is refused too."""
    d = _copy_with_config(models, tmp_path)
    for name in ("model.safetensors", "config.json"):
        link = tmp_path / f"to-{name}.gguf"
        os.symlink(os.path.join(d, name), str(link))
        before = open(os.path.join(d, name), "rb").read()
        p = run_cli(d, str(link), "--outtype", "f32", "--dense")
        assert p.returncode == 1 and "a file of the source directory" in p.stderr, p.stderr
        assert open(os.path.join(d, name), "rb").read() == before
    os.symlink(str(tmp_path / "b.gguf"), str(tmp_path / "a.gguf"))
    os.symlink(str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"))
    p = run_cli(d, str(tmp_path / "a.gguf"), "--outtype", "f32", "--dense")
    assert p.returncode == 1 and "loop of symbolic links" in p.stderr, p.stderr
    assert os.path.islink(tmp_path / "a.gguf")


def test_output_is_never_a_file_of_the_source_directory(models, tmp_path):
    """OUT naming one of an HF directory's own files (the weights, config.json, the tokenizer)
    was written over it, rc 0, the checkpoint lost (QA): refused before any work in every mode;
    a new .gguf inside the directory is fine."""
    import shutil

    src = str(tmp_path / "hf")
    shutil.copytree(models["bpe"], src)
    files = {f: open(os.path.join(src, f), "rb").read() for f in os.listdir(src)}
    victims = [f for f in files if f.endswith((".safetensors", ".json"))]
    assert "config.json" in victims and any(f.endswith(".safetensors") for f in victims)
    for f in victims:
        for extra in ([], ["--dense"]):
            p = run_cli(src, os.path.join(src, f), "--outtype", "f32", *extra)
            assert p.returncode == 1 and "a file of the source directory" in p.stderr, p.stderr
    assert {f: open(os.path.join(src, f), "rb").read() for f in os.listdir(src)} == files
    p = run_cli(src, os.path.join(src, "model.gguf"), "--outtype", "f32", "--dense")
    assert p.returncode == 0, p.stderr
    # the success line names the types written (it printed the flag's value, "auto")
    p = run_cli(src, str(tmp_path / "a.gguf"), "--dense", "--down-type", "q8_0", "--outtype", "f16")
    assert p.returncode == 0 and "(f16 + q8_0, " in p.stderr.splitlines()[-1], p.stderr


def test_values_beyond_f16_are_an_error_naming_the_tensor(tmp_path):
    """A weight above 65504 became inf in an f16 output (rc 0, then NaN logits when run, or a
    'NaN logits at token 48' from the offline stage): a one-line error naming the tensor and the
    way out; bf16 holds it."""
    import json

    from safetensors.numpy import load_file, save_file

    src = make_random_llama(tmp_path, "silu", False, 2, "bpe", name="big")
    st = next(f for f in os.listdir(src) if f.endswith(".safetensors"))
    w = load_file(os.path.join(src, st))
    key = next(k for k in w if k.endswith("layers.0.mlp.up_proj.weight"))
    w[key][5, 7] = 1e5
    save_file(w, os.path.join(src, st), metadata={"format": "pt"})
    assert json.load(open(os.path.join(src, "config.json")))
    for extra in (["--dense"], []):
        p = run_cli(src, str(tmp_path / "o.gguf"), "--outtype", "f16", *extra)
        assert p.returncode == 1 and "blk.0.ffn_up" in p.stderr and "--outtype bf16" in p.stderr, p.stderr
        last = p.stderr.strip().splitlines()[-1]  # (after the progress lines)
        assert last.startswith("error: ") and "blk.0.ffn_up" in last, p.stderr
        assert "RuntimeWarning" not in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not os.path.exists(tmp_path / "o.gguf")
    assert run_cli(src, str(tmp_path / "o.gguf"), "--outtype", "bf16", "--dense").returncode == 0


def test_a_sentencepiece_tokenizer_json_alone_keeps_its_special_ids(models, tmp_path):
    """A directory whose only tokenizer is a SentencePiece-style tokenizer.json (Metaspace BPE,
    what transformers 5 saves for Llama / Mistral) stored no bos / eos ids: generation never
    stopped at </s> (QA). They come from tokenizer_config.json's texts through tokenizer.json's
    own vocabulary, the ids transformers' tokenizer gives them."""
    import shutil

    from transformers import AutoTokenizer

    src = str(tmp_path / "spm_json")
    shutil.copytree(models["spm"], src)
    os.remove(os.path.join(src, "tokenizer.model"))
    ref = AutoTokenizer.from_pretrained(src)
    out = str(tmp_path / "o.gguf")
    p = run_cli(src, out, "--outtype", "f32", "--dense")
    assert p.returncode == 0, p.stderr
    r = gguf.GGUFReader(out)
    assert C.K_HF_TOKENIZER_JSON in r.fields and C.K_TOK_LIST not in r.fields
    assert read_field(r, C.K_TOK_EOS) == ref.eos_token_id is not None
    assert read_field(r, C.K_TOK_BOS) == ref.bos_token_id is not None
    from pyinfer.engine import Engine

    assert ref.eos_token_id in Engine(out, n_ctx=32, n_threads=1).tokenizer.stop_ids


def test_offline_flags_the_conversion_would_ignore_are_refused(converted, tmp_path):
    """A flag of the offline stage that the chosen path would not read is a one-line error
    before any work, not a file made without it (--epochs in sparse mode input, --sparse-alloc
    in glu, any but the calibration flags with --dense); a calibration seed outside the
    metadata's u32 is refused up front (was a traceback after the offline stage); SRC OUT may
    come after the options."""
    out = str(tmp_path / "o.gguf")
    for args, words in (
            (["--dense", "--target-sparsity", "5"], "--target-sparsity needs the offline stage"),
            (["--dense", "--epochs", "2", "--sparse-alloc", "greedy"],
             "--epochs, --sparse-alloc need the offline stage"),
            (["--sparse-mode", "input", "--predictor-rank", "3"], "--predictor-rank needs predictors"),
            (["--sparse-mode", "glu", "--sparsity-score", "wina"], "--sparsity-score needs --sparse-mode input"),
            (["--calib-seed", "-1"], "--calib-seed must be an integer in 0..4294967295"),
            (["--calib-seed", str(2**32)], "--calib-seed must be an integer in 0..4294967295"),
            (["--dense", "--outtype", "q4_0", "--calib-tokens", "-5"], "--calib-tokens must be at least")):
        p = run_cli(converted, out, *args)
        assert p.returncode == 1 and p.stderr.startswith("error: ") and words in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr and not os.path.exists(out)
    p = run_cli(converted, "--outtype", "q4_0", "--dense", "--calib-seed", "7", out)
    assert p.returncode == 0, p.stderr
    assert os.path.exists(out)


def test_interrupt_leaves_nothing(models, tmp_path, monkeypatch):
    """A KeyboardInterrupt in the middle of the tensors removes OUT.tmp and never creates OUT."""
    from convert import writer
    from convert.hf import plan_hf

    meta, jobs = plan_hf(models["bpe"], "q8_0")

    def boom():
        raise KeyboardInterrupt

    jobs[5].load = boom
    out = str(tmp_path / "out.gguf")
    with pytest.raises(KeyboardInterrupt):
        writer.write_gguf(out, meta, jobs, progress=False)
    assert os.listdir(tmp_path) == []


def test_existing_output_survives_failure(models, converted, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")
    d = _copy_with_config(models, tmp_path, hidden_act="gelu")
    p = run_cli(d, str(out), "--dense")
    assert p.returncode == 1 and out.read_bytes() == b"old"


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
@pytest.mark.parametrize("mode", [["--dense"], []])
def test_a_short_write_names_the_output_and_the_cause(models, converted, tmp_path, mode):
    """A full disk (here: a file-size limit, RLIMIT_FSIZE) stopped NumPy's write of a tensor
    with "N requested and M written"; the default mode named its hidden staging file. Now the
    OS's reason and OUT are named, and nothing is left behind."""
    import resource

    limit = os.path.getsize(converted) // 2  # inside a tensor's data

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = tmp_path / "out.gguf"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "convert.cli", models["bpe"], str(out), "--outtype",
                        "f32", *mode], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120, preexec_fn=small_files)
    err = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and err.startswith(f"error: cannot write {out}: File too large"), err
    assert "requested" not in err and "Traceback" not in p.stderr
    if not mode:
        assert "dense staging copy" in err
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SMOL), reason=f"{SMOL} not downloaded")
def test_smollm2_unpermute_matches_transformers(tmp_path):
    """Q/K of a real llama.cpp file, un-permuted, equal transformers' own GGUF import."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = str(tmp_path / "smol-q8.gguf")
    p = run_cli(SMOL, out, "--outtype", "f32", "--dense")
    assert p.returncode == 0, p.stderr
    cfg = AutoConfig.from_pretrained(os.path.dirname(SMOL), gguf_file=os.path.basename(SMOL))
    with torch.device("meta"):  # the loader wants a model to map names; no weights are made here
        model = LlamaForCausalLM(cfg)
    sd = load_gguf_checkpoint(SMOL, return_tensors=True, model_to_load=model)["tensors"]
    got = tensors(gguf.GGUFReader(out))
    assert C.OUTPUT not in got  # tied
    for i in (0, 14, 29):
        for ours, theirs in ((C.ATTN_Q, "self_attn.q_proj"), (C.ATTN_K, "self_attn.k_proj"),
                             (C.ATTN_V, "self_attn.v_proj"), (C.FFN_GATE, "mlp.gate_proj")):
            want = np.asarray(sd[f"model.layers.{i}.{theirs}.weight"], dtype=np.float32)
            np.testing.assert_array_equal(got[ours.format(bid=i)].data, want)
        want = np.asarray(sd[f"model.layers.{i}.mlp.down_proj.weight"], dtype=np.float32)
        # --dense: the down projection in llama.cpp's (and transformers') own row layout
        assert C.FFN_DOWN_T.format(bid=i) not in got
        np.testing.assert_array_equal(got[C.SRC_FFN_DOWN.format(bid=i)].data, want)
    r = gguf.GGUFReader(out)
    assert field(r, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
    assert field(r, C.K_TOK_MODEL) == "gpt2" and len(field(r, C.K_TOK_LIST)) == 49152
    assert field(r, C.K_TOK_BOS) == 1 and field(r, C.K_TOK_EOS) == 2 and field(r, C.K_TOK_EOT) == 2
    assert field(r, C.K_CHAT_TEMPLATE).startswith("{% for message in messages %}")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SMOL), reason=f"{SMOL} not downloaded")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_mid_write_leaves_nothing(tmp_path, sig):
    """Ctrl-C, `kill` and a closed terminal (SIGHUP left the 145 MB temporary file) stop the
    conversion and remove its temporary file; the status is 130 for Ctrl-C, else 128 + the
    signal's number (the shell's convention; SIGTERM gave 130)."""
    import signal
    import time

    out = tmp_path / "out.gguf"
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "convert.cli", SMOL, str(out), "--outtype", "q4_0", "--dense"], cwd=ROOT,
                         env=env, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not os.listdir(tmp_path) and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    # stderr is a pipe: progress lines (pyinfer/progress.py) come first, then the one-line error
    want = EXIT_INTERRUPTED if sig == "SIGINT" else 128 + getattr(signal, sig)
    assert p.returncode == want and err.strip().splitlines()[-1] == "error: interrupted", err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SMOL), reason=f"{SMOL} not downloaded")
def test_a_signal_after_the_rename_is_a_success(tmp_path):
    """Ctrl-C in the seconds after the finished file was renamed over OUT (the success line's
    work) reported "error: interrupted" and status 130 while OUT had been replaced: now the
    conversion ends as the success it is."""
    import signal
    import time

    out = tmp_path / "out.gguf"
    out.write_text("precious\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "convert.cli", SMOL, str(out), "--dense"], cwd=ROOT,
                         env=env, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while os.path.getsize(out) < 100 and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err.strip().splitlines()[-1].startswith("wrote "), err
    assert open(out, "rb").read(4) == b"GGUF" and os.listdir(tmp_path) == ["out.gguf"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SMOL), reason=f"{SMOL} not downloaded")
def test_an_inherited_ignored_sigint_stays_ignored(tmp_path):
    """A conversion started with SIGINT ignored (a `cmd &` job of a non-interactive shell)
    runs through a SIGINT, as Python leaves an inherited SIG_IGN alone."""
    import signal
    import time

    out = tmp_path / "out.gguf"
    p = subprocess.Popen([sys.executable, "-m", "convert.cli", SMOL, str(out), "--dense"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    time.sleep(0.6)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and open(out, "rb").read(4) == b"GGUF", err


def test_a_second_interrupt_during_cleanup_leaves_no_file(tmp_path, monkeypatch):
    """Ctrl-C twice: the second landed in write_gguf's cleanup (while the writer closed) and
    left the temporary file behind."""
    from convert.writer import Metadata, TensorJob, write_gguf

    closes = []

    def close(self):
        closes.append(1)
        if len(closes) == 1:
            raise KeyboardInterrupt  # the second Ctrl-C
        return real_close(self)

    def load():
        raise KeyboardInterrupt  # the first, while a tensor is made

    real_close = gguf.GGUFWriter.close
    monkeypatch.setattr(gguf.GGUFWriter, "close", close)
    with pytest.raises(KeyboardInterrupt):
        write_gguf(str(tmp_path / "o.gguf"), Metadata(),
                   [TensorJob("t", (4, 32), gguf.GGMLQuantizationType.F32, load)], progress=False)
    assert os.listdir(tmp_path) == []


def test_main_restores_the_callers_sigterm_handler(converted, tmp_path):
    """convert.cli.main installs its SIGTERM handler (cleanup, like Ctrl-C) only while it runs:
    a program that calls it keeps its own handler afterwards, after a success or an error."""
    import signal

    from convert.cli import main

    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        assert main([converted, str(tmp_path / "a.gguf"), "--outtype", "f32", "--dense"]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
        assert main([converted, converted, "--dense"]) == 1  # refused: its own source
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


# ---------------------------------------------------------------- hostile inputs (issue 9)
def test_failed_conversion_keeps_the_users_tmp_file(models, tmp_path):
    """The temporary file has a unique name: a user's own OUT.tmp survives a failed conversion."""
    out = tmp_path / "out.gguf"
    mine = tmp_path / "out.gguf.tmp"
    mine.write_bytes(b"my notes")
    d = _copy_with_config(models, tmp_path, hidden_act="gelu")
    p = run_cli(d, str(out), "--dense")
    assert p.returncode == 1, p.stderr
    assert mine.read_bytes() == b"my notes"
    assert sorted(os.listdir(tmp_path)) == ["edited", "out.gguf.tmp"]


def test_success_keeps_the_users_tmp_file_and_a_normal_mode(models, tmp_path):
    out = tmp_path / "out.gguf"
    mine = tmp_path / "out.gguf.tmp"
    mine.write_bytes(b"my notes")
    convert(models["notok"], str(out))
    assert mine.read_bytes() == b"my notes"
    assert sorted(os.listdir(tmp_path)) == ["out.gguf", "out.gguf.tmp"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


@pytest.mark.parametrize("changes,contains", [
    (dict(hidden_size="64"), "config.json: hidden_size must be an integer in 1..4294967295, got '64'"),
    (dict(hidden_size=64.0), "hidden_size must be an integer"),
    (dict(num_hidden_layers=True), "num_hidden_layers must be an integer"),
    (dict(rope_theta=None), "config.json: rope_theta must be a positive number, got None"),
    (dict(rope_theta="big"), "rope_theta must be a positive number"),
    (dict(max_position_embeddings=-5), "config.json: max_position_embeddings must be an integer in 1.."),
    (dict(intermediate_size=2**40), "intermediate_size must be an integer in 1..4294967295"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a positive number"),
    (dict(architectures="LlamaForCausalLM"), "architectures must be a list of names"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be an object"),
    (dict(num_attention_heads=3, head_dim=None), "is not a multiple of num_attention_heads 3"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": None}), "rope_theta must be a positive"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    (dict(hidden_act=["silu"]), "unsupported hidden_act"),
    # transformers builds the model from model_type: a Llama architecture with model_type
    # mistral (and a sliding window) converted as Llama and gave other logits; an unknown one
    # was accepted
    (dict(model_type="mistral", sliding_window=4), "model_type 'mistral' is not LlamaForCausalLM's"),
    (dict(model_type="foobar"), "model_type 'foobar' is not LlamaForCausalLM's (llama)"),
    (dict(model_type=3), "model_type must be a name"),
])
def test_error_config_value_types(models, tmp_path, changes, contains):
    d = _copy_with_config(models, tmp_path, **changes)
    _expect_error(tmp_path, d, contains=contains)


@pytest.mark.parametrize("text,contains", [
    ("[1, 2, 3]", "config.json must be a JSON object, not a list"),
    ("null", "config.json must be a JSON object, not a NoneType"),
    ("[" * 100000, "cannot read"),
])
def test_error_config_not_an_object(models, tmp_path, text, contains):
    d = _copy_with_config(models, tmp_path)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(text)
    _expect_error(tmp_path, d, contains=contains)


def _rewrite_safetensors_header(path: str, edit) -> None:
    """Apply ``edit(header_dict)`` to a safetensors file's JSON header, keeping the data bytes."""
    import struct

    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        data = f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _first_tensor(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


@pytest.mark.parametrize("edit,contains", [
    # a shape that needs more bytes than its offsets give
    (lambda h, n: h[n].update(shape=[s * 4 for s in h[n]["shape"]]), "needs"),
    (lambda h, n: h[n].update(data_offsets=h[n]["data_offsets"][::-1]), "are reversed or negative"),
    (lambda h, n: h[n].update(data_offsets=[-8, 0]), "are reversed or negative"),
    (lambda h, n: h[n].update(shape=[-1, 4]), "is not a list of non-negative integers"),
    (lambda h, n: h[n].update(shape="big"), "is not a list of non-negative integers"),
    (lambda h, n: h[n].update(data_offsets=[0]), "is not a pair of integers"),
    (lambda h, n: h.update({n: [1, 2]}), "the entry is not an object"),
    (lambda h, n: h[n].pop("dtype"), "no dtype"),
])
def test_error_malformed_safetensors_header(models, tmp_path, edit, contains):
    d = _copy_with_config(models, tmp_path)
    st = os.path.join(d, "model.safetensors")
    _rewrite_safetensors_header(st, lambda h: edit(h, _first_tensor(h)))
    msg = _expect_error(tmp_path, d, contains=contains)
    assert "model.safetensors" in msg


def test_error_safetensors_header_not_an_object(models, tmp_path):
    import struct

    d = _copy_with_config(models, tmp_path)
    st = os.path.join(d, "model.safetensors")
    raw = b"[1, 2]  "
    with open(st, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    _expect_error(tmp_path, d, contains="the safetensors header is not a JSON object")


@pytest.mark.parametrize("edit,contains", [
    (lambda tj: tj.update(model=["BPE"]), "tokenizer.json: 'model' must be an object, not a list"),
    (lambda tj: tj.update(model="BPE"), "'model' must be an object, not a str"),
    (lambda tj: tj["model"].update(vocab=["a", "b"]), "model.vocab must map token texts"),
    (lambda tj: tj["model"].update(merges=[1, 2]), "model.merges must be a list"),
    (lambda tj: tj.update(added_tokens={"a": 1}), "'added_tokens' must be a list"),
    (lambda tj: tj.update(pre_tokenizer=[1]), "'pre_tokenizer' must be an object or null"),
])
def test_error_malformed_tokenizer_json(models, tmp_path, edit, contains):
    d = tmp_path / "tok"
    shutil.copytree(models["bpe"], d)
    with open(d / "tokenizer.json") as f:
        tj = json.load(f)
    edit(tj)
    with open(d / "tokenizer.json", "w") as f:
        json.dump(tj, f)
    _expect_error(tmp_path, str(d), contains=contains)


def test_error_tokenizer_json_the_engine_cannot_load(models, tmp_path):
    """A tokenizer.json that is not byte-level BPE is stored for the engine's tokenizers to load;
    one it cannot load (here {}: no model) converted with a warning and every run then failed."""
    d = tmp_path / "tok"
    shutil.copytree(models["bpe"], d)
    (d / "tokenizer.json").write_text("{}")
    _expect_error(tmp_path, str(d), contains="tokenizer.json: ")


def test_a_config_without_architectures_takes_its_model_type(models, tmp_path):
    """transformers loads a config with model_type and no architectures; pyinfer refused it as
    'unsupported architecture (none)'."""
    from convert.cli import main as convert_main

    d = _copy_with_config(models, tmp_path, architectures=None)
    out = str(tmp_path / "m.gguf")
    assert convert_main([d, out, "--dense", "--outtype", "f32"]) == 0
    from pyinfer.config import ModelConfig

    assert ModelConfig.from_gguf(gguf.GGUFReader(out)).family == "llama"


def test_error_tokenizer_json_not_an_object(models, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(models["bpe"], d)
    (d / "tokenizer.json").write_text('"just a string"')
    _expect_error(tmp_path, str(d), contains="tokenizer.json: must be a JSON object, not a str")


def test_fewer_layers_in_config_than_checkpoint_is_refused(models, tmp_path):
    """models["bpe"] has 2 layers; a config saying 1 would silently drop layer 1."""
    d = tmp_path / "short"
    shutil.copytree(models["bpe"], d)
    with open(d / "config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 1
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    _expect_error(tmp_path, str(d), contains="tensor(s) the conversion would leave out (model.layers.1.")
    out = tmp_path / "out.gguf"
    p = run_cli(str(d), str(out), "--dense", "--allow-unused-tensors")
    assert p.returncode == 0, p.stderr
    assert "converting anyway (--allow-unused-tensors)" in p.stderr
    assert field(gguf.GGUFReader(str(out)), C.K_BLOCK_COUNT) == 1


def test_gguf_with_layers_beyond_block_count_is_refused(converted, tmp_path):
    """A GGUF source whose block_count is smaller than its blk.N tensors would be truncated too."""
    src = gguf.GGUFReader(converted)
    path = str(tmp_path / "short.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        if f.name == C.K_BLOCK_COUNT:
            w.add_uint32(f.name, 1)
        elif vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vtype, f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vtype)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _expect_error(tmp_path, path, contains="tensor(s) of layers beyond its block_count 1 (blk.1.")


def test_perplexity_tokenizes_as_llama_cpp_does(models, tmp_path):
    """pyinfer-perplexity of a model that adds BOS (SentencePiece, Llama-2 style): llama.cpp
    tokenizes the text with BOS in front and cuts chunks from that; pyinfer tokenized without
    it and put BOS over each chunk's first token, so the text's first token was lost and every
    chunk boundary moved by one. The result is an independent computation's, with llama.cpp's
    "Final estimate: PPL = x +/- err" (err: the standard error of the mean per-token nll, times
    the perplexity), and --chunks -1 (llama.cpp's default) means all."""
    import math

    from pyinfer.engine import Engine

    out = str(tmp_path / "spm.gguf")
    convert(models["spm"], out, "f32")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and runs far away. " * 12)
    eng = Engine(out, n_ctx=32, n_threads=1)
    tok = eng.tokenizer
    assert tok.add_bos and tok.bos_id is not None
    ids = [tok.bos_id] + tok.encode(text.read_text(), add_bos=False, parse_special=False)
    nll = []
    for c in range(len(ids) // 32):
        chunk = ids[c * 32:(c + 1) * 32]
        chunk[0] = tok.bos_id
        eng.reset()
        z = eng.forward(chunk, 0, all_logits=True).astype(np.float64)[16:31]
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        nll += list(lse - z[np.arange(15), chunk[17:32]])
    nll = np.asarray(nll)
    ppl = math.exp(nll.mean())
    err = nll.std() / math.sqrt(len(nll) - 1) * ppl  # llama.cpp: sqrt((E[nll^2] - E[nll]^2) / (n - 1))
    r = subprocess.run([sys.executable, "-m", "pyinfer.perplexity", out, "-f", str(text), "-c", "32",
                        "-t", "1", "--chunks", "-1"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    got = r.stdout.splitlines()
    assert got[0].startswith(f"perplexity: {ppl:.4f} over {len(nll)} tokens"), (got, ppl)
    # llama.cpp's running estimate after each chunk, then its final line
    assert got[1] == "".join(f"[{k}]{math.exp(nll[:15 * k].mean()):.4f},"
                             for k in range(1, len(nll) // 15 + 1)), got[1]
    assert got[2] == f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}", (got, err)


@pytest.mark.parametrize("key,value,vtype,message", [
    (C.K_EMBEDDING_LENGTH, "64", "STRING", "stored as STRING, expected an integer"),
    (C.K_CONTEXT_LENGTH, -5, "INT32", "context_length is -5"),
    (C.K_CONTEXT_LENGTH, 0, "UINT32", "context_length is 0"),
    (C.K_HEAD_COUNT, 0, "UINT32", "n_head is 0"),
    (C.K_HEAD_COUNT_KV, 3, "UINT32", "do not share 3 key/value heads evenly"),
    (C.K_RMS_EPS, 0.0, "FLOAT32", "must be a positive number"),
    (C.K_ROPE_FREQ_BASE, "1e4", "STRING", "stored as STRING, expected a number"),
    (C.K_TOK_EOS, 10**6, "UINT32", "eos token id 1000000 is outside the vocabulary"),
])
def test_bad_source_metadata_is_one_line_before_anything_is_written(tmp_path, key, value, vtype,
                                                                     message):
    """A llama.cpp-style source whose metadata no run could use: the converter raised
    ZeroDivisionError / TypeError / struct.error mid-way, or wrote a file every run refused."""
    from gguf import GGUFValueType as VT

    from tests._tiny_gguf import write_tiny_gguf

    src = write_tiny_gguf(str(tmp_path / "src.gguf"), overrides={key: (value, VT[vtype], None)})
    r = subprocess.run([sys.executable, "-m", "convert.cli", src, str(tmp_path / "o.gguf"),
                        "--dense", "-t", "1"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["src.gguf"]


def test_dense_refuses_calibration_flags_it_would_not_read(tmp_path):
    """--dense reads --calib/--calib-tokens/--calib-seed only for its importance matrix: with
    --no-imatrix, or where nothing is quantized to q4_0 / q5_0 from floats (q8_0 here), they were
    accepted and ignored (a binary --calib file too)."""
    from tests._tiny_gguf import write_tiny_gguf

    src = write_tiny_gguf(str(tmp_path / "src.gguf"))
    calib = tmp_path / "c.txt"
    calib.write_text("the cat sat on the mat\n" * 50)

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "convert.cli", src, str(tmp_path / "o.gguf"),
                               "--dense", "-t", "1", *flags], capture_output=True, text=True,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)

    r = run("--no-imatrix", "--calib", str(calib))
    assert r.returncode == 1 and "--calib needs the importance matrix's calibration" in r.stderr
    r = run("--outtype", "q8_0", "--calib-tokens", "64")
    assert r.returncode == 1 and "quantizes no tensor to q4_0 / q5_0" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["c.txt", "src.gguf"]
    r = run("--outtype", "q8_0")
    assert r.returncode == 0, r.stderr


def _tiny_hf(model_dir: str, seed: int = 0, tie: bool = False):
    """A 2-layer random Llama saved with transformers, with a BPE tokenizer; returns the model."""
    import torch
    import transformers as T

    from tests._models import make_bpe_tokenizer

    os.makedirs(model_dir, exist_ok=True)
    vocab = make_bpe_tokenizer(model_dir)
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                        initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    return T.LlamaForCausalLM(cfg).eval()


def _logits_both(model_dir: str, out: str, ids: list[int]):
    """(pyinfer's, transformers') logits of ``ids`` for an f32 --dense conversion of model_dir."""
    import torch
    import transformers as T

    from convert.cli import main as convert_main
    from pyinfer.engine import Engine

    assert convert_main([model_dir, out, "--dense", "--outtype", "f32", "-t", "1"]) == 0
    ref_model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    return Engine(out, n_ctx=32, n_threads=1).model.forward(ids, 0, all_logits=True), ref


IDS = [1, 17, 42, 7, 99, 3, 64, 5]


def test_tied_config_with_its_own_lm_head_uses_it_as_transformers_does(tmp_path, capsys):
    """tie_word_embeddings true and an lm_head.weight unlike the embeddings: transformers 5 leaves
    them untied ("we will NOT tie them"); the converter dropped lm_head.weight silently."""
    d = str(tmp_path / "m")
    _tiny_hf(d, tie=False).save_pretrained(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    ours, ref = _logits_both(d, str(tmp_path / "m.gguf"), IDS)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert "lm_head.weight differs from the embeddings" in capsys.readouterr().err


def test_a_single_safetensors_file_wins_over_an_index_as_in_transformers(tmp_path):
    """model.safetensors beside model.safetensors.index.json and its shards: transformers loads
    the single file; the converter took the shards."""
    from safetensors.torch import save_file

    d = str(tmp_path / "m")
    _tiny_hf(d, seed=0).save_pretrained(d, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    other = _tiny_hf(d, seed=1)
    save_file({k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"
               or not other.config.tie_word_embeddings},
              os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    ours, ref = _logits_both(d, str(tmp_path / "m.gguf"), IDS)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("act", [["gelu_pytorch_tanh"], {"a": 1}])
def test_gemma3_activation_of_the_wrong_type_is_one_line(act):
    from convert.hf import LlamaHParams
    from pyinfer.errors import PyinferError

    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "hidden_activation": act}
    with pytest.raises(PyinferError, match="unsupported Gemma 3 hidden_activation"):
        LlamaHParams.from_config(cfg)


def test_swish_is_silu(tmp_path):
    """transformers' ACT2FN takes "swish" as SiLU; the converter refused it."""
    d = str(tmp_path / "m")
    _tiny_hf(d).save_pretrained(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["hidden_act"] = "swish"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    ours, ref = _logits_both(d, str(tmp_path / "m.gguf"), IDS)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
