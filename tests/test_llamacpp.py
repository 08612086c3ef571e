"""llama.cpp GGUFs run as they are (pyinfer.llamacpp): dense, on the CPU, no conversion.

References: transformers' LlamaForCausalLM on a tiny random model written in llama.cpp's layout
(Q/K rows permuted as llama.cpp's convert_hf_to_gguf.py does, ffn_down untransposed:
tests._models.write_llamacpp_gguf), and the same file converted by pyinfer-convert (whose GGUF
import is itself checked against transformers' GGUF loader in test_convert.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C
from pyinfer.errors import PyinferError
from pyinfer.ops.cpu import QTensor
from tests._paths import smollm2_gguf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert.cli import convert  # noqa: E402
from pyinfer import llamacpp  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from tests._models import make_random_llama, write_llamacpp_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (its published formula)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_logits(model_dir, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def cli(module, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF dir, llama.cpp-layout f32 GGUF, the same converted by pyinfer-convert --dense f32)."""
    tmp = tmp_path_factory.mktemp("llamacpp")
    model_dir = make_random_llama(tmp / "hf", "silu", tied=False, n_kv_heads=2, tokenizer="bpe")
    src = str(tmp / "llamacpp-f32.gguf")
    write_llamacpp_gguf(model_dir, src, "f32")
    conv = str(tmp / "converted-f32.gguf")
    convert(src, conv, "f32", progress=False)
    return model_dir, src, conv


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_1"])
@pytest.mark.parametrize("n_head", [1, 4])
def test_row_gather_inverts_llamacpp_permute(qtype, n_head):
    rng = np.random.default_rng(n_head)
    hf = rng.standard_normal((n_head * 16, 64)).astype(np.float32)
    ours = QTensor.from_array(hf, C.OUTTYPES[qtype])
    permuted = QTensor.from_array(llamacpp_permute(hf, n_head), C.OUTTYPES[qtype])
    back = llamacpp.unpermute_qk_rows(permuted, n_head)
    np.testing.assert_array_equal(back.raw, ours.raw)  # the stored rows, moved whole
    assert back.data.base is None or not np.shares_memory(back.data, permuted.data)


def test_bad_head_count_is_an_error():
    with pytest.raises(PyinferError, match="heads"):
        llamacpp.qk_row_order(24, 5)


def test_tiny_llamacpp_file_matches_transformers(tiny, capfd):
    model_dir, src, _ = tiny
    eng = Engine(src, n_ctx=64, n_threads=2)
    assert eng.llamacpp and all(lw.ffn_down_t is None for lw in eng.weights.layers)
    ours = eng.model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(ours, hf_logits(model_dir, PROMPT)) < 2e-5  # measured 5e-7
    # decode (the fused attention kernel + the GEMV over ffn_down's rows) continues the prefill
    eng.reset()
    eng.model.forward(PROMPT[:-1], 0)
    last = eng.model.forward(PROMPT[-1:], len(PROMPT) - 1)
    np.testing.assert_allclose(last, ours[-1], rtol=0, atol=1e-4 * np.abs(ours).max())
    err = capfd.readouterr().err
    assert "llama.cpp GGUF" in err and "pyinfer-convert" in err


def test_llamacpp_file_equals_its_dense_conversion(tiny):
    """f32 weights on both sides: the same function, up to float summation order."""
    _, src, conv = tiny
    a = Engine(src, n_ctx=64, n_threads=2)
    b = Engine(conv, n_ctx=64, n_threads=2)
    assert not b.llamacpp
    la, lb = (e.model.forward(PROMPT, 0, all_logits=True) for e in (a, b))
    assert rel_err(la, lb) < 1e-5  # measured 2e-7
    for e in (a, b):
        e.reset()
    from pyinfer.sampler import SamplingParams

    ga, gb = (list(e.generate(PROMPT, SamplingParams(temperature=0), max_tokens=20, ignore_eos=True))
              for e in (a, b))
    assert ga == gb and len(ga) == 20


@pytest.mark.parametrize("src_type", ["q8_0", "q4_1"])
def test_quantized_llamacpp_file_reads_the_stored_blocks(tmp_path, src_type):
    """A quantized llama.cpp file against its f32 conversion (the file's exact values, laid out
    by the converter): what differs is the kernels' q8 rounding of the activations only."""
    model_dir = make_random_llama(tmp_path / "hf", "silu", tied=True, n_kv_heads=2, tokenizer="bpe")
    src = str(tmp_path / "src.gguf")
    write_llamacpp_gguf(model_dir, src, src_type)
    conv = str(tmp_path / "f32.gguf")
    convert(src, conv, "f32", progress=False)
    la = Engine(src, n_ctx=64, n_threads=2).model.forward(PROMPT, 0, all_logits=True)
    lb = Engine(conv, n_ctx=64, n_threads=2).model.forward(PROMPT, 0, all_logits=True)
    assert rel_err(la, lb) < 0.02  # measured q8_0 0.0044, q4_1 0.0039
    assert rel_err(la, hf_logits(model_dir, PROMPT)) < 0.3  # the file's rounding (test_model_vs_hf)


def test_gpu_device_refused_auto_runs_on_cpu(tiny, capfd):
    _, src, _ = tiny
    with pytest.raises(PyinferError, match="llama.cpp GGUF runs on the CPU"):
        Engine(src, n_ctx=32, device="cuda")
    eng = Engine(src, n_ctx=32, device="auto")
    assert type(eng.model).__name__ == "Model"


def test_clis_run_a_llamacpp_file(tiny, tmp_path):
    """pyinfer-run and pyinfer-perplexity take the llama.cpp file and give what its conversion
    gives; the notice is on stderr, once."""
    _, src, conv = tiny
    args = ["-p", "The quick brown fox", "-n", "12", "--temp", "0", "--ignore-eos", "-t", "1"]
    r1, r2 = cli("pyinfer.cli", "-m", src, *args), cli("pyinfer.cli", "-m", conv, *args)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert r1.stdout == r2.stdout and len(r1.stdout) > len("The quick brown fox")
    assert r1.stderr.count("is a llama.cpp GGUF") == 1 and "llama.cpp GGUF" not in r2.stderr
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    p1, p2 = (cli("pyinfer.perplexity", m, "-f", str(text), "-c", "64", "--chunks", "2")
              for m in (src, conv))
    assert p1.returncode == 0 and p2.returncode == 0, p1.stderr + p2.stderr
    ppl1, ppl2 = (float(p.stdout.split()[1]) for p in (p1, p2))
    assert abs(ppl1 / ppl2 - 1) < 1e-4, (p1.stdout, p2.stdout)


def test_api_chat_on_a_llamacpp_file(tiny):
    from pyinfer import LLM

    _, src, conv = tiny
    msgs = [{"role": "user", "content": "Hello there"}]
    outs = [LLM(m, n_ctx=128, seed=0).create_chat_completion(msgs, max_tokens=8, temperature=0)
            for m in (src, conv)]
    assert outs[0]["choices"][0]["message"] == outs[1]["choices"][0]["message"]


def test_pyinfer_file_is_not_llamacpp(tiny):
    _, src, conv = tiny
    assert llamacpp.is_llamacpp(gguf.GGUFReader(src))
    assert not llamacpp.is_llamacpp(gguf.GGUFReader(conv))


# ---------------------------------------------------------------- the real model
SMOL = smollm2_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 GGUF not found (see tests/_paths.py)")
def test_smollm2_llamacpp_file_runs_directly(tmp_path):
    """SmolLM2's llama.cpp file (Q4_1) run as it is, against pyinfer-convert's dense files.

    Against ``--outtype f32`` (the file's values exactly, the converter's layout): the argmax of
    every prompt position that is not a near tie equal, logits within 3.0 (measured max 1.25-1.81
    over 20 positions with session 6's kernels, 2.02 with session 7's Q4_1 prefill GEMM, whose
    matrix products are each within their f32 bound: the 30 layers amplify summation order; the kernels
    round activations to q8 for Q4_1 rows, f32 rows are dotted in f32). Against ``--outtype auto``
    (ffn_down_t quantized again to Q4_1 along the other axis: measured max 11.9 from the f32
    logits, where the direct run stays at 1.25): the same greedy chat answer.
    """
    from pyinfer import LLM

    f32 = str(tmp_path / "smol-f32.gguf")
    convert(SMOL, f32, "f32", progress=False)
    direct = LLM(SMOL, n_ctx=256, n_threads=2)
    assert direct.engine.llamacpp
    ref = LLM(f32, n_ctx=256, n_threads=2)
    ids = direct.tokenize("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published")
    la = direct.engine.model.forward(ids, 0, all_logits=True)
    lb = ref.engine.model.forward(ids, 0, all_logits=True)
    # argmax equal wherever f32's top two logits are more than 0.5 apart: a near tie (position 1
    # of this prompt: 0.061) falls either way with the q8 activation codes, which any change of
    # f32 order flips (measured: rms deviation from f32 0.30-0.34 for two kernel builds)
    top2 = np.sort(lb, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.5
    assert clear.sum() >= len(ids) // 2  # 14 of 20 positions here
    assert (la.argmax(1) == lb.argmax(1))[clear].all()
    assert np.abs(la - lb).max() < 3.0  # 1.25-1.81 before session 7's Q4_1 prefill GEMM, 2.02 with it
    del ref
    auto = str(tmp_path / "smol-auto.gguf")
    assert cli("convert.cli", SMOL, auto, "--dense", "--outtype", "auto").returncode == 0
    args = ["--chat", "-p", "What is the capital of Germany?", "--temp", "0", "-n", "24"]
    r1, r2 = cli("pyinfer.cli", "-m", SMOL, *args), cli("pyinfer.cli", "-m", auto, *args)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert r1.stdout == r2.stdout and "Berlin" in r1.stdout


@pytest.mark.parametrize("keys", [
    {"llama.rope.scaling.factor": 4.0},  # no type: llama.cpp's default is linear
    {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    {"llama.rope.scale_linear": 4.0},  # the older key
])
def test_linear_rope_scaling_of_a_llamacpp_file(tiny, tmp_path, keys):
    """A llama.cpp file's linear RoPE scaling (positions / factor, as llama.cpp's loader reads
    the keys) was ignored: the file ran, and converted, unscaled. Reference: transformers with
    rope_scaling linear x4 on the same weights."""
    import gguf

    from convert.cli import convert
    from pyinfer.engine import Engine

    model_dir = tiny[0]
    types = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32}
    src = str(tmp_path / "scaled.gguf")
    write_llamacpp_gguf(model_dir, src, "f32", extra={k: (v, types[type(v)]) for k, v in keys.items()})
    tokens = list(range(3, 40))
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    own = getattr(cfg, "rope_parameters", None) or {}
    theta = own.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
    if hasattr(cfg, "rope_parameters"):  # transformers 5's spelling (rope_scaling is its alias)
        cfg.rope_parameters = linear
    else:
        cfg.rope_scaling = linear
    ref_model = transformers.LlamaForCausalLM.from_pretrained(model_dir, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0].numpy()
    unscaled = hf_logits(model_dir, tokens)
    assert rel_err(unscaled, ref) > 2e-3  # (the scaling matters at these positions: 100x the tolerance)
    conv = str(tmp_path / "conv.gguf")
    convert(src, conv, "f32", progress=False)
    for path in (src, conv):
        got = Engine(path, n_ctx=64, n_threads=1).model.forward(tokens, 0, all_logits=True)
        assert rel_err(got, ref) < 2e-5, path


def test_other_rope_scaling_of_a_llamacpp_file_is_refused(tiny, tmp_path):
    import gguf

    from pyinfer.engine import Engine
    from pyinfer.errors import PyinferError

    src = str(tmp_path / "yarn.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={
        "llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(PyinferError, match="unsupported rope scaling 'yarn'"):
        Engine(src, n_ctx=64, n_threads=1)


def test_the_converter_refuses_what_the_engine_refuses_and_drops_a_bad_name(tiny, tmp_path):
    """A rope dimension_count below the head dim (partial rotary: the engine and llama.cpp
    refuse it) was converted into a file no run could load; a general.name stored as an array
    (descriptive only) was copied into a file every run refused."""
    import gguf

    from convert.cli import convert
    from pyinfer.engine import Engine
    from pyinfer.errors import PyinferError

    src = str(tmp_path / "rot.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={
        "llama.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)})
    for make in (lambda: Engine(src, n_ctx=32, n_threads=1),
                 lambda: convert(src, str(tmp_path / "rot.out.gguf"), "f32", progress=False)):
        with pytest.raises(PyinferError, match="partial rotary"):
            make()
    src = str(tmp_path / "name.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={
        "general.name": (["a", "b"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)})
    out = str(tmp_path / "name.out.gguf")
    convert(src, out, "f32", progress=False)
    tokens = [1, 5, 9, 2]
    np.testing.assert_allclose(Engine(out, n_ctx=32, n_threads=1).model.forward(tokens, 0, True),
                               hf_logits(tiny[0], tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("extra, message", [
    ({"split.count": (2, "UINT16"), "split.no": (0, "UINT16")}, "part 1 of 2 of a split model"),
    ({"llama.expert_count": (8, "UINT32")}, "mixture-of-experts models (8 experts"),
])
def test_split_parts_and_expert_models_are_named(tiny, tmp_path, extra, message):
    """One part of a gguf-split set failed on a "missing" tensor, a Mixtral-style file was told
    to be converted (which failed): both are now said for what they are, by the run and the
    converter."""
    import gguf

    from convert.cli import convert
    from pyinfer.engine import Engine
    from pyinfer.errors import PyinferError

    src = str(tmp_path / "odd.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={
        k: (v, getattr(gguf.GGUFValueType, t)) for k, (v, t) in extra.items()})
    for make in (lambda: Engine(src, n_ctx=32, n_threads=1),
                 lambda: convert(src, str(tmp_path / "out.gguf"), "f32", progress=False)):
        with pytest.raises(PyinferError, match=re.escape(message)):
            make()


def test_per_layer_arrays_of_one_value_are_read_as_that_value(tiny, tmp_path):
    """llama.cpp reads feed_forward_length / head_count / head_count_kv as one number or one per
    layer (get_key_or_arr); a file with per-layer arrays (all layers alike) was refused."""
    import json as _json

    import gguf

    from pyinfer.engine import Engine
    from pyinfer.errors import PyinferError

    cfg = _json.load(open(os.path.join(tiny[0], "config.json")))
    n = cfg["num_hidden_layers"]
    arr = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    src = str(tmp_path / "arrays.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={
        "llama.feed_forward_length": ([cfg["intermediate_size"]] * n, *arr),
        "llama.attention.head_count": ([cfg["num_attention_heads"]] * n, *arr),
        "llama.attention.head_count_kv": ([cfg["num_key_value_heads"]] * n, *arr)})
    tokens = [1, 7, 3, 9]
    got = Engine(src, n_ctx=32, n_threads=1).model.forward(tokens, 0, all_logits=True)
    assert rel_err(got, hf_logits(tiny[0], tokens)) < 1e-4
    bad = str(tmp_path / "mixed.gguf")
    write_llamacpp_gguf(tiny[0], bad, "f32", extra={
        "llama.attention.head_count_kv": ([cfg["num_key_value_heads"]] * (n - 1) + [1], *arr)})
    with pytest.raises(PyinferError, match="differs from layer to layer"):
        Engine(bad, n_ctx=32, n_threads=1)


def test_a_vocab_size_key_that_disagrees_does_not_size_a_llamacpp_model(tiny, tmp_path):
    """llama.cpp sizes the model by its token list (vocab_size only names the model type): a
    file whose llama.vocab_size disagreed with token_embd was refused by the direct run."""
    import gguf

    from pyinfer.engine import Engine

    src = str(tmp_path / "vs.gguf")
    write_llamacpp_gguf(tiny[0], src, "f32", extra={"llama.vocab_size": (100000, gguf.GGUFValueType.UINT32)})
    tokens = [1, 7, 3, 9]
    got = Engine(src, n_ctx=32, n_threads=1).model.forward(tokens, 0, all_logits=True)
    assert rel_err(got, hf_logits(tiny[0], tokens)) < 1e-4
