"""Neuron placement under a VRAM budget: which FFN neurons of which layer live on the GPU.

PowerInfer (arXiv 2312.12456, §5 "neuron placement policy") places the neurons with the highest
*impact* -- their activation count over a calibration set -- on the GPU, subject to the GPU memory
left for FFN weights, and pays a synchronisation cost for every layer that is split between GPU and
CPU. Upstream's solver is a cvxopt ILP that, as written, reduces to a global top-k by activation
count; here the problem is solved as a small mixed-integer program with HiGHS (highspy), with a
greedy solver beside it, and the better of the two feasible answers is kept.

Model (one row of the constraint matrix per line):

    neurons of layer l sorted hot-first (stable: ties by neuron id), cut into consecutive groups
    of ``group_size`` (the last group of a layer may be smaller);
    x[l,g] in {0,1}   group g of layer l goes to the GPU
    y[l]   in {0,1}   layer l is split (has any GPU neurons)

    maximise   sum_{l,g} c[l,g] x[l,g]                c = summed activation counts of the group
    s.t.       sum_{l,g} bytes[l,g] x[l,g] <= budget   bytes = size[l,g] * bytes_per_neuron[l]
               sum_g size[l,g] x[l,g] >= m[l] y[l]     m = min(min_neurons_per_layer, n_ff[l])
               x[l,g] <= y[l]
               x[l,g+1] <= x[l,g]                      full-size groups only (symmetry breaking)
               y[l] <= x[l,k[l]-1]                     k[l] = full groups a used layer must hold

The last two rows cut off no optimum (equal-size groups are hot-first, so a colder group never
beats a hotter one) and make the LP relaxation tight enough that HiGHS closes the gap at the root.
The per-layer minimum models the sync cost of a split layer: a layer either stays on the CPU or
gets enough neurons to be worth the split. Layers are always indexed by their number (list
position), never by a name sorted as text (upstream pairs ``layer10`` before ``layer2``).

Everything here is a pure function of numpy arrays: the profiler produces ``counts`` and the
converter writes ``gpu_idx`` / ``gpu_bucket`` into the GGUF; the loader may re-solve for another
budget from the stored ``act_count`` tensors (about 0.1-0.3 s for a 7B shape, see
``tests/test_solver.py``).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pyinfer.errors import PyinferError

DEFAULT_GROUP_SIZE = 64
DEFAULT_MIN_NEURONS_PER_LAYER = 256
DEFAULT_TIME_LIMIT_S = 1.0  # load-time re-solve budget; the greedy incumbent bounds the loss
DEFAULT_MIP_REL_GAP = 1e-3  # FACTS.md: with presolve off, HiGHS solves 10k-var knapsacks in ~0.1 s


@dataclass
class Placement:
    """A GPU/CPU split of every layer's FFN neurons.

    Attributes:
        gpu_idx: per layer, np.int32 (n_ff,) 0/1 mask, 1 = neuron on the GPU (tensor ``blk.N.gpu_idx``).
        gpu_bucket: per layer, np.int32 (n_hot,) sorted ids of the GPU neurons (``blk.N.gpu_bucket``).
        bytes_used: bytes of FFN weights placed on the GPU (<= the budget).
        objective: summed activation counts of the GPU neurons (the paper's impact metric).
        solver: "ilp" or "greedy", whichever gave ``objective``.
        solve_seconds: wall time of the whole solve (grouping, greedy, ILP), seconds.
        budget_bytes: the budget this placement was solved for.
    """

    gpu_idx: list[np.ndarray]
    gpu_bucket: list[np.ndarray]
    bytes_used: int
    objective: float
    solver: str
    solve_seconds: float
    budget_bytes: int = 0
    layers_split: int = field(init=False)

    def __post_init__(self) -> None:
        self.layers_split = sum(int(b.size > 0) for b in self.gpu_bucket)

    @property
    def n_gpu_neurons(self) -> int:
        return sum(int(b.size) for b in self.gpu_bucket)


@dataclass
class _Groups:
    """Flat arrays over all groups of all layers, in layer order then hot-first order."""

    layer: np.ndarray  # (n_groups,) int64 layer of each group
    size: np.ndarray  # (n_groups,) int64 neurons in the group
    nbytes: np.ndarray  # (n_groups,) int64 bytes of the group
    value: np.ndarray  # (n_groups,) float64 summed activation counts
    start: np.ndarray  # (n_layers + 1,) int64: groups of layer l are start[l]:start[l+1]
    order: list[np.ndarray]  # per layer, neuron ids sorted hot-first (int64)
    min_neurons: np.ndarray  # (n_layers,) int64 effective per-layer minimum


def _check_inputs(counts, bytes_per_neuron, budget_bytes, group_size, min_neurons_per_layer):
    if counts is None or len(counts) == 0:
        raise PyinferError("placement: no layers (empty activation counts)")
    arrays = []
    for i, c in enumerate(counts):
        a = np.asarray(c)
        if a.ndim != 1 or a.size == 0:
            raise PyinferError(f"placement: layer {i} counts must be a non-empty 1-D array, got shape {a.shape}")
        a = a.astype(np.float64)
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise PyinferError(f"placement: layer {i} counts must be finite and >= 0")
        arrays.append(a)
    if np.ndim(bytes_per_neuron) == 0:
        bpn = [int(bytes_per_neuron)] * len(arrays)
    else:
        bpn = [int(b) for b in bytes_per_neuron]
        if len(bpn) != len(arrays):
            raise PyinferError(
                f"placement: {len(bpn)} bytes_per_neuron values for {len(arrays)} layers of counts")
    if any(b <= 0 for b in bpn):
        raise PyinferError("placement: bytes_per_neuron must be > 0")
    if int(budget_bytes) != budget_bytes or budget_bytes < 0:
        raise PyinferError(f"placement: budget must be a whole number of bytes >= 0, got {budget_bytes}")
    if int(group_size) != group_size or group_size < 1:
        raise PyinferError(f"placement: group_size must be an integer >= 1, got {group_size}")
    if int(min_neurons_per_layer) != min_neurons_per_layer or min_neurons_per_layer < 0:
        raise PyinferError(f"placement: min_neurons_per_layer must be an integer >= 0, got {min_neurons_per_layer}")
    return arrays, bpn


def _make_groups(counts: list[np.ndarray], bpn: list[int], group_size: int, min_neurons: int) -> _Groups:
    layer, size, nbytes, value, order = [], [], [], [], []
    start = [0]
    for l, c in enumerate(counts):
        o = np.argsort(-c, kind="stable")  # hot-first; ties by neuron id, so deterministic
        n = c.size
        n_g = -(-n // group_size)
        sz = np.full(n_g, group_size, dtype=np.int64)
        sz[-1] = n - group_size * (n_g - 1)
        # summed counts per group: reduceat over the sorted counts at group starts
        val = np.add.reduceat(c[o], np.arange(0, n, group_size))
        layer.append(np.full(n_g, l, dtype=np.int64))
        size.append(sz)
        nbytes.append(sz * bpn[l])
        value.append(val)
        order.append(o)
        start.append(start[-1] + n_g)
    mins = np.array([min(min_neurons, c.size) for c in counts], dtype=np.int64)
    return _Groups(np.concatenate(layer), np.concatenate(size), np.concatenate(nbytes),
                   np.concatenate(value), np.array(start, dtype=np.int64), order, mins)


def _greedy(gr: _Groups, budget: int) -> np.ndarray:
    """Density-ordered greedy knapsack; returns a (n_groups,) bool selection within the budget.

    Items are, per layer, an *opening bundle* (the hottest groups that reach the layer minimum,
    taken together or not at all) and then each further group on its own. Within a layer the groups
    are hot-first, so the bundle is at least as dense as any later group of its layer; a group is
    only considered once its layer's bundle was taken. Items that do not fit are skipped and smaller
    ones still tried (the usual greedy knapsack fill).
    """
    n_layers = gr.start.size - 1
    items_first, items_last, items_val, items_bytes, items_layer, items_bundle = [], [], [], [], [], []
    for l in range(n_layers):
        s, e = int(gr.start[l]), int(gr.start[l + 1])
        cum = np.cumsum(gr.size[s:e])
        k = int(np.searchsorted(cum, gr.min_neurons[l])) + 1 if gr.min_neurons[l] > 0 else 1
        k = min(k, e - s)
        items_first.append(s); items_last.append(s + k)
        items_val.append(gr.value[s:s + k].sum()); items_bytes.append(gr.nbytes[s:s + k].sum())
        items_layer.append(l); items_bundle.append(True)
        for g in range(s + k, e):
            items_first.append(g); items_last.append(g + 1)
            items_val.append(gr.value[g]); items_bytes.append(gr.nbytes[g])
            items_layer.append(l); items_bundle.append(False)
    val = np.array(items_val, dtype=np.float64)
    nb = np.array(items_bytes, dtype=np.int64)
    # density descending; bundles before plain groups on ties, then by position (layer, group)
    idx = np.lexsort((np.arange(val.size), ~np.array(items_bundle), -(val / nb)))
    chosen = np.zeros(gr.size.size, dtype=bool)
    opened = np.zeros(n_layers, dtype=bool)
    left = int(budget)
    for i in idx:
        if val[i] <= 0:
            break  # zero-count groups add nothing; keep them on the CPU
        if nb[i] > left or (not items_bundle[i] and not opened[items_layer[i]]):
            continue
        left -= int(nb[i])
        chosen[items_first[i]:items_last[i]] = True
        opened[items_layer[i]] = True
    return chosen


def _ilp(gr: _Groups, budget: int, start: np.ndarray, time_limit: float, mip_rel_gap: float,
         threads: int | None) -> np.ndarray | None:
    """Solve the MIP in the module docstring with HiGHS; None when it returns no usable solution."""
    import highspy

    n_g = gr.size.size
    n_l = gr.start.size - 1
    n_col = n_g + n_l  # x[0..n_g) then y[0..n_l)
    # Symmetry-breaking rows x[l,g+1] <= x[l,g] between consecutive *full-size* groups of a layer:
    # they have equal bytes and value[g] >= value[g+1] (hot-first), so swapping g+1 for g never
    # loses, and the optimum survives. The (possibly smaller) last group stays free. Without them
    # HiGHS spends seconds proving optimality when the per-layer minimum binds.
    full = gr.size == gr.size.max()
    nxt = np.arange(n_g - 1)
    pair = nxt[(gr.layer[nxt] == gr.layer[nxt + 1]) & full[nxt] & full[nxt + 1]]
    n_ord = pair.size
    # With that ordering, a used layer holds a prefix of its full groups (plus perhaps its free
    # last group), so it must hold the first k[l] groups: add y[l] <= x[l, k[l]-1]. This tightens
    # the LP relaxation when the minimum binds (7B shape, min 2048: 1.7 s -> 0.25 s).
    pre_g, pre_l = [], []
    for l in range(n_l):
        s, e = int(gr.start[l]), int(gr.start[l + 1])
        chain = int(full[s:e].sum()) if full[s] else 0  # full groups come first within a layer
        free = int(gr.size[s + chain:e].sum())  # neurons outside the ordered chain
        k = -(-max(0, int(gr.min_neurons[l]) - free) // int(gr.size.max()))
        if 1 <= k <= chain:
            pre_g.append(s + k - 1)
            pre_l.append(l)
    n_pre = len(pre_g)
    n_row = 1 + n_l + n_g + n_ord + n_pre  # budget, layer minimum, x <= y links, ordering, prefix
    # Budget row in units of the smallest group's bytes, so coefficients are O(1) rather than 1e6.
    unit = float(gr.nbytes.min())
    # Column-wise matrix. x column: (budget row, min row of its layer, its link row).
    # y column of layer l: (min row l, link rows of its groups).
    g_ids = np.arange(n_g)
    x_index = np.stack([np.zeros(n_g, dtype=np.int64), 1 + gr.layer, 1 + n_l + g_ids], axis=1).ravel()
    x_value = np.stack([gr.nbytes / unit, gr.size.astype(np.float64), np.ones(n_g)], axis=1).ravel()
    x_count = np.full(n_g, 3, dtype=np.int64)
    if n_ord or n_pre:
        # ordering row r (pair g, g+1): +1 on x[g+1], -1 on x[g]. Append entries then sort by column.
        rows = 1 + n_l + n_g + np.arange(n_ord)
        pre_rows = 1 + n_l + n_g + n_ord + np.arange(n_pre)
        col = np.concatenate([np.repeat(g_ids, 3), pair + 1, pair, np.array(pre_g, dtype=np.int64)])
        idx = np.concatenate([x_index, rows, rows, pre_rows])
        val = np.concatenate([x_value, np.ones(n_ord), -np.ones(n_ord), -np.ones(n_pre)])
        perm = np.argsort(col, kind="stable")
        x_index, x_value = idx[perm], val[perm]
        x_count = np.bincount(col, minlength=n_g)
    x_start = np.concatenate([[0], np.cumsum(x_count)[:-1]])
    per_layer = np.diff(gr.start)
    y_index, y_value, y_start = [], [], [int(x_count.sum())]
    pre_row_of = {l: 1 + n_l + n_g + n_ord + i for i, l in enumerate(pre_l)}
    for l in range(n_l):
        extra = [pre_row_of[l]] if l in pre_row_of else []
        y_index.append(np.concatenate([[1 + l], 1 + n_l + np.arange(gr.start[l], gr.start[l + 1]), extra]))
        y_value.append(np.concatenate([[-float(gr.min_neurons[l])], -np.ones(per_layer[l]), np.ones(len(extra))]))
        y_start.append(y_start[-1] + 1 + int(per_layer[l]) + len(extra))
    lp = highspy.HighsLp()
    lp.num_col_ = n_col
    lp.num_row_ = n_row
    lp.sense_ = highspy.ObjSense.kMaximize
    # Objective scaled to max 1 for the solver's tolerances; the true objective is recomputed.
    vmax = float(gr.value.max()) or 1.0
    lp.col_cost_ = np.concatenate([gr.value / vmax, np.zeros(n_l)])
    lp.col_lower_ = np.zeros(n_col)
    lp.col_upper_ = np.ones(n_col)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.concatenate([[-inf], np.zeros(n_l), np.full(n_g + n_ord + n_pre, -inf)])
    lp.row_upper_ = np.concatenate([[budget / unit], np.full(n_l, inf), np.zeros(n_g + n_ord + n_pre)])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = n_col
    lp.a_matrix_.num_row_ = n_row
    lp.a_matrix_.start_ = np.concatenate([x_start, y_start]).astype(np.int32)
    lp.a_matrix_.index_ = np.concatenate([x_index] + y_index).astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate([x_value] + y_value)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_col

    h = _quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    # FACTS.md: HiGHS presolve does nothing useful on this knapsack and ignores the time limit.
    h.setOptionValue("presolve", "off")
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("time_limit", float(time_limit))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    h.passModel(lp)
    # Warm start from the greedy answer: HiGHS then always holds a feasible incumbent.
    y0 = np.zeros(n_l)
    y0[np.unique(gr.layer[start])] = 1.0
    h.setSolution(n_col, np.arange(n_col, dtype=np.int32), np.concatenate([start.astype(np.float64), y0]))
    h.run()
    status = h.getModelStatus()
    ok = {highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit,
          highspy.HighsModelStatus.kInterrupt, highspy.HighsModelStatus.kSolutionLimit}
    if status not in ok:
        return None
    sol = np.asarray(h.getSolution().col_value, dtype=np.float64)
    if sol.size != n_col:
        return None
    return sol[:n_g] > 0.5


def _feasible(gr: _Groups, chosen: np.ndarray, budget: int) -> bool:
    """Exact integer check of the budget and the per-layer minimum (solver tolerances aside)."""
    if int(gr.nbytes[chosen].sum()) > budget:
        return False
    per_layer = np.bincount(gr.layer[chosen], weights=gr.size[chosen], minlength=gr.start.size - 1)
    used = per_layer > 0
    return bool(np.all(per_layer[used] >= gr.min_neurons[used]))


def solve_placement(
    counts: Sequence[np.ndarray],
    bytes_per_neuron: int | Sequence[int],
    budget_bytes: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    min_neurons_per_layer: int = DEFAULT_MIN_NEURONS_PER_LAYER,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    mip_rel_gap: float = DEFAULT_MIP_REL_GAP,
    use_ilp: bool = True,
    threads: int | None = None,
) -> Placement:
    """Choose the GPU neurons of every layer that maximise summed activation counts within a budget.

    PowerInfer §5 (neuron placement policy): impact of a neuron = its activation count on the
    calibration set; maximise total impact on the GPU subject to GPU memory, with a per-layer
    minimum because each split layer pays a CPU-GPU sync. The ILP (module docstring) is solved with
    HiGHS, presolve off, warm-started from the greedy answer; the better feasible answer of ILP
    and greedy is returned.

    Args:
        counts: one array per layer, in layer order (list index = layer number), shape (n_ff,),
            any real dtype, values >= 0 (activation counts from the profiler). Layers may differ
            in n_ff.
        bytes_per_neuron: bytes of one neuron's ffn_up + ffn_gate + ffn_down_t rows at the file's
            weight type; one int for all layers or one per layer.
        budget_bytes: bytes of VRAM for FFN neurons, after the caller subtracted the fixed
            placements (attention, predictors, norms, output, KV cache). 0 is valid and gives an
            empty placement (every layer on the CPU); < 0 is an error.
        group_size: neurons per placement unit (hot-first within a layer; last group may be
            smaller). 1 solves per neuron (slower; n_ff * n_layers binaries).
        min_neurons_per_layer: a layer with any GPU neurons gets at least this many (clamped to
            the layer's n_ff); 0 disables the constraint.
        time_limit: HiGHS wall-clock limit, seconds; on expiry the best incumbent is used.
        mip_rel_gap: HiGHS relative optimality gap (1e-3 default; 0 for an exact optimum).
        use_ilp: False skips HiGHS and returns the greedy answer.
        threads: HiGHS threads (None: its default).

    Returns:
        Placement with per-layer gpu_idx (np.int32 0/1, (n_ff,)) and gpu_bucket (np.int32 sorted ids).
        When everything fits, every neuron is placed (never-activated ones too: no layer is split);
        otherwise groups whose counts are all 0 stay on the CPU. When everything fits or nothing
        can be placed the answer is provably optimal and the ILP is skipped (solver "greedy").

    Raises:
        PyinferError: empty counts, an empty/non-1-D/negative/non-finite layer, mismatched
            bytes_per_neuron length, bytes_per_neuron <= 0, budget < 0, group_size < 1,
            min_neurons_per_layer < 0.
    """
    t0 = time.perf_counter()
    arrays, bpn = _check_inputs(counts, bytes_per_neuron, budget_bytes, group_size, min_neurons_per_layer)
    budget = int(budget_bytes)
    gr = _make_groups(arrays, bpn, int(group_size), int(min_neurons_per_layer))

    solver = "greedy"
    useful = gr.value > 0
    everything_fits = int(gr.nbytes.sum()) <= budget
    if everything_fits:
        # Whole model on the GPU: also the never-activated neurons, so no layer is split at all.
        chosen = np.ones(gr.size.size, dtype=bool)
    else:
        chosen = _greedy(gr, budget)
    # Any non-empty answer holds >= min_neurons[l] neurons of some layer l (or one group when the
    # minimum is 0), so below the cheapest such set the empty answer is optimal.
    lower = np.maximum(gr.min_neurons[gr.layer], gr.size) * np.asarray(bpn, dtype=np.int64)[gr.layer]
    nothing_fits = not chosen.any() and budget < int(lower.min())
    if use_ilp and not everything_fits and not nothing_fits and useful.any():
        ilp = _ilp(gr, budget, chosen, time_limit, mip_rel_gap, threads)
        if ilp is not None and _feasible(gr, ilp, budget) and gr.value[ilp].sum() > gr.value[chosen].sum():
            chosen, solver = ilp, "ilp"
        elif ilp is not None and _feasible(gr, ilp, budget) and gr.value[ilp].sum() == gr.value[chosen].sum():
            solver = "ilp"  # HiGHS confirmed the greedy answer (within mip_rel_gap)

    gpu_idx, gpu_bucket = [], []
    for l, c in enumerate(arrays):
        s, e = int(gr.start[l]), int(gr.start[l + 1])
        mask = np.zeros(c.size, dtype=np.int32)
        for g in np.flatnonzero(chosen[s:e]):
            mask[gr.order[l][g * group_size:(g + 1) * group_size]] = 1
        gpu_idx.append(mask)
        gpu_bucket.append(np.flatnonzero(mask).astype(np.int32))
    return Placement(
        gpu_idx=gpu_idx,
        gpu_bucket=gpu_bucket,
        bytes_used=int(gr.nbytes[chosen].sum()),
        objective=float(gr.value[chosen].sum()),
        solver=solver,
        solve_seconds=time.perf_counter() - t0,
        budget_bytes=budget,
    )


def _quiet_highs(highspy):
    """``highspy.Highs()`` with the C-level stdout (fd 1) sent to /dev/null meanwhile: the first
    one a process makes prints HiGHS's banner there, before any option can turn output off, and
    stdout carries a run's generated text (usage.md). Python's and C's buffers are flushed
    before the switch (what was printed earlier still reaches stdout) and C's again before fd 1
    comes back (the banner does not). Without an fd 1 to protect, or where the switch fails, a
    plain constructor. (The switch is process-wide: placement runs at load, before any thread
    writes an answer.)"""
    if sys.stdout is not None:
        sys.stdout.flush()
    _c_fflush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 (a daemon, pythonw): nothing to protect
        return highspy.Highs()
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        os.close(saved)
        return highspy.Highs()
    try:
        os.dup2(null, 1)
        h = highspy.Highs()
        _c_fflush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return h


def _c_fflush() -> None:
    """fflush(NULL) of the C library, where ctypes reaches it (not on Windows)."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass
