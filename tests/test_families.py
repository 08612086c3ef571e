"""The families beyond Llama against Hugging Face transformers (issue 14).

Each case builds a tiny random model with transformers (biases and norm weights randomised, since
transformers initialises them to 0 and 1, which would hide bugs), saves it with save_pretrained,
converts it at f32 with pyinfer-convert and compares logits with transformers' on one prompt
(1e-3 relative), then checks that token-at-a-time decode through the KV cache gives the same
logits, and for the ReLU-family FFNs that the sparse FFN (exact zeros, no predictor) is lossless.
dReLU and fatrelu have no transformers class: their reference is transformers' Llama with the MLP
activation swapped in memory (torch's relu / F.threshold), the config.json then naming the
activation as pyinfer-convert reads it.
"""
import json
import os

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert.cli import main as convert_main  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ffn import DenseFFN, SparseFFN  # noqa: E402
from pyinfer.weights import fused_model  # noqa: E402
from tests._models import convert_neuron_major, make_bpe_tokenizer  # noqa: E402

PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250, 11, 300, 77, 21]
TOL = 1e-3  # f32, the brief's bound


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def build(tmp_path, name, cls, cfg_cls, mlp_patch=None, config_edit=None, **cfg):
    """Save a random model; return (dir, reference logits (n_tok, n_vocab))."""
    d = str(tmp_path / name)
    os.makedirs(d)
    vocab = make_bpe_tokenizer(d)
    torch.manual_seed(0)
    cfg.setdefault("initializer_range", 0.1)  # past near-uniform attention: layout bugs show
    config = cfg_cls(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, **cfg)
    model = _randomise(cls(config))
    if mlp_patch is not None:
        for layer in model.model.layers:
            mlp_patch(layer.mlp)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].numpy()
    model.save_pretrained(d)
    if config_edit:
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        config_edit(c)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
    return d, ref


def convert(d, tmp_path, rows=True):
    """pyinfer-convert --dense (ffn_down in row layout), or without rows the neuron-major layout
    (ffn_down_t, no predictors) the sparse FFN reads."""
    out = str(tmp_path / (os.path.basename(d) + ("" if rows else "-nm") + ".gguf"))
    if rows:
        assert convert_main([d, out, "--outtype", "f32", "--dense"]) == 0
    else:
        assert convert_neuron_major(d, out, "f32") == 0
    return out


def check(tmp_path, d, ref, sparse=False):
    """Logits equal transformers' in both layouts of the down projection, prefill equals decode,
    and (sparse) the sparse FFN is lossless."""
    for rows in (True, False):
        path = convert(d, tmp_path, rows)
        eng = Engine(path, n_ctx=64, n_threads=2)
        assert all((lw.ffn_down_t is None) == rows for lw in eng.weights.layers)
        ours = eng.model.forward(PROMPT, 0, all_logits=True)
        assert rel_err(ours, ref) < TOL
        eng.model.cache.k[:] = np.nan  # decode must rewrite every row it reads
        eng.model.forward(PROMPT[:3], 0)
        for i in range(3, len(PROMPT)):
            assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < TOL
    if sparse:  # over the neuron-major file (path of the last round)
        cfg = eng.cfg
        ffn = SparseFFN(cfg, None, np.zeros(cfg.n_layer, np.float32), "relu")
        eng2 = Engine(path, n_ctx=64, n_threads=2)
        eng2.model.ffn = ffn
        prefill = eng2.model.forward(PROMPT, 0, all_logits=True)
        assert rel_err(prefill, ref) < TOL
        ffn.stats.reset()
        eng2.model.forward(PROMPT[:3], 0)
        for i in range(3, len(PROMPT)):
            step = eng2.model.forward([PROMPT[i]], i)
            np.testing.assert_allclose(step, ours[i], rtol=0, atol=1e-4 * np.abs(ours[i]).max())
        assert ffn.stats.sparsity > 0.2  # exact zeros were skipped, not computed
    return eng


# ---- SwiGLU families -----------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("n_kv", [1, 2])
def test_qwen2(tmp_path, tied, n_kv):
    d, ref = build(tmp_path, f"qwen2-{tied}-{n_kv}", transformers.Qwen2ForCausalLM,
                   transformers.Qwen2Config, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv,
                   tie_word_embeddings=tied, rope_theta=10000.0)
    eng = check(tmp_path, d, ref)
    assert eng.weights.layers[0].bq is not None and eng.weights.layers[0].bo is None
    assert eng.cfg.family == "qwen2"
    assert eng.model.llama_fused and not eng.model.llama_plain  # decode: the fused kernels
    fused_equals_unfused(eng)


@pytest.mark.parametrize("tied,n_kv,head_dim,bias,window", [
    (True, 2, 32, False, None), (False, 1, 16, True, None), (False, 2, 16, False, 5)])
def test_qwen3(tmp_path, tied, n_kv, head_dim, bias, window):
    """Qwen3: per-head RMSNorms of Q and K before RoPE (transformers' Qwen3Attention), a head_dim
    of its own (n_head * head_dim != n_embd), attention_bias on q, k, v and o, sliding-window
    layers from max_window_layers on (as Qwen2's)."""
    swa = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
    d, ref = build(tmp_path, f"qwen3-{tied}-{n_kv}-{window}", transformers.Qwen3ForCausalLM,
                   transformers.Qwen3Config, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=3 if window else 2, num_attention_heads=4,
                   num_key_value_heads=n_kv, head_dim=head_dim, tie_word_embeddings=tied,
                   rope_theta=10000.0, attention_bias=bias, **swa)
    eng = check(tmp_path, d, ref)
    lw = eng.weights.layers[0]
    assert eng.cfg.family == "qwen3" and eng.cfg.head_dim == head_dim
    assert lw.attn_q_norm is not None and lw.attn_k_norm is not None
    assert (lw.bq is not None) == bias and (lw.bo is not None) == bias
    assert [eng.cfg.window(i) for i in range(eng.cfg.n_layer)] == ([0, 5, 5] if window else [0, 0])
    # decode through the fused kernels (head norms inside cpu.decode_attn) unless o_proj has a
    # bias or layers slide (then the attention half alone is fused); the GPU engine takes the
    # same models (its head norms: test_gpu_model_runs_biases_rope_divisors_and_head_norms)
    fused = not bias and not window
    assert eng.model.llama_fused == fused and not eng.model.llama_plain
    assert eng.model.attn_fused == bool(window)
    assert fused_model(eng.cfg, eng.weights) == fused
    fused_equals_unfused(eng, exact=not fused)  # (the fused FFN half sums in its own order)


def fused_equals_unfused(eng, exact=False):
    """One-token decode through the fused kernels (cpu.decode_attn with biases / RoPE divisors)
    gives the kernel-by-kernel loop's logits (same dots; RoPE's angles from another libm).
    exact: bit for bit (no RoPE divisors: the same kernels in the same order)."""
    steps = {}
    for fused in (True, False):
        eng.model.fused = fused
        eng.model.forward(PROMPT[:3], 0)
        steps[fused] = [eng.model.forward([t], i + 3) for i, t in enumerate(PROMPT[3:])]
    eng.model.fused = True
    for a, b in zip(steps[True], steps[False]):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_default_conversion_without_a_sparse_mode(tmp_path, capsys):
    """A SwiGLU model that is not Llama-shaped (Qwen2 with sliding-window layers) converts by
    default to a dense file (ffn_down in row layout, no predictors): the GPU engine does not run
    it and glu decodes no faster on the CPU; its logits are transformers'; --sparse-mode glu still
    makes the predictors."""
    from pyinfer import constants as C
    from pyinfer.config import read_field

    d, ref = build(tmp_path, "qwen2-default", transformers.Qwen2ForCausalLM,
                   transformers.Qwen2Config, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   rope_theta=10000.0, use_sliding_window=True, sliding_window=5,
                   max_window_layers=1)
    out = str(tmp_path / "default.gguf")
    assert convert_main([d, out, "--outtype", "f32", "--calib-tokens", "128", "-t", "1"]) == 0
    assert "no sparse mode for this model by default" in capsys.readouterr().err
    r = gguf.GGUFReader(out)
    assert read_field(r, C.K_SPARSE_MODE) is None
    assert read_field(r, C.K_FFN_LAYOUT) == C.FFN_LAYOUT_ROWS
    names = {t.name for t in r.tensors}
    assert C.FC1.format(bid=0) not in names and C.SRC_FFN_DOWN.format(bid=0) in names
    eng = Engine(out, n_ctx=64, n_threads=1)
    assert not eng.is_sparse
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < TOL
    glu = str(tmp_path / "glu.gguf")
    assert convert_main([d, glu, "--outtype", "f32", "--sparse-mode", "glu", "--calib-tokens",
                         "128", "--epochs", "2", "-t", "1"]) == 0
    assert read_field(gguf.GGUFReader(glu), C.K_SPARSE_MODE) == C.SPARSE_MODE_GLU


def tiny_qwen2_or_llama3(tmp_path, family, tag):
    """(dir, transformers' logits) of a tiny Qwen2 (q/k/v biases), Qwen3 (per-head Q/K norms, a
    head_dim of its own) or Llama 3 (scaled RoPE)."""
    if family == "qwen3":
        return build(tmp_path, f"qwen3-{tag}", transformers.Qwen3ForCausalLM,
                     transformers.Qwen3Config, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, rope_theta=10000.0)
    if family == "qwen2":
        return build(tmp_path, f"qwen2-{tag}", transformers.Qwen2ForCausalLM,
                     transformers.Qwen2Config, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     rope_theta=10000.0)
    return build(tmp_path, f"llama3-{tag}", transformers.LlamaForCausalLM,
                 transformers.LlamaConfig, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=256, rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_sparse_mode_input_with_biases_and_rope_divisors(tmp_path, capsys, family):
    """Qwen2 (q/k/v biases), Qwen3 (head norms) and Llama 3 (RoPE frequency divisors) files take
    sparse mode input by default (f16 here): with every input kept their logits are
    transformers' (within f16 weights' rounding; a missing bias or divisor is ~5e-2 off), the
    decode of one token at a time (one kernel call over the layers, biases, head norms and
    divisors inside it) equals the prefill's logits at the file's thresholds, and inputs were
    skipped."""
    from pyinfer import constants as C
    from pyinfer.config import read_field

    d, ref = tiny_qwen2_or_llama3(tmp_path, family, "in")
    out = str(tmp_path / f"{family}-in.gguf")
    assert convert_main([d, out, "--outtype", "f16", "--calib-tokens", "256", "-t", "1"]) == 0
    assert "sparse mode input" in capsys.readouterr().err
    assert read_field(gguf.GGUFReader(out), C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    every = Engine(out, n_ctx=64, n_threads=2, dense=True)  # thresholds -1: every input kept
    assert every.model.input_sparse is not None and every.model.llama_fused
    assert (every.weights.rope_freqs is not None) == (family == "llama3")
    assert (every.weights.layers[0].bq is not None) == (family == "qwen2")
    assert (every.weights.layers[0].attn_q_norm is not None) == (family == "qwen3")
    assert rel_err(every.model.forward(PROMPT, 0, all_logits=True), ref) < 1e-2
    every.model.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(every.model.forward([PROMPT[i]], i), ref[i]) < 1e-2
    eng = Engine(out, n_ctx=64, n_threads=2)
    assert eng.model._whole_token_input()
    prefill = eng.model.forward(PROMPT, 0, all_logits=True)
    eng.model.cache.k[:] = np.nan  # decode must rewrite every row it reads
    eng.model.forward(PROMPT[:3], 0)
    eng.model.ffn.stats.reset()
    for i in range(3, len(PROMPT)):
        step = eng.model.forward([PROMPT[i]], i)
        np.testing.assert_allclose(step, prefill[i], rtol=0, atol=1e-4 * np.abs(prefill[i]).max())
    assert eng.model.ffn.stats.sparsity > 0.05
    # the GPU engine over NumpyDevice (its kernels' twins) runs the file as whole input-sparse
    # layers: the CPU's logits, decode and prefill, with the same channels kept
    from pyinfer.device import NumpyDevice
    from pyinfer.hybrid import place_model
    from pyinfer.input_sparse import InputSparseFFN, thresholds_from_reader
    from pyinfer.model import Model
    from tests.test_hybrid import TOL_SAME, decode_all

    thr = thresholds_from_reader(eng.reader, eng.cfg)
    ref_ffn = InputSparseFFN(eng.cfg, thr)
    ref = decode_all(Model(eng.cfg, eng.weights, 64, 2, ffn=ref_ffn, cache_type="f32"), PROMPT)
    gm = place_model(eng.reader, eng.cfg, eng.weights, InputSparseFFN(eng.cfg, thr), 64, 2,
                     device="cuda", backend=NumpyDevice())
    assert type(gm).__name__ == "GpuModel" and gm.is_input_sparse
    assert rel_err(decode_all(gm, PROMPT), ref) < TOL_SAME
    assert gm.stats.active == ref_ffn.stats.active
    assert rel_err(gm.forward(PROMPT, 0, all_logits=True), ref) < TOL_SAME


def test_qwen2_sliding_window_layers(tmp_path):
    d, ref = build(tmp_path, "qwen2-swa", transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                   sliding_window=5, max_window_layers=1)
    eng = check(tmp_path, d, ref)
    assert eng.cfg.window(0) == 0 and eng.cfg.window(1) == 5 and eng.cfg.window(2) == 5
    assert not eng.model.llama_fused  # windows: the attention half fused, the FFN half not
    assert eng.model.attn_fused
    fused_equals_unfused(eng, exact=True)


@pytest.mark.parametrize("window", [4, None])
def test_mistral(tmp_path, window):
    d, ref = build(tmp_path, f"mistral-{window}", transformers.MistralForCausalLM,
                   transformers.MistralConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   sliding_window=window, tie_word_embeddings=False)
    eng = check(tmp_path, d, ref)
    assert eng.cfg.sliding_window == (window or 0)
    assert eng.model.llama_plain == (window is None)  # without a window: the fused Llama path
    if window is not None:  # the attention half alone fused
        assert eng.model.attn_fused
        fused_equals_unfused(eng, exact=True)
    # A batched prompt gives each position the same bits however it is split (whatever the
    # cache held): a batch starting at window - 1 ran its lone full-window query through the
    # one-query (decode) path, whose bits differ.
    want = eng.eval_prompt(PROMPT).copy()
    for k in range(2, len(PROMPT) - 1):
        eng.reset()
        eng.eval_prompt(PROMPT[:k])
        np.testing.assert_array_equal(eng.eval_prompt(PROMPT), want, err_msg=f"cache held {k}")


def test_mistral_window_changes_the_output(tmp_path):
    """The window test above can fail: the same weights without the window give other logits."""
    d, ref = build(tmp_path, "mistral-w", transformers.MistralForCausalLM,
                   transformers.MistralConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   sliding_window=4)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["sliding_window"] = None
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    eng = Engine(convert(d, tmp_path), n_ctx=64, n_threads=1)
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) > 1e-2


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling(tmp_path, form):
    """transformers 5 writes rope_parameters; the rope_scaling + rope_theta form of
    transformers 4 configs converts to the same file."""
    def to_v4(c):
        params = c.pop("rope_parameters")
        c["rope_theta"] = params.pop("rope_theta")
        c["rope_scaling"] = params

    d, ref = build(tmp_path, f"llama3-{form}", transformers.LlamaForCausalLM,
                   transformers.LlamaConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=256,
                   rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0),
                   config_edit=to_v4 if form == "rope_scaling" else None)
    eng = check(tmp_path, d, ref)
    assert eng.model.llama_fused and not eng.model.llama_plain  # decode: the fused kernels
    fused_equals_unfused(eng)
    freqs = eng.weights.rope_freqs
    assert freqs is not None and freqs.min() == pytest.approx(1.0) and freqs.max() == pytest.approx(8.0)
    assert 1.0 < np.median(freqs) < 8.0 or np.any((freqs > 1.0) & (freqs < 8.0))  # smoothed band


def test_llama3_from_llama_cpp_gguf(tmp_path):
    """A llama.cpp GGUF of a Llama 3 model (Q/K rows permuted, RoPE divisors in rope_freqs.weight)
    runs as it is and converts (it was refused): both give transformers' logits, and the
    conversion decodes through the fused kernels."""
    from tests._models import write_llamacpp_gguf

    d, ref = build(tmp_path, "llama3-lc", transformers.LlamaForCausalLM,
                   transformers.LlamaConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=256, rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0))
    src = str(tmp_path / "llama3-lc.gguf")
    write_llamacpp_gguf(d, src, "f32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(src).tensors}
    out = str(tmp_path / "llama3-lc-conv.gguf")
    assert convert_main([src, out, "--outtype", "f32", "--dense"]) == 0
    for path in (src, out):
        eng = Engine(path, n_ctx=64, n_threads=2)
        assert eng.weights.rope_freqs is not None
        assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < TOL
        eng.model.forward(PROMPT[:3], 0)
        for i in range(3, len(PROMPT)):
            assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < TOL
    assert eng.model.llama_fused


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_from_llama_cpp_gguf(tmp_path, family):
    """A llama.cpp GGUF of a Qwen2 / Qwen3 model (architecture qwen2 / qwen3: their own keys, Q/K
    rows as in Hugging Face since llama.cpp runs them with NeoX RoPE; Qwen2's q/k/v biases,
    Qwen3's attn_q_norm / attn_k_norm) converts: dense, its logits are transformers' and its
    decode takes the fused kernels; by default (f16 here) it becomes a sparse mode input file;
    pyinfer also runs it as it is, with transformers' logits."""
    from pyinfer import constants as C
    from pyinfer.config import read_field
    from tests._models import write_llamacpp_gguf

    d, ref = tiny_qwen2_or_llama3(tmp_path, family, "lc")
    src = str(tmp_path / f"{family}-lc.gguf")
    write_llamacpp_gguf(d, src, "f32", arch=family)
    assert read_field(gguf.GGUFReader(src), "general.architecture") == family
    out = str(tmp_path / f"{family}-lc-conv.gguf")
    assert convert_main([src, out, "--outtype", "f32", "--dense"]) == 0
    eng = Engine(out, n_ctx=64, n_threads=2)
    assert eng.cfg.family == family
    assert (eng.weights.layers[1].bv is not None) == (family == "qwen2")
    assert (eng.weights.layers[1].attn_k_norm is not None) == (family == "qwen3")
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < TOL
    eng.model.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < TOL
    assert eng.model.llama_fused
    sparse = str(tmp_path / f"{family}-lc-in.gguf")
    assert convert_main([src, sparse, "--outtype", "f16", "--calib-tokens", "256", "-t", "1"]) == 0
    assert read_field(gguf.GGUFReader(sparse), C.K_SPARSE_MODE) == C.SPARSE_MODE_INPUT
    every = Engine(sparse, n_ctx=64, n_threads=2, dense=True)
    assert rel_err(every.model.forward(PROMPT, 0, all_logits=True), ref) < 1e-2
    # run as it is (pyinfer.llamacpp): the same logits, decode through the fused kernels
    from pyinfer.info import describe

    info = describe(src)  # pyinfer-inspect of the llama.cpp file: its family, Qwen3's norms
    assert info["family"] == family and info["head_norms"] == (family == "qwen3")
    assert info["head_dim"] == direct_head_dim(d)
    direct = Engine(src, n_ctx=64, n_threads=2)
    assert direct.llamacpp and direct.cfg.family == family and direct.model.llama_fused
    assert rel_err(direct.model.forward(PROMPT, 0, all_logits=True), ref) < TOL
    direct.model.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(direct.model.forward([PROMPT[i]], i), ref[i]) < TOL


def direct_head_dim(d):
    """head_dim of a saved transformers model directory (its config, or hidden / heads)."""
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def test_rope_scaling_refused(tmp_path):
    d, _ = build(tmp_path, "yarn", transformers.LlamaForCausalLM, transformers.LlamaConfig,
                 hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=2,
                 config_edit=lambda c: c.update(rope_parameters={"rope_type": "yarn",
                                                                 "rope_theta": 1e4, "factor": 2.0}))
    assert convert_main([d, str(tmp_path / "x.gguf"), "--outtype", "f32", "--dense"]) == 1


# ---- ReLU families: dReLU, ProSparse fatrelu, OPT, Falcon ----------------------------------

def _drelu(mlp):
    mlp.forward = lambda x: mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))


def test_drelu(tmp_path):
    d, ref = build(tmp_path, "drelu", transformers.LlamaForCausalLM, transformers.LlamaConfig,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                   mlp_patch=_drelu, config_edit=lambda c: c.update(hidden_act="drelu"))
    eng = check(tmp_path, d, ref, sparse=True)
    assert eng.cfg.ffn_up_act == "relu"


FAT_T = 0.1


def _fatrelu(mlp):
    mlp.act_fn = torch.nn.Threshold(FAT_T, 0.0)  # g if g > FAT_T else 0


def test_prosparse_fatrelu(tmp_path):
    d, ref = build(tmp_path, "fatrelu", transformers.LlamaForCausalLM, transformers.LlamaConfig,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, hidden_act="relu",
                   mlp_patch=_fatrelu,
                   config_edit=lambda c: c.update(hidden_act="fatrelu", hidden_act_param=FAT_T))
    eng = check(tmp_path, d, ref, sparse=True)
    assert eng.cfg.act_shift == pytest.approx(FAT_T)


@pytest.mark.parametrize("tied,bias", [(True, True), (False, False)])
def test_opt(tmp_path, tied, bias):
    d, ref = build(tmp_path, f"opt-{tied}-{bias}", transformers.OPTForCausalLM,
                   transformers.OPTConfig, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                   enable_bias=bias, tie_word_embeddings=tied)
    eng = check(tmp_path, d, ref, sparse=True)
    assert eng.weights.pos_embd.rows == 128 and eng.weights.layers[0].ffn_gate is None


@pytest.mark.parametrize("layout", ["7b", "40b", "40b-one-norm", "mha-sequential"])
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_falcon(tmp_path, layout, act):
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96,
              activation=act, alibi=False, bias=layout != "7b")
    if layout == "7b":
        kw.update(multi_query=True, parallel_attn=True, new_decoder_architecture=False)
    elif layout.startswith("40b"):
        kw.update(new_decoder_architecture=True, num_kv_heads=2,
                  num_ln_in_parallel_attn=1 if layout == "40b-one-norm" else 2)
    else:
        kw.update(multi_query=False, parallel_attn=False, new_decoder_architecture=False)
    d, ref = build(tmp_path, f"falcon-{layout}-{act}", transformers.FalconForCausalLM,
                   transformers.FalconConfig, **kw)
    eng = check(tmp_path, d, ref, sparse=act == "relu")
    assert eng.cfg.n_head_kv == {"7b": 1, "40b": 2, "40b-one-norm": 2, "mha-sequential": 4}[layout]


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
@pytest.mark.parametrize("kind", ["all", "partial"])
def test_gpu_model_runs_biases_rope_divisors_and_head_norms(tmp_path, family, kind):
    """The GPU engine's forward over NumpyDevice (its kernels' twins) on Qwen2 (q/k/v biases
    added after the fused projection), Llama 3 (the RoPE table divided by rope_freqs) and Qwen3
    (each head's RMSNorm of Q and K before RoPE): decode and prefill give the CPU model's
    logits, every layer on the device or one (the rest on the CPU); place_model takes them."""
    from pyinfer.device import NumpyDevice
    from pyinfer.hybrid import place_model
    from tests.test_hybrid import TOL_SAME, compare, plan_for

    eng = _biased_or_scaled(tmp_path, family)
    compare(eng, lambda: DenseFFN(eng.cfg), plan_for(kind, eng.cfg, dense=True), "f32",
            NumpyDevice(), exact_counts=True, tol=TOL_SAME)
    m = place_model(eng.reader, eng.cfg, eng.weights, DenseFFN(eng.cfg), 64, 2, device="cuda",
                    backend=NumpyDevice())
    assert type(m).__name__ == "GpuModel"


def _biased_or_scaled(tmp_path, family):
    """An f32 neuron-major Engine of a tiny Qwen2 (q/k/v biases), Llama 3 (scaled RoPE) or Qwen3
    (head norms)."""
    d, _ = tiny_qwen2_or_llama3(tmp_path, family, "gpu")
    eng = Engine(convert(d, tmp_path, rows=False), n_ctx=64, n_threads=2)  # ffn_down_t
    assert eng.model.llama_fused and not eng.model.llama_plain
    return eng


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3"])
def test_gpu_device_runs_biases_rope_divisors_and_head_norms(tmp_path, family):
    """On a CUDA device: the CupyDevice GpuModel of a Qwen2 / Llama 3 / Qwen3 file gives the CPU
    model's logits (decode through CUDA graphs, prefill), every layer resident."""
    from pyinfer.ops import cuda
    from tests.test_hybrid import TOL, compare, plan_for

    if not cuda.available():
        pytest.skip(f"no CUDA device: {cuda.unavailable_reason()}")
    from pyinfer.device import CupyDevice

    eng = _biased_or_scaled(tmp_path, family)
    compare(eng, lambda: DenseFFN(eng.cfg), plan_for("all", eng.cfg, dense=True), "f32",
            CupyDevice(), exact_counts=True, tol=TOL["f32"])


def test_gpu_engine_refuses_other_families(tmp_path):
    from pyinfer.errors import PyinferError
    from pyinfer.hybrid import place_model

    d, _ = build(tmp_path, "opt-gpu", transformers.OPTForCausalLM, transformers.OPTConfig,
                 hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=64)
    eng = Engine(convert(d, tmp_path), n_ctx=32, n_threads=1)
    with pytest.raises(PyinferError, match="GPU engine runs Llama-shaped files only"):
        place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, 32, 1, device="cuda")
    m = place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, 32, 1, device="auto")
    assert type(m).__name__ == "Model"  # auto falls back to the CPU
    from pyinfer.device import NumpyDevice  # a GpuModel on any backend refuses it too
    from pyinfer.gpu_model import GpuModel

    with pytest.raises(PyinferError, match="GPU engine runs Llama-shaped files only"):
        GpuModel(eng.cfg, eng.weights, 32, 1, eng.model.ffn, NumpyDevice(), plan=None)


def test_conversions_for_the_gpu_engine(tmp_path, capsys, monkeypatch):
    """Where sparse mode input does not pay (f32 here), a Qwen3 converts to glu's predictors for
    the GPU engine as a Llama 3 does (the engine takes its head norms); --vram-budget for a
    family the GPU engine does not run (OPT) is refused before the staging conversion."""
    import predictors.offline as offline
    from predictors.offline import OfflineOptions, default_mode
    from pyinfer import constants as C

    for family in ("qwen3", "llama3"):
        d, _ = tiny_qwen2_or_llama3(tmp_path, family, "modes")
        eng = Engine(convert(d, tmp_path, rows=False), n_ctx=32, n_threads=1, dense=True)
        assert default_mode(eng.cfg, eng.weights, "f32", OfflineOptions()) == C.SPARSE_MODE_GLU
    d, _ = build(tmp_path, "opt-budget", transformers.OPTForCausalLM, transformers.OPTConfig,
                 hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=64)
    capsys.readouterr()

    def no_staging(*a, **k):
        raise AssertionError("staged before refusing --vram-budget")

    monkeypatch.setattr(offline, "_stage", no_staging)
    assert convert_main([d, str(tmp_path / "x.gguf"), "--outtype", "f32",
                         "--vram-budget", "1", "--calib-tokens", "64", "-t", "1"]) == 1
    assert "--vram-budget places neurons for the GPU engine" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.gguf")


@pytest.mark.parametrize("drop", [("attn_k_norm",), ("attn_q_norm", "attn_k_norm")])
def test_qwen3_file_without_its_head_norms(tmp_path, monkeypatch, drop):
    """A pyinfer file of family qwen3 lacking its head norms is refused at load (without both it
    ran as a plain Llama: other logits, no word)."""
    import convert.cli as cli
    from pyinfer.errors import PyinferError

    d, _ = tiny_qwen2_or_llama3(tmp_path, "qwen3", "nonorm")
    plan = cli.plan

    def without(*a, **k):
        meta, jobs = plan(*a, **k)
        return meta, [j for j in jobs if not any(x in j.name for x in drop)]

    monkeypatch.setattr(cli, "plan", without)
    out = str(tmp_path / "nonorm.gguf")
    assert convert_main([d, out, "--outtype", "f32", "--dense"]) == 0
    with pytest.raises(PyinferError, match=f"qwen3 file has no tensor blk.0.{drop[0]}.weight"):
        Engine(out, n_ctx=32, n_threads=1)


@pytest.mark.parametrize("drop", [("attn_k_norm",), ("attn_q_norm", "attn_k_norm")])
def test_llama_cpp_qwen3_file_without_its_head_norms(tmp_path, monkeypatch, drop):
    """A llama.cpp qwen3 file lacking a head norm is refused at load with the tensor's name (it
    ran as a plain Llama, or failed at the first token with a traceback)."""
    from pyinfer.errors import PyinferError
    from tests._models import write_llamacpp_gguf

    d, _ = tiny_qwen2_or_llama3(tmp_path, "qwen3", "drop")
    orig = gguf.GGUFWriter.add_tensor

    def add(self, name, *a, **k):
        if not any(x in name for x in drop):
            orig(self, name, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    src = str(tmp_path / "lc-drop.gguf")
    write_llamacpp_gguf(d, src, "f32", arch="qwen3")
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", orig)
    with pytest.raises(PyinferError, match=f"has no tensor blk.0.{drop[0]}.weight"):
        Engine(src, n_ctx=32, n_threads=1)


@pytest.mark.parametrize("family", ["opt", "falcon"])
def test_offline_stage_on_non_gated_ffn(tmp_path, family):
    """pyinfer-convert's offline stage profiles a non-gated ReLU FFN (the up projection plus its
    bias selects neurons), trains PowerInfer's predictor over it, and the sparse file still gives
    transformers' logits: ReLU's zeros make it lossless."""
    if family == "opt":
        d, ref = build(tmp_path, "opt-off", transformers.OPTForCausalLM, transformers.OPTConfig,
                       hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=128, word_embed_proj_dim=64)
    else:
        d, ref = build(tmp_path, "falcon-off", transformers.FalconForCausalLM,
                       transformers.FalconConfig, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, ffn_hidden_size=256, activation="relu",
                       new_decoder_architecture=True, num_kv_heads=2, bias=True)
    out = str(tmp_path / "sparse.gguf")
    assert convert_main([d, out, "--outtype", "f32", "--calib-tokens", "256", "--epochs", "3",
                         "-t", "1"]) == 0
    eng = Engine(out, n_ctx=64, n_threads=1)
    ffn = eng.model.ffn
    assert isinstance(ffn, SparseFFN) and ffn.mode == "relu" and ffn.predictors is not None
    assert rel_err(eng.model.forward(PROMPT, 0, all_logits=True), ref) < TOL
    eng.model.forward(PROMPT[:3], 0)
    ffn.stats.reset()
    for i in range(3, len(PROMPT)):
        assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < TOL
    assert ffn.stats.sparsity > 0.2


def test_opt_context_past_learned_positions(tmp_path):
    from pyinfer.errors import PyinferError

    d, _ = build(tmp_path, "opt-ctx", transformers.OPTForCausalLM, transformers.OPTConfig,
                 hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=32, word_embed_proj_dim=64)
    path = convert(d, tmp_path)
    with pytest.raises(PyinferError, match="exceeds the 32 learned positions"):
        Engine(path, n_ctx=33, n_threads=1)


# ---- Gemma 3 ------------------------------------------------------------------------------

def _gemma3_v4(c):
    """transformers 4's spelling of the same config: rope_theta / rope_local_base_freq and
    sliding_window_pattern instead of rope_parameters and layer_types."""
    params = c.pop("rope_parameters")
    c["rope_theta"] = params["full_attention"]["rope_theta"]
    c["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    c.pop("layer_types")


@pytest.mark.parametrize("case", ["tied-gqa-softcap", "untied-mqa-v4", "wide-heads"])
def test_gemma3(tmp_path, case):
    """GeGLU, q/k norms, 4 norms per layer with Gemma's +1, sqrt(n_embd) embedding scale, local
    and global layers (window 4-5 < the 16-token prompt) with their own RoPE bases,
    query_pre_attn_scalar != head_dim, final logit softcapping; the transformers-4 config form."""
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    edit = None
    if case == "tied-gqa-softcap":
        kw.update(num_key_value_heads=2, head_dim=16, sliding_window=5, sliding_window_pattern=2,
                  tie_word_embeddings=True, final_logit_softcapping=3.0, query_pre_attn_scalar=16)
    elif case == "untied-mqa-v4":
        kw.update(num_key_value_heads=1, head_dim=16, sliding_window=4, sliding_window_pattern=3,
                  tie_word_embeddings=False, query_pre_attn_scalar=24,
                  attn_logit_softcapping=1.0)  # not applied by transformers' Gemma3Attention
        edit = _gemma3_v4
    else:  # n_head * head_dim (128) != n_embd (64), as in Gemma-3-270M (1024 vs 640)
        kw.update(num_key_value_heads=2, head_dim=32, sliding_window=6,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                  tie_word_embeddings=True, query_pre_attn_scalar=32)
    d, ref = build(tmp_path, f"gemma3-{case}", transformers.Gemma3ForCausalLM,
                   transformers.Gemma3TextConfig, config_edit=edit, **kw)
    eng = check(tmp_path, d, ref)
    cfg = eng.cfg
    assert cfg.family == "gemma3" and cfg.hidden_act == "gelu_tanh" and not eng.model.llama_plain
    # one-token decode: the attention half (head norms, scale, window, post-norm) in one kernel
    # call, bit for bit the kernel-by-kernel loop (check above: both against transformers)
    assert eng.model.attn_fused
    fused_equals_unfused(eng, exact=True)
    assert cfg.embd_scale == pytest.approx(8.0) and eng.weights.layers[0].attn_q_norm is not None
    windows = [cfg.window(i) for i in range(cfg.n_layer)]
    assert windows == {"tied-gqa-softcap": [5, 0, 5], "untied-mqa-v4": [4, 4, 0],
                       "wide-heads": [0, 6, 6]}[case]
    assert [cfg.rope_base(i) for i in range(3)] == [1e4 if w else 1e6 for w in windows]
    if case == "tied-gqa-softcap":
        assert cfg.final_softcap == 3.0 and np.abs(ref).max() < 3.0


@pytest.mark.parametrize("edit", ["no-window", "one-rope-base", "no-plus-one"])
def test_gemma3_details_change_the_output(tmp_path, edit):
    """The Gemma 3 test above can fail: dropping the window, the local RoPE base, or Gemma's +1
    on the norm weights gives logits that miss transformers' by far more than the tolerance."""
    d, ref = build(tmp_path, f"gemma3-ctl-{edit}", transformers.Gemma3ForCausalLM,
                   transformers.Gemma3TextConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=16)
    path = convert(d, tmp_path)
    from pyinfer.config import ModelConfig
    from pyinfer.model import Model
    from pyinfer.weights import ModelWeights
    import dataclasses
    import gguf

    reader = gguf.GGUFReader(path)
    cfg = ModelConfig.from_gguf(reader)
    w = ModelWeights.from_gguf(reader, cfg)
    if edit == "no-window":
        cfg = dataclasses.replace(cfg, sliding_window=0, swa_layers=())
    elif edit == "one-rope-base":
        cfg = dataclasses.replace(cfg, rope_freq_base_swa=0.0)
    else:
        for lw in w.layers:
            lw.attn_norm = lw.attn_norm - 1.0
    model = Model(cfg, w, n_ctx=32, n_threads=1)
    assert rel_err(model.forward(PROMPT, 0, all_logits=True), ref) > 1e-2


def test_gemma3_from_llama_cpp_gguf(tmp_path):
    """A gemma3 GGUF laid out as llama.cpp's converter writes it (gguf-py's own HF -> GGUF tensor
    name map, norm weights + 1, Q/K unpermuted, arch-prefixed keys, no SWA pattern or local
    RoPE base stored) converts to transformers' logits: llama.cpp's defaults fill the gaps."""
    import gguf
    from pyinfer.config import ModelConfig
    from pyinfer.model import Model
    from pyinfer.weights import ModelWeights

    hd = 16
    d, ref = build(tmp_path, "gemma3-src", transformers.Gemma3ForCausalLM,
                   transformers.Gemma3TextConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                   sliding_window=5, query_pre_attn_scalar=hd, tie_word_embeddings=True)
    model = transformers.Gemma3ForCausalLM.from_pretrained(d, dtype=torch.float32)
    c = model.config
    src = str(tmp_path / "gemma3-llamacpp.gguf")
    w = gguf.GGUFWriter(src, "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        out = names.get_name(name, try_suffixes=(".weight",))
        assert out is not None, name
        a = p.numpy().astype(np.float32)
        w.add_tensor(out, a + 1.0 if name.endswith("norm.weight") else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = str(tmp_path / "gemma3-pyinfer.gguf")
    assert convert_main([src, out, "--outtype", "f32", "--dense"]) == 0
    reader = gguf.GGUFReader(out)
    cfg = ModelConfig.from_gguf(reader)
    assert cfg.family == "gemma3" and [cfg.window(i) for i in range(2)] == [5, 5]
    m = Model(cfg, ModelWeights.from_gguf(reader, cfg), n_ctx=32, n_threads=1)
    ours = m.forward(PROMPT, 0, all_logits=True)
    assert rel_err(ours, ref) < TOL
    m.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(m.forward([PROMPT[i]], i), ref[i]) < TOL


def test_gemma3_null_sliding_window_is_refused(tmp_path):
    """"sliding_window": null (transformers' Gemma 3 cannot run it: a TypeError) is a one-line
    error, not a guess."""
    d, _ = build(tmp_path, "gemma3-null", transformers.Gemma3ForCausalLM,
                 transformers.Gemma3TextConfig, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 config_edit=lambda c: c.update(sliding_window=None))
    out = str(tmp_path / "null.gguf")
    assert convert_main([d, out, "--dense", "--outtype", "f32"]) == 1
    assert not os.path.exists(out)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_config_keys_left_to_transformers_defaults(tmp_path, family):
    """A config.json without a key whose transformers default is not derived from the others
    converts to the model transformers loads: Gemma 3 without sliding_window (Gemma3TextConfig's
    4096: its local layers keep their own RoPE base; a window of 0 gave every layer the global
    base, logits 0.5 off) and Qwen3 without head_dim (Qwen3Config's 128, not hidden_size /
    num_attention_heads)."""
    if family == "gemma3":
        d, ref = build(tmp_path, "gemma3-defaults", transformers.Gemma3ForCausalLM,
                       transformers.Gemma3TextConfig, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, query_pre_attn_scalar=16,
                       layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 1e4}},
                       config_edit=lambda c: c.pop("sliding_window"))
    else:
        d, ref = build(tmp_path, "qwen3-defaults", transformers.Qwen3ForCausalLM,
                       transformers.Qwen3Config, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, rope_theta=10000.0, config_edit=lambda c: c.pop("head_dim"))
    loaded = transformers.AutoConfig.from_pretrained(d)  # what transformers reads back
    assert (loaded.sliding_window, loaded.head_dim) == ((4096, 16) if family == "gemma3"
                                                        else (None, 128))
    eng = check(tmp_path, d, ref)
    if family == "gemma3":
        assert [eng.cfg.rope_base(i) for i in range(3)] == [1e6, 1e4, 1e4]
    else:
        assert eng.cfg.head_dim == 128


@pytest.mark.parametrize("family", ["qwen2", "llama3", "qwen3", "gemma3", "mistral-window"])
def test_dense_token_in_one_call_equals_the_layer_calls(tmp_path, family):
    """A dense file (ffn_down in row layout) decodes a token in one kernel call
    (``cpu.decode_layers_rows`` over a plan of every layer's pointers): bit for bit the
    per-layer calls (``cpu.decode_attn`` and the FFN half: ``decode_ffn_rows``, or Gemma's
    GELU-tanh and post-norms kernel by kernel) with Qwen2's biases, Llama 3's RoPE divisors,
    Qwen3's head norms, Gemma 3's norms, score scale, local RoPE base and sliding windows, and
    Mistral's window, for f16 and f32 caches, 1-3 threads and a start past layer 0 (the
    hybrid's CPU layers); the FFN counters the same."""
    if family == "gemma3":  # windows of 4 < the 16-token prompt: the window's rows only
        d, ref = build(tmp_path, "gemma3-rows", transformers.Gemma3ForCausalLM,
                       transformers.Gemma3TextConfig, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, sliding_window=4, sliding_window_pattern=2,
                       query_pre_attn_scalar=24,
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 1e4}})
    elif family == "mistral-window":
        d, ref = build(tmp_path, "mistral-rows", transformers.MistralForCausalLM,
                       transformers.MistralConfig, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       sliding_window=4)
    else:
        d, ref = tiny_qwen2_or_llama3(tmp_path, family, "rows")
    path = convert(d, tmp_path)  # --dense: row-layout ffn_down
    for cache, n_threads in (("f16", 1), ("f32", 2), ("f16", 3)):
        got = {}
        for whole in (True, False):
            eng = Engine(path, n_ctx=64, n_threads=n_threads, cache_type=cache)
            m = eng.model
            m.whole_token = whole
            m.forward(PROMPT[:3], 0)
            steps = [m.forward([PROMPT[i]], i) for i in range(3, len(PROMPT))]
            x = np.random.default_rng(0).standard_normal((1, eng.cfg.n_embd)).astype(np.float32)
            m.run_layers(x, len(PROMPT), first=1)  # layers 1.. only, as GpuModel hands them over
            got[whole] = (np.array(steps), x, m.cache.k.copy(), m.ffn.stats.total)
            assert bool(m._rows_plan) == whole
            if whole:  # bad arguments are errors, not reads through a missing plan or cache
                from pyinfer.ops import cpu

                with pytest.raises(TypeError):
                    cpu.decode_layers_rows(None, x[0], m.cache.k, m.cache.v, 3)
                with pytest.raises(ValueError, match="cache shapes do not match"):
                    cpu.decode_layers_rows(m._rows_plan, x[0], m.cache.k[1:], m.cache.v[1:], 3)
                with pytest.raises(ValueError, match="position 64 outside the cache"):
                    cpu.decode_layers_rows(m._rows_plan, x[0], m.cache.k, m.cache.v, 64)
            m.ffn = type("OtherFFN", (DenseFFN,), {})(eng.cfg)  # a tool's FFN (the profiler's)
            assert m._dense_rows_plan() is False  # its own calls, not the plan
        for a, b in zip(got[True], got[False]):
            np.testing.assert_array_equal(a, b)
        if cache == "f32":  # (an f16 cache's rounding costs Gemma 3e-3)
            assert rel_err(got[True][0], ref[3:]) < TOL
