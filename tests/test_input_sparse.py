"""Sparse mode "input" (TEAL / WINA input sparsity, issue 12): the converted file, its logits
against a NumPy forward over the transformers weights with the same masks, 0% against dense, and
calibration that does not depend on the thread count."""
from __future__ import annotations

import os
import sys

import gguf
import numpy as np
import pytest

from convert.cli import main as convert_main
from pyinfer import constants as C
from pyinfer.config import read_field
from pyinfer.engine import Engine
from pyinfer.errors import PyinferError
from pyinfer.ffn import FFNStats
from tests._models import convert_neuron_major, load_hf_state_dict, make_random_llama

CALIB = ["--calib-tokens", "128", "-t", "1"]


@pytest.fixture(scope="module")
def silu_dir(tmp_path_factory):
    return make_random_llama(tmp_path_factory.mktemp("silu_in"), hidden_act="silu", tokenizer="bpe",
                             intermediate_size=128, n_layers=2, name="silu")


# (score, allocation): both scores and both allocations, each allocation with one score
@pytest.fixture(scope="module", params=[("wina", "uniform"), ("magnitude", "greedy"),
                                        ("magnitude", None)],
                ids=["wina-uniform", "magnitude-greedy", "magnitude-default"])
def input_file(request, silu_dir, tmp_path_factory):
    score, alloc = request.param
    out = str(tmp_path_factory.mktemp("in") / f"{score}.gguf")
    # None: the default, fisher where PyTorch is installed (the test extra installs it)
    extra = [] if alloc is None else ["--sparse-alloc", alloc]
    assert convert_main([silu_dir, out, "--outtype", "f32", "--target-sparsity", "0.5",
                         "--sparse-mode", "input", "--sparsity-score", score, *extra, *CALIB]) == 0
    return out, score


def test_file_stores_only_what_the_run_uses(input_file):
    path, score = input_file
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    assert read_field(r, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    assert read_field(r, C.K_IN_SCORE) == score
    alloc = read_field(r, C.K_IN_ALLOC)
    assert alloc in (("uniform",) if score == "wina" else ("greedy", "fisher"))
    for i in range(2):
        assert {C.ATTN_QKV_T.format(bid=i), C.ATTN_OUT_T.format(bid=i),
                C.FFN_GATE_UP_T.format(bid=i), C.FFN_DOWN_T.format(bid=i)} <= names
        for gone in (C.ATTN_Q, C.ATTN_K, C.ATTN_V, C.ATTN_OUT, C.FFN_GATE, C.FFN_UP, C.FC1, C.FC2,
                     C.ACT_COUNT):
            assert gone.format(bid=i) not in names
        assert (C.IN_SCALE["ffn_down"].format(bid=i) in names) == (score == "wina")
    sp = np.array([read_field(r, C.K_IN_SPARSITY.format(group=g)) for g in C.IN_GROUPS])  # (4, L)
    per_channel = {"attn_qkv": 64 * 128, "attn_output": 64 * 64, "ffn_gate_up": 64 * 256,
                   "ffn_down": 128 * 64}
    w = np.array([per_channel[g] for g in C.IN_GROUPS], float)[:, None]
    block = (sp * w).sum(0) / w.sum()  # (L,)
    if alloc == "fisher":  # model-wide: the whole model at the target, its layers may differ
        assert 0.5 - 1e-6 <= block.mean() < 0.5 + 0.01, block
        assert (sp <= 0.95 + 1e-6).all()
    else:  # every block at the target (TEAL: uniform)
        assert np.all(block >= 0.5 - 1e-6) and np.all(block < 0.5 + 0.01), block
    if alloc == "uniform":  # every group of every layer at the target itself
        np.testing.assert_allclose(sp, 0.5, atol=1e-6)
    else:  # the greedy splits the block unevenly somewhere
        assert np.abs(sp - 0.5).max() >= 0.05


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, base):  # transformers' rotate_half layout; x (T, n_head, hd)
    hd = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([np.outer(pos, inv)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def reference_logits(sd, cfg, tokens, thr, scales, head=None):
    """Llama forward as transformers computes it (float64), each projection's input with the
    channels whose |x_j| (* scale_j) <= threshold set to 0. thr {group: (n_layer,)}; head: None
    (the dense lm head) or (threshold, scale or None) for the lm head's input."""
    def keep(x, i, g):
        s = np.abs(x) * (scales[i][g] if scales else 1.0)
        return np.where(s > thr[g][i], x, 0.0)

    W = {k: v.astype(np.float64) for k, v in sd.items()}
    T, hd = len(tokens), cfg.head_dim
    x = W["model.embed_tokens.weight"][tokens]
    pos = np.arange(T)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        h = keep(_rmsnorm(x, W[p + "input_layernorm.weight"], cfg.rms_eps), i, "attn_qkv")
        q = _rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, cfg.n_head, hd), pos,
                  cfg.rope_freq_base)
        k = _rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, cfg.n_head_kv, hd), pos,
                  cfg.rope_freq_base)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, cfg.n_head_kv, hd)
        k, v = np.repeat(k, cfg.n_gqa, 1), np.repeat(v, cfg.n_gqa, 1)
        s = np.einsum("thd,jhd->htj", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("htj,jhd->thd", s, v).reshape(T, -1)
        x = x + keep(att, i, "attn_output") @ W[p + "self_attn.o_proj.weight"].T
        h = keep(_rmsnorm(x, W[p + "post_attention_layernorm.weight"], cfg.rms_eps), i, "ffn_gate_up")
        g = h @ W[p + "mlp.gate_proj.weight"].T
        a = g / (1 + np.exp(-g)) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + keep(a, i, "ffn_down") @ W[p + "mlp.down_proj.weight"].T
    x = _rmsnorm(x, W["model.norm.weight"], cfg.rms_eps)
    if head is not None and head[0] is not None:
        x = np.where(np.abs(x) * (1.0 if head[1] is None else head[1]) > head[0], x, 0.0)
    lm_head = W.get("lm_head.weight", W["model.embed_tokens.weight"])  # tied: the embeddings
    return x @ lm_head.T


def test_logits_match_masked_reference(input_file, silu_dir):
    """Prefill (masked dense) and token-by-token decode (row sums over kept channels) both equal
    the reference with the file's thresholds, and some channels were really skipped."""
    path, score = input_file
    eng = Engine(path, n_ctx=64, n_threads=2)
    cfg = eng.cfg
    thr = eng.model.ffn.thr
    scales = [lw.in_scale for lw in eng.weights.layers] if score == "wina" else None
    tokens = np.random.default_rng(1).integers(3, cfg.n_vocab, 24).tolist()
    want = reference_logits(load_hf_state_dict(silu_dir), cfg, tokens, thr, scales)
    eng.reset_stats()
    got = eng.model.forward(tokens, 0, all_logits=True)
    assert 0.3 < eng.ffn_sparsity() < 0.7
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    eng.reset()
    steps = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_allclose(steps, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    # the masks matter: without them the reference is far from what the file computes
    dense_ref = reference_logits(load_hf_state_dict(silu_dir), cfg, tokens,
                                 {g: np.full(2, -1.0) for g in C.IN_GROUPS}, None)
    assert np.abs(dense_ref - want).max() > 30 * np.abs(got - want).max()


def test_zero_target_equals_dense(input_file, silu_dir, tmp_path):
    """At a 0% target every channel is kept: the transposed file's logits equal the dense
    row-layout file's, prefill and decode."""
    from predictors.input_sparse import calibrate, thresholds_for
    from tests.test_input_sparse import _set

    path, score = input_file
    dense_path = str(tmp_path / "dense.gguf")
    assert convert_neuron_major(silu_dir, dense_path, "f32") == 0
    dense = Engine(dense_path, n_ctx=64, n_threads=1, dense=True)
    rng = np.random.default_rng(2)
    curves, _ = calibrate(dense, [rng.integers(3, 200, 40).tolist()], score == "wina", 0, 1,
                          alloc="uniform" if score == "wina" else "greedy")
    thr, sparsity, _ = thresholds_for(curves, dense.cfg, 0.0)
    assert (thr == -1).all() and (sparsity == 0).all()
    eng = Engine(path, n_ctx=64, n_threads=1)
    _set(eng, thr)
    tokens = rng.integers(3, dense.cfg.n_vocab, 16).tolist()
    want = dense.model.forward(tokens, 0, all_logits=True)
    np.testing.assert_allclose(eng.model.forward(tokens, 0, all_logits=True), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    eng.reset_stats()
    eng.reset()
    got = np.stack([eng.eval_token(t) for t in tokens])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert eng.ffn_sparsity() == 0.0


def _set(eng, thr):
    for gi, g in enumerate(C.IN_GROUPS):
        eng.model.ffn.thr[g] = np.ascontiguousarray(thr[:, gi])


def test_calibration_independent_of_threads(silu_dir, tmp_path):
    from predictors.input_sparse import calibrate, thresholds_for

    dense_path = str(tmp_path / "dense.gguf")
    assert convert_neuron_major(silu_dir, dense_path, "q8_0") == 0
    seqs = [np.random.default_rng(3).integers(3, 200, 100).tolist()]
    for alloc in C.IN_ALLOCS:
        got = []
        for nt in (1, 2):
            eng = Engine(dense_path, n_ctx=64, n_threads=nt, dense=True)
            curves, _ = calibrate(eng, seqs, True, 0, nt, alloc=alloc)
            got.append(thresholds_for(curves, eng.cfg, 0.4)[0])
        np.testing.assert_array_equal(got[0], got[1])
        assert (got[0] > 0).any()


def test_uniform_thresholds_are_the_target_quantiles(dense_f32):
    """"uniform": each group's threshold is the target quantile of its calibration scores
    (|x_j| for magnitude, |x_j| * column norm for WINA, the norms from the dequantized weights
    by NumPy), so each group of each layer skips the target fraction of its calibration pairs;
    the reported loss is the dropped share of output energy, between 0 and the target."""
    from predictors.input_sparse import calibrate, thresholds_for
    from pyinfer.ops.reference import dequantize

    dense = Engine(dense_f32, n_ctx=64, n_threads=1, dense=True)
    cfg = dense.cfg
    seqs = [np.random.default_rng(5).integers(3, 200, 60).tolist()]
    rec = _layer_inputs(dense, seqs)
    for wina in (False, True):
        cal, norms = calibrate(dense, seqs, wina, 0, 1)
        assert cal.paths is None and cal.alloc == "uniform"
        for target in (0.25, 0.5):
            thr, sp, loss = thresholds_for(cal, cfg, target)
            np.testing.assert_allclose(sp, target)
            assert np.all(loss > 0) and np.all(loss < target)
            for i in range(cfg.n_layer):
                lw = dense.weights.layers[i]
                w = {"attn_qkv": np.concatenate([dequantize(lw.wq), dequantize(lw.wk),
                                                 dequantize(lw.wv)]),
                     "attn_output": dequantize(lw.wo),
                     "ffn_gate_up": np.concatenate([dequantize(lw.ffn_gate),
                                                    dequantize(lw.ffn_up)]),
                     "ffn_down": dequantize(lw.ffn_down_t).T}  # (n_out, n_in) each
                for gi, g in enumerate(C.IN_GROUPS):
                    s = np.abs(rec[i][0][g])
                    if wina:
                        s = s * np.linalg.norm(w[g].astype(np.float64), axis=0)
                    skipped = float((s <= thr[i, gi]).mean())
                    assert abs(skipped - target) < 0.01, (i, g, skipped)


def test_bad_allocation_is_refused(silu_dir, tmp_path, capsys):
    from predictors.offline import OfflineOptions

    with pytest.raises(PyinferError, match="--sparse-alloc"):
        OfflineOptions(sparse_mode="input", input_alloc="best").check()
    with pytest.raises(SystemExit) as e:
        convert_main([silu_dir, str(tmp_path / "x.gguf"), "--sparse-mode", "input",
                      "--sparse-alloc", "best"])
    assert e.value.code != 0 and "--sparse-alloc" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_gpu_model_runs_the_file(input_file):
    """Each score and allocation runs on the GPU engine (NumpyDevice standing in; WINA's column
    scales go to the device): its logits and kept channels are the CPU model's. Without a GPU,
    --device auto runs the CPU and --device cuda is a one-line error."""
    from pyinfer.device import NumpyDevice
    from pyinfer.gpu_model import GpuModel
    from pyinfer.hybrid import place_model
    from pyinfer.input_sparse import InputSparseFFN, thresholds_from_reader
    from pyinfer.ops import cuda

    path, _ = input_file
    eng = Engine(path, n_ctx=32, n_threads=2, device="auto")
    if not cuda.available():
        assert type(eng.model).__name__ == "Model"
        with pytest.raises(PyinferError, match="no CUDA device"):
            Engine(path, n_ctx=32, device="cuda")
    cpu_eng = Engine(path, n_ctx=32, n_threads=2, cache_type="f32")  # the device's cache type
    toks = [1, 17, 42, 7, 99, 3]
    ref = np.stack([cpu_eng.model.forward([t], i) for i, t in enumerate(toks)])
    gm = place_model(cpu_eng.reader, cpu_eng.cfg, cpu_eng.weights,
                     InputSparseFFN(cpu_eng.cfg, thresholds_from_reader(cpu_eng.reader,
                                                                        cpu_eng.cfg)),
                     32, 2, device="cuda", backend=NumpyDevice())
    assert isinstance(gm, GpuModel) and gm.plan.n_resident == cpu_eng.cfg.n_layer
    got = np.stack([gm.forward([t], i) for i, t in enumerate(toks)])
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    assert gm.stats.active == cpu_eng.model.ffn.stats.active > 0
    assert gm.stats.total == cpu_eng.model.ffn.stats.total


def _layer_inputs(eng, seqs):
    """{layer: (recorded group inputs, layer input pieces)} of the dense row-layout engine."""
    from predictors.input_sparse import record_inputs

    out = {}
    record_inputs(eng, seqs, 1, lambda i, rec, en, xs: out.__setitem__(i, (rec, xs)))
    return out


@pytest.fixture(scope="module")
def dense_f32(silu_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense") / "dense.gguf")
    assert convert_neuron_major(silu_dir, path, "f32") == 0
    return path


def test_block_greedy_evaluates_what_the_run_computes(dense_f32, input_file):
    """The greedy's block output (calibration: f32 NumPy over the row-layout weights, masks at
    the unit curves' thresholds) equals the runtime's layer output (transposed file, prefill)
    with those thresholds, on the last layer (its input recorded from the dense model)."""
    from predictors.input_sparse import _Block, column_norms, unit_curve

    path, score = input_file
    dense = Engine(dense_f32, n_ctx=64, n_threads=1, dense=True)
    cfg = dense.cfg
    seq = np.random.default_rng(7).integers(3, 200, 48).tolist()
    rec, xs = _layer_inputs(dense, [seq])[cfg.n_layer - 1]
    lw = dense.weights.layers[cfg.n_layer - 1]
    norms = column_norms(lw)
    rng = np.random.default_rng(0)
    curves = [unit_curve(rec[g], norms[g], score == "wina", rng) for g in C.IN_GROUPS]
    blk = _Block(lw, cfg, xs, curves, norms, score == "wina", 1)
    levels = np.array([30, 45, 20, 60])
    got = blk.run(levels, 0)

    eng = Engine(path, n_ctx=64, n_threads=1)
    thr = np.full((cfg.n_layer, 4), -1.0, np.float32)
    thr[-1] = [curves[gi].thr[levels[gi]] for gi in range(4)]
    _set(eng, thr)
    x = xs[0].copy()
    eng.model.run_layers(x, 0, cfg.n_layer - 1)
    np.testing.assert_allclose(x, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())
    assert np.abs(got - blk.y).max() > 100 * np.abs(x - got).max()  # the masks changed it


def test_block_path_steps_are_greedy(dense_f32):
    """Each step of the path raises the group whose step costs the least block output error
    per byte, every candidate recomputed from scratch (no cached stages); the path's errors and
    sparsities are those of its levels; ``thresholds_for`` puts every block at the target."""
    from predictors.input_sparse import (N_LEVELS, STEP, _Block, block_path, calibrate,
                                         column_norms, thresholds_for, unit_curve)
    from pyinfer.input_sparse import in_sizes

    dense = Engine(dense_f32, n_ctx=64, n_threads=1, dense=True)
    cfg = dense.cfg
    seq = np.random.default_rng(8).integers(3, 200, 40).tolist()
    rec, xs = _layer_inputs(dense, [seq])[0]
    lw = dense.weights.layers[0]
    norms = column_norms(lw)
    curves = [unit_curve(rec[g], norms[g], True, np.random.default_rng(0)) for g in C.IN_GROUPS]
    sizes = in_sizes(cfg)
    ub = np.array([sizes[g][0] * sizes[g][1] for g in C.IN_GROUPS], float)
    path = block_path(_Block(lw, cfg, xs, curves, norms, True, 1), ub, 0.6)
    fresh = _Block(lw, cfg, xs, curves, norms, True, 1)
    assert path.sparsity[-1] >= 0.6 and np.all(np.diff(path.sparsity) > 0)
    for p in range(1, len(path.levels)):
        prev, err_prev = path.levels[p - 1], path.error[p - 1]
        costs = []
        for gi in range(4):
            cand = prev.copy()
            cand[gi] += STEP
            costs.append((fresh.error(fresh.run(cand, 0)) - err_prev) / (STEP * ub[gi]))
        chosen = int(np.flatnonzero(path.levels[p] != prev)[0])
        assert costs[chosen] <= min(costs) + 1e-9 * max(1.0, abs(min(costs)))
        np.testing.assert_allclose(path.error[p], fresh.error(fresh.run(path.levels[p], 0)),
                                   rtol=1e-6)
        assert path.sparsity[p] == pytest.approx((path.levels[p] * ub).sum() / (N_LEVELS * ub.sum()))
    cal, _ = calibrate(dense, [seq], True, 0, 1, max_sparsity=0.6, alloc="greedy")
    for target in (0.25, 0.4):
        _, sp, _ = thresholds_for(cal, cfg, target)
        block = (sp * ub).sum(1) / ub.sum()
        assert np.all(block >= target - 1e-9) and np.all(block < target + 1.0 / N_LEVELS + 1e-9)


def test_decode_same_bits_at_any_thread_count(input_file):
    """The kept channels and every sum's order depend on the activations alone: decode gives the
    same logits, bit for bit, at 1, 2 and 3 threads (the row sums are cut into chunks by the
    number of kept rows alone)."""
    path, _ = input_file
    tokens = np.random.default_rng(11).integers(3, 200, 10).tolist()
    got = []
    for nt in (1, 2, 3):
        eng = Engine(path, n_ctx=32, n_threads=nt)
        eng.reset_stats()
        got.append(np.stack([eng.eval_token(t) for t in tokens]))
        assert eng.ffn_sparsity() > 0.3
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_whole_token_call_equals_half_layer_calls(input_file, n_threads):
    """``decode_layers`` (every layer of a token in one kernel call and one parallel region)
    gives the residual, the K/V cache rows and the stats of ``decode_attn`` + ``decode`` called
    layer by layer, bit for bit, from the first layer and from layer 1."""
    path, _ = input_file
    eng = Engine(path, n_ctx=16, n_threads=n_threads)
    m, cfg = eng.model, eng.cfg
    isp = m.input_sparse
    eng.eval_prompt(np.random.default_rng(12).integers(3, 200, 5).tolist())
    x0 = np.random.default_rng(13).standard_normal(cfg.n_embd).astype(np.float32)
    for g in C.IN_GROUPS:  # as tools set them: float64 arrays, reassigned
        isp.thr[g] = isp.thr[g].astype(np.float64)
    for first in (0, 1):
        got, want = [x0.copy(), m.cache.k.copy(), m.cache.v.copy()], [x0.copy(), m.cache.k.copy(),
                                                                       m.cache.v.copy()]
        isp.stats = FFNStats()
        isp.decode_layers(eng.weights.layers, got[0], got[1], got[2], 5, first, n_threads)
        stats_got = (isp.stats.total, isp.stats.active)
        isp.stats = FFNStats()
        for i in range(first, cfg.n_layer):
            lw = eng.weights.layers[i]
            isp.decode_attn(lw, i, want[0], want[1][i], want[2][i], 5, n_threads)
            isp.decode(lw, i, want[0], cfg.rms_eps, n_threads)
        for a, b in zip(got, want):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert stats_got == (isp.stats.total, isp.stats.active) and stats_got[1] > 0
        assert not np.array_equal(got[0], x0)


def test_whole_token_switch(input_file):
    """``whole_token = False`` (tools that wrap the half-layer methods) decodes through
    ``decode_attn`` / ``decode`` layer by layer, and gives the whole-token call's logits."""
    path, _ = input_file
    tokens = np.random.default_rng(14).integers(3, 200, 6).tolist()
    eng = Engine(path, n_ctx=16, n_threads=2)
    isp = eng.model.input_sparse
    calls = []
    decode = isp.decode
    isp.decode = lambda *a: calls.append(1) or decode(*a)
    got = {}
    for whole in (True, False):
        isp.whole_token = whole
        eng.reset()
        got[whole] = np.stack([eng.eval_token(t) for t in tokens])
        assert (len(calls) > 0) == (not whole)
    np.testing.assert_array_equal(got[True], got[False])


def _brute_force(cost, ub, need, max_level):
    """The least total cost over every combination of levels skipping >= need level-bytes."""
    import itertools

    best = None
    for lv in itertools.product(range(max_level + 1), repeat=cost.shape[0] * cost.shape[1]):
        lv = np.array(lv).reshape(cost.shape[:2])
        if (lv * ub).sum() >= need - 1e-9:
            c = sum(cost[i, g, lv[i, g]] for i in range(cost.shape[0]) for g in range(cost.shape[1]))
            best = c if best is None else min(best, c)
    return best


def test_allocate_levels_target_bounds_and_optimum():
    """The model-wide allocation skips at least the target share of all weight bytes and less
    than one level of the largest group more, keeps every level in [0, max_level], is
    deterministic and monotone in the target, and with convex costs and equal group sizes
    reaches the least total cost that exhaustive search finds."""
    from predictors.input_sparse import N_LEVELS, allocate_levels

    rng = np.random.default_rng(0)
    L = 6
    ub = np.array([960 * 576, 576 * 576, 576 * 3072, 1536 * 576], float)
    k = np.arange(N_LEVELS) / N_LEVELS
    # convex-ish growth with unit-specific scale and exponent, plus noise (non-monotone bits)
    cost = (rng.lognormal(0, 1.5, (L, 4, 1)) * k ** rng.uniform(1.5, 4, (L, 4, 1))
            + rng.normal(0, 1e-3, (L, 4, N_LEVELS)))
    cost[..., 0] = 0
    prev = np.zeros((L, 4), np.int64)
    for target in (0.0, 0.1, 0.25, 0.4, 0.6, 0.9):
        lv = allocate_levels(cost, ub, target, max_level=90)
        assert lv.dtype == np.int64 and lv.shape == (L, 4)
        assert lv.min() >= 0 and lv.max() <= 90
        got = (lv * ub).sum() / (N_LEVELS * L * ub.sum())
        assert target - 1e-12 <= got < target + ub.max() / (N_LEVELS * L * ub.sum()) + 1e-12
        np.testing.assert_array_equal(lv, allocate_levels(cost.copy(), ub.copy(), target, 90))
        assert (lv >= prev).all()
        prev = lv
        if 0 < target < 0.9:  # not uniform: sensitive units get less
            assert lv.max() - lv.min() > 10
    assert (allocate_levels(cost, ub, 1.0, max_level=90) == 90).all()  # capped
    with pytest.raises(ValueError, match="target"):
        allocate_levels(cost, ub, 1.5)
    # optimum: 1 layer x 3 units of equal size, convex costs, levels 0..8
    small = np.zeros((1, 3, N_LEVELS))
    small[0, :, :9] = np.array([[0.5], [1.0], [3.0]]) * np.arange(9) ** np.array([[2.0], [1.5], [1.2]])
    ub3 = np.ones(3)
    for need in range(1, 25):
        target = need / (N_LEVELS * 3)
        lv = allocate_levels(small, ub3, target, max_level=8)
        got = sum(small[0, g, lv[0, g]] for g in range(3))
        assert got == pytest.approx(_brute_force(small, ub3, need, 8))


@pytest.mark.parametrize("layout", ["neuron_major", "rows"])
def test_torch_forward_matches_transformers(silu_dir, tmp_path, layout):
    """The Fisher pass's torch forward (predictors/input_fisher.py) over the dense file's weights
    gives transformers' logits for the same model, from a neuron-major file (ffn_down_t) and from
    a ``--dense`` file (ffn_down in row layout, as llama.cpp files hold it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from convert.cli import convert
    from predictors.input_fisher import TorchLlama

    dense_path = str(tmp_path / "dense.gguf")
    if layout == "rows":
        convert(str(silu_dir), dense_path, "f32", progress=False, down_rows=True)
    else:
        assert convert_neuron_major(silu_dir, dense_path, "f32") == 0
    eng = Engine(dense_path, n_ctx=64, n_threads=1, dense=True)
    assert (eng.weights.layers[0].ffn_down_t is None) == (layout == "rows")
    tokens = np.random.default_rng(4).integers(3, eng.cfg.n_vocab, 20).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(silu_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
        seen = []
        got = TorchLlama(eng, torch).forward(tokens, lambda i, g, x: seen.append((i, g)) or x)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert seen == [(i, g) for i in range(eng.cfg.n_layer) for g in range(4)]


def test_fisher_costs_are_the_sampled_fisher_estimate(silu_dir, tmp_path):
    """fisher_costs equals 1/2 sum_t (sum over dropped channels of grad * x)^2 computed from a
    separate autograd pass with the same sampled tokens: zero at level 0, non-negative,
    deterministic; and the allocation it drives hits a model-wide target."""
    torch = pytest.importorskip("torch")
    from predictors.input_fisher import TorchLlama, fisher_costs
    from predictors.input_sparse import N_LEVELS, calibrate, thresholds_for
    from pyinfer.input_sparse import in_sizes

    dense_path = str(tmp_path / "dense.gguf")
    assert convert_neuron_major(silu_dir, dense_path, "f32") == 0
    eng = Engine(dense_path, n_ctx=64, n_threads=1, dense=True)
    piece = np.random.default_rng(6).integers(3, 200, 30).tolist()
    cal, _ = calibrate(eng, [piece], False, 0, 1, alloc="fisher")
    thr = np.array([[c.thr for c in cs] for cs in cal.curves])
    cost = fisher_costs(eng, [piece], thr, seed=0, n_threads=1)
    np.testing.assert_array_equal(cost, cal.cost)
    np.testing.assert_array_equal(cost, fisher_costs(eng, [piece], thr, seed=0, n_threads=1))
    assert (cost[..., 0] == 0).all() and (cost >= 0).all() and (cost[..., -1] > 0).all()
    # independent check for two units and levels: autograd on masked inputs' directions
    model = TorchLlama(eng, torch)
    gen = torch.Generator().manual_seed(0)
    leaves = {}

    def hook(i, g, x):
        leaves[(i, g)] = x
        x.retain_grad()
        return x

    with torch.enable_grad():
        model.embd.requires_grad_(True)  # so the graph reaches layer 0's input
        logits = model.forward(piece, hook)
        with torch.no_grad():
            y = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
        torch.nn.functional.cross_entropy(logits, y, reduction="sum").backward()
    for (i, g) in ((0, 0), (1, 3)):
        x = leaves[(i, g)].detach().numpy().astype(np.float64)
        grad = leaves[(i, g)].grad.numpy().astype(np.float64)
        for k in (10, 50, 90):
            drop = np.abs(x) <= thr[i, g, k]
            want = 0.5 * (((grad * x) * drop).sum(1) ** 2).sum()
            assert cost[i, g, k] == pytest.approx(want, rel=1e-4, abs=1e-12)
    sizes = in_sizes(eng.cfg)
    ub = np.array([sizes[g][0] * sizes[g][1] for g in C.IN_GROUPS], float)
    for target in (0.3, 0.5):
        _, sp, loss = thresholds_for(cal, eng.cfg, target)
        got = (sp * ub).sum() / (eng.cfg.n_layer * ub.sum())
        assert target - 1e-9 <= got < target + ub.max() / (N_LEVELS * eng.cfg.n_layer * ub.sum()) + 1e-9
        assert loss.shape == (eng.cfg.n_layer,) and (loss >= 0).all()


def test_blend_levels_between_uniform_and_fisher():
    """The shrunken Fisher allocation (blend_levels) still skips at least the target share of
    all weight bytes, by less than one level of the largest group more than needed; each level
    lies between the uniform level and the unit's Fisher level (rounded outward) and within one
    level of u + w (f - u); weight 1 is the Fisher allocation, weight 0 the uniform one; it is
    deterministic and refuses a weight outside [0, 1]."""
    from predictors.input_sparse import N_LEVELS, allocate_levels, blend_levels

    rng = np.random.default_rng(1)
    L = 7
    ub = np.array([960 * 576, 576 * 576, 576 * 3072, 1536 * 576], float)
    k = np.arange(N_LEVELS) / N_LEVELS
    cost = rng.lognormal(0, 1.5, (L, 4, 1)) * k ** rng.uniform(1.2, 4, (L, 4, 1))
    total = N_LEVELS * L * ub.sum()
    for target in (0.1, 0.3, 0.333, 0.35, 0.4, 0.5):
        f = allocate_levels(cost, ub, target)
        u = target * N_LEVELS
        assert np.abs(f - u).max() > 10  # a Fisher allocation far from uniform to shrink
        for w in (0.0, 0.25, 0.5, 0.75, 1.0):
            lv = blend_levels(f, ub, target, w)
            assert lv.dtype == np.int64 and lv.shape == (L, 4)
            got = (lv * ub).sum() / total
            assert target - 1e-12 <= got < target + ub.max() / total + 1e-12, (target, w)
            assert (lv >= np.floor(np.minimum(u, f) + 1e-9)).all()
            assert (lv <= np.ceil(np.maximum(u, f) - 1e-9)).all()
            assert np.abs(lv - (u + w * (f - u))).max() < 1.0
            np.testing.assert_array_equal(lv, blend_levels(f.copy(), ub.copy(), target, w))
        np.testing.assert_array_equal(blend_levels(f, ub, target, 1.0), f)
        if float(u).is_integer():
            assert (blend_levels(f, ub, target, 0.0) == int(u)).all()
        half = blend_levels(f, ub, target, 0.5)
        assert ((half - u) * (f - u) >= 0).all()  # on the Fisher side of uniform, never past it
        assert (np.abs(half - u) <= np.abs(f - u)).all()
    with pytest.raises(ValueError, match="weight"):
        blend_levels(f, ub, 0.3, 1.5)
    with pytest.raises(ValueError, match="weight"):
        blend_levels(f, ub, 0.3, -0.1)


def test_fisher_weight_option(silu_dir, tmp_path):
    """``--sparse-alloc fisher --fisher-weight 0.5`` writes the weight into the file and puts
    every unit half-way between the uniform level and the unit's level in the unshrunk Fisher
    file from the same calibration, the model at the target; the flag is refused without
    ``--sparse-alloc fisher`` and outside [0, 1]."""
    pytest.importorskip("torch")
    from predictors.offline import OfflineOptions

    sp = {}
    for w in ("1", "0.5"):
        out = str(tmp_path / f"w{w}.gguf")
        assert convert_main([silu_dir, out, "--outtype", "f32", "--target-sparsity", "0.4",
                             "--sparse-mode", "input", "--sparsity-score", "magnitude",
                             "--sparse-alloc", "fisher", "--fisher-weight", w, *CALIB]) == 0
        r = gguf.GGUFReader(out)
        assert read_field(r, C.K_IN_ALLOC) == "fisher"
        assert read_field(r, C.K_IN_FISHER_WEIGHT) == pytest.approx(float(w))
        sp[w] = np.array([read_field(r, C.K_IN_SPARSITY.format(group=g)) for g in C.IN_GROUPS])
    per_channel = np.array([64 * 128, 64 * 64, 64 * 256, 128 * 64], float)[:, None]  # (4, 1)
    for s in sp.values():  # (4, L): the model as a whole skips the target share of the bytes
        assert 0.4 - 1e-6 <= (s * per_channel).sum() / (per_channel.sum() * s.shape[1]) < 0.41
    f, h = sp["1"], sp["0.5"]
    assert np.abs(f - 0.4).max() >= 0.05  # the Fisher levels moved away from uniform
    assert np.abs(h - (0.4 + f) / 2).max() <= 0.01 + 1e-6  # half-way, to the level
    with pytest.raises(PyinferError, match="--fisher-weight needs --sparse-alloc fisher"):
        OfflineOptions(sparse_mode="input", input_alloc="uniform", fisher_weight=0.5).check()
    with pytest.raises(PyinferError, match=r"--fisher-weight must be in \[0, 1\]"):
        OfflineOptions(sparse_mode="input", input_alloc="fisher", fisher_weight=2.0).check()
    opts = OfflineOptions(sparse_mode="input", input_alloc="fisher")
    opts.check()
    assert opts.fisher_weight is not None and 0.0 <= opts.fisher_weight <= 1.0


def test_fisher_pieces_take_a_prefix_of_the_tokens():
    """The Fisher pass's tokens (fisher_pieces) are the first n calibration tokens, in whole
    pieces but the last, each piece still starting at its own position 0."""
    from predictors.input_fisher import fisher_pieces

    pieces = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    assert fisher_pieces(pieces, None) == pieces
    assert fisher_pieces(pieces, 100) == pieces
    assert fisher_pieces(pieces, 5) == [[1, 2, 3, 4, 5]]
    assert fisher_pieces(pieces, 7) == [[1, 2, 3, 4, 5], [6, 7]]
    assert sum(map(len, fisher_pieces(pieces, 10))) == 10


def test_default_allocation_is_fisher_with_torch_and_uniform_without(monkeypatch, capsys):
    """Unset, the allocation is "fisher" at weight DEFAULT_FISHER_WEIGHT where PyTorch can be
    imported; without PyTorch the stage falls back to "uniform" and says so on stderr (one line),
    and an explicit allocation is kept either way."""
    import importlib.util

    from predictors import offline

    real_find_spec = importlib.util.find_spec
    opts = offline.OfflineOptions(sparse_mode="input")
    opts.check()
    want = "fisher" if real_find_spec("torch") is not None else "uniform"
    assert opts.input_alloc == want
    if want == "fisher":
        assert opts.fisher_weight == offline.DEFAULT_FISHER_WEIGHT
    capsys.readouterr()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    opts = offline.OfflineOptions(sparse_mode="input")
    opts.check()
    assert opts.input_alloc == "uniform" and opts.fisher_weight is None
    err = capsys.readouterr().err
    assert "PyTorch is not installed" in err and "--sparse-alloc uniform" in err
    assert err.count("\n") == 1
    opts = offline.OfflineOptions(sparse_mode="input", input_alloc="greedy")
    opts.check()
    assert opts.input_alloc == "greedy" and capsys.readouterr().err == ""
    opts = offline.OfflineOptions()  # mode not known yet (default_mode): nothing said ...
    opts.check()
    assert opts.input_alloc == "uniform" and capsys.readouterr().err == ""
    opts.note_alloc_fallback()  # ... until the default turns out to be "input"
    assert "PyTorch is not installed" in capsys.readouterr().err


def test_every_mask_keeps_nan():
    """The input masks keep a NaN channel wherever they run: the C prefill mask and decode
    selection, the array-module mask the GPU model's prefill runs (``xp.mask_inputs``) and the
    GPU kernels' NumPy twin (``NumpyDevice.mask_inputs``). The last two still dropped it after
    the kernels were changed."""
    from pyinfer.device import NumpyDevice
    from pyinfer.ops import cpu, xp

    x = np.array([[0.5, np.nan, 0.05, -2.0, 0.0, np.nan]], np.float32)
    want = [0, 1, 3, 5]
    m = np.empty_like(x)
    assert cpu.mask_inputs(x, None, 0.1, m, 1) == 4
    assert np.flatnonzero(~(m[0] == 0)).tolist() == want
    idx = np.empty(6, np.int32)
    assert cpu.select_inputs(x[0].copy(), None, 0.1, np.empty(6, np.float32), idx) == 4
    assert idx[:4].tolist() == want
    got, n = xp.mask_inputs(x, None, 0.1)
    assert int(n) == 4 and np.flatnonzero(~(got[0] == 0)).tolist() == want
    v, kept = x[0].copy(), np.zeros(1, np.uint64)
    NumpyDevice().mask_inputs(v, None, 0.1, kept)
    assert int(kept[0]) == 4 and np.flatnonzero(~(v == 0)).tolist() == want


@pytest.mark.parametrize("silu", [True, False])
def test_batch_masks_are_decode_selection(silu):
    """Prefill's masks (``mask_inputs``, ``glu_mask``): each row keeps exactly the channels
    ``select_inputs`` keeps for it (the decode selection), with the same values; the GLU product
    follows float64 SiLU / ReLU; the same result at 1 and 3 threads."""
    from pyinfer.ops import cpu

    rng = np.random.default_rng(5)
    T, n = 7, 96
    gu = rng.standard_normal((T, 2 * n)).astype(np.float32) * 3
    scale = rng.random(n).astype(np.float32) + 0.5
    g, u = gu[:, :n].astype(np.float64), gu[:, n:].astype(np.float64)
    a64 = (g / (1 + np.exp(-g)) if silu else np.maximum(g, 0)) * u
    for sc in (None, scale):
        outs = []
        for nt in (1, 3):
            a = np.empty((T, n), np.float32)
            kept = cpu.glu_mask(gu, silu, sc, 0.4, a, nt)
            m = np.empty_like(a)
            assert cpu.mask_inputs(gu[:, :n].copy(), sc, 0.4, m, nt) == sum(
                cpu.select_inputs(gu[t, :n].copy(), sc, 0.4, np.empty(n, np.float32),
                                  np.empty(n, np.int32)) for t in range(T))
            outs.append((a, m))
            assert 0 < kept < T * n
            total = 0
            for t in range(T):
                full = np.empty((1, n), np.float32)
                cpu.glu_mask(gu[t:t + 1], silu, None, -1.0, full, 1)  # every channel kept
                np.testing.assert_allclose(full[0], a64[t], rtol=1e-5, atol=1e-6)
                coef, idx = np.empty(n, np.float32), np.empty(n, np.int32)
                k = cpu.select_inputs(full[0], sc, 0.4, coef, idx)
                want = np.zeros(n, np.float32)
                want[idx[:k]] = coef[:k]
                np.testing.assert_array_equal(a[t], want)
                x = gu[t, :n].copy()
                k = cpu.select_inputs(x, sc, 0.4, coef, idx)
                want = np.zeros(n, np.float32)
                want[idx[:k]] = coef[:k]
                np.testing.assert_array_equal(m[t], want)
                total += int((a[t] != 0).sum())
            assert kept == total
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_group_thresholds_write_through():
    """``InputSparseFFN.thr`` rows are views of the (4, n_layer) f32 array the whole-token
    kernel takes: assigning a group (any float dtype) and writing into a row both land there;
    a wrong length or an unknown group is an error, and no group can be removed."""
    from pyinfer.input_sparse import GroupThresholds
    n = 3
    thr = GroupThresholds({g: np.full(n, i, np.float32) for i, g in enumerate(C.IN_GROUPS)}, n)
    assert thr.stacked.dtype == np.float32 and thr.stacked.shape == (4, n)
    assert list(thr) == list(C.IN_GROUPS) and len(thr) == 4
    np.testing.assert_array_equal(thr.stacked[:, 0], [0, 1, 2, 3])
    thr["ffn_down"] = np.array([0.5, 0.25, 0.125])  # float64, reassigned as tools do
    np.testing.assert_array_equal(thr.stacked[3], np.float32([0.5, 0.25, 0.125]))
    thr["attn_qkv"][:] = -1.0  # in place, as tools/profile_input_decode.py does
    np.testing.assert_array_equal(thr.stacked[0], [-1.0] * n)
    assert dict(thr)["ffn_down"][1] == np.float32(0.25)
    with pytest.raises(ValueError):
        thr["attn_output"] = np.zeros(n + 1)
    with pytest.raises(KeyError):
        thr["ffn_up"]
    with pytest.raises(TypeError):
        del thr["attn_qkv"]


def test_chat_stats_name_weight_reads(input_file):
    """The REPL's statistics line of an input file counts projection weight bytes skipped, under
    that name (not "FFN sparsity", which counts neurons), equal to the engine's own count."""
    from pyinfer import LLM
    from pyinfer.repl import format_stats

    llm = LLM(input_file[0], n_ctx=64, n_threads=1, seed=0)
    text = "".join(llm.stream_text([1, 17, 42, 7], max_tokens=6, temperature=0.0, ignore_eos=True))
    s = llm.last_stats
    assert text and s.sparsity_label == "weight reads skipped" and 0.05 < s.ffn_sparsity < 0.9
    assert f"weight reads skipped {100 * s.ffn_sparsity:.1f}%" in format_stats(s)


@pytest.mark.parametrize("kt,dst,qmax", [("Q4_K", "Q4_1", 15), ("Q5_K", "Q5_1", 31)])
def test_k_quant_regrouped_keeps_the_numbers(kt, dst, qmax):
    """Q4_K (Q5_K) rows regrouped as Q4_1 (Q5_1) decode (gguf.quants) to the K-quant decoding up
    to the f16 rounding of each sub-block's scale d sc and min dmin m, far inside a quantization
    step."""
    from pyinfer import quants

    QT = gguf.GGMLQuantizationType
    kt, dst = QT[kt], QT[dst]
    regroup = quants.q4_k_to_q4_1 if kt == QT.Q4_K else quants.q5_k_to_q5_1
    bb = {QT.Q4_1: 20, QT.Q5_1: 24}[dst]
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((48, 768)) * 0.05).astype(np.float32)
    w[5] += 0.3  # an offset row: mins far from 0
    w[9, :256] = 0.0  # an all-zero super-block
    k = quants.quantize(w, kt)
    q = regroup(k)
    assert q.shape == (48, 768 // 32 * bb)
    a = gguf.quants.dequantize(k, kt).reshape(48, -1)
    b = gguf.quants.dequantize(q, dst).reshape(48, -1)
    blocks = q.reshape(-1, bb)
    d = np.abs(blocks[:, 0:2].copy().view(np.float16).astype(np.float32))
    m = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float32))
    bound = (2.0 ** -11 * (qmax * d + m) + 1e-7).reshape(48, -1, 1)  # per 32-value block
    err = np.abs(a - b).reshape(48, -1, 32)
    assert (err <= bound).all()
    step = np.abs(a - w).max()
    assert err.max() < 0.05 * step  # requantizing would move values by up to half a step
    with pytest.raises(ValueError):
        regroup(np.zeros((2, 100), np.uint8))


@pytest.mark.parametrize("kt,dst", [("q4_k", "Q4_1"), ("q5_k", "Q5_1")])
def test_k_m_source_takes_input_mode_with_its_own_numbers(tmp_path, kt, dst):
    """A llama.cpp Q4_K_M-like (Q5_K_M-like) GGUF (Q/K rows permuted, ffn_down Q6_K, the other
    matrices Q4_K (Q5_K): rows of 256) converts to sparse mode input by default; the input-block
    matrices hold the source's K-quant numbers regrouped as Q4_1 (Q5_1) (decoded by gguf.quants:
    equal up to the f16 rounding of the scales) and the Q6_K down projection requantized to
    Q8_0, and the file run with every input kept computes the source file's function."""
    from convert.from_gguf import unpermute_qk
    from pyinfer.ops import cpu
    from tests._models import write_llamacpp_gguf

    QT = gguf.GGMLQuantizationType
    hf = make_random_llama(tmp_path, hidden_size=256, intermediate_size=512, n_layers=2,
                           n_heads=4, n_kv_heads=2, vocab_size=576, name="q4km")
    src, out = str(tmp_path / "q4km.gguf"), str(tmp_path / "in.gguf")
    write_llamacpp_gguf(hf, src, kt, down_qtype="q6_k")
    assert convert_main([src, out, *CALIB]) == 0
    r_src, r_out = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert read_field(r_out, C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    t_src = {t.name: t for t in r_src.tensors}
    t_out = {t.name: t for t in r_out.tensors}

    def src_rows(i, part):  # the source's matrix decoded, rows in Hugging Face order
        t = t_src[f"blk.{i}.{part}.weight"]
        assert t.tensor_type == (QT.Q6_K if part == "ffn_down" else QT[kt.upper()]), part
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        return unpermute_qk(w, {"attn_q": 4, "attn_k": 2}[part]) if part in ("attn_q", "attn_k") else w

    groups = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "attn_output": ("attn_output",),
              "ffn_gate_up": ("ffn_gate", "ffn_up"), "ffn_down": ("ffn_down",)}
    for i in range(2):
        for g, parts in groups.items():
            t = t_out[C.IB[g].format(bid=i)]
            qt = QT.Q8_0 if g == "ffn_down" else QT[dst]
            assert t.tensor_type == qt, (g, t.tensor_type)
            want = np.concatenate([src_rows(i, p) for p in parts])
            n_out, n_in = want.shape
            rows = cpu.ib_to_rows(np.asarray(t.data).reshape(-1), qt, n_out, n_in)
            got = gguf.quants.dequantize(rows, qt).reshape(n_out, n_in)
            # Q4_1 / Q5_1: f16 roundings of the scales only; Q8_0: an 8-bit step of each 32 values
            tol = 2.0 ** -7 if qt == QT.Q8_0 else 2.0 ** -10
            assert np.abs(got - want).max() <= tol * np.abs(want).max(), (i, g)
    # the lm head (576 outputs: one chunk): a Q4_K one takes input sparsity with its own
    # numbers; a Q5_K one, wider than 4 bits, the two-stage head (a Q4_1 copy picks candidates)
    t = t_out[C.OUTPUT_IB]
    assert t_src[C.OUTPUT].tensor_type == QT[kt.upper()]
    want = gguf.quants.dequantize(np.asarray(t_src[C.OUTPUT].data), QT[kt.upper()])
    rows = cpu.ib_to_rows(np.asarray(t.data).reshape(-1), t.tensor_type, 576, 256)
    got = gguf.quants.dequantize(rows, t.tensor_type).reshape(576, 256)
    if kt == "q4_k":
        assert t.tensor_type == QT.Q4_1 and not read_field(r_out, C.K_LM_HEAD_CANDIDATES)
        assert np.abs(got - want).max() <= 2.0 ** -10 * np.abs(want).max()
    else:  # requantized to 4 bits: within a Q4_1 step (a sixteenth of a block's range)
        assert t.tensor_type == QT.Q4_1 and read_field(r_out, C.K_LM_HEAD_CANDIDATES) > 0
        assert np.abs(got - want).max() <= np.abs(want).max() / 8
    ids = list(range(3, 40))
    a = Engine(src, n_ctx=64, n_threads=1).forward(ids, 0, all_logits=True)
    b = Engine(out, n_ctx=64, n_threads=1, dense=True).forward(ids, 0, all_logits=True)
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.95
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


def test_kept_curve_tool(input_file, dense_f32, capsys):
    """tools/kept_curve.py: scale 0 keeps every projection byte, "none" none, and the bytes kept
    fall as the file's thresholds grow; a file without sparse mode input is refused in one line."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tools"))
    import kept_curve

    path, _ = input_file
    assert kept_curve.main([path, "-t", "1", "--depth", "4", "--rounds", "1", "--n-gen", "2",
                            "--scales", "0", "1", "3", "none"]) == 0
    rows = [ln.split("|") for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    kept = {r[1].strip(): float(r[2]) for r in rows[1:]}
    assert kept["every input"] == 1.0 and kept["none"] == 0.0
    assert 1.0 > kept["x1"] >= kept["x3"] > 0.0
    assert kept_curve.main([dense_f32]) == 1
    err = capsys.readouterr().err
    assert "no sparse mode input" in err and len(err.strip().splitlines()) == 1


def _stored(eng, i: int, g: str) -> np.ndarray:
    """Layer i's matrix of input group g (n_out, n_in) f32 as a file stores it, decoded by
    gguf: an input file's input-block tensor, or a dense file's row-major matrices."""
    import gguf as _gguf

    lw = eng.weights.layers[i]
    t = getattr(lw, g + "_t", None)
    if t is not None and hasattr(t, "to_rows"):
        ts = [t.to_rows()]
    else:
        ts = {"attn_qkv": [lw.wq, lw.wk, lw.wv], "attn_output": [lw.wo],
              "ffn_gate_up": [lw.ffn_gate, lw.ffn_up], "ffn_down": [lw.ffn_down]}[g]
    return np.concatenate([_gguf.quants.dequantize(t.raw, t.qtype).reshape(t.rows, t.cols)
                           for t in ts])


@pytest.mark.parametrize("mode", ["input", "dense", "glu"])
def test_imatrix_scales_bring_q4_0_closer_to_the_float_model(silu_dir, dense_f32, tmp_path, mode,
                                                            capsys):
    """q4_0 projections and lm head take importance-weighted scales (quants.quantize_weighted,
    the calibration inputs' mean squares as the importance matrix) by default, in an input file
    in a --dense one and in a glu one (predictors; its neuron-major ffn_down_t, whose blocks run
    along outputs, stays round-to-nearest), and round-to-nearest with --no-imatrix: gguf's own
    quantization, byte for byte. Each stored matrix (decoded by gguf) against the f32 model's, on the inputs the f32
    model gives each projection for text no calibration saw (the model's own samples, as the
    calibration's, from other seeds): the default file's output error is lower in every
    projection of every layer, and by at least 8% on average (measured: 6-16%); the lm head
    likewise, weighted by its own input's mean squares."""
    import gguf as _gguf

    from predictors.calibrate import generate_tokens
    from predictors.input_sparse import record_inputs
    from pyinfer.ops.reference import dequantize

    dense = mode == "dense"
    mode = {"dense": ["--dense"], "glu": ["--sparse-mode", "glu"],
            "input": ["--target-sparsity", "0.25", "--sparse-mode", "input",
                      "--sparse-alloc", "uniform"]}[mode]
    files = {}
    for name, extra in (("imatrix", []), ("rtn", ["--no-imatrix"])):
        files[name] = str(tmp_path / f"{name}.gguf")
        capsys.readouterr()
        calib = [] if dense and name == "rtn" else ["--calib-tokens", "512"]  # (--dense
        # --no-imatrix reads no calibration text: its flags are refused there)
        assert convert_main([silu_dir, files[name], "--outtype", "q4_0", *mode, *extra, *calib,
                             "-t", "1"]) == 0
        if dense:  # the pass runs for the default only, and says so
            assert ("importance matrix" in capsys.readouterr().err) == (name == "imatrix")
    ref = Engine(dense_f32, n_ctx=64, n_threads=1, dense=True)
    held = {}
    record_inputs(ref, generate_tokens(ref, 192, seed=5, max_len=64, progress=False), 1,
                  lambda i, rec, en, xs: held.__setitem__(i, rec),
                  lambda h: held.__setitem__("head", h))
    engs = {name: Engine(p, n_ctx=64, n_threads=1) for name, p in files.items()}
    ratios = []
    for i, lw in enumerate(ref.weights.layers):
        want = {"attn_qkv": np.concatenate([dequantize(lw.wq), dequantize(lw.wk), dequantize(lw.wv)]),
                "attn_output": dequantize(lw.wo),
                "ffn_gate_up": np.concatenate([dequantize(lw.ffn_gate), dequantize(lw.ffn_up)]),
                "ffn_down": dequantize(lw.ffn_down_t).T}
        for g, w in want.items():
            x = held[i][g]
            if g == "ffn_down" and engs["rtn"].weights.layers[i].ffn_down is None \
                    and not hasattr(engs["rtn"].weights.layers[i].ffn_down_t, "to_rows"):
                t = {name: eng.weights.layers[i].ffn_down_t for name, eng in engs.items()}
                np.testing.assert_array_equal(t["imatrix"].raw, t["rtn"].raw)
                continue
            got = {name: _stored(eng, i, g) for name, eng in engs.items()}
            if dense:  # round-to-nearest is gguf's quantizer (an input file regroups its blocks)
                rtn = _gguf.quants.dequantize(_gguf.quants.quantize(np.asarray(w, np.float32),
                                                                    _gguf.GGMLQuantizationType.Q4_0),
                                              _gguf.GGMLQuantizationType.Q4_0).reshape(w.shape)
                np.testing.assert_array_equal(got["rtn"], rtn)
            err = {name: float(((x @ (q - w).T) ** 2).mean()) for name, q in got.items()}
            assert err["imatrix"] < err["rtn"], (i, g, err)
            ratios.append(err["imatrix"] / err["rtn"])
    assert np.mean(ratios) < 0.92, ratios
    # the lm head (output.weight, q4_0 here)
    emb = np.asarray(ref.weights.output.data, np.float32)
    heads = {name: eng.weights.output for name, eng in engs.items()}
    assert all(t.qtype == _gguf.GGMLQuantizationType.Q4_0 for t in heads.values())
    np.testing.assert_array_equal(heads["rtn"].raw, _gguf.quants.quantize(emb, heads["rtn"].qtype))
    h = held["head"]
    err = {name: float(((h @ (_gguf.quants.dequantize(t.raw, t.qtype).reshape(emb.shape) - emb).T)
                        ** 2).mean()) for name, t in heads.items()}
    assert err["imatrix"] < 0.95 * err["rtn"], err
    if dense:  # converted again: the q4_0 source's blocks are copied as stored, no pass runs
        again = str(tmp_path / "again.gguf")
        capsys.readouterr()
        assert convert_main([files["imatrix"], again, "--outtype", "q4_0", "--dense"]) == 0
        assert "importance matrix" not in capsys.readouterr().err
        want = {t.name: np.asarray(t.data) for t in _gguf.GGUFReader(files["imatrix"]).tensors}
        got = {t.name: np.asarray(t.data) for t in _gguf.GGUFReader(again).tensors}
        assert got.keys() == want.keys()
        for name, a in want.items():
            np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_input_file_keeps_a_q4_0_sources_blocks(silu_dir, tmp_path):
    """A q4_0 source converted to sparse mode input keeps its blocks as stored, regrouped by
    input channel (decoded back to rows: the source's bytes). The source here is a --dense q4_0
    file with importance-weighted scales, a fifth of whose blocks round-to-nearest would not
    give back (their scale is not m / -8; llama.cpp's importance-matrix files are alike):
    requantizing them cost SmolLM2 5% perplexity."""
    import gguf as _gguf

    src = str(tmp_path / "dense.gguf")
    out = str(tmp_path / "input.gguf")
    assert convert_main([silu_dir, src, "--outtype", "q4_0", "--dense", "--calib-tokens", "512",
                         "-t", "1"]) == 0
    assert convert_main([src, out, "--sparse-mode", "input", "--target-sparsity", "0.25",
                         "--sparse-alloc", "uniform", "--calib-tokens", "512", "-t", "1"]) == 0
    dense, inp = Engine(src, n_ctx=64, n_threads=1), Engine(out, n_ctx=64, n_threads=1)
    q4 = _gguf.GGMLQuantizationType.Q4_0
    moved = []
    for ld, li in zip(dense.weights.layers, inp.weights.layers):
        for g, ts in (("attn_qkv", [ld.wq, ld.wk, ld.wv]), ("attn_output", [ld.wo]),
                      ("ffn_gate_up", [ld.ffn_gate, ld.ffn_up]), ("ffn_down", [ld.ffn_down])):
            want = np.concatenate([np.asarray(t.raw, np.uint8).reshape(t.rows, -1) for t in ts])
            assert all(t.qtype == q4 for t in ts)
            got = getattr(li, g + "_t").to_rows()
            assert got.qtype == q4
            np.testing.assert_array_equal(np.asarray(got.raw, np.uint8).reshape(want.shape), want,
                                          err_msg=g)
            rtn = np.asarray(_gguf.quants.quantize(_gguf.quants.dequantize(want, q4).reshape(
                want.shape[0], -1), q4), np.uint8).reshape(want.shape)
            moved.append(float((rtn != want).reshape(-1, 18).any(1).mean()))
    assert np.mean(moved) > 0.05, moved  # the source is one that round-to-nearest would change


@pytest.mark.parametrize("act", ["silu", "relu"])
def test_record_inputs_applies_the_models_activation(tmp_path, act):
    """record_inputs (the calibration pass of sparse mode input and of the importance matrix)
    hands the down projection act(gate h) * up h with the model's own activation, h being the
    FFN input it records (checked in NumPy from the f32 weights): ReGLU models (PowerInfer's)
    are Llama-shaped too."""
    from predictors.input_sparse import record_inputs
    from pyinfer.ops.reference import dequantize

    d = make_random_llama(tmp_path / "m", hidden_act=act, tokenizer="bpe", intermediate_size=128,
                          n_layers=2, name=act)
    path = str(tmp_path / "f32.gguf")
    assert convert_neuron_major(d, path, "f32") == 0
    eng = Engine(path, n_ctx=64, n_threads=1, dense=True)
    rec = {}
    record_inputs(eng, [np.random.default_rng(3).integers(3, 200, 40).tolist()], 1,
                  lambda i, r, en, xs: rec.__setitem__(i, r))
    for i, lw in enumerate(eng.weights.layers):
        h = rec[i]["ffn_gate_up"].astype(np.float64)
        g, u = h @ dequantize(lw.ffn_gate).T, h @ dequantize(lw.ffn_up).T
        a = np.maximum(g, 0.0) if act == "relu" else g / (1.0 + np.exp(-g))
        np.testing.assert_allclose(rec[i]["ffn_down"], a * u, rtol=1e-3, atol=1e-5 * np.abs(a * u).max())


def test_a_nan_hidden_state_is_reported_through_an_input_sparse_head(tmp_path):
    """An input-sparse lm head keeps the channels with |h| * s > threshold, which NaN never
    passes: a NaN hidden state (here from a NaN embedding row) gave all-zero, finite logits
    with no error, in prefill and in the one-call decode. Now the engine says so."""
    from pyinfer.ops.cpu import QTensor
    from pyinfer.ops.reference import dequantize

    d = make_random_llama(tmp_path / "hf", hidden_act="silu", tokenizer="bpe",
                          intermediate_size=128, n_layers=2, name="silu", vocab_size=576)
    out = str(tmp_path / "m.gguf")
    assert convert_main([str(d), out, "--outtype", "q8_0", "--sparse-mode", "input",
                         "--lm-head-candidates", "0", *CALIB]) == 0
    e = Engine(out, n_ctx=64, n_threads=1)
    assert e.model.lm_head.head_on(e.model.w)  # the head reads kept channels only
    emb = dequantize(e.model.w.token_embd).copy()
    emb[7] = np.nan
    e.model.w.token_embd = QTensor.from_array(emb, C.QT.F32)  # the file is read-only
    with pytest.raises(PyinferError, match="NaN logits at token 2"):
        e.eval_prompt([3, 4, 7])
    e.eval_prompt([3, 4])
    with pytest.raises(PyinferError, match="NaN logits at token 2"):
        e.eval_token(7)

    # A NaN that appears inside a layer only (one channel of layer 0's FFN norm): the input
    # selection of gate/up kept |h| * s > threshold, which NaN never passes, so the channel
    # vanished from the sums and the logits came out finite. NaN channels are kept now.
    e = Engine(out, n_ctx=64, n_threads=1)
    e.model.w.layers[0].ffn_norm = e.model.w.layers[0].ffn_norm.copy()
    e.model.w.layers[0].ffn_norm[5] = np.nan
    with pytest.raises(PyinferError, match="NaN logits at token 1"):
        e.eval_prompt([3, 4])
    e = Engine(out, n_ctx=64, n_threads=1)
    norm = e.model.w.layers[0].ffn_norm = e.model.w.layers[0].ffn_norm.copy()
    e.eval_prompt([3])
    norm[5] = np.nan  # in place: the one-call decode holds the array's address
    with pytest.raises(PyinferError, match="NaN logits at token 1"):
        e.eval_token(4)
