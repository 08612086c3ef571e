"""Our logits against Hugging Face transformers (PyTorch, CPU) on small random Llama models.

The reference is transformers' LlamaForCausalLM, which nobody here wrote; the model goes through
the real path: save_pretrained -> pyinfer-convert -> GGUF -> Engine. Dense files are checked in
both layouts of the down projection: ``pyinfer-convert --dense``'s ``ffn_down`` in llama.cpp's row
layout (pyinfer.ffn_layout "rows"), and the neuron-major ``ffn_down_t`` that every file had before
(what --dense wrote until session 9, still loaded as it is).
"""
import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from convert.cli import convert as convert_file  # noqa: E402
from convert.cli import main as convert_main  # noqa: E402
from pyinfer import constants as C  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402
from tests._models import make_random_llama  # noqa: E402

PROMPT = [1, 17, 42, 7, 99, 3, 64, 5, 120, 33, 8, 250]

# (outtype, max relative error of logits). f32 is the brief's 1e-3; the quantized bounds are what
# weight rounding alone costs on these random models (measured, with margin), not kernel error.
TOLERANCES = {"f32": 1e-3, "f16": 5e-3, "q8_0": 3e-2, "q4_0": 0.2,
              # measured 2026-11-23 (issue 11): bf16 0.0030, q4_1 0.200, q5_0 0.084, q5_1 0.070,
              # q4_k 0.184, q5_k 0.093, q6_k 0.044 (K-quants on the 256-wide model below)
              "bf16": 1e-2, "q4_1": 0.3, "q5_0": 0.15, "q5_1": 0.12, "q4_k": 0.3, "q5_k": 0.15,
              "q6_k": 0.08}
K_OUTTYPES = ("q4_k", "q5_k", "q6_k")


def hf_logits(model_dir, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return out.logits[0].numpy()


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


LAYOUTS = (C.FFN_LAYOUT_ROWS, C.FFN_LAYOUT_NEURON_MAJOR)


def convert(model_dir, tmp_path, outtype, layout=C.FFN_LAYOUT_ROWS):
    """A dense file: `pyinfer-convert --dense` (row layout), or the neuron-major layout."""
    out = tmp_path / f"model-{outtype}-{layout}.gguf"
    if layout == C.FFN_LAYOUT_ROWS:
        assert convert_main([str(model_dir), str(out), "--outtype", outtype, "--dense"]) == 0
    else:
        convert_file(str(model_dir), str(out), outtype, progress=False)
    r = gguf.GGUFReader(str(out))
    names = {t.name for t in r.tensors}
    assert r.fields[C.K_FFN_LAYOUT].contents() == layout
    assert (C.SRC_FFN_DOWN.format(bid=0) in names) == (layout == C.FFN_LAYOUT_ROWS)
    assert (C.FFN_DOWN_T.format(bid=0) in names) == (layout != C.FFN_LAYOUT_ROWS)
    return out


@pytest.mark.parametrize("hidden_act", ["silu", "relu"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("n_kv_heads", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers_f32(tmp_path, hidden_act, tied, n_kv_heads, layout):
    model_dir = make_random_llama(tmp_path / "hf", hidden_act=hidden_act, tied=tied,
                                  n_kv_heads=n_kv_heads, tokenizer="bpe")
    ref = hf_logits(model_dir, PROMPT)
    eng = Engine(str(convert(model_dir, tmp_path, "f32", layout)), n_ctx=64, n_threads=2)
    assert all((lw.ffn_down is not None) == (layout == C.FFN_LAYOUT_ROWS)
               for lw in eng.weights.layers)
    ours = eng.model.forward(PROMPT, 0, all_logits=True)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < TOLERANCES["f32"]


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", *K_OUTTYPES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers_quantized(tmp_path, outtype, layout):
    # K-quants need rows of 256 values (narrower rows would take llama.cpp's fallback types)
    dims = dict(hidden_size=256, intermediate_size=512, head_dim=64) if outtype in K_OUTTYPES else {}
    model_dir = make_random_llama(tmp_path / "hf", hidden_act="silu", tied=False, n_kv_heads=2,
                                  tokenizer="bpe", **dims)
    ref = hf_logits(model_dir, PROMPT)
    eng = Engine(str(convert(model_dir, tmp_path, outtype, layout)), n_ctx=64, n_threads=2)
    ours = eng.model.forward(PROMPT, 0, all_logits=True)  # prefill: the GEMMs
    assert rel_err(ours, ref) < TOLERANCES[outtype]
    steps = np.stack([eng.model.forward([t], i) for i, t in enumerate(PROMPT)])  # decode: GEMVs
    assert rel_err(steps, ref) < TOLERANCES[outtype]


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_incremental_decode_equals_batched_prefill(tmp_path, n_threads, layout):
    """Token-at-a-time decode through the KV cache gives the logits of one batched pass."""
    model_dir = make_random_llama(tmp_path / "hf", hidden_act="silu", tied=True, n_kv_heads=2,
                                  tokenizer="bpe")
    ref = hf_logits(model_dir, PROMPT)
    eng = Engine(str(convert(model_dir, tmp_path, "f32", layout)), n_ctx=64, n_threads=n_threads)
    split = 5
    eng.model.forward(PROMPT[:split], 0)
    for i in range(split, len(PROMPT)):
        step = eng.model.forward([PROMPT[i]], i)
        assert rel_err(step, ref[i]) < TOLERANCES["f32"]


@pytest.mark.parametrize("hidden_act,outtype", [("silu", "q8_0"), ("relu", "q4_0"), ("silu", "f16")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_decode_equals_step_by_step(tmp_path, hidden_act, outtype, layout):
    """The fused half-layer kernels (cpu.decode_attn / decode_ffn) compute what the kernel-by-kernel
    loop computes, token by token through the cache, and both stay within the type's tolerance of
    transformers."""
    model_dir = make_random_llama(tmp_path / "hf", hidden_act=hidden_act, tied=False, n_kv_heads=2,
                                  tokenizer="bpe")
    ref = hf_logits(model_dir, PROMPT)
    eng = Engine(str(convert(model_dir, tmp_path, outtype, layout)), n_ctx=64, n_threads=2)
    runs = {}
    for fused in (True, False):
        eng.model.fused = fused
        runs[fused] = np.stack([eng.model.forward([t], i) for i, t in enumerate(PROMPT)])
    assert rel_err(runs[True], runs[False]) < 1e-5
    assert rel_err(runs[True], ref) < TOLERANCES[outtype]


def test_generation_stops_where_transformers_stops(tmp_path):
    """A model whose generation_config.json lists two end ids ([<|im_end|>, <|endoftext|>], as
    Qwen2.5-Instruct ships it; Llama 3.1 lists <|eom_id|> too) stops on the second as
    transformers' generate does: pyinfer's end-of-generation set is llama.cpp's (eos, eot and
    those tokens by their text), not the file's eos id alone. The lm head's <|endoftext|> row is
    made to win greedily at the 4th step."""
    import json

    d = make_random_llama(str(tmp_path), tokenizer="bpe", name="eog", tied=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    assert end != tok.eos_token_id
    ids = torch.tensor([tok("The capital of France is").input_ids])

    def greedy(**kw):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=end, **kw)
        return out[0, ids.shape[1]:].tolist()

    free = greedy(eos_token_id=None)
    with torch.no_grad():
        model.lm_head.weight[end] = 1.05 * model.lm_head.weight[free[3]]
    assert greedy(eos_token_id=None)[3] == end
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    model.save_pretrained(d)
    want = greedy()
    assert want[-1] == end and len(want) == 4  # transformers stops on the listed id
    out = str(tmp_path / "eog.gguf")
    assert convert_main([d, out, "--dense", "--outtype", "f32", "-t", "1"]) == 0
    from pyinfer import LLM

    llm = LLM(out, n_ctx=64, n_threads=1)
    assert {tok.eos_token_id, end} <= llm.engine.tokenizer.stop_ids
    got = list(llm.generate(llm.tokenize("The capital of France is"), max_tokens=8, temperature=0))
    assert got == want[:-1]  # (generate yields the text's tokens, not the end token)
    # ignore_eos: the end tokens are never drawn (llama.cpp's --ignore-eos), the runner-up instead
    free = list(llm.generate(llm.tokenize("The capital of France is"), max_tokens=8,
                             temperature=0, ignore_eos=True))
    assert len(free) == 8 and free[:3] == got and not set(free) & llm.engine.tokenizer.stop_ids
    # ... whatever stop ids the request names (the model's own end tokens stay banned)
    assert list(llm.generate(llm.tokenize("The capital of France is"), max_tokens=8,
                             temperature=0, ignore_eos=True, stop_ids=[free[5]])) == free
    assert json.loads(open(f"{d}/generation_config.json").read())["eos_token_id"] == [
        tok.eos_token_id, end]
