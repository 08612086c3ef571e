"""The offline stage of sparse mode "input" (SwiGLU models; runtime in pyinfer/input_sparse.py):
calibrate one input threshold per layer and projection group, allocate the sparsity greedily, and
write the file with those matrices stored transposed.

1. ``record_inputs``: the dense model (the staging file's row layout, pyinfer's own kernels) runs
   the calibration chunks layer by layer and hands each layer's four group inputs (attention-normed
   x, attention output, FFN-normed x, GLU output act(gate) * up) and the energies of the residual
   stream and of each block's output to a callback; nothing larger than one layer is kept.
2. ``unit_curves``: per layer and group, for sparsity levels 0, 1/100, ..., 99/100 of the
   (token, channel) pairs: the threshold on the score (|x_j|, TEAL; |x_j| * ||W[:, j]||, WINA)
   and the calibration loss of dropping the pairs below it: the energy the dropped channels would
   have put into the projection's output, sum_j x_j^2 ||W[:, j]||^2 (the diagonal of
   ||W x_dropped||^2, WINA's bound), relative to the output's. (Weighting it by the block output's
   energy over the residual stream's, a noise-to-signal ratio, was tried first: SmolLM2's middle
   layers carry a residual stream hundreds of times their blocks' outputs, so that weighting sent
   them to 98% sparsity.)
3. ``allocate``: TEAL's greedy (Liu et al. 2024, §4.2, there within a block; here model-wide):
   repeatedly raise by one level the sparsity of the unit whose loss grows least per weight byte
   saved, until the skipped bytes reach ``target_sparsity`` of all projection bytes.
4. The final file: the converter's jobs with q/k/v, attn_output, gate and up replaced by their
   transposed forms (``transposed_jobs``), the thresholds, and for WINA the column norms.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from pyinfer import constants as C
from pyinfer.ffn import linear, linear_t
from pyinfer.input_sparse import in_sizes
from pyinfer.ops import cpu
from pyinfer.ops.reference import dequantize

N_LEVELS = 100  # sparsity levels per unit: k / N_LEVELS, k = 0 .. N_LEVELS - 1
MAX_SAMPLES = 1 << 19  # (token, channel) pairs per unit whose scores set the quantiles


@dataclass
class UnitCurve:
    """One (layer, group): ``thr[k]`` keeps channels with score > thr[k] (thr[0] = -1: all) and
    skips about k / N_LEVELS of the pairs; ``loss[k]`` its calibration loss (module docstring)."""

    thr: np.ndarray  # (N_LEVELS,) f32
    loss: np.ndarray  # (N_LEVELS,) f64, non-decreasing, loss[0] = 0


def column_norms(lw) -> dict[str, np.ndarray]:
    """Per input channel, the 2-norm of the column it multiplies in each group's matrix (qkv and
    gate/up: the matrices that share the input stacked). From a row-layout layer's weights."""
    def sq(w):
        return (dequantize(w).astype(np.float64) ** 2).sum(0)  # (n_in,)

    return {"attn_qkv": np.sqrt(sq(lw.wq) + sq(lw.wk) + sq(lw.wv)).astype(np.float32),
            "attn_output": np.sqrt(sq(lw.wo)).astype(np.float32),
            "ffn_gate_up": np.sqrt(sq(lw.ffn_gate) + sq(lw.ffn_up)).astype(np.float32),
            "ffn_down": np.sqrt((dequantize(lw.ffn_down_t).astype(np.float64) ** 2).sum(1)
                                ).astype(np.float32)}


def record_inputs(eng, pieces: list[list[int]], n_threads: int, on_layer) -> None:
    """Run ``pieces`` (token lists, each from position 0) through the dense row-layout model of
    ``eng`` layer by layer; after each layer call ``on_layer(i, inputs, energy)`` with inputs
    {group: (n_tok, n_in) f32} over all pieces and energy {"resid_attn", "attn", "resid_ffn",
    "ffn": mean squared norm per token} (residual before each block, block output)."""
    cfg, w = eng.cfg, eng.weights
    E, hd = cfg.n_embd, cfg.head_dim
    xs = []
    for p in pieces:
        x = np.empty((len(p), E), np.float32)
        cpu.get_rows(w.token_embd, np.asarray(p, np.int32), x)
        xs.append(x)
    n_tok = sum(len(p) for p in pieces)
    for i in range(cfg.n_layer):
        lw = w.layers[i]
        rec = {g: np.empty((n_tok, in_sizes(cfg)[g][0]), np.float32) for g in C.IN_GROUPS}
        en = dict.fromkeys(("resid_attn", "attn", "resid_ffn", "ffn"), 0.0)
        s = 0
        for x in xs:
            T = x.shape[0]
            pos = np.arange(T, dtype=np.int32)
            h = np.empty_like(x)
            cpu.rmsnorm(x, lw.attn_norm, cfg.rms_eps, h)
            q = linear(lw.wq, h, np.empty((T, cfg.n_embd_q), np.float32), n_threads)
            k = linear(lw.wk, h, np.empty((T, cfg.n_embd_kv), np.float32), n_threads)
            v = linear(lw.wv, h, np.empty((T, cfg.n_embd_kv), np.float32), n_threads)
            q3, k3 = q.reshape(T, cfg.n_head, hd), k.reshape(T, cfg.n_head_kv, hd)
            cpu.rope_neox(q3, pos, cfg.rope_freq_base, hd)
            cpu.rope_neox(k3, pos, cfg.rope_freq_base, hd)
            att = np.empty((T, cfg.n_head, hd), np.float32)
            cpu.attention(q3, np.ascontiguousarray(k3), v.reshape(T, cfg.n_head_kv, hd), 0, att,
                          n_threads)
            att = att.reshape(T, cfg.n_embd_q)
            o = linear(lw.wo, att, np.empty((T, E), np.float32), n_threads)
            rec["attn_qkv"][s:s + T] = h
            rec["attn_output"][s:s + T] = att
            en["resid_attn"] += float((x.astype(np.float64) ** 2).sum())
            en["attn"] += float((o.astype(np.float64) ** 2).sum())
            x += o
            cpu.rmsnorm(x, lw.ffn_norm, cfg.rms_eps, h)
            g = linear(lw.ffn_gate, h, np.empty((T, cfg.n_ff), np.float32), n_threads)
            u = linear(lw.ffn_up, h, np.empty((T, cfg.n_ff), np.float32), n_threads)
            cpu.silu_mul(g, u, g)
            f = linear_t(lw.ffn_down_t, g, np.empty((T, E), np.float32), n_threads)
            rec["ffn_gate_up"][s:s + T] = h
            rec["ffn_down"][s:s + T] = g
            en["resid_ffn"] += float((x.astype(np.float64) ** 2).sum())
            en["ffn"] += float((f.astype(np.float64) ** 2).sum())
            x += f
            s += T
        on_layer(i, rec, {k: v / n_tok for k, v in en.items()})


def unit_curve(x: np.ndarray, cnorm: np.ndarray, wina: bool,
               rng: np.random.Generator) -> UnitCurve:
    """The threshold and loss of each sparsity level for one unit (module docstring, step 2).

    x (n_tok, n_in) f32 the unit's calibration inputs; cnorm (n_in,) its column norms. At most
    MAX_SAMPLES pairs (drawn by ``rng``)."""
    n = x.size
    flat = x.reshape(-1)
    cols = np.tile(np.arange(x.shape[1]), x.shape[0]) if n <= MAX_SAMPLES else None
    if n > MAX_SAMPLES:
        pick = np.sort(rng.choice(n, MAX_SAMPLES, replace=False))
        flat, cols = flat[pick], pick % x.shape[1]
    c = cnorm[cols]
    mag = np.abs(flat)
    score = mag * c if wina else mag  # f32, as the kernels compute it
    if wina:  # the loss of a pair is its score squared: a plain sort will do
        s_sorted = np.sort(score)
        cum = np.cumsum(s_sorted.astype(np.float64) ** 2)
    else:
        order = np.argsort(score, kind="stable")
        s_sorted = score[order]
        cum = np.cumsum(((mag.astype(np.float64) * c) ** 2)[order])
    total = max(cum[-1], 1e-30)
    thr = np.empty(N_LEVELS, np.float32)
    loss = np.zeros(N_LEVELS)
    thr[0] = -1.0
    for k in range(1, N_LEVELS):
        j = int(round(k / N_LEVELS * s_sorted.size))
        thr[k] = s_sorted[j - 1]  # drops the j smallest (ties go with them)
        loss[k] = cum[j - 1] / total
    return UnitCurve(thr, np.maximum.accumulate(loss))


def allocate(curves: list[list[UnitCurve]], unit_bytes: dict[str, int],
             target: float) -> np.ndarray:
    """Levels (n_layer, 4) int: greedy (module docstring, step 3) until the skipped bytes reach
    ``target`` of the total. Ties go to the lower (layer, group) index: deterministic."""
    n_layer = len(curves)
    groups = C.IN_GROUPS
    level = np.zeros((n_layer, len(groups)), np.int64)
    total = n_layer * sum(unit_bytes.values())
    need = target * total
    heap = []

    def push(i, gi):
        k = level[i, gi]
        if k + 1 < N_LEVELS:
            c = curves[i][gi]
            cost = (c.loss[k + 1] - c.loss[k]) / (unit_bytes[groups[gi]] / N_LEVELS)
            heapq.heappush(heap, (cost, i, gi))

    for i in range(n_layer):
        for gi in range(len(groups)):
            push(i, gi)
    skipped = 0.0
    while skipped < need and heap:
        _, i, gi = heapq.heappop(heap)
        level[i, gi] += 1
        skipped += unit_bytes[groups[gi]] / N_LEVELS
        push(i, gi)
    return level


def transposed_jobs(jobs, cfg, outtype: str, scales: list[dict] | None):
    """The converter's jobs with each layer's wq/wk/wv, attn_output, ffn_gate and ffn_up replaced by
    attn_qkv_t, attn_output_t and ffn_gate_up_t (same place in the file), plus the WINA column
    norms ``scales`` (per layer {group: (n_in,) f32}) when given."""
    from convert.writer import TensorJob, matrix_qtype

    by_name = {j.name: j for j in jobs}
    drop = set()
    out = []
    for j in jobs:
        if j.name in drop:
            continue
        if not j.name.startswith("blk.") or not j.name.endswith(".attn_q.weight"):
            out.append(j)
            continue
        i = int(j.name.split(".")[1])
        name = {key: tmpl.format(bid=i) for key, tmpl in (
            ("q", C.ATTN_Q), ("k", C.ATTN_K), ("v", C.ATTN_V), ("o", C.ATTN_OUT),
            ("g", C.FFN_GATE), ("u", C.FFN_UP))}
        src = {key: by_name[n] for key, n in name.items()}
        drop.update(name.values())
        n_qkv = cfg.n_embd_q + 2 * cfg.n_embd_kv

        def qkv(s=src):
            return np.ascontiguousarray(np.concatenate([s["q"].load(), s["k"].load(),
                                                        s["v"].load()]).T)

        def o_t(s=src):
            return np.ascontiguousarray(s["o"].load().T)

        def gu(s=src):
            return np.ascontiguousarray(np.concatenate([s["g"].load(), s["u"].load()]).T)

        out.append(TensorJob(C.ATTN_QKV_T.format(bid=i), (cfg.n_embd, n_qkv),
                             matrix_qtype(n_qkv, outtype), qkv))
        out.append(TensorJob(C.ATTN_OUT_T.format(bid=i), (cfg.n_embd_q, cfg.n_embd),
                             matrix_qtype(cfg.n_embd, outtype), o_t))
        out.append(TensorJob(C.FFN_GATE_UP_T.format(bid=i), (cfg.n_embd, 2 * cfg.n_ff),
                             matrix_qtype(2 * cfg.n_ff, outtype), gu))
        if scales is not None:
            for g in C.IN_GROUPS:
                a = scales[i][g]
                out.append(TensorJob(C.IN_SCALE[g].format(bid=i), a.shape, C.QT.F32,
                                     lambda a=a: a))
    return out


def format_table(sparsity: np.ndarray, loss: np.ndarray, score: str, target: float) -> str:
    """The summary: per layer the calibrated sparsity of each group and the calibration loss."""
    head = f"{'layer':>5} " + " ".join(f"{g:>12}" for g in C.IN_GROUPS) + f" {'calib_loss':>11}"
    lines = [f"offline stage summary (sparse mode input, score {score}, target {target:.0%} of "
             "projection weight bytes; columns: fraction of input channels skipped on the "
             "calibration tokens)", head, "-" * len(head)]
    for i in range(sparsity.shape[0]):
        lines.append(f"{i:>5} " + " ".join(f"{s:>12.1%}" for s in sparsity[i])
                     + f" {loss[i]:>11.2e}")
    lines.append("-" * len(head))
    lines.append(f"{'mean':>5} " + " ".join(f"{s:>12.1%}" for s in sparsity.mean(0))
                 + f" {loss.sum():>11.2e} (sum)")
    return "\n".join(lines)


def calibrate(eng, seqs: list[list[int]], wina: bool, seed: int, n_threads: int):
    """(curves [n_layer][4] UnitCurve, column norms [n_layer] {group: (n_in,) f32}) from the
    dense row-layout engine ``eng`` over the calibration sequences (steps 1-2). Deterministic for
    a seed, whatever ``n_threads``."""
    from predictors.profile import chunks

    norms = [column_norms(lw) for lw in eng.weights.layers]
    curves: list[list[UnitCurve]] = []
    rng = np.random.default_rng(seed)

    def on_layer(i, rec, en):
        curves.append([unit_curve(rec[g], norms[i][g], wina, rng) for g in C.IN_GROUPS])

    record_inputs(eng, chunks(seqs, min(512, eng.n_ctx)), n_threads, on_layer)
    return curves, norms


def thresholds_for(curves, cfg, target: float):
    """(thresholds (n_layer, 4) f32, calibrated sparsity (n_layer, 4), loss (n_layer,)) of the
    greedy allocation for ``target`` (step 3); columns in ``constants.IN_GROUPS`` order."""
    sizes = in_sizes(cfg)
    unit_bytes = {g: sizes[g][0] * sizes[g][1] for g in C.IN_GROUPS}
    level = allocate(curves, unit_bytes, target)
    thr = np.array([[curves[i][gi].thr[level[i, gi]] for gi in range(4)]
                    for i in range(cfg.n_layer)], np.float32)
    loss = np.array([sum(curves[i][gi].loss[level[i, gi]] for gi in range(4))
                     for i in range(cfg.n_layer)])
    return thr, level / N_LEVELS, loss


def input_stage(src: str, out: str, outtype: str, opts, eng, seqs, source: str, secs: dict,
                allow_unused: bool, plan, n_threads: int) -> dict:
    """Steps 1-4 of the module docstring over the dense staging engine ``eng`` and calibration
    sequences ``seqs``; writes ``out``. Returns the summary dict of ``convert_sparse``."""
    from convert.writer import VT, write_gguf
    from pyinfer.errors import PyinferError

    cfg = eng.cfg
    wina = opts.input_score == "wina"
    t0 = time.perf_counter()
    curves, norms = calibrate(eng, seqs, wina, opts.seed, n_threads)
    secs["calibration"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    thr, sparsity, loss = thresholds_for(curves, cfg, opts.target_sparsity)
    secs["allocation"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    meta, jobs = plan(src, outtype, allow_unused)
    meta.string(C.K_SPARSE_MODE, C.SPARSE_MODE_INPUT)
    meta.string(C.K_IN_SCORE, opts.input_score)
    for gi, g in enumerate(C.IN_GROUPS):
        meta.array(C.K_IN_THRESHOLD.format(group=g), [float(t) for t in thr[:, gi]], VT.FLOAT32)
        meta.array(C.K_IN_SPARSITY.format(group=g), [float(s) for s in sparsity[:, gi]], VT.FLOAT32)
    meta.f32(C.K_TARGET_SPARSITY, opts.target_sparsity)
    meta.string(C.K_CALIB_SOURCE, source)
    meta.u32(C.K_CALIB_TOKENS, sum(len(s) for s in seqs))
    meta.u32(C.K_CALIB_SEED, opts.seed)
    jobs = transposed_jobs(jobs, cfg, outtype, norms if wina else None)
    try:
        write_gguf(out, meta, jobs, progress=opts.progress)
    except OSError as e:
        raise PyinferError(f"cannot write {out}: {e.strerror or e}") from None
    secs["final write"] = time.perf_counter() - t0
    return {"mode": C.SPARSE_MODE_INPUT, "calib_source": source, "seconds": secs,
            "sparsity": sparsity, "loss": loss, "thresholds": thr, "placement": None, "rows": [],
            "table": format_table(sparsity, loss, opts.input_score, opts.target_sparsity)}
