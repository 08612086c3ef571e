"""tools/bench_llamacpp_file.py (issue 11's Q4_K_M test): a llama.cpp file in llama-quantize's
Q4_K_M mix converts with ``--outtype auto`` at its size and keeps each tensor's type.

The mix is written here without llama.cpp: the per-tensor rule of llama.cpp's
``llama_tensor_get_type`` for Q4_K_M (src/llama-quant.cpp: Q4_K, with attn_v and ffn_down at Q6_K
in the layers ``use_more_bits`` picks) and its ``tensor_type_fallback`` for rows that are not whole
256-value super-blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as a real run of
llama-quantize on SmolLM2 gave (docs/benchmarks.md, session 6). n_embd is 192, so, as with
SmolLM2's 576, every matrix with rows of n_embd falls back while ffn_down (rows of n_ff = 512)
keeps its K-quant, and ffn_down_t (rows of n_embd) must fall back in the converted file.
The end-to-end test with llama.cpp's own quantizer runs only where a llama-quantize binary is
given (PYINFER_LLAMA_QUANTIZE or PATH)."""
import os
import shutil
import sys

import gguf
import numpy as np
import pytest

from tests._models import make_random_llama, write_llamacpp_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_llamacpp_file as T  # noqa: E402

QT = gguf.GGMLQuantizationType
N_LAYER = 3
# llama.cpp src/llama-quant.cpp tensor_type_fallback
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(i: int, n: int) -> bool:  # llama.cpp src/llama-quant.cpp
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, shape) -> str:
    """llama-quantize's Q4_K_M choice for a llama tensor of numpy shape (rows, cols)."""
    base = "q4_k"
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        if use_more_bits(int(name.split(".")[1]), N_LAYER):
            base = "q6_k"
    if name == "token_embd.weight":
        base = "q6_k"  # tied embeddings: the output's Q6_K
    if shape[1] % 256:
        base = FALLBACK[base.upper()].lower()
    return base


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q4km")
    model_dir = make_random_llama(tmp / "hf", "silu", True, 1, "bpe", hidden_size=192,
                                  intermediate_size=512, n_layers=N_LAYER, n_heads=3, head_dim=64)
    src = str(tmp / "model.Q4_K_M.gguf")
    write_llamacpp_gguf(model_dir, src, "q4_k", qtype_of=q4_k_m_type)
    return src


def test_q4_k_m_dense_conversion_copies_every_tensor_as_stored(q4_k_m, tmp_path):
    """What the tool converts (``pyinfer-convert --dense``): ffn_down keeps llama.cpp's row
    layout, so every matrix is the source's own blocks, byte for byte."""
    out = str(tmp_path / "pyinfer.gguf")
    T.convert(q4_k_m, out)
    a, b, ratio = T.size_report(q4_k_m, out)
    assert abs(ratio - 1) < 0.10, ratio  # the target
    src_t = {t.name: t for t in gguf.GGUFReader(q4_k_m).tensors}
    n_down = 0
    for t in gguf.GGUFReader(out).tensors:
        assert "ffn_down_t" not in t.name, t.name
        if t.name.endswith("ffn_down.weight"):
            n_down += 1
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue  # norms (and Q/K rows are reordered, not re-encoded: compared below)
        s = src_t[t.name]
        assert t.tensor_type == s.tensor_type, t.name
        if "attn_q" not in t.name and "attn_k" not in t.name:  # Q/K rows are reordered at conversion
            assert np.array_equal(np.asarray(t.data), np.asarray(s.data)), t.name
    assert n_down == N_LAYER
    assert "ffn_down Q4_K x2 + Q6_K x1" in T.census_text(T.type_census(out))


def test_q4_k_m_mix_converts_at_its_size_and_types(q4_k_m, tmp_path):
    src_census = T.type_census(q4_k_m)
    # the mix is llama.cpp's: K-quants only in ffn_down, both Q4_K and Q6_K there
    assert src_census["ffn_down"] == {"Q4_K": 2, "Q6_K": 1}, src_census
    assert src_census["ffn_gate"] == {"Q5_0": N_LAYER} and src_census["token_embd"] == {"Q8_0": 1}
    out = str(tmp_path / "pyinfer.gguf")
    T.convert(q4_k_m, out, rows=False)  # the neuron-major layout a sparse conversion writes
    a, b, ratio = T.size_report(q4_k_m, out)
    assert (a, b) == (os.path.getsize(q4_k_m), os.path.getsize(out))
    assert abs(ratio - 1) < 0.10, ratio  # the target
    src_t = {t.name: t for t in gguf.GGUFReader(q4_k_m).tensors}
    n_down = 0
    for t in gguf.GGUFReader(out).tensors:
        if "ffn_down_t" in t.name:
            n_down += 1
            down = src_t[t.name.replace("ffn_down_t", "ffn_down")]
            # rows of n_embd (192): llama.cpp's own fallback of ffn_down's type
            assert t.tensor_type.name == FALLBACK[down.tensor_type.name], t.name
            base = gguf.quants.dequantize(down.data, down.tensor_type).T
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            err = np.sqrt(np.mean((got - base) ** 2) / np.mean(base ** 2))
            assert err < 0.06, (t.name, err)  # one more rounding at 5 or 8 bits
        else:
            assert t.tensor_type == src_t[t.name].tensor_type, t.name  # copied at its type
    assert n_down == N_LAYER
    text = T.census_text(T.type_census(out))
    assert "ffn_down_t Q5_0 x2 + Q8_0 x1" in text and "F32" not in text


def test_names_and_commands(tmp_path):
    assert T.build_path("/w", "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_K_M") == \
        "/w/SmolLM2-135M-Instruct.Q4_K_M.gguf"
    assert T.build_path("/w", "/m/model.gguf", "Q6_K") == "/w/model.Q6_K.gguf"
    assert T.quantize_command("/b/llama-quantize", "in.gguf", "out.gguf", "Q4_K_M", 2) == \
        ["/b/llama-quantize", "--allow-requantize", "in.gguf", "out.gguf", "Q4_K_M", "2"]


def test_no_quantizer_is_a_clear_error(q4_k_m, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    code = T.main(["--source", q4_k_m, "--workdir", str(tmp_path / "w"), "--types", "Q5_K_M",
                   "--no-bench"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: no llama.cpp quantizer"), err
    assert not any(f.endswith(".gguf") or f.endswith(".part") for f in os.listdir(tmp_path / "w"))
    code = T.main(["--source", str(tmp_path / "missing.gguf"), "--workdir", str(tmp_path)])
    assert code == 1 and "not found" in capsys.readouterr().err


def test_failing_quantizer_leaves_nothing(q4_k_m, tmp_path):
    """A quantizer that exits non-zero: a one-line error with its last line, no file left."""
    fake = tmp_path / "llama-quantize"
    fake.write_text("#!/bin/sh\necho partial > \"$3\"\necho 'unknown type' >&2\nexit 3\n")
    fake.chmod(0o755)
    out = str(tmp_path / "x.gguf")
    with pytest.raises(T.PyinferError, match="exit 3.*unknown type"):
        T.build(q4_k_m, out, "Q9_K", str(fake))
    assert os.listdir(tmp_path) == ["llama-quantize"]


def _llama_quantize():
    return os.environ.get("PYINFER_LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.mark.skipif(not _llama_quantize(), reason="no llama-quantize binary (set PYINFER_LLAMA_QUANTIZE)")
def test_tool_with_llama_quantize(q4_k_m, tmp_path, capsys):
    """llama.cpp itself re-quantizes the mix to Q4_K_M; the tool converts it within 10%."""
    code = T.main(["--source", q4_k_m, "--workdir", str(tmp_path), "--types", "Q4_K_M",
                   "--llama-quantize", _llama_quantize(), "--no-bench"])
    assert code == 0
    lc = T.build_path(str(tmp_path), q4_k_m, "Q4_K_M")
    census = T.type_census(lc)
    assert set(census["ffn_down"]) <= {"Q4_K", "Q6_K"} and "Q6_K" in census["ffn_down"]
    _, _, ratio = T.size_report(lc, str(tmp_path / "pyinfer.Q4_K_M.gguf"))
    assert abs(ratio - 1) < 0.10
    assert "| Q4_K_M |" in capsys.readouterr().out
