#!/usr/bin/env python3
"""A full-depth 7B-shaped model on disk, and what pyinfer does with it (issue 11, "Scale").

    python tools/make_7b.py make OUT.gguf --type q4_0|q4_k [--n-layer 32] [--direct PYINFER.gguf]
    python tools/make_7b.py bench PYINFER.gguf [--threads 2] [--n-gen 8] [--n-prompt 32]

``make`` writes a llama.cpp-style GGUF (architecture ``llama``, ``ffn_down`` as (n_embd, n_ff),
Q/K rows in llama.cpp's order, a 32,000-token SentencePiece-style vocabulary) with Llama-2-7B's
dimensions (n_embd 4096, n_ff 11008, 32 heads, 32 layers, vocab 32000): the input of
``pyinfer-convert``. Weights are random with a realistic scale (normal, std 0.02, about what
Llama-2-7B's matrices hold) and every matrix, token_embd and output included, is at ``--type``
(llama.cpp's own Q4_K_M would keep a few at Q6_K). Quantizing 6.7 billion values in NumPy would
take hours on a small machine, so each row width gets a pool of ``--pool`` rows quantized once
(gguf's quantizer for q4_0, ``pyinfer.quants`` for Q4_K, ggml's reference quantizers) and each
matrix draws its rows from that pool: every block is a real quantizer's output, and the file is
written tensor by tensor (memory stays near one matrix).

``--direct`` also writes the pyinfer file straight from the tool: the converter's own plan
(``convert.from_gguf.plan_gguf``) for every tensor, except ``ffn_down_t``, which is drawn from
the pool in its neuron-major layout instead of being requantized. For Q4_K that requantization
(NumPy, about 1.4 s per million values here) would take over half an hour for 1.4 billion
values; ``pyinfer-convert`` remains the way for real models.

``bench`` loads a pyinfer file and reports, as a Markdown table row: load time, RSS (file-backed
and anonymous, from /proc/self/status) after loading and while decoding, prefill tokens/s of one
``--n-prompt`` batch, and decode tokens/s of ``--n-gen`` tokens, dense and with a synthetic
predictor that keeps 1 - ``--sparsity`` of the FFN neurons per token (tools/bench_sparse_cpu.py's
power law), the two interleaved over ``--reps`` rounds (medians). Weights are memory-mapped: the
anonymous RSS must stay near the KV cache and buffers, far below the file size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import gguf  # noqa: E402
import numpy as np  # noqa: E402

from pyinfer import constants as C  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = {"q4_0": QT.Q4_0, "q4_k": QT.Q4_K, "q8_0": QT.Q8_0}
# Llama-2-7B (its config.json)
DIMS = dict(n_embd=4096, n_ff=11008, n_head=32, n_vocab=32000, n_ctx=4096, rope_base=10000.0)


def spm_vocab(n_vocab: int):
    """A llama.cpp "llama" (SentencePiece) vocabulary: <unk>, <s>, </s>, the 256 byte tokens,
    then made-up word pieces. Returns (tokens, scores, types)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256  # llama.cpp: unknown, control, byte
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        word, k = "", i
        while True:
            word, k = letters[k % 26] + word, k // 26
            if k == 0:
                break
        tokens.append("\u2581" + word)
        types.append(1)
        i += 1
    scores = [0.0] * 259 + [-float(j) for j in range(n_vocab - 259)]
    return tokens, scores, types


class RowPool:
    """``n`` quantized rows per row width, drawn from N(0, std^2); ``rows(k)`` picks k of them."""

    def __init__(self, qtype, n: int, std: float, seed: int):
        from pyinfer.quants import quantize

        self.qtype, self.n, self.std = qtype, n, std
        self.rng = np.random.default_rng(seed)
        self._quantize = quantize
        self._pools: dict[int, np.ndarray] = {}

    def rows(self, k: int, cols: int) -> np.ndarray:
        """(k, bytes per row) uint8: k rows of ``cols`` values at the pool's type."""
        if cols not in self._pools:
            a = (self.rng.standard_normal((self.n, cols)) * self.std).astype(np.float32)
            self._pools[cols] = self._quantize(a, self.qtype).view(np.uint8).reshape(self.n, -1)
        return self._pools[cols][self.rng.integers(0, self.n, k)]


def llamacpp_tensors(n_layer: int, d: dict):
    """(name, (rows, cols)) of every matrix in llama.cpp's naming and order; norms separately."""
    E, F, V = d["n_embd"], d["n_ff"], d["n_vocab"]
    out = [(C.TOKEN_EMBD, (V, E))]
    for i in range(n_layer):
        out += [(C.ATTN_Q.format(bid=i), (E, E)), (C.ATTN_K.format(bid=i), (E, E)),
                (C.ATTN_V.format(bid=i), (E, E)), (C.ATTN_OUT.format(bid=i), (E, E)),
                (C.FFN_GATE.format(bid=i), (F, E)), (C.FFN_UP.format(bid=i), (F, E)),
                (C.SRC_FFN_DOWN.format(bid=i), (E, F))]
    out.append((C.OUTPUT, (V, E)))
    norms = [C.ATTN_NORM.format(bid=i) for i in range(n_layer)]
    norms += [C.FFN_NORM.format(bid=i) for i in range(n_layer)] + [C.OUTPUT_NORM]
    return out, norms


def make(out: str, qtype, n_layer: int, pool: RowPool, d: dict = DIMS) -> None:
    """Write the llama.cpp-style GGUF (module docstring), tensor by tensor, to a temporary file
    renamed onto ``out`` when complete."""
    from convert.writer import FILE_TYPES, temp_path_beside

    mats, norms = llamacpp_tensors(n_layer, d)
    tmp = temp_path_beside(out)
    try:
        w = gguf.GGUFWriter(tmp, "llama")
        w.add_name(f"random 7B-shaped ({n_layer} layers, {qtype.name})")
        w.add_context_length(d["n_ctx"])
        w.add_embedding_length(d["n_embd"])
        w.add_block_count(n_layer)
        w.add_feed_forward_length(d["n_ff"])
        w.add_head_count(d["n_head"])
        w.add_head_count_kv(d["n_head"])
        w.add_rope_dimension_count(d["n_embd"] // d["n_head"])
        w.add_rope_freq_base(d["rope_base"])
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(d["n_vocab"])
        w.add_file_type(int(FILE_TYPES[{QT.Q4_0: "q4_0", QT.Q4_K: "q4_k", QT.Q8_0: "q8_0"}[qtype]]))
        tokens, scores, types = spm_vocab(d["n_vocab"])
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        nbytes = {}
        for name, (rows, cols) in mats:
            nbytes[name] = rows * (cols // 256 * 144 if qtype == QT.Q4_K else
                                   cols // 32 * gguf.GGML_QUANT_SIZES[qtype][1])
            w.add_tensor_info(name, (rows, nbytes[name] // rows), np.dtype(np.uint8), nbytes[name],
                              raw_dtype=qtype)
        for name in norms:
            w.add_tensor_info(name, (d["n_embd"],), np.dtype(np.float32), 4 * d["n_embd"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, (rows, cols) in mats:
            w.write_tensor_data(pool.rows(rows, cols))
        for _ in norms:
            w.write_tensor_data(np.ones(d["n_embd"], np.float32))
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def make_direct(src: str, out: str, pool: RowPool) -> None:
    """The pyinfer file of ``src`` (module docstring, ``--direct``)."""
    import dataclasses

    from convert.from_gguf import plan_gguf
    from convert.writer import write_gguf

    meta, jobs = plan_gguf(src, C.OUTTYPE_AUTO)
    tail = C.FFN_DOWN_T.split("}")[-1]
    jobs = [dataclasses.replace(j, raw=True, load=lambda j=j: pool.rows(*j.shape))
            if j.name.endswith(tail) else j for j in jobs]
    write_gguf(out, meta, jobs, progress=False)


def rss() -> dict:
    """VmRSS, RssAnon, RssFile and VmHWM of this process in MiB (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def bench(path: str, n_threads: int, n_prompt: int, n_gen: int, sparsity: float, reps: int):
    from pyinfer.engine import Engine
    from pyinfer.ffn import SparseFFN
    from pyinfer.model import Model
    from tools.bench_sparse_cpu import SyntheticPredictor

    n_ctx = n_prompt + n_gen + 16
    t0 = time.perf_counter()
    eng = Engine(path, n_ctx=n_ctx, n_threads=n_threads, dense=True)
    load_s = time.perf_counter() - t0
    rss_load = rss()
    cfg = eng.cfg
    pred = SyntheticPredictor(np.random.default_rng(1), cfg.n_ff, 1 - sparsity)
    # threshold -1: every predicted neuron is computed (the predictor alone sets the sparsity)
    ffn = SparseFFN(cfg, [pred] * cfg.n_layer, np.full(cfg.n_layer, -1.0, np.float32))
    sparse = Model(cfg, eng.weights, n_ctx=n_ctx, n_threads=n_threads, ffn=ffn)
    dense = eng.model
    ids = [int(i) for i in np.random.default_rng(0).integers(259, cfg.n_vocab, n_prompt + n_gen)]

    def decode(model):
        model.forward(ids[:4], 0)
        t = time.perf_counter()
        for i in range(n_gen):
            model.forward([ids[4 + i]], 4 + i)
        return n_gen / (time.perf_counter() - t)

    pp, dd, ss = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        dense.forward(ids[:n_prompt], 0)
        pp.append(n_prompt / (time.perf_counter() - t))
        dd.append(decode(dense))
        rss_dec = rss()
        ss.append(decode(sparse))
    size = os.path.getsize(path) / 2**20
    print("| file | MiB | load s | RSS after load (file / anon) MiB | RSS decoding (file / anon) "
          f"MiB | peak RSS MiB | prefill {n_prompt} tok/s | decode dense tok/s | decode "
          f"{sparsity:.0%} sparse tok/s | measured sparsity |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {os.path.basename(path)} | {size:.0f} | {load_s:.1f} | {rss_load['RssFile']:.0f} / "
          f"{rss_load['RssAnon']:.0f} | {rss_dec['RssFile']:.0f} / {rss_dec['RssAnon']:.0f} | "
          f"{rss()['VmHWM']:.0f} | {statistics.median(pp):.2f} | {statistics.median(dd):.2f} | "
          f"{statistics.median(ss):.2f} | {ffn.stats.sparsity:.1%} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a llama.cpp-style 7B-shaped GGUF")
    m.add_argument("out")
    m.add_argument("--type", choices=list(TYPES), default="q4_0")
    m.add_argument("--n-layer", type=int, default=32)
    m.add_argument("--pool", type=int, default=256, help="quantized rows per row width")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--direct", metavar="PYINFER_GGUF",
                   help="also write the pyinfer file, ffn_down_t drawn from the pool")
    b = sub.add_parser("bench", help="load, prefill and decode a pyinfer file")
    b.add_argument("model")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--n-prompt", type=int, default=32)
    b.add_argument("--n-gen", type=int, default=8)
    b.add_argument("--sparsity", type=float, default=0.9)
    b.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "make":
        if args.type == "q4_k" and DIMS["n_embd"] % 256:
            ap.error("q4_k needs n_embd a multiple of 256")
        pool = RowPool(TYPES[args.type], args.pool, 0.02, args.seed)
        t0 = time.perf_counter()
        make(args.out, TYPES[args.type], args.n_layer, pool)
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if args.direct:
            t0 = time.perf_counter()
            make_direct(args.out, args.direct, pool)
            print(f"wrote {args.direct} ({os.path.getsize(args.direct) / 2**30:.2f} GiB) in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    else:
        bench(args.model, args.threads, args.n_prompt, args.n_gen, args.sparsity, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
