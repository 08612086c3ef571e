"""tools/make_7b.py on small dimensions: its llama.cpp-style file is read by gguf, converted by
pyinfer-convert and run by the engine; ``--direct`` gives the same tensors as the converter except
ffn_down_t, which keeps the type; the weights have the scale asked for (gguf's dequantizer)."""
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
