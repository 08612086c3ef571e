"""The offline stage of sparse mode "input" (SwiGLU models; runtime in pyinfer/input_sparse.py):
calibrate one input threshold per layer and projection group, split each layer's sparsity among
its projections (uniformly, the default, by TEAL's block-wise greedy, or model-wide by an
end-of-model Fisher estimate), and write the file with
those matrices stored transposed.

1. ``record_inputs``: the dense model (the staging file's row layout, pyinfer's own kernels) runs
   the calibration chunks layer by layer and hands each layer's four group inputs (attention-normed
   x, attention output, FFN-normed x, GLU output act(gate) * up) and the energies of the residual
   stream and of each block's output to a callback; nothing larger than one layer is kept.
2. ``unit_curve``: per layer and group, for sparsity levels 0, 1/100, ..., 99/100 of the
   (token, channel) pairs: the threshold on the score (|x_j|, TEAL; |x_j| * ||W[:, j]||, WINA).
   (Its ``loss``, the dropped channels' share of the projection's output energy, is no longer
   used to allocate: a model-wide greedy on it sent SmolLM2's layer 11 down projection to 99%
   sparsity, where one massive channel carries nearly all the energy, and cost +17% perplexity at
   25% against +1.6% for a uniform 25% in every group; the summary table of a uniform file
   shows it.)
3. The allocation (``pyinfer-convert --sparse-alloc``). "uniform" (the default): every group of
   every layer at the target level of its own curve, so each skips the target fraction of its
   calibration pairs; nothing more to compute. "greedy", ``block_path``: TEAL's block-wise greedy (Liu et al. 2024, §4.2). Per layer, from all groups
   dense, repeatedly raise by 5% the sparsity of the group whose step increases the layer's output
   error (||y_sparse - y||^2 on the first EVAL_TOKENS calibration tokens, the layer's input taken
   from the dense model) least per weight byte skipped. ``thresholds_for`` then gives every layer
   the same block sparsity, the target (uniform across blocks, as TEAL does), split among the
   groups as the path says.
   "fisher" (``allocate_levels`` over predictors/input_fisher.py's costs): an end-of-model
   estimate of each unit's cost at each level, then the model-wide greedy of equal marginal cost
   per byte; layers differ, the model as a whole meets the target (SmolLM2: a third less KL
   from dense than uniform), then each unit moved back towards the uniform level
   (``blend_levels``, ``--fisher-weight``; half-way by default: 5% lower perplexity than
   uniform at 40% on held-out text; needs PyTorch; the default allocation where it is installed).
4. The final file: the converter's jobs with q/k/v, attn_output, gate and up replaced by their
   transposed forms (``transposed_jobs``), the thresholds, and for WINA the column norms.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pyinfer import constants as C
from pyinfer.ffn import linear, linear_t
from pyinfer.input_sparse import in_sizes
from pyinfer.ops import cpu
from pyinfer.ops.families import head_norms
from pyinfer.ops.reference import dequantize

N_LEVELS = 100  # sparsity levels per unit: k / N_LEVELS, k = 0 .. N_LEVELS - 1
# (token, channel) pairs per unit whose scores set the quantiles: the 1% levels' quantiles from
# 262,144 pairs have a standard error under 0.1% of the pairs
MAX_SAMPLES = 1 << 18
LOSS_SAMPLES = 1 << 16  # of those, the pairs the loss (a summary figure, no allocation uses it) is summed over


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
            "ffn_down": np.sqrt(sq(lw.ffn_down) if lw.ffn_down_t is None  # a --dense file
                                else (dequantize(lw.ffn_down_t).astype(np.float64) ** 2).sum(1)
                                ).astype(np.float32)}


def _rope(x3: np.ndarray, pos: np.ndarray, cfg, rope_freqs) -> None:
    """RoPE in place on x3 (T, n_heads, head_dim) as the engine turns it: with the file's
    frequency divisors (Llama 3's rope_freqs) where it has them."""
    if rope_freqs is None:
        cpu.rope_neox(x3, pos, cfg.rope_freq_base, cfg.head_dim)
    else:
        from pyinfer.ops.families import rope_scaled

        rope_scaled(x3, pos, cfg.rope_freq_base, rope_freqs)


def _add(y: np.ndarray, b) -> np.ndarray:
    """y += b where the projection has a bias (Qwen2's q/k/v); y."""
    if b is not None:
        y += b
    return y


def record_inputs(eng, pieces: list[list[int]], n_threads: int, on_layer, on_final=None) -> None:
    """Run ``pieces`` (token lists, each from position 0) through the dense row-layout model of
    ``eng`` layer by layer; after each layer call ``on_layer(i, inputs, energy, xs)`` with inputs
    {group: (n_tok, n_in) f32} over all pieces, energy {"resid_attn", "attn", "resid_ffn",
    "ffn": mean squared norm per token} (residual before each block, block output) and xs the
    layer's input, one (len(piece), n_embd) f32 array per piece; at the end
    ``on_final(h)``, h (n_tok, n_embd) f32 the lm head's input (the output-normed last residual).
    Llama-shaped models (``cfg.llama_plain``): SwiGLU, or ReGLU where ``hidden_act`` is "relu"."""
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
        x_in = [x.copy() for x in xs]
        for x in xs:
            T = x.shape[0]
            pos = np.arange(T, dtype=np.int32)
            h = np.empty_like(x)
            cpu.rmsnorm(x, lw.attn_norm, cfg.rms_eps, h)
            q = _add(linear(lw.wq, h, np.empty((T, cfg.n_embd_q), np.float32), n_threads), lw.bq)
            k = _add(linear(lw.wk, h, np.empty((T, cfg.n_embd_kv), np.float32), n_threads), lw.bk)
            v = _add(linear(lw.wv, h, np.empty((T, cfg.n_embd_kv), np.float32), n_threads), lw.bv)
            q3, k3 = q.reshape(T, cfg.n_head, hd), k.reshape(T, cfg.n_head_kv, hd)
            head_norms(q3, k3, lw, cfg.rms_eps)
            _rope(q3, pos, cfg, w.rope_freqs)
            _rope(k3, pos, cfg, w.rope_freqs)
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
            (cpu.relu_mul if cfg.hidden_act == "relu" else cpu.silu_mul)(g, u, g)
            f = linear_t(lw.ffn_down_t, g, np.empty((T, E), np.float32), n_threads)
            rec["ffn_gate_up"][s:s + T] = h
            rec["ffn_down"][s:s + T] = g
            en["resid_ffn"] += float((x.astype(np.float64) ** 2).sum())
            en["ffn"] += float((f.astype(np.float64) ** 2).sum())
            x += f
            s += T
        on_layer(i, rec, {k: v / n_tok for k, v in en.items()}, x_in)
    if on_final is not None:
        x = np.concatenate(xs)
        h = np.empty_like(x)
        cpu.rmsnorm(x, w.output_norm, cfg.rms_eps, h)
        on_final(h)


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
    s_sorted = np.sort(score)
    thr = np.empty(N_LEVELS, np.float32)
    thr[0] = -1.0
    j = np.maximum(np.rint(np.arange(1, N_LEVELS) / N_LEVELS * s_sorted.size).astype(np.int64), 1)
    thr[1:] = s_sorted[j - 1]  # level k drops the j smallest (ties go with them)
    # loss[k]: output energy (|x_j| ||W[:, j]||)^2 of the pairs level k drops (score <= thr[k]),
    # by bucket: a pair's bucket is the number of thresholds below its score (one pass, no argsort)
    sub = (slice(None) if score.size <= LOSS_SAMPLES else  # own generator: thresholds unchanged
           np.random.default_rng(0).choice(score.size, LOSS_SAMPLES, replace=False))
    energy = (mag[sub].astype(np.float64) * c[sub]) ** 2
    bucket = np.searchsorted(thr[1:], score[sub], side="left")
    cum = np.cumsum(np.bincount(bucket, weights=energy, minlength=N_LEVELS))
    loss = np.zeros(N_LEVELS)
    loss[1:] = cum[:N_LEVELS - 1] / max(cum[-1], 1e-30)
    return UnitCurve(thr, np.maximum.accumulate(loss))


STEP = 5  # the block greedy raises a group's sparsity by STEP / N_LEVELS per step (TEAL: 5%)
MAX_LEVEL = 95  # no group skips more than this many levels (95% of its pairs)
#: calibration tokens (a prefix of the pieces) the Fisher pass runs over: its time is linear in
#: them; on SmolLM2 an allocation from 256 tokens costs as little, under an independent
#: 1,024-token estimate, as one from 1,024 (docs/benchmarks.md, "Input sparsity quality (issue
#: 12), session 8")
FISHER_TOKENS = 256
EVAL_TOKENS = 128  # calibration tokens (a prefix of each piece) the block greedy evaluates on (SmolLM2, 30 layers: ~9 min on a loaded 2-core box)


@dataclass
class BlockPath:
    """One layer's greedy path (TEAL §4.2): ``levels[p]`` (4,) int the sparsity levels of the
    groups after p steps, ``sparsity[p]`` the block sparsity (fraction of the layer's projection
    bytes skipped on the calibration pairs), ``error[p]`` the block output error relative to the
    block's output energy, ||y_p - y||^2 / ||y - x||^2 over the evaluated tokens."""

    levels: np.ndarray  # (n_steps + 1, 4) int64, levels[0] = 0
    sparsity: np.ndarray  # (n_steps + 1,) f64, non-decreasing
    error: np.ndarray  # (n_steps + 1,) f64


class _Block:
    """One layer as f32 NumPy over its dequantized row-layout weights, for the block greedy: the
    output of the layer on given inputs with each group's input channels masked at a level.
    Stage s of the cached state depends only on the levels of groups 0..s, so raising group g
    recomputes stages g.. only (q/k/v: everything; down: one product)."""

    def __init__(self, lw, cfg, xs: list[np.ndarray], curves: list[UnitCurve],
                 norms: dict[str, np.ndarray], wina: bool, n_threads: int, rope_freqs=None):
        self.cfg, self.lw, self.xs, self.nt = cfg, lw, xs, n_threads
        self.rope_freqs = rope_freqs  # the file's RoPE frequency divisors, or None
        self.wqkv = np.concatenate([dequantize(lw.wq), dequantize(lw.wk), dequantize(lw.wv)]).T
        self.bqkv = lw.qkv_bias(cfg)  # [bq; bk; bv] where the layer has q/k/v biases (Qwen2)
        self.wo = np.ascontiguousarray(dequantize(lw.wo).T)  # (n_embd_q, n_embd)
        self.wgu = np.concatenate([dequantize(lw.ffn_gate), dequantize(lw.ffn_up)]).T
        self.wd = dequantize(lw.ffn_down_t)  # (n_ff, n_embd)
        self.curves = curves
        self.scale = [norms[g] if wina else None for g in C.IN_GROUPS]
        self.x = np.concatenate(xs)
        self.h = np.empty_like(self.x)
        cpu.rmsnorm(self.x, lw.attn_norm, cfg.rms_eps, self.h)
        self.state = [None] * 4  # per stage: its output for the current levels
        self.levels = np.zeros(4, np.int64)
        self.y = self.run(self.levels, 0)  # dense block output (n_tok, n_embd)
        self.state = list(self._last)
        self.out_energy = max(float(((self.y - self.x).astype(np.float64) ** 2).sum()), 1e-30)

    def _mask(self, gi: int, level: int, v: np.ndarray) -> np.ndarray:
        if level == 0:
            return v
        s = np.abs(v)
        if self.scale[gi] is not None:
            s *= self.scale[gi]
        return np.where(s <= self.curves[gi].thr[level], np.float32(0.0), v)

    def run(self, levels, first: int) -> np.ndarray:
        """The block output (n_tok, n_embd) f32 for ``levels``, from stage ``first`` on (the
        stages before it taken from ``self.state``); the stages' outputs are left in _last."""
        cfg, hd = self.cfg, self.cfg.head_dim
        st = list(self.state)
        if first <= 0:  # q/k/v from the masked normed input, then attention per piece
            qkv = _add(self._mask(0, levels[0], self.h) @ self.wqkv, self.bqkv)
            att = np.empty((qkv.shape[0], cfg.n_embd_q), np.float32)
            s = 0
            for x in self.xs:
                T = x.shape[0]
                pos = np.arange(T, dtype=np.int32)
                q3 = np.ascontiguousarray(qkv[s:s + T, :cfg.n_embd_q]).reshape(T, cfg.n_head, hd)
                k3 = np.ascontiguousarray(qkv[s:s + T, cfg.n_embd_q:cfg.n_embd_q + cfg.n_embd_kv]
                                          ).reshape(T, cfg.n_head_kv, hd)
                v3 = np.ascontiguousarray(qkv[s:s + T, cfg.n_embd_q + cfg.n_embd_kv:]
                                          ).reshape(T, cfg.n_head_kv, hd)
                head_norms(q3, k3, self.lw, cfg.rms_eps)
                _rope(q3, pos, cfg, self.rope_freqs)
                _rope(k3, pos, cfg, self.rope_freqs)
                a = np.empty((T, cfg.n_head, hd), np.float32)
                cpu.attention(q3, k3, v3, 0, a, self.nt)
                att[s:s + T] = a.reshape(T, cfg.n_embd_q)
                s += T
            st[0] = att
        if first <= 1:  # output projection, residual, FFN norm
            x1 = self.x + self._mask(1, levels[1], st[0]) @ self.wo
            h2 = np.empty_like(x1)
            cpu.rmsnorm(x1, self.lw.ffn_norm, cfg.rms_eps, h2)
            st[1] = (x1, h2)
        if first <= 2:  # gate/up and the GLU product
            gu = self._mask(2, levels[2], st[1][1]) @ self.wgu
            act = np.ascontiguousarray(gu[:, :cfg.n_ff])
            (cpu.silu_mul if cfg.hidden_act == "silu" else cpu.relu_mul)(
                act, np.ascontiguousarray(gu[:, cfg.n_ff:]), act)
            st[2] = act
        st[3] = st[1][0] + self._mask(3, levels[3], st[2]) @ self.wd
        self._last = st
        return st[3]

    def error(self, y: np.ndarray) -> float:
        return float(((y - self.y).astype(np.float64) ** 2).sum()) / self.out_energy


def block_path(blk: _Block, unit_bytes: np.ndarray, max_sparsity: float) -> BlockPath:
    """TEAL's block-wise greedy (Liu et al. 2024, §4.2): from all groups dense, repeatedly raise
    by STEP levels the group whose step increases the block output error least per byte skipped
    (errors measured on the calibration inputs of ``blk``), until the block sparsity reaches
    ``max_sparsity`` or every group is at MAX_LEVEL. unit_bytes (4,) the bytes of each group's
    matrix. Ties go to the lower group index: deterministic."""
    total = float(unit_bytes.sum())
    levels = np.zeros(4, np.int64)
    err = 0.0
    path_l, path_s, path_e = [levels.copy()], [0.0], [0.0]
    while path_s[-1] < max_sparsity:
        best = None
        for gi in range(4):
            if levels[gi] >= MAX_LEVEL:
                continue
            cand = levels.copy()
            cand[gi] = min(levels[gi] + STEP, MAX_LEVEL)
            e = blk.error(blk.run(cand, gi))
            cost = (e - err) / ((cand[gi] - levels[gi]) * unit_bytes[gi])
            if best is None or cost < best[0]:
                best = (cost, gi, cand, e, blk._last)
        if best is None:
            break
        _, gi, levels, err, blk.state = best
        path_l.append(levels.copy())
        path_s.append(float((levels * unit_bytes).sum()) / (N_LEVELS * total))
        path_e.append(err)
    return BlockPath(np.array(path_l), np.array(path_s), np.array(path_e))


def levels_for(path: BlockPath, unit_bytes: np.ndarray, target: float) -> np.ndarray:
    """(4,) levels of one layer at block sparsity ``target``: the path's first step at or past
    the target, its last group raised only as far as the target needs (whole levels)."""
    p = int(np.searchsorted(path.sparsity, target - 1e-12))
    if p == 0:
        return path.levels[0].copy()
    if p >= len(path.sparsity):
        return path.levels[-1].copy()
    lv = path.levels[p - 1].copy()
    gi = int(np.flatnonzero(path.levels[p] != lv)[0])
    total = float(unit_bytes.sum())
    need = target * N_LEVELS * total - float((lv * unit_bytes).sum())
    lv[gi] += min(int(np.ceil(need / unit_bytes[gi] - 1e-9)), int(path.levels[p][gi] - lv[gi]))
    return lv


def allocate_levels(cost: np.ndarray, unit_bytes: np.ndarray, target: float,
                    max_level: int = MAX_LEVEL) -> np.ndarray:
    """Levels (n_layer, n_groups) int64 that skip at least ``target`` of all units' weight bytes
    (sum of level / N_LEVELS * unit_bytes over units >= target * n_layer * sum(unit_bytes)) at
    the least total cost, assuming the units' costs add up: the model-wide marginal-cost greedy
    (equal cost per byte skipped at the margin, a Lagrangian relaxation of the knapsack).

    cost (n_layer, n_groups, N_LEVELS) f64 the estimated loss of each unit at each level
    (cost[..., 0] = 0); unit_bytes (n_groups,) the bytes of each group's matrix. Each unit's curve is made
    non-decreasing and replaced by its lower convex hull over levels 0..max_level; the hull's
    segments are taken in order of cost per byte (ties: lower unit index, then lower level) until
    the target is met, the last one only as far as the target needs (whole levels). Every level
    stays in [0, max_level]; a target above max_level / N_LEVELS gives every unit max_level.
    Deterministic. Raises ValueError for a target outside [0, 1] or mismatched shapes."""
    L, n_g, N = cost.shape
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target sparsity must be in [0, 1], got {target}")
    if unit_bytes.shape != (n_g,) or not 0 < max_level < N:
        raise ValueError("cost (n_layer, n_groups, n_levels) and unit_bytes (n_groups,) disagree")
    segs = []  # (cost per byte, unit, from level, to level)
    for u, c in enumerate(np.maximum.accumulate(cost.reshape(L * n_g, N)[:, :max_level + 1], 1)):
        hull = [0]
        for lv in range(1, max_level + 1):
            while len(hull) >= 2 and ((c[hull[-1]] - c[hull[-2]]) * (lv - hull[-2])
                                      >= (c[lv] - c[hull[-2]]) * (hull[-1] - hull[-2])):
                hull.pop()
            hull.append(lv)
        by = float(unit_bytes[u % n_g])
        segs += [((c[b] - c[a]) / ((b - a) * by), u, a, b) for a, b in zip(hull[:-1], hull[1:])]
    segs.sort()
    level = np.zeros(L * n_g, np.int64)
    need, got = target * N_LEVELS * L * float(unit_bytes.sum()), 0.0
    for _, u, a, b in segs:  # a unit's segments come in level order (convex: rising slopes)
        if got >= need - 1e-9:
            break
        by = float(unit_bytes[u % n_g])
        step = min(b - a, int(np.ceil((need - got) / by - 1e-9)))
        level[u] = a + step
        got += step * by
    return level.reshape(L, n_g)


def blend_levels(fisher: np.ndarray, unit_bytes: np.ndarray, target: float,
                 weight: float) -> np.ndarray:
    """The shrunken Fisher allocation: each unit's level moved from the uniform level
    u = target * N_LEVELS towards its Fisher level f (``allocate_levels``) by ``weight``,
    u + weight * (f - u), rounded to whole levels so that the model still skips at least
    ``target`` of all units' weight bytes. weight 1 gives ``fisher`` back, 0 the uniform
    allocation (every unit at u when u is a whole level), 0.5 the half-way allocation of docs/benchmarks.md ("Input sparsity quality
    (issue 12), session 7", a shrinkage estimator: the Fisher estimate's noise pulled towards the
    uniform prior).

    fisher (n_layer, n_groups) int the Fisher levels, skipping at least ``target`` of the bytes;
    unit_bytes (n_groups,) the bytes of each group's matrix. Returns (n_layer, n_groups) int64,
    each level between floor(min(u, f)) and ceil(max(u, f)). Rounding: every unit starts at the
    floor of its blended level, then units are raised to the ceiling in order of their fractional
    part (largest first; ties the lower unit index) until the byte total reaches the target.
    Since the blend of two allocations that meet the target meets it, the ceilings do.
    Deterministic. Raises ValueError for a weight or target outside [0, 1] or mismatched shapes.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"Fisher weight must be in [0, 1], got {weight}")
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target sparsity must be in [0, 1], got {target}")
    L, n_g = fisher.shape
    if unit_bytes.shape != (n_g,):
        raise ValueError("fisher (n_layer, n_groups) and unit_bytes (n_groups,) disagree")
    u = target * N_LEVELS
    exact = (u + weight * (fisher.astype(np.float64) - u)).ravel()  # (L * n_g,)
    level = np.floor(exact + 1e-9).astype(np.int64)
    frac = np.where(exact - level > 1e-9, exact - level, 0.0)
    by = np.tile(unit_bytes.astype(np.float64), L)
    need = target * N_LEVELS * L * float(unit_bytes.sum())
    got = float((level * by).sum())
    for j in np.argsort(-frac, kind="stable"):
        if got >= need - 1e-6 or frac[j] == 0.0:
            break
        level[j] += 1
        got += by[j]
    return level.reshape(L, n_g)


def transposed_jobs(jobs, cfg, outtype: str, scales: list[dict] | None,
                    imatrix: list[dict] | None = None, down_type: str | None = None):
    """The converter's jobs with each layer's wq/wk/wv, attn_output, ffn_gate, ffn_up and
    ffn_down replaced by the four matrices of input sparsity (same place in the file), plus the
    WINA column norms ``scales`` (per layer {group: (n_in,) f32}) when given.

    A matrix whose type (``matrix_qtype`` over its n_in inputs, then ``ib_qtype``: Q4_K as Q4_1,
    Q5_K as Q5_1, Q6_K as Q8_0) is q8_0, q4_0, q4_1, q5_0 or q5_1 and whose outputs are a
    multiple of 64 takes the input-block layout (``C.IB``, ``cpu.IBTensor``: the row-major
    quantization regrouped by input channel; decode reads a kept channel's row at the GEMV's
    int8 cost per byte); the others are stored transposed (``attn_qkv_t``, ``attn_output_t``,
    ``ffn_gate_up_t``, ``ffn_down_t``) for the f32 / int16 AXPY of rowsum_team.h. outtype
    ``auto`` (``C.OUTTYPE_AUTO``, the default for a GGUF source) takes each group's type from its
    source job: wq's for q/k/v, attn_output's, ffn_gate's for gate/up, ffn_down's. The down
    projection comes as the plan's ``ffn_down_t`` (n_ff, n_embd) or, with its ``down_rows``,
    llama.cpp's ``ffn_down`` (n_embd, n_ff), whose stored Q4_K / Q5_K blocks are then regrouped
    as they are. With ``imatrix`` (per layer {group: (n_in,) E[x_j^2]}, ``Calibration.imatrix``)
    the q4_0 / q5_0 matrices quantized here take ``quants.quantize_weighted``'s scales instead
    of round-to-nearest. ``down_type`` (``--down-type``, a name of OUTTYPES) sets the down
    projection's type whatever ``outtype`` says (``group_type``)."""
    from convert.writer import TensorJob, job_floats, matrix_qtype
    from pyinfer.ops import cpu
    from pyinfer.quants import WEIGHTED_TYPES, quantize, quantize_weighted

    by_name = {j.name: j for j in jobs}
    # the down projection as the plan gives it: llama.cpp's rows (n_embd, n_ff; the plan's
    # down_rows, which keeps a quantized source's blocks) or ffn_down_t (n_ff, n_embd)
    rows_down = C.SRC_FFN_DOWN.format(bid=0) in by_name
    drop = set()
    out = []
    n_qkv = cfg.n_embd_q + 2 * cfg.n_embd_kv
    for j in jobs:
        if j.name in drop:
            continue
        if not j.name.startswith("blk.") or not j.name.endswith(".attn_q.weight"):
            out.append(j)
            continue
        i = int(j.name.split(".")[1])
        name = {key: tmpl.format(bid=i) for key, tmpl in (
            ("q", C.ATTN_Q), ("k", C.ATTN_K), ("v", C.ATTN_V), ("o", C.ATTN_OUT),
            ("g", C.FFN_GATE), ("u", C.FFN_UP),
            ("d", C.SRC_FFN_DOWN if rows_down else C.FFN_DOWN_T))}
        src = {key: by_name[n] for key, n in name.items()}
        drop.update(name.values())

        # each group's matrix W (n_out, n_in), row-major, f32
        def qkv(s=src):
            return np.concatenate([job_floats(s["q"]), job_floats(s["k"]), job_floats(s["v"])])

        def o(s=src):
            return job_floats(s["o"])

        def gu(s=src):
            return np.concatenate([job_floats(s["g"]), job_floats(s["u"])])

        def down(s=src):  # (n_embd, n_ff), from either layout
            w = job_floats(s["d"])
            return w if rows_down else np.ascontiguousarray(w.T)

        for g, load, n_out, n_in, t_name, members in (
                ("attn_qkv", qkv, n_qkv, cfg.n_embd, C.ATTN_QKV_T, "qkv"),
                ("attn_output", o, cfg.n_embd, cfg.n_embd_q, C.ATTN_OUT_T, "o"),
                ("ffn_gate_up", gu, 2 * cfg.n_ff, cfg.n_embd, C.FFN_GATE_UP_T, "gu"),
                ("ffn_down", down, cfg.n_embd, cfg.n_ff, C.FFN_DOWN_T, "d")):
            ot = group_type(g, src[members[0]].qtype, outtype, down_type)
            mt = matrix_qtype(n_in, ot)
            qt = ib_qtype(mt)
            if cpu.ib_supported(qt, n_out, n_in):
                if mt in REGROUPED:
                    def rows(members=members, s=src, mt=mt):  # Q4_K's / Q5_K's numbers, regrouped
                        return _regrouped_k([s[m] for m in members], mt)
                elif all(src[m].raw and src[m].qtype == qt for m in members) and (
                        g != "ffn_down" or rows_down):
                    # a source already of this type (e.g. a q4_0 GGUF under auto) keeps its
                    # blocks as stored, regrouped: round-to-nearest would not give back a block
                    # whose scale is not m / -8 (llama.cpp's importance-matrix files, pyinfer's
                    # weighted scales): 15% of a weighted q4_0 file's blocks, +5% perplexity
                    def rows(s=src, members=members):
                        return np.concatenate([np.asarray(s[m].load()).view(np.uint8).reshape(
                            s[m].shape[0], -1) for m in members])
                else:
                    im = (imatrix[i][g] if imatrix is not None and qt in WEIGHTED_TYPES
                          else None)

                    def rows(load=load, qt=qt, n_out=n_out, im=im):
                        w = np.ascontiguousarray(load(), np.float32)
                        q = quantize(w, qt) if im is None else quantize_weighted(w, qt, im)
                        return q.view(np.uint8).reshape(n_out, -1)

                def ib(rows=rows, qt=qt, n_out=n_out, n_in=n_in):
                    return cpu.ib_padded_from_rows(rows(), qt, n_out, n_in)
                # (zero outputs appended where the value rows would alias: cpu.ib_pad_outs)
                n_lay = n_out + cpu.ib_pad_outs(qt, n_out)
                out.append(TensorJob(C.IB[g].format(bid=i), (n_in // 32, 32 * n_lay), qt, ib,
                                     raw=True))
            elif g == "ffn_down" and not rows_down:
                out.append(src["d"])
            else:  # transposed (from row-layout down rows too: ffn_down_t, as the plan makes it)
                out.append(TensorJob(t_name.format(bid=i), (n_in, n_out),
                                     matrix_qtype(n_out, ot),
                                     lambda load=load: np.ascontiguousarray(load().T)))

        if scales is not None:
            for g in C.IN_GROUPS:
                a = scales[i][g]
                out.append(TensorJob(C.IN_SCALE[g].format(bid=i), a.shape, C.QT.F32,
                                     lambda a=a: a))
    return out


# Types without an input-block layout whose matrices take one of another type in sparse mode
# input: Q4_K regrouped as Q4_1 and Q5_K as Q5_1 (the same 4- and 5-bit numbers,
# pyinfer.quants.q4_k_to_q4_1 / q5_k_to_q5_1; 20 bytes per 32 values against 18, 24 against 22),
# Q6_K requantized to Q8_0 (8.5 bits a value against 6.56: at 25% of the inputs skipped about
# what the source reads). llama.cpp's Q4_K_M and Q5_K_M files mix them with Q6_K (attn_v and
# ffn_down of some layers). A group takes the type of its first matrix (wq for q/k/v, ffn_gate
# for gate/up), the others requantized to it, as for every type.
IB_FROM = {C.QT.Q4_K: C.QT.Q4_1, C.QT.Q5_K: C.QT.Q5_1, C.QT.Q6_K: C.QT.Q8_0}
#: the K-quants whose blocks are regrouped (not requantized) into their IB_FROM type
REGROUPED = (C.QT.Q4_K, C.QT.Q5_K)


def ib_qtype(qt):
    """The type a group's matrix of type ``qt`` is stored in by ``transposed_jobs`` (IB_FROM)."""
    return IB_FROM.get(qt, qt)


def _regrouped_k(jobs, kt) -> np.ndarray:
    """The jobs' matrices, rows stacked, as Q4_1 (``kt`` Q4_K) or Q5_1 (Q5_K) rows (uint8 (rows,
    bytes)) holding their K-quant numbers (``pyinfer.quants.q4_k_to_q4_1`` / ``q5_k_to_q5_1``):
    a job the plan copies from a ``kt`` source gives its own blocks, another its floats quantized
    to ``kt``."""
    from convert.writer import job_floats
    from pyinfer.quants import q4_k_to_q4_1, q5_k_to_q5_1, quantize

    regroup = q4_k_to_q4_1 if kt == C.QT.Q4_K else q5_k_to_q5_1
    return regroup(np.concatenate([
        np.asarray(j.load(), np.uint8).reshape(j.shape[0], -1) if j.raw and j.qtype == kt
        else quantize(job_floats(j), kt) for j in jobs]))


def group_qtypes(weights, cfg, outtype: str, down_type: str | None = None) -> list:
    """Per layer and group (``C.IN_GROUPS`` order) the type ``transposed_jobs`` gives the group's
    matrix, from the staging file's dense ``weights`` (wq stands for q/k/v, ffn_gate for gate/up,
    as there) and the conversion's ``outtype`` and ``--down-type`` ``down_type`` (None: as
    outtype): a list of n_layer lists of four ``QT``."""
    from convert.writer import matrix_qtype

    sizes = in_sizes(cfg)
    out = []
    for lw in weights.layers:
        src = (lw.wq, lw.wo, lw.ffn_gate, lw.ffn_down_t)
        out.append([ib_qtype(matrix_qtype(sizes[g][0], group_type(g, s.qtype, outtype, down_type)))
                    for g, s in zip(C.IN_GROUPS, src)])
    return out


def group_type(group: str, source_qtype, outtype: str, down_type: str | None):
    """The type (a ``QT``, or a name of OUTTYPES for ``matrix_qtype``) a group's matrix is asked
    for: ``down_type`` for ffn_down where given, else ``outtype``, or under ``auto`` the source
    job's own ``source_qtype``."""
    if group == "ffn_down" and down_type is not None:
        return down_type
    return source_qtype if outtype == C.OUTTYPE_AUTO else outtype


def input_mode_pays(weights, cfg, outtype: str, down_type: str | None = None) -> bool:
    """True where sparse mode input makes this model faster on the CPU than mode glu, in decode
    and prefill alike: every projection matrix takes the input-block layout (q8_0 / q4_0 / q4_1 /
    q5_0 / q5_1, outputs a multiple of 64: ``cpu.ib_supported``) or is f16 (the transposed f16
    AXPY). Measured on SmolLM2 at 25%, 2 threads (docs/benchmarks.md, sessions 17-18): q8_0 decode 1.32x /
    prefill 1.26x its dense file against glu's 0.94x / 0.69x; f16 1.05x / 1.96x against 1.00x /
    1.14x; q4_1 (input-block since session 18) 1.42x / 1.02x against 0.85x / 0.63x; q4_k as
    the transposed AXPY 0.77x / 0.55x against 0.83x / 0.69x, so Q4_K and Q6_K now take the
    input-block layout too (``ib_qtype``; session 23, a Llama-3.2-1B shape: decode 1.0-1.1x the
    Q4_K file, prefill 1.19x). Q5_0 / Q5_1 (and Q5_K regrouped as Q5_1) since session 25:
    decode 1.08-1.26x / 1.30-1.38x / 1.18-1.29x the dense file, prefill 1.19x / 1.40x, where glu
    reads every gate and up row and stays under 1x. For the other types (f32, bf16) neither mode
    pays, and glu, which the GPU engine needs, stays the default. The offline stage's default mode
    hangs on it."""
    sizes = in_sizes(cfg)
    return all(qt == C.QT.F16 or cpu.ib_supported(qt, sizes[g][1], sizes[g][0])
               for types in group_qtypes(weights, cfg, outtype, down_type)
               for g, qt in zip(C.IN_GROUPS, types))


def lm_head_source(jobs):
    """The converter's job of the lm head's matrix: ``output.weight``, or ``token_embd.weight``
    where the embeddings are tied."""
    by_name = {j.name: j for j in jobs}
    return by_name.get(C.OUTPUT) or by_name[C.TOKEN_EMBD]


def mean_squares(x: np.ndarray) -> np.ndarray:
    """(n_tok, n) f32 -> (n,) f64 E[x_j^2] over the tokens: the importance matrix of one input
    (``quants.quantize_weighted``)."""
    return np.einsum("ij,ij->j", x, x, dtype=np.float64) / len(x)


def _weighable(job) -> bool:
    """True where the converter quantizes ``job`` to q4_0 / q5_0 from floats (a job copied as
    stored keeps its blocks)."""
    from pyinfer.quants import WEIGHTED_TYPES

    return not job.raw and job.qtype in WEIGHTED_TYPES


def _weighted_job(job, imatrix: np.ndarray):
    """``job`` as encoded bytes with ``quants.quantize_weighted``'s scales, the search run once
    however often the job is loaded (the lm head's input-block copy loads its source again)."""
    from convert.writer import TensorJob
    from pyinfer.quants import quantize_weighted

    done = []

    def load():
        if not done:
            done.append(quantize_weighted(np.ascontiguousarray(job.load(), np.float32), job.qtype,
                                          imatrix))
        return done[0]
    return TensorJob(job.name, job.shape, job.qtype, load, raw=True)


def weighted_head_jobs(jobs, head_imatrix: np.ndarray | None) -> list:
    """``jobs`` with the lm head's matrix (``lm_head_source``: ``output.weight``, or the tied
    ``token_embd.weight``) quantized by ``quants.quantize_weighted`` with the head input's mean
    squares ``head_imatrix`` (n_embd,) where the converter quantizes it to q4_0 / q5_0 from floats
    (a job copied as stored, or of another type, stays as it is). The job becomes one of encoded
    bytes, so the input-block copy of the head (``lm_head_jobs``) and the two-stage head's exact
    rows hold the same numbers. A tied matrix serves the embedding lookup with those numbers too
    (SmolLM2 q4_0: 2% lower perplexity in all, docs/benchmarks.md, session 30)."""
    src = lm_head_source(jobs)
    if head_imatrix is None or not _weighable(src):
        return list(jobs)
    new = _weighted_job(src, head_imatrix)
    return [new if j is src else j for j in jobs]


#: the dense file's projections (row-major matrices, inputs along rows) and the input group
#: whose mean squares weigh each: the name after "blk.N." -> ``constants.IN_GROUPS`` entry
_DENSE_GROUPS = {t.split("}.", 1)[1]: g for t, g in (
    (C.ATTN_Q, "attn_qkv"), (C.ATTN_K, "attn_qkv"), (C.ATTN_V, "attn_qkv"),
    (C.ATTN_OUT, "attn_output"), (C.FFN_GATE, "ffn_gate_up"), (C.FFN_UP, "ffn_gate_up"),
    (C.SRC_FFN_DOWN, "ffn_down"))}


def _dense_group(name: str) -> tuple[int, str] | None:
    """(layer, input group) of a dense file's projection job name, else None."""
    part = name.split(".", 2)
    if len(part) < 3 or part[0] != "blk" or part[2] not in _DENSE_GROUPS:
        return None
    return int(part[1]), _DENSE_GROUPS[part[2]]


def takes_weighted_scales(jobs) -> bool:
    """True where ``weighted_jobs`` would change a job: a projection or the lm head quantized to
    q4_0 / q5_0 from floats (so an importance pass is worth running)."""
    head = lm_head_source(jobs)
    return any(_weighable(j) and (j is head or _dense_group(j.name) is not None) for j in jobs)


def importance(eng, seqs: list[list[int]], n_threads: int) -> tuple[list[dict], np.ndarray]:
    """The importance matrices of a dense row-layout engine ``eng`` over the calibration
    sequences: per layer {group: (n_in,) f64 E[x_j^2]} of each ``constants.IN_GROUPS`` input
    (``record_inputs``) and (n_embd,) f64 the same for the lm head's input."""
    from predictors.profile import chunks

    per_layer: list[dict] = []
    head: dict = {}
    record_inputs(eng, chunks(seqs, min(512, eng.n_ctx)), n_threads,
                  lambda i, rec, en, xs: per_layer.append(
                      {g: mean_squares(rec[g]) for g in C.IN_GROUPS}),
                  lambda h: head.__setitem__("h", mean_squares(h)))
    return per_layer, head["h"]


def weighted_jobs(jobs, imatrix: list[dict], head_imatrix: np.ndarray) -> list:
    """A dense file's ``jobs`` with each q4_0 / q5_0 projection quantized from floats (attn_q/k/v,
    attn_output, ffn_gate/up, the row-layout ffn_down) and the lm head's matrix
    (``weighted_head_jobs``) taking ``quants.quantize_weighted``'s scales, weighted by
    ``importance``'s mean squares of the matrix's input; the other jobs as they are."""
    out = []
    for j in jobs:
        key = _dense_group(j.name)
        out.append(_weighted_job(j, imatrix[key[0]][key[1]])
                   if key is not None and _weighable(j) else j)
    return weighted_head_jobs(out, head_imatrix)


def lm_head_supported(jobs, cfg) -> bool:
    """True where the lm head can take input sparsity: its matrix is q8_0, q4_0, q4_1, q5_0 or
    q5_1 (or Q4_K / Q5_K / Q6_K, stored as ``ib_qtype`` says) with n_vocab a multiple of 64 and
    n_embd of 32 (``cpu.ib_supported``)."""
    return cpu.ib_supported(ib_qtype(lm_head_source(jobs).qtype), cfg.n_vocab, cfg.n_embd)


#: head types a 4-bit copy pays against: the two-stage head's default (more than 4 bits a weight)
_WIDE_HEADS = (C.QT.F32, C.QT.F16, C.QT.BF16, C.QT.Q8_0, C.QT.Q6_K, C.QT.Q5_0, C.QT.Q5_1,
               C.QT.Q5_K)


def head_candidates(jobs, cfg, asked: int | None) -> int:
    """K of the two-stage lm head (``C.K_LM_HEAD_CANDIDATES``): ``asked`` (the converter's
    --lm-head-candidates), or where None ``offline.DEFAULT_LM_HEAD_CANDIDATES`` for a head wider
    than 4 bits (``_WIDE_HEADS``), else 0; at most n_vocab. The q4_1 copy needs n_vocab a
    multiple of 64 and n_embd of 32: otherwise 0 (PyinferError where K was asked for)."""
    from predictors.offline import DEFAULT_LM_HEAD_CANDIDATES

    fits = cpu.ib_supported(C.QT.Q4_1, cfg.n_vocab, cfg.n_embd)
    if asked is None:
        wide = lm_head_source(jobs).qtype in _WIDE_HEADS
        return min(DEFAULT_LM_HEAD_CANDIDATES, cfg.n_vocab) if wide and fits else 0
    check_candidates(cfg, asked)
    return min(asked, cfg.n_vocab)


def check_candidates(cfg, asked: int | None) -> None:
    """PyinferError where --lm-head-candidates K > 0 was asked of a model whose head cannot
    have the copy (n_vocab not a multiple of 64 or n_embd of 32): the offline stage calls it as
    soon as the model is known, before calibration."""
    from pyinfer.errors import PyinferError

    if asked and not cpu.ib_supported(C.QT.Q4_1, cfg.n_vocab, cfg.n_embd):
        raise PyinferError("--lm-head-candidates needs a vocabulary that is a multiple of 64 and "
                           f"n_embd of 32 (this one: {cfg.n_vocab}, {cfg.n_embd})")


def head_copy_type(jobs, cfg):
    """The type of the two-stage head's copy: q4_1 for a head wider than 4 bits (or a 4-bit type
    without the input-block layout), else None (the head's own numbers)."""
    src = lm_head_source(jobs).qtype
    return C.QT.Q4_1 if src in _WIDE_HEADS or not lm_head_supported(jobs, cfg) else None


def two_stage_head(meta, jobs, cfg, asked: int | None) -> tuple[list, int]:
    """A file of another sparse mode (or a dense one) with the two-stage lm head alone (no input
    sparsity: its copy reads every input): ``jobs`` plus the copy's (``lm_head_jobs``), the chunk
    and K written to ``meta``. asked: --lm-head-candidates (None: the default where the head is
    wider than 4 bits, ``head_candidates``). Returns (jobs, K); K 0 leaves both as they are."""
    k = head_candidates(jobs, cfg, asked)
    if not k:
        return list(jobs), 0
    meta.u32(C.K_LM_HEAD_CHUNK, C.LM_HEAD_CHUNK)
    meta.u32(C.K_LM_HEAD_CANDIDATES, k)
    return list(jobs) + lm_head_jobs(jobs, cfg, C.LM_HEAD_CHUNK, None, head_copy_type(jobs, cfg)), k


def lm_head_jobs(jobs, cfg, chunk: int, norms: np.ndarray | None, copy_type=None) -> list:
    """The jobs of the lm head under input sparsity: ``output_ib.weight``, the head's own q8_0 /
    q4_0 / q4_1 / q5_0 / q5_1 numbers (those of the dense head, ``lm_head_source``; a Q4_K
    head's regrouped as Q4_1, a Q5_K head's as Q5_1, a Q6_K head's requantized to Q8_0:
    ``ib_qtype``) in ``cpu.IBChunks``' layout
    (``copy_type``, e.g. Q4_1: the two-stage head's copy, requantized from the head's values),
    and for WINA its column norms ``norms`` (n_embd,) f32."""
    from convert.writer import TensorJob, job_floats
    from pyinfer.quants import quantize

    src = lm_head_source(jobs)
    qt = ib_qtype(src.qtype) if copy_type is None else copy_type
    n_out, n_in = cfg.n_vocab, cfg.n_embd

    def load():
        if src.qtype in REGROUPED and qt == ib_qtype(src.qtype):
            raw = _regrouped_k([src], src.qtype)
        elif src.raw and src.qtype == qt:
            raw = np.asarray(src.load())
        else:
            raw = quantize(np.ascontiguousarray(job_floats(src), np.float32), qt)
        return cpu.ib_chunked_from_rows(raw.view(np.uint8).reshape(n_out, -1), qt, n_out, n_in,
                                        chunk)

    out = [TensorJob(C.OUTPUT_IB, (n_in // 32, 32 * n_out), qt, load, raw=True)]
    if norms is not None:
        out.append(TensorJob(C.OUTPUT_IN_SCALE, norms.shape, C.QT.F32, lambda: norms))
    return out


def format_table(sparsity: np.ndarray, loss: np.ndarray, score: str, target: float,
                 alloc: str = "greedy") -> str:
    """The summary: per layer the calibrated sparsity of each group and the calibration loss
    (``thresholds_for``: "greedy" the block output error relative to the block output's energy,
    "uniform" the share of the projections' output energy dropped) on the calibration tokens."""
    loss_name = {"greedy": "block_err", "fisher": "fisher_kl"}.get(alloc.split()[0], "energy_lost")
    head = f"{'layer':>5} " + " ".join(f"{g:>12}" for g in C.IN_GROUPS) + f" {loss_name:>11}"
    lines = [f"offline stage summary (sparse mode input, score {score}, allocation {alloc}, "
             f"target {target:.0%} of projection weight bytes; columns: fraction of input channels "
             "skipped on the calibration tokens)", head, "-" * len(head)]
    for i in range(sparsity.shape[0]):
        lines.append(f"{i:>5} " + " ".join(f"{s:>12.1%}" for s in sparsity[i])
                     + f" {loss[i]:>11.2e}")
    lines.append("-" * len(head))
    lines.append(f"{'mean':>5} " + " ".join(f"{s:>12.1%}" for s in sparsity.mean(0))
                 + f" {loss.mean():>11.2e}")
    return "\n".join(lines)


@dataclass
class Calibration:
    """What ``calibrate`` measured: per layer the four groups' unit curves (thresholds per level),
    for ``alloc`` "greedy" the block greedy's path (None otherwise), for "fisher" the costs."""

    curves: list[list[UnitCurve]]
    paths: list[BlockPath] | None
    alloc: str = "greedy"
    cost: np.ndarray | None = None  # "fisher": (n_layer, 4, N_LEVELS) input_fisher.fisher_costs
    head: UnitCurve | None = None  # the lm head's input (``calibrate(lm_head=True)``)
    head_norms: np.ndarray | None = None  # (n_embd,) f32 the lm head's column norms
    # per layer {group: (n_in,) f64 E[x_j^2]} of each group's input over every calibration
    # token: the importance matrix of quants.quantize_weighted
    imatrix: list[dict] | None = None
    head_imatrix: np.ndarray | None = None  # (n_embd,) f64 the same for the lm head's input


def calibrate(eng, seqs: list[list[int]], wina: bool, seed: int, n_threads: int,
              max_sparsity: float = 0.9, alloc: str = "uniform",
              fisher_tokens: int | None = FISHER_TOKENS,
              lm_head: bool = False, device: str = "cpu") -> tuple[Calibration, list[dict]]:
    """(Calibration, column norms [n_layer] {group: (n_in,) f32}) from the dense row-layout
    engine ``eng`` over the calibration sequences (steps 1-3: thresholds from every calibration
    token; for ``alloc`` "greedy" the block greedy on the first EVAL_TOKENS of them, up to block
    sparsity ``max_sparsity``; for "fisher" the end-of-model costs over the first
    ``fisher_tokens`` calibration tokens (None: all), which needs PyTorch; with ``lm_head`` the
    lm head input's curve over every calibration token). ``device``: where the Fisher pass runs
    (``train.torch_device``). Deterministic for a seed (and device). Raises ValueError for an
    unknown alloc, PyinferError for "fisher" without PyTorch or with a device it cannot use."""
    if alloc not in C.IN_ALLOCS:
        raise ValueError(f"unknown allocation {alloc!r} (one of {', '.join(C.IN_ALLOCS)})")
    from predictors.profile import chunks

    cfg = eng.cfg
    norms = [column_norms(lw) for lw in eng.weights.layers]
    sizes = in_sizes(cfg)
    unit_bytes = np.array([sizes[g][0] * sizes[g][1] for g in C.IN_GROUPS], np.float64)
    curves: list[list[UnitCurve]] = []
    paths: list[BlockPath] = []
    rng = np.random.default_rng(seed)
    pieces = chunks(seqs, min(512, eng.n_ctx))
    n_eval = [0] * len(pieces)  # a prefix of each piece (attention needs the tokens before)
    left = EVAL_TOKENS
    for j, p in enumerate(pieces):
        n_eval[j] = min(len(p), left)
        left -= n_eval[j]

    imatrix: list[dict] = []

    def on_layer(i, rec, en, xs):
        c = [unit_curve(rec[g], norms[i][g], wina, rng) for g in C.IN_GROUPS]
        curves.append(c)
        imatrix.append({g: mean_squares(rec[g]) for g in C.IN_GROUPS})
        if alloc != "greedy":
            return
        blk = _Block(eng.weights.layers[i], cfg, [x[:n] for x, n in zip(xs, n_eval) if n],
                     c, norms[i], wina, n_threads, eng.weights.rope_freqs)
        paths.append(block_path(blk, unit_bytes, max_sparsity))

    head = {}

    def on_final(h):
        head["imatrix"] = mean_squares(h)
        if not lm_head:
            return
        w = dequantize(eng.weights.output)
        head["norms"] = np.sqrt(np.einsum("ij,ij->j", w, w, dtype=np.float64)).astype(np.float32)
        head["curve"] = unit_curve(h, head["norms"], wina, rng)

    record_inputs(eng, pieces, n_threads, on_layer, on_final)
    cost = None
    if alloc == "fisher":
        from predictors.input_fisher import fisher_costs, fisher_pieces

        thr = np.array([[c.thr for c in cs] for cs in curves])  # (n_layer, 4, N_LEVELS)
        cost = fisher_costs(eng, fisher_pieces(pieces, fisher_tokens), thr, seed, n_threads,
                            norms if wina else None, device)
    return Calibration(curves, paths if alloc == "greedy" else None, alloc, cost,
                       head.get("curve"), head.get("norms"), imatrix, head.get("imatrix")), norms


def thresholds_for(cal: Calibration, cfg, target: float, fisher_weight: float = 1.0):
    """(thresholds (n_layer, 4) f32, calibrated sparsity (n_layer, 4), loss (n_layer,)) at block
    sparsity ``target`` in every layer (TEAL: uniform across blocks); columns in
    ``constants.IN_GROUPS`` order. "uniform": every group at level round(target * N_LEVELS) (at
    most N_LEVELS - 1), the loss the groups' dropped share of output energy (``UnitCurve.loss``)
    averaged by weight bytes. "greedy": the path's split inside each block, the loss the block
    output error at the step reached (an upper bound for the fractional last step). "fisher": the
    model-wide ``allocate_levels`` over the estimated end-of-model costs (layers then differ: the
    target holds for the model, not for each block), moved towards the uniform level by
    ``blend_levels`` when ``fisher_weight`` < 1 (ignored by the other allocations), the loss each
    layer's summed cost."""
    sizes = in_sizes(cfg)
    unit_bytes = np.array([sizes[g][0] * sizes[g][1] for g in C.IN_GROUPS], np.float64)
    if cal.alloc == "uniform":
        lv = min(int(round(target * N_LEVELS)), N_LEVELS - 1)
        level = np.full((cfg.n_layer, 4), lv, np.int64)
        err = np.array([(np.array([c.loss[lv] for c in cs]) * unit_bytes).sum() / unit_bytes.sum()
                        for cs in cal.curves])
    elif cal.alloc == "fisher":
        level = allocate_levels(cal.cost, unit_bytes, target)
        if fisher_weight < 1.0:
            level = blend_levels(level, unit_bytes, target, fisher_weight)
        err = np.array([[cal.cost[i, gi, level[i, gi]] for gi in range(4)]
                        for i in range(cfg.n_layer)]).sum(1)
    else:
        level = np.array([levels_for(p, unit_bytes, target) for p in cal.paths])
        err = np.array([p.error[min(int(np.searchsorted(p.sparsity, target - 1e-12)),
                                    len(p.error) - 1)] for p in cal.paths])
    thr = np.array([[cal.curves[i][gi].thr[level[i, gi]] for gi in range(4)]
                    for i in range(cfg.n_layer)], np.float32)
    return thr, level / N_LEVELS, err


def input_stage(src: str, out: str, outtype: str, opts, eng, seqs, source: str, secs: dict,
                allow_unused: bool, plan, n_threads: int, down_type: str | None = None) -> dict:
    """Steps 1-4 of the module docstring over the dense staging engine ``eng`` and calibration
    sequences ``seqs``; writes ``out`` (its down projection at ``down_type``, ``--down-type``,
    where given). Returns the summary dict of ``convert_sparse``."""
    from convert.writer import VT, write_gguf
    from pyinfer.errors import PyinferError

    cfg = eng.cfg
    wina = opts.input_score == "wina"
    t0 = time.perf_counter()
    from predictors.offline import DEFAULT_LM_HEAD_SPARSITY, DEFAULT_LM_HEAD_SPARSITY_TWO_STAGE

    # the down projection's rows as the source stores them (a Q4_K / Q5_K source's blocks are
    # regrouped, not requantized: ib_qtype); transposed_jobs writes what the run reads
    meta, jobs = plan(src, outtype, allow_unused, down_rows=True, down_type=down_type)
    meta.string(C.K_FFN_LAYOUT, C.FFN_LAYOUT_NEURON_MAJOR)
    asked = opts.lm_head_sparsity
    k_cand = head_candidates(jobs, cfg, opts.lm_head_candidates) if asked != 0 else 0
    want = (asked if asked is not None else
            DEFAULT_LM_HEAD_SPARSITY_TWO_STAGE if k_cand else DEFAULT_LM_HEAD_SPARSITY)
    head = want > 0 and (k_cand > 0 or lm_head_supported(jobs, cfg))
    # the two-stage head's copy: q4_1 for a head wider than 4 bits, else the head's own numbers
    copy_t = head_copy_type(jobs, cfg) if k_cand else None
    if want > 0 and not head and opts.lm_head_sparsity is not None:
        raise PyinferError("--lm-head-sparsity needs the lm head in q8_0, q4_0, q4_1, q5_0 or "
                           "q5_1 (or a K-quant), or "
                           "--lm-head-candidates over 0, with a "
                           f"vocabulary that is a multiple of 64 (this one: {lm_head_source(jobs).qtype.name}, "
                           f"{cfg.n_vocab})")
    cal, norms = calibrate(eng, seqs, wina, opts.seed, n_threads,
                           max_sparsity=min(0.95, opts.target_sparsity + 0.05),
                           alloc=opts.input_alloc, lm_head=head, device=opts.train_device)
    secs["calibration"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weight = opts.fisher_weight if opts.input_alloc == "fisher" else 1.0
    thr, sparsity, loss = thresholds_for(cal, cfg, opts.target_sparsity, weight)
    secs["allocation"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    meta.string(C.K_SPARSE_MODE, C.SPARSE_MODE_INPUT)
    meta.string(C.K_IN_SCORE, opts.input_score)
    meta.string(C.K_IN_ALLOC, opts.input_alloc)
    if opts.input_alloc == "fisher":
        meta.f32(C.K_IN_FISHER_WEIGHT, weight)
    for gi, g in enumerate(C.IN_GROUPS):
        meta.array(C.K_IN_THRESHOLD.format(group=g), [float(t) for t in thr[:, gi]], VT.FLOAT32)
        meta.array(C.K_IN_SPARSITY.format(group=g), [float(s) for s in sparsity[:, gi]], VT.FLOAT32)
    meta.f32(C.K_TARGET_SPARSITY, opts.target_sparsity)
    meta.string(C.K_CALIB_SOURCE, source)
    meta.u32(C.K_CALIB_TOKENS, sum(len(s) for s in seqs))
    meta.u32(C.K_CALIB_SEED, opts.seed)
    jobs = transposed_jobs(jobs, cfg, outtype, norms if wina else None,
                           cal.imatrix if opts.imatrix else None, down_type)
    if opts.imatrix:
        jobs = weighted_head_jobs(jobs, cal.head_imatrix)
    head_sparsity = None
    if head:
        level = min(int(round(want * N_LEVELS)), N_LEVELS - 1)
        head_sparsity = level / N_LEVELS
        meta.f32(C.K_LM_HEAD_THRESHOLD, float(cal.head.thr[level]))
        meta.f32(C.K_LM_HEAD_SPARSITY, head_sparsity)
        meta.u32(C.K_LM_HEAD_CHUNK, C.LM_HEAD_CHUNK)
        if k_cand:
            meta.u32(C.K_LM_HEAD_CANDIDATES, k_cand)
        jobs += lm_head_jobs(jobs, cfg, C.LM_HEAD_CHUNK, cal.head_norms if wina else None,
                             copy_t)
    write_gguf(out, meta, jobs, progress=opts.progress)
    secs["final write"] = time.perf_counter() - t0
    table = format_table(sparsity, loss, opts.input_score, opts.target_sparsity,
                         opts.input_alloc if opts.input_alloc != "fisher" else
                         f"fisher (weight {weight:g})")
    table += ("\nlm head: dense" + (" (needs q8_0 / q4_0 / q4_1 / q5_0 / q5_1 and n_vocab a "
                                     "multiple of 64)"
                                    if want > 0 else "")
              if head_sparsity is None else
              f"\nlm head: {head_sparsity:.1%} of its input channels skipped on the calibration "
              "tokens (not counted in the target)"
              + (f"; a {(copy_t or lm_head_source(jobs).qtype).name.lower()} copy picks {k_cand} "
                 "candidates, the exact head computes them"
                 if k_cand else ""))
    return {"mode": C.SPARSE_MODE_INPUT, "calib_source": source, "seconds": secs,
            "sparsity": sparsity, "loss": loss, "thresholds": thr, "placement": None, "rows": [],
            "lm_head_sparsity": head_sparsity, "table": table}
