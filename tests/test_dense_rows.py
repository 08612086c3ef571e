"""A dense file's down projection in llama.cpp's row layout (``pyinfer.ffn_layout`` "rows",
what ``pyinfer-convert --dense`` writes since session 9) against the same weights in the
neuron-major layout (``ffn_down_t``, what every file had before, still loaded as it is).

The files are written here from the same float weights (tests/_tiny_gguf.py) with gguf's
writer, so the two layouts hold exactly transposed values (F16/F32, and Q8_0 blocks quantized
along each layout's own rows); the references are gguf's dequantizer and the neuron-major engine.
"""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C
from pyinfer import placement as P
from pyinfer.engine import Engine
from pyinfer.errors import PyinferError
from tests import _tiny_gguf as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VT = gguf.GGUFValueType
PROMPT = [1, 5, 9, 2, 7, 30, 11, 4]


def write_pair(tmp_path, qtype=gguf.GGMLQuantizationType.F16, sparse=False):
    """(neuron-major path, rows path): the tiny model, dense unless ``sparse``, its down
    projection at ``qtype`` as ffn_down_t (n_ff, n_embd) or as ffn_down (n_embd, n_ff)."""
    base = T.tiny_tensors()
    drop = {} if sparse else {C.K_SPARSE_MODE: None, C.K_ACT_THRESHOLD: None,
                              C.K_PRED_THRESHOLD: None, C.K_PRED_CPU: None}
    nm, rows = str(tmp_path / "nm.gguf"), str(tmp_path / "rows.gguf")
    tensors_nm, tensors_rows = {}, {}
    for i in range(T.N_LAYER):
        down_t = base[C.FFN_DOWN_T.format(bid=i)][0]  # (n_ff, n_embd) f32
        tensors_nm[C.FFN_DOWN_T.format(bid=i)] = (down_t, qtype)
        tensors_rows[C.FFN_DOWN_T.format(bid=i)] = None
        tensors_rows[C.SRC_FFN_DOWN.format(bid=i)] = (np.ascontiguousarray(down_t.T), qtype)
        if not sparse:
            for t in (tensors_nm, tensors_rows):
                t[C.FC1.format(bid=i)] = t[C.FC2.format(bid=i)] = None
    T.write_tiny_gguf(nm, overrides=drop, tensors=tensors_nm)
    T.write_tiny_gguf(rows, overrides={**drop, C.K_FFN_LAYOUT: (C.FFN_LAYOUT_ROWS, VT.STRING, None)},
                      tensors=tensors_rows)
    return nm, rows


def test_layout_in_the_file(tmp_path):
    """gguf's reader sees ffn_down (n_embd rows of n_ff, ggml shape (n_ff, n_embd)) and no
    ffn_down_t in the rows file, the reverse in the other."""
    nm, rows = write_pair(tmp_path)
    for path, layout in ((nm, C.FFN_LAYOUT_NEURON_MAJOR), (rows, C.FFN_LAYOUT_ROWS)):
        r = gguf.GGUFReader(path)
        assert r.fields[C.K_FFN_LAYOUT].contents() == layout
        by = {t.name: t for t in r.tensors}
        name = C.SRC_FFN_DOWN if layout == C.FFN_LAYOUT_ROWS else C.FFN_DOWN_T
        other = C.FFN_DOWN_T if layout == C.FFN_LAYOUT_ROWS else C.SRC_FFN_DOWN
        t = by[name.format(bid=0)]
        want = (T.N_FF, T.N_EMBD) if layout == C.FFN_LAYOUT_ROWS else (T.N_EMBD, T.N_FF)
        assert tuple(int(d) for d in t.shape) == want and other.format(bid=0) not in by


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_rows_file_equals_neuron_major(tmp_path, qtype, n_threads):
    """Prefill (the GEMMs) and decode (GEMVs over the rows; the fused kernel over ffn_down_t) of
    the two layouts give the same logits; the rows file maps ffn_down, not ffn_down_t."""
    nm, rows = write_pair(tmp_path, qtype)
    a = Engine(nm, n_ctx=32, n_threads=n_threads)
    b = Engine(rows, n_ctx=32, n_threads=n_threads)
    assert not b.llamacpp and not b.is_sparse
    assert all(lw.ffn_down_t is None and lw.ffn_down.shape == (T.N_EMBD, T.N_FF)
               for lw in b.weights.layers)
    assert all(lw.ffn_down is None and lw.ffn_down_t is not None for lw in a.weights.layers)
    pa = a.model.forward(PROMPT, 0, all_logits=True)
    pb = b.model.forward(PROMPT, 0, all_logits=True)
    np.testing.assert_allclose(pb, pa, rtol=0, atol=2e-4 * np.abs(pa).max())
    da = np.stack([a.model.forward([t], i) for i, t in enumerate(PROMPT)])
    db = np.stack([b.model.forward([t], i) for i, t in enumerate(PROMPT)])
    np.testing.assert_allclose(db, da, rtol=0, atol=2e-4 * np.abs(da).max())
    np.testing.assert_allclose(db, pb, rtol=0, atol=2e-4 * np.abs(pb).max())


def test_sparse_mode_on_a_rows_file_is_one_clear_error(tmp_path):
    """A rows file that (by hand) carries a sparse mode: the engine refuses it in one line
    naming --dense, and runs it with --dense; so do the CLI and the API."""
    _, rows = write_pair(tmp_path, sparse=True)
    with pytest.raises(PyinferError, match="row layout.*--dense"):
        Engine(rows, n_ctx=32)
    assert Engine(rows, n_ctx=32, dense=True).model.forward(PROMPT, 0).shape == (len(T.tiny_vocab()[0]),)
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "pyinfer.cli", "-m", rows, "-p", "ab", "-n", "2", "--temp", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "--dense" in lines[0] and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--dense"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=env)
    assert p.returncode == 0, p.stderr


def test_placement_counts_ffn_down_as_ffn(tmp_path):
    """placement.py: ffn_down counts as an FFN matrix (not fixed bytes) and a neuron costs the
    same bytes in either layout of an F16 file."""
    nm, rows = write_pair(tmp_path)
    sizes = {}
    for path in (nm, rows):
        r = gguf.GGUFReader(path)
        e = Engine(path, n_ctx=32)
        s = P.tensor_sizes(r)
        sizes[path] = (P.fixed_gpu_bytes(s, e.cfg), P.ffn_bytes_per_neuron(s, e.cfg),
                       P.model_gpu_bytes(s, e.cfg))
    assert sizes[nm] == sizes[rows]
    q4_0_row = T.N_EMBD // 32 * 18  # gate and up are Q4_0 in the tiny model, down f16
    assert sizes[rows][1][0] == 2 * q4_0_row + T.N_EMBD * 2 + P.NEURON_ID_BYTES  # and its id


def test_inspect_names_the_layout(tmp_path):
    from pyinfer.info import describe, render

    nm, rows = write_pair(tmp_path)
    a, b = describe(nm), describe(rows)
    assert (a["layout"], a["ffn_layout"]) == ("pyinfer", C.FFN_LAYOUT_NEURON_MAJOR)
    assert (b["layout"], b["ffn_layout"]) == ("pyinfer", C.FFN_LAYOUT_ROWS)
    assert "ffn_down in row layout, dense only" in render(b)
    assert "ffn_down_t, neuron-major" in render(a)


def test_unknown_layout_is_refused(tmp_path):
    path = str(tmp_path / "odd.gguf")
    T.write_tiny_gguf(path, overrides={C.K_FFN_LAYOUT: ("columns", VT.STRING, None)})
    with pytest.raises(PyinferError, match="'columns'"):
        Engine(path, n_ctx=32)


@pytest.mark.parametrize("layout", ["nm", "rows"])
def test_profiler_records_one_token_pieces(tmp_path, layout):
    """The offline profiler over either layout: a one-token piece (a 9-token sequence cut at 8)
    is recorded like any other, equal to profiling that token alone (it used to take the fused
    one-token decode, which records nothing)."""
    from predictors.profile import profile

    nm, rows = write_pair(tmp_path)
    eng = Engine(nm if layout == "nm" else rows, n_ctx=32, n_threads=1)
    seq = [3, 5, 9, 2, 7, 30, 11, 4, 6]
    prof = profile(eng, [seq], chunk_len=8, progress=False)
    alone = profile(eng, [seq[8:]], chunk_len=8, progress=False)
    assert prof.n_tokens == 9 and prof.tokens == seq
    np.testing.assert_array_equal(prof.x[:, 8], alone.x[:, 0])
    np.testing.assert_array_equal(prof.act[:, 8], alone.act[:, 0])
    first = profile(eng, [seq[:8]], chunk_len=8, progress=False)
    np.testing.assert_array_equal(prof.x[:, :8], first.x)
