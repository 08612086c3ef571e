"""Neuron placement for a VRAM budget: the split stored in the file, or one re-solved from the
stored activation counts (PowerInfer arXiv 2312.12456 §5, neuron placement policy).

The budget the user gives is for the whole GPU. What the FFN neurons may use is

    ffn_budget = vram_budget - fixed_gpu_bytes
    fixed_gpu_bytes = every tensor that is not an FFN matrix (ffn_gate / ffn_up / ffn_down_t, or
                      ffn_down in a dense file's row layout),
                      except token_embd when the output matrix is separate (the embedding lookup
                      stays on the CPU; with tied embeddings token_embd *is* the output matrix)
                      -> attention matrices, norms, output matrix, predictors fc1/fc2,
                      where the predictors are only those of the layers whose decode runs them
                      (``pyinfer.predictor.cpu``), and a file with the two-stage lm head counts
                      its copy (``output_ib``) and its GEMV's partial sums in place of the exact
                      head, which stays on the host (``gpu_model.ib_head_bytes``)
                    + the KV cache for n_ctx tokens: 2 * n_layer * n_ctx * n_head_kv * head_dim * 4
                      bytes (f32, as pyinfer's cache holds it), n_ctx = min(4096, training context)
                      (the engine's default context)
                    + the GPU engine's own memory at that context (``runtime_gpu_bytes``: the
                      forward's buffers and the prefill reserve, as ``pyinfer.hybrid`` counts
                      them), so that the split a file stores fits when the engine runs it under
                      the same budget

and one neuron costs the bytes of its ffn_gate + ffn_up + ffn_down_t rows at the file's weight
type (a row-layout ffn_down: its bytes / n_ff, one column's share) plus its int32 id on the
device. A budget below fixed_gpu_bytes leaves every neuron on the CPU. Budgets in GiB become
bytes by ``budget_bytes`` on both sides (the file's key and the engine's comparison).

File form (written by ``pyinfer-convert``'s offline stage): ``blk.N.act_count`` (I32, n_ff) always;
with a budget also ``blk.N.gpu_idx`` (I32 0/1 mask, n_ff) for every layer and ``blk.N.gpu_bucket``
(I32 sorted hot ids) for layers that have GPU neurons. GGUF cannot hold an empty tensor, so a
layer with no GPU neurons has no ``gpu_bucket``: its absence means empty.
"""
from __future__ import annotations

import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig, read_field
from pyinfer.errors import PyinferError

KV_BYTES_PER_ELEMENT = 4  # pyinfer's KV cache is f32
DEFAULT_PLACEMENT_CTX = 4096  # the engine's default context (engine.DEFAULT_N_CTX)
NEURON_ID_BYTES = 4  # a hot neuron's int32 id on the device (hybrid.plan_hybrid counts it)


def budget_bytes(gib: float) -> int:
    """Bytes of a VRAM budget given in GiB, rounded to the nearest byte: the converter stores
    this and the engine compares its own budget with it (0.7 GiB is 751,619,277 bytes on both
    sides; the engine truncated, so a stored split was refused at the same budget)."""
    return int(round(float(gib) * 2**30))


def placement_ctx(cfg: ModelConfig, n_ctx: int | None = None) -> int:
    """The context the placement plans for: ``n_ctx``, or min(4096, training context)."""
    return min(DEFAULT_PLACEMENT_CTX, cfg.n_ctx_train) if n_ctx is None else n_ctx


def runtime_gpu_bytes(cfg: ModelConfig, n_ctx: int | None = None, rank: int = 1) -> int:
    """The GPU engine's own device memory besides weights and KV cache at context ``n_ctx``: the
    forward's buffers (``gpu_model.buffer_bytes``; ``rank``: the largest predictor's) and the
    memory kept free for prefill (``gpu_model.prefill_reserve_bytes``), what ``hybrid._Sizes``
    counts before any neuron."""
    from pyinfer.gpu_model import buffer_bytes, prefill_reserve_bytes

    ctx = placement_ctx(cfg, n_ctx)
    return buffer_bytes(cfg, ctx, max(1, int(rank))) + prefill_reserve_bytes(cfg, ctx)


def tensor_sizes(reader) -> dict[str, int]:
    """name -> bytes of every tensor in a GGUF reader."""
    return {t.name: int(t.n_bytes) for t in reader.tensors}


def _is_ffn(name: str) -> bool:
    return name.endswith((".ffn_gate.weight", ".ffn_up.weight", ".ffn_down_t.weight",
                          ".ffn_down.weight"))


def kv_cache_bytes(cfg: ModelConfig, n_ctx: int | None = None) -> int:
    return 2 * cfg.n_layer * placement_ctx(cfg, n_ctx) * cfg.n_embd_kv * KV_BYTES_PER_ELEMENT


_HEAD_TENSORS = (C.OUTPUT_NORM, C.OUTPUT, C.OUTPUT_IB, C.OUTPUT_IN_SCALE)


def fixed_gpu_bytes(sizes: dict[str, int], cfg: ModelConfig, n_ctx: int | None = None,
                    rank: int = 1, device_predictors: list | None = None,
                    head_bytes: int | None = None) -> int:
    """Bytes that go to the GPU before any FFN neuron (module docstring formula), as
    ``pyinfer.hybrid`` counts them.

    sizes: tensor name -> bytes (:func:`tensor_sizes`, plus any tensor about to be written);
    rank: the largest device predictor's rank (the engine's hidden buffer);
    device_predictors: per layer, whether the device runs its predictor (the file's
    ``pyinfer.predictor.cpu`` flags, ``gpu_model.device_predictors``): the fc1 / fc2 of the
    others stay off the device (None: every predictor goes);
    head_bytes: the device bytes of a head over ``output_ib`` (``gpu_model.ib_head_bytes``:
    the exact head's rows stay on the host), in place of the output norm and matrix."""
    fixed = 0
    for name, nbytes in sizes.items():
        if _is_ffn(name) or name.endswith((".gpu_idx", ".gpu_bucket", ".act_count")):
            continue
        if name == C.TOKEN_EMBD and (not cfg.tied_embeddings or head_bytes is not None):
            continue
        if head_bytes is not None and name in _HEAD_TENSORS:
            continue
        if device_predictors is not None and name.endswith((".fc1.weight", ".fc2.weight")) \
                and not device_predictors[int(name.split(".")[1])]:
            continue
        fixed += nbytes
    return (fixed + (head_bytes or 0) + kv_cache_bytes(cfg, n_ctx)
            + runtime_gpu_bytes(cfg, n_ctx, rank))


def ffn_bytes_per_neuron(sizes: dict[str, int], cfg: ModelConfig) -> list[int]:
    """Per layer, the device bytes of one hot neuron: its ffn_gate + ffn_up + ffn_down_t rows
    (n_ff rows each; a file in row layout has ffn_down (n_embd, n_ff) instead, whose bytes / n_ff
    are one neuron's) and its int32 id."""
    out = []
    for i in range(cfg.n_layer):
        down = C.FFN_DOWN_T.format(bid=i)
        down = down if down in sizes else C.SRC_FFN_DOWN.format(bid=i)
        b = sum(sizes[t.format(bid=i)] for t in (C.FFN_GATE, C.FFN_UP)) + sizes[down]
        out.append(b // cfg.n_ff + NEURON_ID_BYTES)
    return out


def model_gpu_bytes(sizes: dict[str, int], cfg: ModelConfig, n_ctx: int | None = None,
                    rank: int = 1, device_predictors: list | None = None,
                    head_bytes: int | None = None) -> int:
    """Everything the GPU would hold if the whole model fit: fixed bytes (``fixed_gpu_bytes``,
    the same arguments) + all FFN neurons."""
    return (fixed_gpu_bytes(sizes, cfg, n_ctx, rank, device_predictors, head_bytes)
            + sum(b * cfg.n_ff for b in ffn_bytes_per_neuron(sizes, cfg)))


def predictor_rank_of(reader, device_predictors: list | None = None) -> int:
    """The largest predictor rank of a file (rows of ``blk.N.fc1``: GGUF's shape lists them
    second) among the layers ``device_predictors`` marks (None: all), 1 without any."""
    ranks = [int(t.shape[1]) for t in reader.tensors
             if t.name.endswith(".fc1.weight") and len(t.shape) > 1
             and (device_predictors is None or device_predictors[int(t.name.split(".")[1])])]
    return max(ranks or [1])


def device_predictors_of(reader, cfg: ModelConfig) -> list[bool]:
    """Per layer, whether the GPU engine runs the layer's predictor: the file's
    ``pyinfer.predictor.cpu`` flags (absent: all), as ``gpu_model.device_predictors`` reads them."""
    flags = read_field(reader, C.K_PRED_CPU)
    return [True] * cfg.n_layer if flags is None else [bool(f) for f in flags]


def head_bytes_of(reader, cfg: ModelConfig) -> int | None:
    """``gpu_model.ib_head_bytes`` of a file's head over ``output_ib`` (None without one)."""
    from pyinfer.gpu_model import ib_head_bytes

    sizes = tensor_sizes(reader)
    chunk = read_field(reader, C.K_LM_HEAD_CHUNK)
    if C.OUTPUT_IB not in sizes or not isinstance(chunk, int):
        return None
    mode = read_field(reader, C.K_SPARSE_MODE)
    return ib_head_bytes(cfg, sizes[C.OUTPUT_IB], chunk, sizes.get(C.OUTPUT_IN_SCALE, 0),
                         mode == C.SPARSE_MODE_INPUT)


def solve(counts: list[np.ndarray], sizes: dict[str, int], cfg: ModelConfig, vram_budget_bytes: int,
          group_size: int | None = None, n_ctx: int | None = None, time_limit: float | None = None,
          rank: int = 1, device_predictors: list | None = None, head_bytes: int | None = None):
    """``predictors.solver.solve_placement`` for a whole-GPU budget (module docstring formula;
    ``rank``, ``device_predictors`` and ``head_bytes`` as ``fixed_gpu_bytes`` takes them)."""
    from predictors.solver import DEFAULT_GROUP_SIZE, DEFAULT_TIME_LIMIT_S, solve_placement

    budget = max(0, int(vram_budget_bytes) - fixed_gpu_bytes(sizes, cfg, n_ctx, rank,
                                                             device_predictors, head_bytes))
    p = solve_placement(counts, ffn_bytes_per_neuron(sizes, cfg), budget,
                        group_size=group_size or DEFAULT_GROUP_SIZE,
                        time_limit=DEFAULT_TIME_LIMIT_S if time_limit is None else time_limit)
    p.budget_bytes = int(vram_budget_bytes)
    return p


def stored_counts(reader, cfg: ModelConfig) -> list[np.ndarray] | None:
    """Per-layer activation counts (int64 (n_ff,)) from ``blk.N.act_count``, or None if absent."""
    by_name = {t.name: t for t in reader.tensors}
    counts = []
    for i in range(cfg.n_layer):
        t = by_name.get(C.ACT_COUNT.format(bid=i))
        if t is None:
            return None
        a = np.asarray(t.data).reshape(-1).astype(np.int64)
        if a.size != cfg.n_ff:
            raise PyinferError(f"{C.ACT_COUNT.format(bid=i)} has {a.size} entries, expected {cfg.n_ff}")
        counts.append(a)
    return counts


def stored_placement(reader, cfg: ModelConfig):
    """The split the file was converted with (``Placement``), or None when it has none."""
    from predictors.solver import Placement

    budget = read_field(reader, C.K_VRAM_BUDGET)
    if budget is None:
        return None
    by_name = {t.name: t for t in reader.tensors}
    idx, buckets = [], []
    for i in range(cfg.n_layer):
        t = by_name.get(C.GPU_IDX.format(bid=i))
        if t is None:
            raise PyinferError(f"{C.GPU_IDX.format(bid=i)} is missing although the file has a GPU split")
        mask = np.asarray(t.data).reshape(-1).astype(np.int32)
        if mask.size != cfg.n_ff:
            raise PyinferError(f"{C.GPU_IDX.format(bid=i)} has {mask.size} entries, expected "
                               f"{cfg.n_ff} (a damaged file)")
        b = by_name.get(C.GPU_BUCKET.format(bid=i))
        bucket = (np.asarray(b.data).reshape(-1).astype(np.int32) if b is not None
                  else np.zeros(0, np.int32))  # absent = no GPU neurons in this layer
        if not np.array_equal(np.flatnonzero(mask).astype(np.int32), bucket):
            raise PyinferError(f"layer {i}: gpu_idx and gpu_bucket disagree")
        idx.append(mask)
        buckets.append(bucket)
    sizes = tensor_sizes(reader)
    bpn = ffn_bytes_per_neuron(sizes, cfg)
    used = sum(int(b.size) * bpn[i] for i, b in enumerate(buckets))
    counts = stored_counts(reader, cfg)
    obj = float(sum(c[b].sum() for c, b in zip(counts, buckets))) if counts else 0.0
    return Placement(idx, buckets, used, obj, "stored", 0.0, int(budget))


def placement_from_gguf(reader, cfg: ModelConfig, vram_budget_bytes: int | None = None,
                        n_ctx: int | None = None):
    """The neuron split for a GPU engine.

    vram_budget_bytes None: the split stored in the file (None if it has none). A budget equal to
    the stored one also returns the stored split; any other budget re-solves from the stored
    ``act_count`` tensors (well under a second for small models; see tests/test_offline.py).
    Returns ``predictors.solver.Placement`` or None. Raises PyinferError when a re-solve is asked
    of a file without activation counts (convert it without --dense) or for a budget <= 0.
    """
    if vram_budget_bytes is None:
        return stored_placement(reader, cfg)
    if vram_budget_bytes <= 0:
        raise PyinferError("the VRAM budget must be > 0")
    stored = read_field(reader, C.K_VRAM_BUDGET)
    if stored is not None and int(stored) == int(vram_budget_bytes) and n_ctx is None:
        return stored_placement(reader, cfg)
    counts = stored_counts(reader, cfg)
    if counts is None:
        raise PyinferError("this file has no activation counts (blk.N.act_count); "
                           "convert it with the offline stage (pyinfer-convert without --dense)")
    group = read_field(reader, C.K_GROUP_SIZE)
    sizes = tensor_sizes(reader)
    preds = device_predictors_of(reader, cfg)
    return solve(counts, sizes, cfg, int(vram_budget_bytes),
                 group_size=int(group) if group is not None else None, n_ctx=n_ctx,
                 rank=predictor_rank_of(reader, preds), device_predictors=preds,
                 head_bytes=head_bytes_of(reader, cfg))
