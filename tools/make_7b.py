#!/usr/bin/env python3
"""A full-depth 7B-shaped model on disk, and what pyinfer does with it (issue 11, "Scale").

    python tools/make_7b.py make OUT.gguf --type q4_0|q4_k [--n-layer 32] [--direct PYINFER.gguf]
        [--dense-direct DENSE.gguf]
    python tools/make_7b.py bench PYINFER.gguf [--threads 2] [--n-gen 8] [--n-prompt 32]
    python tools/make_7b.py llamacpp OUT.gguf --llama-bench BUILD/bin/llama-bench [--threads 2]
    python tools/make_7b.py compare PYINFER.gguf OUT.gguf [--llama-bench BIN] [--threads 2]

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
values; ``pyinfer-convert`` remains the way for real models. ``--dense-direct`` writes the file
``pyinfer-convert --dense`` writes (the same plan with ``down_rows``: ``ffn_down`` kept in llama.cpp's
row layout, so every tensor is copied as stored and nothing is drawn or requantized).

``bench`` loads a pyinfer file and reports, as a Markdown table row: load time, RSS (file-backed
and anonymous, from /proc/self/status) after loading and while decoding, prefill tokens/s of one
``--n-prompt`` batch, and decode tokens/s of ``--n-gen`` tokens, dense and with a synthetic
predictor that keeps 1 - ``--sparsity`` of the FFN neurons per token (tools/bench_sparse_cpu.py's
power law), the two interleaved over ``--reps`` rounds (medians). Weights are memory-mapped: the
anonymous RSS must stay near the KV cache and buffers, far below the file size. Given the
llama.cpp file itself (``make``'s output; pyinfer runs it as it is, ``pyinfer/llamacpp.py``),
``bench`` measures it dense only (such a file has no ``ffn_down_t`` for the sparse FFN), and so
for a ``--dense-direct`` file.

``llamacpp`` runs llama.cpp's ``llama-bench`` on the same llama.cpp file (``-p N -n M -r R``, one
process; llama-bench adds its own warm-up run of each test) and reports its prefill and decode
tokens/s, the process's wall time (load, warm-ups and tests) and its peak RSS (ru_maxrss of
this process's children: llama.cpp's default repacks q4_0/Q4_K weights into a copy at load, so its RSS is
expected near the file size in anonymous memory).

``compare`` interleaves, round by round (tools/bench.py's ``run``: one warm-up round, medians of
``--reps``), pyinfer's own file dense and at ``--sparsity``, pyinfer on the llama.cpp file as it
is, and ``llama-bench`` on that llama.cpp file (one repetition per call, so each call also loads
the model), for prefill of ``--n-prompt`` tokens and decode of ``--n-gen`` tokens. On a shared
machine this is the comparison to trust; ``bench`` and ``llamacpp`` add load time and memory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

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


def make_direct(src: str, out: str, pool: RowPool | None, dense: bool = False) -> None:
    """The pyinfer file of ``src`` (module docstring, ``--direct``; ``dense``: ``--dense-direct``,
    ffn_down in row layout, every tensor copied as stored, ``pool`` unused)."""
    import dataclasses

    from convert.from_gguf import plan_gguf
    from convert.writer import write_gguf

    meta, jobs = plan_gguf(src, C.OUTTYPE_AUTO, down_rows=dense)
    if dense:
        write_gguf(out, meta, jobs, progress=False)
        return
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
    """Print one Markdown table row for ``path`` (module docstring, ``bench``)."""
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
    sparse = ffn = None
    if all(lw.ffn_down_t is not None for lw in eng.weights.layers):  # else dense only
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
        ss.append(decode(sparse) if sparse is not None else float("nan"))
    size = os.path.getsize(path) / 2**20
    print("| file | MiB | load s | RSS after load (file / anon) MiB | RSS decoding (file / anon) "
          f"MiB | peak RSS MiB | prefill {n_prompt} tok/s | decode dense tok/s | decode "
          f"{sparsity:.0%} sparse tok/s | measured sparsity |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {os.path.basename(path)} | {size:.0f} | {load_s:.1f} | {rss_load['RssFile']:.0f} / "
          f"{rss_load['RssAnon']:.0f} | {rss_dec['RssFile']:.0f} / {rss_dec['RssAnon']:.0f} | "
          f"{rss()['VmHWM']:.0f} | {statistics.median(pp):.2f} | {statistics.median(dd):.2f} | "
          f"{statistics.median(ss):.2f} | {f'{ffn.stats.sparsity:.1%}' if ffn else '-'} |",
          flush=True)


class SparseRunner:
    """tools/bench.py's runner interface over a pyinfer file with the synthetic predictor."""

    def __init__(self, base, sparsity: float):
        from pyinfer.ffn import SparseFFN
        from pyinfer.model import Model
        from tools.bench_sparse_cpu import SyntheticPredictor

        cfg, eng = base.eng.cfg, base.eng
        pred = SyntheticPredictor(np.random.default_rng(1), cfg.n_ff, 1 - sparsity)
        self.ffn = SparseFFN(cfg, [pred] * cfg.n_layer, np.full(cfg.n_layer, -1.0, np.float32))
        self.model = Model(cfg, eng.weights, n_ctx=eng.model.n_ctx, n_threads=eng.model.n_threads,
                           ffn=self.ffn)
        self.ids = base.ids
        self.name = f"{base.name} ({sparsity:.0%} sparse)"

    def prefill(self, n_prompt):
        return float("nan")

    def decode(self, n_gen):
        self.model.forward(self.ids[:8], 0)
        t0 = time.perf_counter()
        for i in range(n_gen):
            self.model.forward([self.ids[8 + i]], 8 + i)
        return n_gen / (time.perf_counter() - t0)


def compare(pyinfer_file: str, llamacpp_file: str, llama_bench: str | None, n_threads: int,
            n_prompt: int, n_gen: int, sparsity: float, reps: int) -> None:
    """Print a Markdown table: prefill and decode tokens/s of each engine (``compare`` above)."""
    import bench as B

    n_ctx = max(n_prompt, 8 + n_gen) + 8
    own = B.PyinferRunner(pyinfer_file, n_threads, n_ctx)
    own.name = f"pyinfer, {os.path.basename(pyinfer_file)}"
    # a dense file (ffn_down in row layout) has no ffn_down_t for the sparse FFN
    sparse = ([SparseRunner(own, sparsity)] if all(lw.ffn_down_t is not None
                                                   for lw in own.eng.weights.layers) else [])
    runners = [own, *sparse, B.PyinferRunner(llamacpp_file, n_threads, n_ctx)]
    runners[-1].name = f"pyinfer, {os.path.basename(llamacpp_file)} as it is"
    if llama_bench:
        runners.append(B.LlamaBenchRunner(llama_bench, llamacpp_file, n_threads))
        runners[-1].name = f"llama.cpp, {os.path.basename(llamacpp_file)}"
    res = B.run(runners, [n_prompt] if n_prompt else [], n_gen, reps)  # 0: skip that test
    ref = res[runners[-1]] if llama_bench else None
    print(f"| engine | threads | prefill {n_prompt} tok/s | decode tok/s | prefill / llama.cpp | "
          "decode / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for r in runners:
        pps, tg = res[r]
        pp = pps[0] if pps else float("nan")
        rel = (f"{pp / (ref[0] or [np.nan])[0]:.2f}x | {tg / ref[1]:.2f}x" if ref else "- | -")
        line = f"| {r.name} | {n_threads} | {pp:.2f} | {tg:.2f} | {rel} |"
        print(line.replace("nanx", "-").replace("nan", "-"), flush=True)


def llamacpp_bench(binary: str, path: str, n_threads: int, n_prompt: int, n_gen: int,
                   reps: int) -> dict:
    """llama-bench on ``path`` (module docstring, ``llamacpp``): {"pp": tok/s, "tg": tok/s,
    "wall_s": s, "peak_rss_mib": MiB}. Raises RuntimeError with llama-bench's last line if it
    fails."""
    import json
    import resource
    import subprocess

    env = dict(os.environ)
    lib = os.path.dirname(os.path.abspath(binary))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, env.get("LD_LIBRARY_PATH")]))
    cmd = [binary, "-m", path, "-p", str(n_prompt), "-n", str(n_gen), "-t", str(n_threads),
           "-r", str(reps), "-o", "json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode:
        last = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-bench failed (exit {p.returncode}): {last[0]}")
    # the largest peak among this process's reaped children: llama-bench, its only big one
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    res = {"wall_s": wall, "peak_rss_mib": peak, "pp": float("nan"), "tg": float("nan")}
    for test in json.loads(p.stdout):
        res["pp" if test["n_gen"] == 0 else "tg"] = float(test["avg_ts"])
    return res


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
    m.add_argument("--dense-direct", metavar="DENSE_GGUF",
                   help="also write the dense pyinfer file (ffn_down in row layout, copied as "
                        "stored: what pyinfer-convert --dense writes)")
    b = sub.add_parser("bench", help="load, prefill and decode a pyinfer file")
    b.add_argument("model")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--n-prompt", type=int, default=32)
    b.add_argument("--n-gen", type=int, default=8)
    b.add_argument("--sparsity", type=float, default=0.9)
    b.add_argument("--reps", type=int, default=2)
    lb = sub.add_parser("llamacpp", help="llama.cpp's llama-bench on the llama.cpp file")
    lb.add_argument("model")
    lb.add_argument("--llama-bench", required=True, help="path of the llama-bench binary")
    lb.add_argument("--threads", type=int, default=2)
    lb.add_argument("--n-prompt", type=int, default=32)
    lb.add_argument("--n-gen", type=int, default=8)
    lb.add_argument("--reps", type=int, default=2)
    c = sub.add_parser("compare", help="pyinfer and llama-bench interleaved")
    c.add_argument("model", help="pyinfer file")
    c.add_argument("llamacpp_model", help="the llama.cpp file it was converted from")
    c.add_argument("--llama-bench", help="path of the llama-bench binary")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--n-prompt", type=int, default=32)
    c.add_argument("--n-gen", type=int, default=8)
    c.add_argument("--sparsity", type=float, default=0.9)
    c.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        compare(args.model, args.llamacpp_model, args.llama_bench, args.threads, args.n_prompt,
                args.n_gen, args.sparsity, args.reps)
        return 0
    if args.cmd == "llamacpp":
        r = llamacpp_bench(args.llama_bench, args.model, args.threads, args.n_prompt, args.n_gen,
                           args.reps)
        print(f"| {os.path.basename(args.model)} (llama-bench) | "
              f"{os.path.getsize(args.model) / 2**20:.0f} | wall {r['wall_s']:.1f} s | "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB | prefill {args.n_prompt} {r['pp']:.2f} "
              f"tok/s | decode {r['tg']:.2f} tok/s |", flush=True)
        return 0
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
        if args.dense_direct:
            t0 = time.perf_counter()
            make_direct(args.out, args.dense_direct, None, dense=True)
            print(f"wrote {args.dense_direct} ({os.path.getsize(args.dense_direct) / 2**30:.2f} "
                  f"GiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    else:
        bench(args.model, args.threads, args.n_prompt, args.n_gen, args.sparsity, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
