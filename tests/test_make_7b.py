"""tools/make_7b.py on small dimensions: its llama.cpp-style file is read by gguf, converted by
pyinfer-convert and run by the engine; ``--direct`` gives the same tensors as the converter except
ffn_down_t, which keeps the type; ``--dense-direct`` equals ``pyinfer-convert --dense`` byte for
byte, ffn_down copied as llama.cpp stores it, and gives the llama.cpp file's logits; the weights
have the scale asked for (gguf's dequantizer)."""
import os
import sys

import gguf
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_7b  # noqa: E402

from pyinfer import constants as C  # noqa: E402

QT = gguf.GGMLQuantizationType
SMALL = dict(n_embd=256, n_ff=512, n_head=4, n_vocab=300, n_ctx=64, rope_base=10000.0)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K])
def test_make_convert_run(tmp_path, qtype):
    from convert.cli import convert
    from pyinfer.engine import Engine

    src, conv, direct = (str(tmp_path / n) for n in ("src.gguf", "conv.gguf", "direct.gguf"))
    pool = make_7b.RowPool(qtype, 16, 0.02, 0)
    make_7b.make(src, qtype, 2, pool, SMALL)
    r = gguf.GGUFReader(src)
    mats = {t.name: t for t in r.tensors if len(t.shape) == 2}
    assert len(mats) == 2 + 2 * 7 and {t.tensor_type for t in mats.values()} == {qtype}
    down = mats[C.SRC_FFN_DOWN.format(bid=1)]
    assert tuple(int(d) for d in down.shape[::-1]) == (256, 512)  # llama.cpp's (n_embd, n_ff)
    w = gguf.quants.dequantize(down.data, qtype)
    assert 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.002
    assert len(r.fields[C.K_TOK_LIST].data) == 300
    convert(src, conv, "auto", progress=False)
    make_7b.make_direct(src, direct, pool)
    a, b = ({t.name: t for t in gguf.GGUFReader(p).tensors} for p in (conv, direct))
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        if "ffn_down_t" not in name:
            np.testing.assert_array_equal(np.asarray(b[name].data), np.asarray(t.data), name)
    for path in (conv, direct):
        eng = Engine(path, n_ctx=32, n_threads=1, dense=True)
        logits = eng.model.forward([1, 5, 300 - 1, 7], 0)
        assert logits.shape == (300,) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K])
def test_dense_direct(tmp_path, qtype):
    """``--dense-direct``: the file pyinfer-convert --dense writes (every tensor the same bytes),
    ffn_down in llama.cpp's row layout with the source's blocks, no ffn_down_t; the engine runs it
    to the llama.cpp file's own logits (the same weights, the same kernels)."""
    from convert.cli import main as convert_main
    from pyinfer.engine import Engine

    src, conv, direct = (str(tmp_path / n) for n in ("src.gguf", "conv.gguf", "direct.gguf"))
    make_7b.make(src, qtype, 2, make_7b.RowPool(qtype, 16, 0.02, 0), SMALL)
    assert convert_main([src, conv, "--dense"]) == 0
    make_7b.make_direct(src, direct, None, dense=True)
    s, a, b = ({t.name: t for t in gguf.GGUFReader(p).tensors} for p in (src, conv, direct))
    assert a.keys() == b.keys() and not [n for n in b if "ffn_down_t" in n]
    for name, t in b.items():
        assert a[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(np.asarray(a[name].data), np.asarray(t.data), name)
    for i in range(2):
        n = C.SRC_FFN_DOWN.format(bid=i)
        np.testing.assert_array_equal(np.asarray(b[n].data), np.asarray(s[n].data), n)
    assert gguf.GGUFReader(direct).fields[C.K_FFN_LAYOUT].contents() == C.FFN_LAYOUT_ROWS
    ids = [1, 5, 300 - 1, 7]
    e_lc, e_d = Engine(src, n_ctx=32, n_threads=1), Engine(direct, n_ctx=32, n_threads=1)
    assert e_lc.llamacpp and not e_d.llamacpp
    np.testing.assert_allclose(e_d.model.forward(ids, 0, all_logits=True),
                               e_lc.model.forward(ids, 0, all_logits=True), rtol=1e-5, atol=1e-6)


def test_compare_and_llamacpp(tmp_path, capsys):
    """``compare`` runs pyinfer's own file (dense and sparse) and the llama.cpp file as it is,
    interleaved; ``llamacpp`` reads llama-bench's JSON (a stand-in script that prints what
    llama-bench -o json prints: one object per test with n_prompt, n_gen and avg_ts)."""
    from convert.cli import convert

    src, conv = str(tmp_path / "src.gguf"), str(tmp_path / "conv.gguf")
    make_7b.make(src, QT.Q4_0, 1, make_7b.RowPool(QT.Q4_0, 16, 0.02, 0), SMALL)
    convert(src, conv, "auto", progress=False)
    make_7b.compare(conv, src, None, 1, 8, 2, 0.5, 1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| pyinfer")]
    assert len(rows) == 3 and "as it is" in rows[2] and "50% sparse" in rows[1]
    for line in rows:
        decode = float(line.split("|")[4])
        assert np.isfinite(decode) and decode > 0, line
    # a dense file (ffn_down in row layout) has no sparse runner
    dense = str(tmp_path / "dense.gguf")
    make_7b.make_direct(src, dense, None, dense=True)
    make_7b.compare(dense, src, None, 1, 8, 2, 0.5, 1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| pyinfer")]
    assert len(rows) == 2 and "dense.gguf" in rows[0] and "as it is" in rows[1]
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "echo '[{\"n_prompt\": 32, \"n_gen\": 0, \"avg_ts\": 12.5},"
                    " {\"n_prompt\": 0, \"n_gen\": 8, \"avg_ts\": 3.25}]'\n")
    fake.chmod(0o755)
    r = make_7b.llamacpp_bench(str(fake), src, 2, 32, 8, 1)
    assert (r["pp"], r["tg"]) == (12.5, 3.25) and r["wall_s"] > 0 and r["peak_rss_mib"] > 0
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="failed to load model"):
        make_7b.llamacpp_bench(str(fake), src, 2, 32, 8, 1)
