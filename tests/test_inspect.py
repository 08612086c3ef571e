"""pyinfer-inspect on files whose contents the test wrote itself (tests/_tiny_gguf.py): every fact
it prints comes back equal to what went into the file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C
from tests import _tiny_gguf as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VT = gguf.GGUFValueType
CALIB_TOKENS = 200


def inspect(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pyinfer.info", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """The tiny model with the offline stage's metadata, activation counts and a GPU split."""
    rng = np.random.default_rng(3)
    counts = [rng.integers(0, CALIB_TOKENS, T.N_FF).astype(np.int32) for _ in range(T.N_LAYER)]
    masks = [(rng.random(T.N_FF) < 0.25).astype(np.int32) for _ in range(T.N_LAYER)]
    recall, precision = [0.991, 0.985], [0.5, 0.625]
    overrides = {
        C.K_SPARSE_MODE: (C.SPARSE_MODE_GLU, VT.STRING, None),
        C.K_PRED_RECALL: (recall, VT.ARRAY, VT.FLOAT32),
        C.K_PRED_PRECISION: (precision, VT.ARRAY, VT.FLOAT32),
        C.K_PRED_RANK: ([T.RANK] * T.N_LAYER, VT.ARRAY, VT.INT32),
        C.K_PRED_CPU: ([1, 0], VT.ARRAY, VT.INT32),
        C.K_TARGET_RECALL: (0.99, VT.FLOAT32, None),
        C.K_TARGET_SPARSITY: (0.5, VT.FLOAT32, None),
        C.K_CALIB_SOURCE: ("self-generated", VT.STRING, None),
        C.K_CALIB_TOKENS: (CALIB_TOKENS, VT.UINT32, None),
        C.K_CALIB_SEED: (7, VT.UINT32, None),
        C.K_VRAM_BUDGET: (3 << 20, VT.UINT64, None),
    }
    tensors = {}
    for i in range(T.N_LAYER):
        tensors[C.ACT_COUNT.format(bid=i)] = (counts[i], C.QT.I32)
        tensors[C.GPU_IDX.format(bid=i)] = (masks[i], C.QT.I32)
    path = str(tmp_path_factory.mktemp("inspect") / "calibrated.gguf")
    T.write_tiny_gguf(path, overrides=overrides, tensors=tensors)
    return path, counts, masks, recall, precision


def test_json_facts_equal_what_was_written(calibrated):
    path, counts, masks, recall, precision = calibrated
    r = inspect(path, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["architecture"], info["n_layer"], info["n_embd"], info["n_ff"], info["n_head"],
            info["n_head_kv"], info["n_ctx_train"]) == ("llama", T.N_LAYER, T.N_EMBD, T.N_FF, T.N_HEAD,
                                                        T.N_HEAD_KV, 64)
    assert info["layout"] == "pyinfer" and info["split"] is None
    written = T.tiny_tensors()
    n_params = sum(a.size for name, (a, _) in written.items() if ".fc" not in name)
    assert info["parameters"] == n_params
    for qt in (C.QT.F16, C.QT.Q8_0, C.QT.Q4_0):
        assert info["types"][qt.name]["tensors"] == sum(1 for a, t in written.values() if t == qt)
    assert info["tokenizer"]["n_tokens"] == len(T.tiny_vocab()[0]) and info["tokenizer"]["chat_template"]
    sp = info["sparse"]
    assert sp["mode"] == "glu" and sp["calibration"] == {"source": "self-generated", "tokens": CALIB_TOKENS,
                                                        "seed": 7}
    assert sp["target_recall"] == pytest.approx(0.99) and sp["vram_budget_bytes"] == 3 << 20
    for i, row in enumerate(sp["layers"]):
        assert row["calibration_sparsity"] == pytest.approx(1 - counts[i].sum() / (T.N_FF * CALIB_TOKENS))
        assert row["gpu_neurons"] == int(masks[i].sum())
        assert row["recall"] == pytest.approx(recall[i]) and row["precision"] == pytest.approx(precision[i])
        assert row["predictor_rank"] == T.RANK and row["act_threshold"] == pytest.approx(0.01)
    assert [row["cpu_predictor"] for row in sp["layers"]] == [True, False]


def test_text_output(calibrated):
    path, counts, *_ = calibrated
    r = inspect("-m", path)
    assert r.returncode == 0, r.stderr
    assert "sparse:        mode glu, target recall 0.99, target sparsity 0.5" in r.stdout
    assert f"calibration:   {CALIB_TOKENS} tokens of self-generated, seed 7" in r.stdout
    assert f"gpu split:     solved for 0.0029296875 GiB ({3 << 20:,} bytes)" in r.stdout
    first = f"{1 - counts[0].sum() / (T.N_FF * CALIB_TOKENS):.1%}"
    assert any(ln.split()[:1] == ["0"] and first in ln for ln in r.stdout.splitlines()), r.stdout


def test_a_llama_cpp_file_and_a_dense_one(tmp_path):
    path = str(tmp_path / "dense.gguf")
    T.write_tiny_gguf(path, overrides={C.K_SPARSE_MODE: None, C.K_FFN_LAYOUT: None,
                                       "split.no": (0, VT.UINT16, None), "split.count": (3, VT.UINT16, None)})
    r = inspect(path)
    assert r.returncode == 0, r.stderr
    assert "llama.cpp file (not converted" in r.stdout and "sparse:        no (dense FFN)" in r.stdout
    assert "split:         part 1 of 3" in r.stdout  # (split.no 0: the first part, -00001-of-00003)
    # head_dim of a file without attention.key_length: n_embd / n_head, as llama.cpp derives it
    assert json.loads(inspect(path, "--json").stdout)["head_dim"] == T.HEAD_DIM


def test_the_family_and_its_window(tmp_path):
    """Converted Mistral / Qwen2 / Gemma 3 files are GGUF architecture "llama": the family they
    came from and the sliding window are shown (text and JSON), which say why the GPU engine
    refuses such a file."""
    path = str(tmp_path / "m.gguf")
    T.write_tiny_gguf(path, overrides={C.K_FAMILY: ("mistral", VT.STRING, None),
                                       C.K_SLIDING_WINDOW: (4, VT.UINT32, None)})
    r = inspect(path)
    assert r.returncode == 0 and "; family mistral, sliding window 4" in r.stdout, r.stdout
    facts = json.loads(inspect(path, "--json").stdout)
    assert facts["family"] == "mistral" and facts["sliding_window"] == 4


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 20)
    for args in ([str(tmp_path / "missing.gguf")], [str(bad)], []):
        r = inspect(*args)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize("count, kind", [(2 ** 31, "uint32"), (-5, "int32")])
def test_a_layer_count_out_of_range_is_refused(tmp_path, count, kind):
    """A 160-byte file claiming 2^31 layers (and a sparse mode, whose per-layer tables inspect
    builds) grew past 10 GB; a negative count printed "-5 layers". Both are one-line errors now."""
    path = str(tmp_path / "huge.gguf")
    w = gguf.GGUFWriter(path, "llama")
    getattr(w, "add_" + kind)("llama.block_count", count)
    w.add_string(C.K_SPARSE_MODE, "glu")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = inspect(path)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"block_count is {count}" in r.stderr


def test_an_input_sparse_file(tmp_path):
    """A tiny SwiGLU model converted to q8_0 by the offline stage's default (sparse mode input):
    the per-group thresholds and calibrated sparsities equal the file's fields as gguf reads them,
    the parameter count leaves out the lm head's input-block copy (it equals the --dense file's),
    and the text names the mode's settings and prints a row per layer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convert.cli import main as convert_main
    from tests._models import make_random_llama

    src = make_random_llama(tmp_path / "hf", hidden_act="silu", tokenizer="bpe", name="silu")
    out, dense = str(tmp_path / "in.gguf"), str(tmp_path / "dense.gguf")
    assert convert_main([src, out, "--outtype", "q8_0", "--calib-tokens", "256", "-t", "1"]) == 0
    assert convert_main([src, dense, "--outtype", "q8_0", "--dense"]) == 0
    r = inspect(out, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    fields = gguf.GGUFReader(out).fields

    def floats(key):
        f = fields[key]
        return [float(f.parts[i][0]) for i in f.data]

    sp = info["sparse"]
    assert sp["mode"] == C.SPARSE_MODE_INPUT and info["by_input_channel"]
    inp = sp["input"]
    assert (inp["score"], inp["allocation"]) == (str(fields[C.K_IN_SCORE].contents()),
                                                 str(fields[C.K_IN_ALLOC].contents()))
    for g in C.IN_GROUPS:
        thr, frac = floats(C.K_IN_THRESHOLD.format(group=g)), floats(C.K_IN_SPARSITY.format(group=g))
        assert [row[g]["threshold"] for row in inp["layers"]] == pytest.approx(thr)
        assert [row[g]["calibration_sparsity"] for row in inp["layers"]] == pytest.approx(frac)
    if C.K_LM_HEAD_THRESHOLD in fields:
        assert inp["lm_head"]["threshold"] == pytest.approx(
            float(fields[C.K_LM_HEAD_THRESHOLD].parts[-1][0]))
    else:  # this tiny vocabulary is no multiple of 64: a dense head
        assert inp["lm_head"] is None
    assert info["parameters"] == json.loads(inspect(dense, "--json").stdout)["parameters"]
    text = inspect(out).stdout
    assert "sparse:        mode input, score magnitude" in text and "attn_qkv" in text
    assert f"{inp['layers'][1]['ffn_down']['calibration_sparsity']:.1%}" in text.splitlines()[-1]


@pytest.mark.parametrize("gib", [0.0141, 0.0143, 0.0146, 0.7, 24.0, 3 / 1024])
def test_budget_text_runs_the_stored_split(gib):
    """The printed budget is what --vram-budget must be given to run the stored split: it goes
    back to the stored bytes through placement.budget_bytes (3 decimals printed 0.014 GiB for
    splits solved at 0.0141 and 0.0143, and 0.015 for 0.0146, which re-solved)."""
    from pyinfer.info import budget_text
    from pyinfer.placement import budget_bytes

    stored = budget_bytes(gib)
    text = budget_text(stored)
    assert budget_bytes(float(text)) == stored and float(text) == pytest.approx(gib, rel=1e-6)
