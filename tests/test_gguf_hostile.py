"""Hostile model files get a one-line PyinferError, never a traceback, hang or memory blow-up.

Focused tests for each finding of issue 9 (model-file side), on the tiny model of
tests/_tiny_gguf.py with one field rewritten or one header integer patched, then a bounded fuzz
(tests/_gguf_fuzz.py) in a child process under an address-space limit and a timeout.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pyinfer import constants as C
from pyinfer.engine import Engine, open_gguf
from pyinfer.errors import PyinferError
from pyinfer.sampler import SamplingParams
from tests._gguf_fuzz import header_slots
from tests._tiny_gguf import N_EMBD, N_FF, RANK, tiny_tensors, write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
CHILD_MEMORY = 2 << 30  # bytes of address space a child may map (the fuzz needs about 0.2 GiB)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def one_line_error(fn, *words):
    with pytest.raises(PyinferError) as ei:
        fn()
    msg = str(ei.value)
    assert msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def patched(src: str, dst, *edits) -> str:
    """Copy the valid file ``src`` to ``dst`` with header integers rewritten; each edit is
    (role, where, value) or (role, where, value, k): the k-th slot of that role in that key or
    tensor (tests/_gguf_fuzz.py ``header_slots``)."""
    slots = header_slots(src)[0]
    data = bytearray(open(src, "rb").read())
    for role, where, value, *k in edits:
        slot = [s for s in slots if s.role == role and s.where == where][k[0] if k else 0]
        data[slot.offset:slot.offset + slot.size] = int(value).to_bytes(slot.size, "little")
    with open(dst, "wb") as f:
        f.write(data)
    return str(dst)


def limits():  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def run_child(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout, preexec_fn=limits)


def open_error_in_child(module: str, path) -> str:
    """The PyinferError message of ``module.open_gguf(path)``, run in a memory-limited child
    (``run_child``); fails on any other outcome (traceback, signal, timeout)."""
    r = run_child(["-c", f"import sys; from {module} import open_gguf\n"
                   "from pyinfer.errors import PyinferError\n"
                   "try: open_gguf(sys.argv[1])\n"
                   "except PyinferError as e: print(e)", str(path)], timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_tiny_model_works(tiny):
    e = Engine(tiny, device="cpu", n_threads=1)
    assert e.is_sparse
    out = list(e.generate(e.tokenizer.encode("the thin"), SamplingParams(temperature=0.0),
                          max_tokens=4, seed=0))
    assert len(out) > 0


# ---- the header scan (pyinfer.gguf_check), through open_gguf ---------------------------------
def test_array_count_2_32_in_a_400kb_file(tmp_path):
    """gguf's reader looped over 2**32 empty reads of a byte array and ate gigabytes: now a
    one-line error in well under a second, checked in a child with 2 GiB of address space."""
    src = write_tiny_gguf(
        str(tmp_path / "big.gguf"),
        overrides={"pyinfer.test.bytes": ([7] * 16, VT.ARRAY, VT.UINT8)},
        tensors={"pyinfer.test.padding": (np.zeros(85_000, np.float32), QT.F32)})
    assert 380_000 < os.path.getsize(src) < 420_000
    bad = patched(src, tmp_path / "count.gguf", ("array_count", "pyinfer.test.bytes", 1 << 32))
    msg = open_error_in_child("pyinfer.engine", bad)
    assert "count.gguf" in msg and "4294967296 elements of UINT8" in msg, msg


@pytest.mark.parametrize("role,where,value,words", [
    ("array_type", C.K_TOK_TYPE, VT.ARRAY, ["array of arrays"]),
    ("array_type", C.K_TOK_TYPE, 13, ["unknown value type 13"]),
    ("array_count", C.K_TOK_LIST, (1 << 64) - 1, ["claims 18446744073709551615 elements"]),
    ("str_len", C.K_CHAT_TEMPLATE, 1 << 63, ["truncated", C.K_CHAT_TEMPLATE]),
    ("str_len", C.K_TOK_LIST, 1 << 40, ["truncated", C.K_TOK_LIST]),
    ("key_len", C.K_NAME, 1 << 62, ["truncated", "key 1"]),  # key 0: general.architecture
    ("value_type", C.K_BLOCK_COUNT, 13, ["unknown value type 13"]),
    ("count", "GGUF.kv_count", 1 << 32, ["4294967296 key/value pairs"]),
    ("count", "GGUF.tensor_count", 1 << 40, ["1099511627776 tensors"]),
    ("version", "GGUF.version", 7, ["version 7"]),
    ("n_dims", C.TOKEN_EMBD, 0, ["0 dimensions"]),
    ("n_dims", C.TOKEN_EMBD, 5, ["5 dimensions"]),
    ("dim", C.OUTPUT_NORM, 0, ["dimension of 0"]),
    ("tensor_type", C.TOKEN_EMBD, 99, ["unknown tensor type 99"]),
    ("tensor_type", C.ATTN_Q.format(bid=0), int(QT.Q4_K), ["not a multiple of the Q4_K block"]),
    ("tensor_offset", C.OUTPUT, (1 << 64) - 32, ["extends past the end"]),
    ("tensor_offset", C.OUTPUT, 1 << 62, ["extends past the end"]),
    ("tensor_offset", C.OUTPUT, 33, ["not a multiple of the alignment 32"]),
    # two tensors over the same bytes: ran to NaN logits, or to a perplexity of nan
    ("tensor_offset", C.OUTPUT, 0, ["overlaps"]),
])
def test_header_field(tiny, tmp_path, role, where, value, words):
    bad = patched(tiny, tmp_path / "bad.gguf", (role, where, value))
    one_line_error(lambda: open_gguf(bad), "bad.gguf", *words)


def test_dims_whose_product_overflows(tiny, tmp_path):
    bad = patched(tiny, tmp_path / "dims.gguf", ("dim", C.TOKEN_EMBD, 1 << 40, 0),
                  ("dim", C.TOKEN_EMBD, 1 << 40, 1))
    one_line_error(lambda: open_gguf(bad), "overflows 64 bits")


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated(tiny, tmp_path, keep):
    data = open(tiny, "rb").read()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:int(len(data) * keep)])
    one_line_error(lambda: open_gguf(str(bad)), "cut.gguf", "truncated")


def test_alignment_not_a_power_of_two(tmp_path):
    bad = write_tiny_gguf(str(tmp_path / "a.gguf"),
                          overrides={"general.alignment": (48, VT.UINT32, None)})
    one_line_error(lambda: open_gguf(bad), "general.alignment is 48")


def test_duplicate_key(tiny, tmp_path):
    data = open(tiny, "rb").read()
    a, b = C.K_TOK_BOS.encode(), C.K_TOK_EOS.encode()
    assert len(a) == len(b) and data.count(a) == 1
    bad = tmp_path / "dup.gguf"
    bad.write_bytes(data.replace(a, b))
    one_line_error(lambda: open_gguf(str(bad)), f"duplicate key '{C.K_TOK_EOS}'")


def test_key_not_utf8(tiny, tmp_path):
    data = open(tiny, "rb").read()
    bad = tmp_path / "key.gguf"
    bad.write_bytes(data.replace(C.K_HIDDEN_ACT.encode(), b"\xff" + C.K_HIDDEN_ACT.encode()[1:]))
    one_line_error(lambda: open_gguf(str(bad)), "is not UTF-8")


# ---- what the engine reads ------------------------------------------------------------------
def engine_error(path, *words):
    return one_line_error(lambda: Engine(path, device="cpu", n_threads=1), *words)


def test_metadata_string_not_utf8(tmp_path):
    bad = write_tiny_gguf(str(tmp_path / "t.gguf"), overrides={
        C.K_CHAT_TEMPLATE: (b"{{ '\xff' }}", VT.STRING, None)})
    engine_error(bad, C.K_CHAT_TEMPLATE, "not UTF-8")


def test_token_not_utf8(tiny, tmp_path):
    data = open(tiny, "rb").read()
    piece = "Ġthe".encode()  # the merged token; its merge "Ġth e" is spelled differently
    assert data.count(piece) == 1
    bad = tmp_path / "tok.gguf"
    bad.write_bytes(data.replace(piece, b"\xff" + piece[1:]))
    engine_error(str(bad), C.K_TOK_LIST, "not UTF-8")


@pytest.mark.parametrize("key,value,words", [
    (C.K_EMBEDDING_LENGTH, ("32", VT.STRING, None), ["stored as STRING", "expected an integer"]),
    (C.K_ROPE_FREQ_BASE, ([1.0], VT.ARRAY, VT.FLOAT32), ["expected a number"]),
    (C.K_TOK_LIST, (list(range(265)), VT.ARRAY, VT.INT32), ["expected an array of strings"]),
    (C.K_TOK_ADD_BOS, (1, VT.UINT8, None), ["expected a bool"]),
    (C.K_ACT_THRESHOLD, (["x", "y"], VT.ARRAY, VT.STRING), ["expected an array of numbers"]),
])
def test_metadata_of_the_wrong_type(tmp_path, key, value, words):
    engine_error(write_tiny_gguf(str(tmp_path / "t.gguf"), overrides={key: value}), key, *words)


@pytest.mark.parametrize("key,name", [
    (C.K_HEAD_COUNT, "head_count"), (C.K_HEAD_COUNT_KV, "n_head_kv"),
    (C.K_EMBEDDING_LENGTH, "n_embd"), (C.K_FEED_FORWARD_LENGTH, "n_ff"),
    (C.K_BLOCK_COUNT, "n_layer"), (C.K_ROPE_DIM, "head_dim"), (C.K_CONTEXT_LENGTH, "n_ctx_train"),
])
def test_zero_size(tmp_path, key, name):
    bad = write_tiny_gguf(str(tmp_path / "z.gguf"), overrides={key: (0, VT.UINT32, None)})
    engine_error(bad, name, "0")


def test_negative_head_count_kv(tmp_path):
    bad = write_tiny_gguf(str(tmp_path / "n.gguf"),
                          overrides={C.K_HEAD_COUNT_KV: (-2, VT.INT32, None)})
    engine_error(bad, "n_head_kv is -2")


def test_unsupported_tensor_type(tmp_path):
    emb = tiny_tensors()[C.TOKEN_EMBD][0]
    # IQ4_NL has q4_0's block size and bytes (18 per 32 values) and no pyinfer kernel
    bad = write_tiny_gguf(str(tmp_path / "iq4nl.gguf"), tensors={
        C.TOKEN_EMBD: (gguf.quants.quantize(emb, QT.Q4_0), QT.IQ4_NL)})
    engine_error(bad, C.TOKEN_EMBD, "unsupported weight type IQ4_NL", "Q8_0")


def test_predictor_fc1_without_fc2(tmp_path):
    bad = write_tiny_gguf(str(tmp_path / "p.gguf"), tensors={C.FC2.format(bid=1): None})
    engine_error(bad, C.FC1.format(bid=1), "without", C.FC2.format(bid=1))


@pytest.mark.parametrize("name,shape", [
    (C.FC1.format(bid=0), (RANK, N_EMBD + 32)),
    (C.FC2.format(bid=0), (N_FF + 1, RANK)),
    (C.FC2.format(bid=1), (N_FF, RANK + 1)),
])
def test_predictor_shape(tmp_path, name, shape):
    a = np.ones(shape, np.float32)
    bad = write_tiny_gguf(str(tmp_path / "p.gguf"), tensors={name: (a, QT.F32)})
    engine_error(bad, "predictor shapes", "do not fit")


def test_predictor_quantized(tmp_path):
    a = tiny_tensors()[C.FC1.format(bid=0)][0]
    bad = write_tiny_gguf(str(tmp_path / "p.gguf"), tensors={
        C.FC1.format(bid=0): (gguf.quants.quantize(a, QT.Q8_0), QT.Q8_0)})
    engine_error(bad, C.FC1.format(bid=0), "Q8_0", "F32 or F16")


@pytest.mark.parametrize("merge,words", [
    ("t zzz", ["'zzz'", "not in the vocabulary"]),
    ("nospace", ["not two tokens"]),
    ("a b", ["'ab'", "not in the vocabulary"]),  # both halves exist, their merge does not
])
def test_merge_outside_the_vocabulary(tmp_path, merge, words):
    bad = write_tiny_gguf(str(tmp_path / "m.gguf"), overrides={
        C.K_TOK_MERGES: (["t h", merge], VT.ARRAY, VT.STRING)})
    engine_error(bad, C.K_TOK_MERGES, *words)


@pytest.mark.parametrize("key,what", [(C.K_TOK_BOS, "bos"), (C.K_TOK_EOS, "eos"),
                                      (C.K_TOK_EOT, "eot")])
def test_special_token_outside_the_vocabulary(tmp_path, key, what):
    bad = write_tiny_gguf(str(tmp_path / "s.gguf"), overrides={key: (100_000, VT.UINT32, None)})
    engine_error(bad, f"{what} token id 100000")


def test_token_id_outside_the_vocabulary(tiny):
    e = Engine(tiny, device="cpu", n_threads=1)
    one_line_error(lambda: e.eval_prompt([1, 10**6]), "token id 1000000")
    one_line_error(lambda: e.eval_prompt([-1]), "token id -1")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits(tmp_path, temperature):
    """The sampler raised 'Probabilities contain NaN', and greedy decoding printed garbage."""
    bad = write_tiny_gguf(str(tmp_path / "nan.gguf"), tensors={
        C.OUTPUT_NORM: (np.full(N_EMBD, np.nan, np.float32), QT.F32)})
    e = Engine(bad, device="cpu", n_threads=1)
    prompt = e.tokenizer.encode("the thin")
    gen = e.generate(prompt, SamplingParams(temperature=temperature), max_tokens=4, seed=0)
    one_line_error(lambda: list(gen), f"the model produced NaN logits at token {len(prompt) - 1}")
    assert e.tokens == []  # nothing the cache holds is claimed


@pytest.mark.parametrize("dense", [True, False])
def test_a_nan_inside_a_layer_is_reported_not_laundered(tmp_path, dense):
    """One NaN in layer 0's FFN norm makes one NaN channel in the q4_0 gate/up projections'
    input: their 8-bit quantizer dropped it (max |x| by max_ps) and turned the block into
    finite garbage, so the model answered garbage instead of saying it is broken. The sparse
    (cats) run's neuron selection dropped the NaN neurons too (|a| > threshold is false for
    NaN): they are kept now."""
    w = np.ones(N_EMBD, np.float32)
    w[3] = np.nan
    bad = write_tiny_gguf(str(tmp_path / "nan.gguf"), tensors={
        C.FFN_NORM.format(bid=0): (w, QT.F32)})
    e = Engine(bad, device="cpu", n_threads=1, dense=dense)
    assert type(e.model.ffn).__name__ == ("DenseFFN" if dense else "SparseFFN")
    one_line_error(lambda: e.eval_prompt([1, 5, 9]), "the model produced NaN logits at token 2")
    assert e.tokens == []  # the cache claims nothing


def test_nan_logits_while_decoding(tiny):
    e = Engine(tiny, device="cpu", n_threads=1)
    e.eval_prompt([1, 5])
    e.model.w.output_norm = np.full(N_EMBD, np.nan, np.float32)  # the file is read-only
    one_line_error(lambda: e.eval_token(7), "the model produced NaN logits at token 2")
    assert e.tokens == [1, 5]


# ---- the fuzz ----------------------------------------------------------------------------------
def test_fuzz(tiny, tmp_path):
    """A few hundred seeded mutations, each opened and run for two tokens: any exception other
    than a one-line PyinferError, a case over 10 s, a signal, the 2 GiB address-space limit or the
    overall timeout fails (see tests/_gguf_fuzz.py)."""
    try:
        r = run_child(["-m", "tests._gguf_fuzz", tiny, str(tmp_path), "--seed", "0",
                       "--cases", "300", "--case-timeout", "10"], timeout=120)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"fuzz timed out; last case: {(out.strip().splitlines() or ['none'])[-1]}")
    lines = r.stdout.strip().splitlines()
    failures = [ln for ln in lines if ln.startswith("FAILURE ")]
    assert r.returncode == 0 and not failures, (
        f"exit {r.returncode}; last case: {lines[-1] if lines else 'none'}\n"
        + "\n".join(failures) + "\n" + r.stderr[-2000:])
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    assert summary["cases"] == 300
    assert summary["error"] > 100 and summary["ok"] > 10, summary  # mutations bite, some pass


def test_cli_says_so_in_one_line(tmp_path):
    """pyinfer-run --temp 0 printed garbage with exit 0 on a model that gives NaN logits."""
    bad = write_tiny_gguf(str(tmp_path / "nan.gguf"), tensors={
        C.OUTPUT_NORM: (np.full(N_EMBD, np.nan, np.float32), QT.F32)})
    r = run_child(["-m", "pyinfer.cli", bad, "-p", "the thin", "-n", "4", "--temp", "0"],
                  timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: the model produced NaN logits at token 2"]


def test_converter_refuses_the_2_32_count_file(tmp_path):
    """pyinfer-convert opens a GGUF source through the same header check (convert/from_gguf.py)."""
    src = write_tiny_gguf(str(tmp_path / "big.gguf"),
                          overrides={"pyinfer.test.bytes": ([7] * 16, VT.ARRAY, VT.UINT8)})
    bad = patched(src, tmp_path / "count.gguf", ("array_count", "pyinfer.test.bytes", 1 << 32))
    msg = open_error_in_child("convert.from_gguf", bad)
    assert "4294967296 elements of UINT8" in msg, msg


def test_nan_logits_in_perplexity(tmp_path):
    """pyinfer-perplexity printed PPL = nan with status 0 where pyinfer-run reports the file."""
    from pyinfer.perplexity import estimate

    bad = write_tiny_gguf(str(tmp_path / "nan.gguf"), tensors={
        C.OUTPUT_NORM: (np.full(N_EMBD, np.nan, np.float32), QT.F32)})
    e = Engine(bad, device="cpu", n_threads=1)
    one_line_error(lambda: estimate(e, list(range(1, 33)), 16, progress=False),
                   "non-finite logits in chunk 1")


def test_a_token_past_a_full_context_is_one_line(tiny):
    """Engine.eval_token on a full cache raised the kernels' ValueError."""
    e = Engine(tiny, device="cpu", n_threads=1, n_ctx=8)
    e.eval_prompt([1, 5, 9, 2, 3, 4, 6, 7])
    one_line_error(lambda: e.eval_token(7), "the context (8 tokens) is full")
    assert len(e.tokens) == 8
