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

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert.cli import main as convert_main  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from pyinfer.ffn import SparseFFN  # noqa: E402
from tests._models import make_bpe_tokenizer  # noqa: E402

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


def convert(d, tmp_path):
    out = str(tmp_path / (os.path.basename(d) + ".gguf"))
    assert convert_main([d, out, "--outtype", "f32", "--dense"]) == 0
    return out


def check(tmp_path, d, ref, sparse=False):
    """Logits equal transformers', prefill equals decode, and (sparse) the sparse FFN is lossless."""
    path = convert(d, tmp_path)
    eng = Engine(path, n_ctx=64, n_threads=2)
    ours = eng.model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(ours, ref) < TOL
    eng.model.cache.k[:] = np.nan  # decode must rewrite every row it reads
    eng.model.forward(PROMPT[:3], 0)
    for i in range(3, len(PROMPT)):
        assert rel_err(eng.model.forward([PROMPT[i]], i), ref[i]) < TOL
    if sparse:
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


def test_qwen2_sliding_window_layers(tmp_path):
    d, ref = build(tmp_path, "qwen2-swa", transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                   sliding_window=5, max_window_layers=1)
    eng = check(tmp_path, d, ref)
    assert eng.cfg.window(0) == 0 and eng.cfg.window(1) == 5 and eng.cfg.window(2) == 5


@pytest.mark.parametrize("window", [4, None])
def test_mistral(tmp_path, window):
    d, ref = build(tmp_path, f"mistral-{window}", transformers.MistralForCausalLM,
                   transformers.MistralConfig, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   sliding_window=window, tie_word_embeddings=False)
    eng = check(tmp_path, d, ref)
    assert eng.cfg.sliding_window == (window or 0)
    assert eng.model.llama_plain == (window is None)  # without a window: the fused Llama path


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
    freqs = eng.weights.rope_freqs
    assert freqs is not None and freqs.min() == pytest.approx(1.0) and freqs.max() == pytest.approx(8.0)
    assert 1.0 < np.median(freqs) < 8.0 or np.any((freqs > 1.0) & (freqs < 8.0))  # smoothed band


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


def test_gpu_engine_refuses_other_families(tmp_path):
    from pyinfer.errors import PyinferError
    from pyinfer.hybrid import place_model

    d, _ = build(tmp_path, "opt-gpu", transformers.OPTForCausalLM, transformers.OPTConfig,
                 hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=64)
    eng = Engine(convert(d, tmp_path), n_ctx=32, n_threads=1)
    with pytest.raises(PyinferError, match="GPU engine runs Llama files only"):
        place_model(eng.reader, eng.cfg, eng.weights, eng.model.ffn, 32, 1, device="cuda")


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
