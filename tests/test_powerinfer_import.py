"""pyinfer-convert on upstream PowerInfer's files (issue 14): a ``PWRI`` model file and its
``.generated.gpuidx`` GPU split.

The files are built here in upstream's format (convert/powerinfer.py lists its sources): a tiny
random ReLU Llama from transformers, written with gguf-py's GGUFWriter with Q/K rows permuted as
llama.cpp's converter permutes them, ``ffn_down_t`` instead of ``ffn_down``, random predictors
``fc1`` (F16) / ``fc2`` (F32) and ``powerinfer.sparse_threshold``; then the magic is overwritten
with ``PWRI`` as upstream's convert.py does. The split file is a GGUF of ``blk.N.gpu_idx`` /
``blk.N.gpu_bucket`` I32 tensors and ``split.vram_capacity``, magic ``PWRI`` and version 3
rewritten as upstream's export_split.py does. References: transformers' logits, gguf-py's reader.
"""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._models import load_hf_state_dict, make_random_llama  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QT = gguf.GGMLQuantizationType
PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250, 11, 30]
N_LAYER, N_EMBD, N_FF, N_HEAD, N_KV = 2, 64, 128, 4, 2
RANK = (8, 12)  # per layer: upstream's predictors may differ in width
THRESHOLD = 0.25
VRAM_CAPACITY = 123_456_789


def _patch_magic(path: str, version: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.write(b"PWRI")
        if version is not None:
            f.write(int(version).to_bytes(4, "little"))


def _write(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_powerinfer(model_dir: str, out: str, threshold: float | None = THRESHOLD, seed: int = 0) -> dict:
    """The PowerInfer file of ``model_dir``; returns its predictors {name: f32 array as stored}."""
    from convert.cli import convert

    sd = load_hf_state_dict(model_dir)
    ours = out + ".tok.gguf"  # the tokenizer keys, borrowed from pyinfer's own conversion
    convert(model_dir, ours, "f32", progress=False)
    r = gguf.GGUFReader(ours)
    w = gguf.GGUFWriter(out, "llama")
    for name, field in r.fields.items():
        if name.startswith("tokenizer."):
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, field.contents(), field.types[0], field.types[-1])
            else:
                w.add_key_value(name, field.contents(), field.types[0])
    del r
    os.remove(ours)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", threshold)

    def permute(a, n):  # llama.cpp's converter: rows (n, 2, d/2) -> (n, d/2, 2)
        return a.reshape(n, 2, a.shape[0] // n // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)

    rng = np.random.default_rng(seed)
    preds = {}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], N_HEAD))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], N_KV))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down_t.weight", np.ascontiguousarray(sd[p + "mlp.down_proj.weight"].T))
        fc1 = rng.standard_normal((RANK[i], N_EMBD)).astype(np.float16)
        fc2 = rng.standard_normal((N_FF, RANK[i])).astype(np.float32)
        w.add_tensor(f"blk.{i}.fc1.weight", fc1)
        w.add_tensor(f"blk.{i}.fc2.weight", fc2)
        preds[f"blk.{i}.fc1.weight"] = fc1.astype(np.float32)
        preds[f"blk.{i}.fc2.weight"] = fc2
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    _write(w)
    _patch_magic(out)
    return preds


def write_gpuidx(path: str, seed: int = 1) -> list[np.ndarray]:
    """A GPU split file as upstream's powerinfer-py ``export_split`` writes it (gpu_idx and
    gpu_bucket for every layer); returns the per-layer masks. Layer 1 has no GPU neuron: its
    bucket is empty (torch.topk of 0 there; ggml reads a tensor of 0 elements)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "generic.gpu_index")
    masks = []
    for i in range(N_LAYER):
        mask = (rng.random(N_FF) < 0.3).astype(np.int32) if i == 0 else np.zeros(N_FF, np.int32)
        masks.append(mask)
        w.add_tensor(f"blk.{i}.gpu_idx", mask, raw_dtype=QT.I32)
        bucket = np.flatnonzero(mask).astype(np.int32)
        w.add_tensor(f"blk.{i}.gpu_bucket", bucket, raw_shape=bucket.shape, raw_dtype=QT.I32)
    w.add_block_count(N_LAYER)
    w.add_uint64("split.vram_capacity", VRAM_CAPACITY)
    _write(w)
    _patch_magic(path, version=3)
    return masks


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "convert.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def relu_llama(tmp_path_factory):
    """(HF dir, transformers' logits (n_tok, n_vocab), PowerInfer file, its predictors, split masks)."""
    tmp = tmp_path_factory.mktemp("pwri")
    d = make_random_llama(tmp, hidden_act="relu", tokenizer="bpe", hidden_size=N_EMBD,
                          intermediate_size=N_FF, n_layers=N_LAYER, n_heads=N_HEAD, n_kv_heads=N_KV)
    model = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    src = str(tmp / "relu-llama.powerinfer.gguf")
    preds = write_powerinfer(d, src)
    masks = write_gpuidx(src + ".generated.gpuidx")
    return d, ref, src, preds, masks


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_file_is_upstream_shaped(relu_llama):
    """The test file really is what upstream writes: PWRI magic, and gguf-py refuses it as GGUF."""
    _, _, src, _, _ = relu_llama
    with open(src, "rb") as f:
        assert f.read(4) == b"PWRI"
    with pytest.raises(ValueError):
        gguf.GGUFReader(src)


def test_convert_keeps_predictors_threshold_split(relu_llama, tmp_path):
    from pyinfer.config import ModelConfig
    from pyinfer.engine import Engine
    from pyinfer.ffn import SparseFFN
    from pyinfer.placement import stored_placement

    _, ref, src, preds, masks = relu_llama
    out = str(tmp_path / "out.gguf")
    res = run_cli(src, out, "--outtype", "f32")  # the offline stage is skipped for a PWRI source
    assert res.returncode == 0, res.stderr
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    for name, want in preds.items():  # F16 fc1 widened to f32 exactly, F32 fc2 as stored
        np.testing.assert_array_equal(np.asarray(t[name].data), want, err_msg=name)
    assert r.fields[C.K_SPARSE_MODE].contents() == "relu"
    assert r.fields[C.K_HIDDEN_ACT].contents() == "relu"
    np.testing.assert_array_equal(r.fields[C.K_PRED_THRESHOLD].contents(), [THRESHOLD] * N_LAYER)
    assert r.fields[C.K_PRED_RANK].contents() == list(RANK)
    assert r.fields[C.K_VRAM_BUDGET].contents() == VRAM_CAPACITY
    cfg = ModelConfig.from_gguf(r)
    p = stored_placement(r, cfg)
    for mask, got_mask, got_bucket in zip(masks, p.gpu_idx, p.gpu_bucket):
        np.testing.assert_array_equal(got_mask, mask)
        np.testing.assert_array_equal(got_bucket, np.flatnonzero(mask))
    del r

    # dense: transformers' logits (Q/K un-permuted, ffn_down_t taken as stored)
    eng = Engine(out, n_ctx=64, n_threads=2, dense=True)
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < 1e-3
    # sparse: the engine runs upstream's predictors with upstream's threshold
    eng = Engine(out, n_ctx=64, n_threads=2)
    ffn = eng.model.ffn
    assert isinstance(ffn, SparseFFN)
    for i, pr in enumerate(ffn.predictors):
        np.testing.assert_array_equal(np.asarray(pr.fc1.data, np.float32), preds[f"blk.{i}.fc1.weight"])
        np.testing.assert_array_equal(np.asarray(pr.fc2.data, np.float32), preds[f"blk.{i}.fc2.weight"])
        assert pr.threshold == np.float32(THRESHOLD)


def test_permissive_threshold_is_lossless(relu_llama, tmp_path):
    """With a threshold every predictor logit passes, sparse decode through the imported file
    equals transformers (ReLU zeros are exact); the threshold really is the one the engine uses."""
    from pyinfer.engine import Engine

    d, ref, _, _, _ = relu_llama
    src = str(tmp_path / "permissive.gguf")
    write_powerinfer(d, src, threshold=-1e30)
    out = str(tmp_path / "out.gguf")
    assert run_cli(src, out, "--outtype", "f32").returncode == 0
    eng = Engine(out, n_ctx=64, n_threads=2)
    assert eng.is_sparse
    eng.model.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < 1e-3
    assert eng.ffn_sparsity() > 0.2  # the ReLU's exact zeros were skipped


def test_default_threshold_and_f16_output(relu_llama, tmp_path):
    """No sparse_threshold key: upstream's default 0.0. --outtype f16 keeps fc1 (F16) byte for
    byte and writes fc2 (F32 source) as F16; without a split file there is no split."""
    d, _, _, preds, _ = relu_llama
    src = str(tmp_path / "nothr.gguf")
    write_powerinfer(d, src, threshold=None)
    out = str(tmp_path / "out.gguf")
    assert run_cli(src, out, "--outtype", "f16").returncode == 0
    r = gguf.GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert list(r.fields[C.K_PRED_THRESHOLD].contents()) == [0.0] * N_LAYER
    assert C.K_VRAM_BUDGET not in r.fields and "blk.0.gpu_idx" not in t
    assert t["blk.0.fc1.weight"].tensor_type == QT.F16 and t["blk.0.fc2.weight"].tensor_type == QT.F16
    np.testing.assert_array_equal(np.asarray(t["blk.0.fc1.weight"].data, np.float32), preds["blk.0.fc1.weight"])
    np.testing.assert_array_equal(np.asarray(t["blk.0.fc2.weight"].data, np.float32),
                                  preds["blk.0.fc2.weight"].astype(np.float16).astype(np.float32))


def _one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


@pytest.mark.parametrize("damage", ["truncated", "header", "split"])
def test_damaged_files_give_one_line_error(relu_llama, tmp_path, damage):
    _, _, src, _, _ = relu_llama
    bad = str(tmp_path / "bad.gguf")
    data = open(src, "rb").read()
    gpuidx = []
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "header":  # tensor count far beyond what the file holds
        data = data[:8] + (2**40).to_bytes(8, "little") + data[16:]
    else:  # a split whose bucket does not match its mask
        split = str(tmp_path / "bad.gpuidx")
        w = gguf.GGUFWriter(split, "generic.gpu_index")
        for i in range(N_LAYER):
            w.add_tensor(f"blk.{i}.gpu_idx", np.ones(N_FF, np.int32), raw_dtype=QT.I32)
            w.add_tensor(f"blk.{i}.gpu_bucket", np.arange(1, N_FF + 1, dtype=np.int32), raw_dtype=QT.I32)
        w.add_uint64("split.vram_capacity", 1)
        _write(w)
        _patch_magic(split, 3)
        gpuidx = ["--gpuidx", split]
    with open(bad, "wb") as f:
        f.write(data)
    out = str(tmp_path / "out.gguf")
    line = _one_line_error(run_cli(bad, out, *gpuidx))
    assert ("gpu_bucket" in line) if damage == "split" else ("bad.gguf" in line)
    assert not os.path.exists(out)


def test_offline_stage_refuses_a_powerinfer_source(relu_llama, tmp_path):
    """The offline stage would train predictors over upstream's: it refuses, saying why."""
    from predictors.offline import convert_sparse
    from pyinfer.errors import PyinferError

    _, _, src, _, _ = relu_llama
    with pytest.raises(PyinferError, match="brings its own predictors"):
        convert_sparse(src, str(tmp_path / "out.gguf"))
    assert not os.listdir(tmp_path)
