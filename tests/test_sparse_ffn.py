"""The sparse FFN: skipping neurons must change nothing but the work done.

- On a ReLU model, skipping exactly the neurons whose relu(gate) is zero is lossless: the logits
  equal transformers' dense ones while fewer neurons are computed.
- The token-at-a-time path (gather-GEMV + AXPY kernels) equals the batched masked path for any
  predictor and threshold, so perplexity measured in batches is the sparsity decode really has.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ffn import Predictor, SparseFFN  # noqa: E402
from pyinfer.ops import _kernels as K  # noqa: E402
from pyinfer.ops import cpu  # noqa: E402
from pyinfer.ops.cpu import QT, QTensor  # noqa: E402
from tests._models import convert_neuron_major, make_random_llama  # noqa: E402

PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250, 11, 12]


def engine_for(tmp_path, hidden_act, outtype="f32"):
    model_dir = make_random_llama(tmp_path / "hf", hidden_act=hidden_act, tied=False, n_kv_heads=2,
                                  tokenizer="bpe", intermediate_size=256)
    out = tmp_path / "m.gguf"
    assert convert_neuron_major(model_dir, out, outtype) == 0
    return model_dir, Engine(str(out), n_ctx=64, n_threads=2, dense=True)


def decode_all(eng, tokens):
    eng.reset()
    return np.stack([eng.model.forward([t], i) for i, t in enumerate(tokens)])


def test_relu_zero_skipping_is_lossless(tmp_path):
    model_dir, eng = engine_for(tmp_path, "relu")
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    cfg = eng.cfg
    eng.model.ffn = SparseFFN(cfg, None, np.zeros(cfg.n_layer, np.float32))
    ours = decode_all(eng, PROMPT)
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-3
    assert 0.2 < eng.model.ffn.stats.sparsity < 0.8  # random ReLU: about half the gates are <= 0


@pytest.mark.parametrize("hidden_act,outtype,mode", [("silu", "f32", "cats"), ("relu", "q8_0", "relu"),
                                                     ("silu", "q4_0", "cats"), ("relu", "f16", "relu"),
                                                     ("silu", "f32", "glu"), ("silu", "q8_0", "glu")])
@pytest.mark.parametrize("pred_dtype,use_every,dense_above", [(np.float32, True, 0.4),
                                                               (np.float16, False, 1.0),
                                                               (np.float16, False, 0.0)])
def test_decode_path_equals_batched_masked_path(tmp_path, hidden_act, outtype, mode, pred_dtype,
                                                use_every, dense_above):
    """Decode (gathers over predicted rows, or dense GEMVs where a layer skips its predictor;
    down rows gathered, or streamed with zeros above ``dense_above``) equals prefill (dense GEMMs
    masked), with f32 or f16 predictors."""
    _, eng = engine_for(tmp_path, hidden_act, outtype)
    cfg = eng.cfg
    rng = np.random.default_rng(0)
    rank = 16
    preds = [Predictor(rng.normal(size=(rank, cfg.n_embd)).astype(pred_dtype),
                       rng.normal(size=(cfg.n_ff, rank)).astype(pred_dtype), 0.5)
             for _ in range(cfg.n_layer)]
    thr = np.full(cfg.n_layer, 0.01 if hidden_act == "silu" else 0.0, np.float32)
    use = None if use_every else [i % 2 == 0 for i in range(cfg.n_layer)]
    eng.model.ffn = SparseFFN(cfg, preds, thr, mode, use_predictor=use)
    eng.model.ffn.dense_down_above = dense_above
    # f32 keys and values: an f16 row can round apart between the two paths and move the logits
    # by more than the FFN paths' own difference that this test bounds
    eng.model.set_cache_type("f32")
    eng.reset()
    # the paths, compared with prefill's q8_0/q4_0 down projection on its f32 strips (the int8
    # one, gemmt.h, is checked against this after the decode)
    prev = K.set_int8_matmul_t(0)
    try:
        batched = eng.model.forward(PROMPT, 0, all_logits=True)
    finally:
        K.set_int8_matmul_t(prev)
    batched_sparsity = eng.model.ffn.stats.sparsity
    eng.model.ffn.stats.reset()
    stepped = decode_all(eng, PROMPT)
    # decode's gathered down projection over quantized ffn_down_t rows sums int16-quantized
    # coefficients (cython/axpyq.h, error within max|c d| / 65534 per term, tested in
    # test_kernels); prefill's f32 strips sum them exactly: measured up to 2.3e-3 of the largest
    # logit after the layers amplify it (0 with the f32 path). The neurons kept stay the same.
    tol = 1e-4 if outtype in ("f32", "f16") else 5e-3
    assert np.max(np.abs(stepped - batched)) / np.max(np.abs(batched)) < tol
    assert eng.model.ffn.stats.sparsity == pytest.approx(batched_sparsity, abs=1e-9)
    assert eng.model.ffn.stats.sparsity > 0.3
    # prefill as it runs: q8_0/q4_0 down projections with int8 coefficients (2^-8 of the largest
    # term per 32 rows, tests/test_prefill_gemm.py): this random 2-layer model amplifies that to
    # 0.75-1.35e-2 of the largest logit (session 9) and flips a few near-threshold neurons
    eng.reset()
    int8 = eng.model.forward(PROMPT, 0, all_logits=True)
    if outtype in ("f32", "f16"):
        np.testing.assert_array_equal(int8, batched)
    else:
        assert np.max(np.abs(stepped - int8)) / np.max(np.abs(int8)) < 3e-2


@pytest.mark.parametrize("qt", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q6_K])
@pytest.mark.parametrize("silu,glu,thr", [(False, False, 0.0), (True, False, 0.05),
                                          (True, True, 0.02), (True, True, -1.0)])
def test_cold_ffn_equals_sparse_step(qt, silu, glu, thr):
    """The hybrid engine's one-call cold path computes sparse_step's function bit for bit
    (same dots, selection and AXPY order) on the masked candidates, at 1, 2, 3 and 7 threads
    (teams with more threads than groups of eight candidates among them), and no candidate."""
    from pyinfer.ffn import sparse_step
    from pyinfer.weights import LayerWeights

    rng = np.random.default_rng(int(qt) * 7 + int(glu))
    n_ff, n_embd = 300, (256 if qt in (QT.Q4_K, QT.Q6_K) else 96)  # K-quants: whole super-blocks
    W = [QTensor.from_array(rng.normal(size=(n_ff, n_embd)).astype(np.float32), qt) for _ in range(3)]
    lw = LayerWeights(attn_norm=None, wq=None, wk=None, wv=None, wo=None, ffn_norm=None,
                      ffn_gate=W[0], ffn_up=W[1], ffn_down_t=W[2])
    h = rng.normal(size=n_embd).astype(np.float32)
    ids = np.sort(rng.choice(n_ff, 170, replace=False)).astype(np.int32)
    for mask in (np.zeros(n_ff, np.uint8), (rng.random(n_ff) < 0.1).astype(np.uint8), None,
                 (rng.random(n_ff) < 0.4).astype(np.uint8)):
        cand = ids if mask is None else ids[mask[ids] != 0]
        want = np.full(n_embd, np.nan, np.float32)
        n_want = sparse_step(lw, h, cand, silu, glu, thr, want, 1)
        for n_threads in (1, 2, 3, 7):
            got = np.full(n_embd, np.nan, np.float32)
            n_cand, n = cpu.cold_ffn(W[0], W[1], W[2], h, ids, mask, silu, glu, thr, got, n_threads)
            assert (n_cand, n) == (cand.size, n_want)
            np.testing.assert_array_equal(got, want)
    assert 0 < n_want < cand.size or thr < 0
