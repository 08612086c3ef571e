"""Per-layer activation predictors: train, size and threshold them (offline stage, PyTorch on CPU).

PowerInfer (arXiv 2312.12456, §5.1 "adaptive sparsity predictors", following Deja Vu) predicts,
before each FFN, which neurons will be active, with a two-layer MLP per layer. The tensor form is
fixed by the runtime kernel and by upstream's GGUF tensors ``blk.N.fc1.weight`` /
``blk.N.fc2.weight``:

    logits = fc2 @ relu(fc1 @ x)        fc1 (rank, n_embd), fc2 (n_ff, rank), no bias
    neuron j runs where logits[j] >= threshold

with x the FFN input *before* its RMSNorm (the residual stream). One scalar threshold per layer.

Input scaling. Residual-stream features have very different scales (a few "massive" dimensions).
Training sees x / s with s the per-feature RMS over the training samples; because x -> fc1 @ x is
linear and relu is applied after it, ``fc1 @ (x / s) == (fc1 / s) @ x`` exactly, so the scale is
folded into fc1's columns after training and the runtime form stays ``fc2 @ relu(fc1 @ x)``.
(Centering would need a bias, which the form does not have, so x is not centered.)

torch is an optional dependency (``pip install pyinfer[train]``) and is imported inside functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pyinfer.errors import PyinferError

#: Ranks for a 4096-wide model, from the sparsest/most skewed layers to the densest/flattest
#: (PowerInfer §5.1 sizes predictors by sparsity and skewness); scaled by n_embd / 4096.
RANK_TABLE_4096 = (128, 256, 512, 1024, 2048)
#: Upper edges of the "difficulty" score for each entry of RANK_TABLE_4096 (last one open).
RANK_SCORE_EDGES = (0.02, 0.05, 0.10, 0.20)
RANK_MULTIPLE = 32  # fc2 rows have ``rank`` elements: keep them whole q8_0/q4_0 blocks
MIN_RANK = 32


@dataclass
class PredictorResult:
    """A trained predictor for one layer and its held-out quality.

    Attributes:
        fc1: float32 (rank, n_embd), input scaling already folded in.
        fc2: float32 (n_ff, rank).
        threshold: logit threshold; a neuron is predicted active where logit >= threshold.
        recall: fraction of truly active (sample, neuron) pairs predicted active, a two-fold
            cross-fitted estimate on the held-out samples (:func:`cross_fit_quality`): each half
            is scored with a threshold tuned on the other half, so it is not the target by
            construction and estimates the recall on new tokens from the calibration text.
        precision: fraction of predicted-active pairs that are truly active, cross-fitted alike.
        predicted_sparsity: fraction of (sample, neuron) pairs predicted inactive, cross-fitted alike.
        tuned_recall: recall of ``threshold`` on the held-out samples it was tuned on (at least
            the target, by construction).
        epochs: epochs trained (including the patience epochs after the best one).
        train_seconds: wall time of training and threshold tuning, seconds.
        holdout_idx: int64 indices (into the ``x`` given) of the held-out samples.
        best_val_loss: held-out BCE (pos-weighted, mean) of the kept weights.
    """

    fc1: np.ndarray
    fc2: np.ndarray
    threshold: float
    recall: float
    precision: float
    predicted_sparsity: float
    tuned_recall: float
    epochs: int
    train_seconds: float
    holdout_idx: np.ndarray
    best_val_loss: float

    @property
    def rank(self) -> int:
        return int(self.fc1.shape[0])


def predict_logits(fc1: np.ndarray, fc2: np.ndarray, x: np.ndarray) -> np.ndarray:
    """NumPy twin of the runtime predictor: ``relu(x @ fc1.T) @ fc2.T``.

    x: float32 (n_embd,) or (n_tok, n_embd). Returns float32 (n_ff,) or (n_tok, n_ff).
    """
    return np.maximum(x @ fc1.T, 0) @ fc2.T


def _import_torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise PyinferError("training predictors needs PyTorch: pip install torch") from e
    return torch


#: where the offline stage's PyTorch work runs (``pyinfer-convert --train-device``)
TRAIN_DEVICES = ("auto", "cpu", "cuda")


def torch_device(torch, device: str = "auto"):
    """The ``torch.device`` for the offline stage's PyTorch work (predictor training, the Fisher
    pass): "auto" is CUDA where PyTorch sees a GPU, else the CPU; "cpu" and "cuda" as named.
    Results depend on the device (float sums in another order), not on anything else.
    Raises PyinferError for "cuda" where PyTorch sees none, or a name outside TRAIN_DEVICES."""
    if device not in TRAIN_DEVICES:
        raise PyinferError(f"unknown training device {device!r} (one of {', '.join(TRAIN_DEVICES)})")
    has_cuda = bool(torch.cuda.is_available())
    if device == "cuda" and not has_cuda:
        raise PyinferError("--train-device cuda: PyTorch sees no CUDA device "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return torch.device("cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu")


def _check(x: np.ndarray, active: np.ndarray, rank: int, target_recall: float, holdout: float):
    if x.ndim != 2 or active.ndim != 2 or x.shape[0] != active.shape[0]:
        raise PyinferError(
            f"predictor: x must be (n_samples, n_embd) and active (n_samples, n_ff), got {x.shape} and {active.shape}")
    if not np.all(np.isfinite(x)):
        raise PyinferError("predictor: x has non-finite values")
    if int(rank) != rank or rank < 1:
        raise PyinferError(f"predictor: rank must be a positive integer, got {rank}")
    if not 0.0 < target_recall <= 1.0:
        raise PyinferError(f"predictor: target_recall must be in (0, 1], got {target_recall}")
    if not 0.0 < holdout < 1.0:
        raise PyinferError(f"predictor: holdout must be in (0, 1), got {holdout}")
    n_val = int(round(x.shape[0] * holdout))
    if n_val < 2 or x.shape[0] - n_val < 1:
        raise PyinferError(f"predictor: {x.shape[0]} samples are too few to hold out {holdout:.0%}")
    if not active.any():
        raise PyinferError("predictor: no neuron is ever active in the samples")


def tune_threshold(logits: np.ndarray, active: np.ndarray, target_recall: float) -> float:
    """Largest threshold whose recall over all (sample, neuron) pairs is >= target_recall.

    logits: float (n, n_ff); active: bool (n, n_ff). Recall is pooled (micro) over the layer, as
    the runtime uses one threshold per layer. Returns the k-th largest logit among the active
    pairs with k = ceil(target_recall * n_active), so ``logits >= threshold`` keeps >= k of them.
    """
    pos = np.sort(logits[active].astype(np.float64))[::-1]
    if pos.size == 0:
        return float("inf")
    k = int(np.ceil(target_recall * pos.size - 1e-9))
    k = min(max(k, 1), pos.size)
    return float(pos[k - 1])


def _quality(logits: np.ndarray, active: np.ndarray, threshold: float) -> tuple[float, float, float]:
    pred = logits >= threshold
    tp = np.count_nonzero(pred & active)
    n_pred = np.count_nonzero(pred)
    recall = tp / max(np.count_nonzero(active), 1)
    precision = tp / n_pred if n_pred else 1.0
    return float(recall), float(precision), float(1.0 - n_pred / pred.size)


def cross_fit_quality(logits: np.ndarray, active: np.ndarray, target_recall: float,
                      seed: int = 0) -> tuple[float, float, float]:
    """Recall, precision and predicted sparsity of a tuned threshold, estimated without the
    optimism of scoring it on the samples it was tuned on.

    The samples are split in two halves at random (by ``seed``); each half is scored with the
    threshold :func:`tune_threshold` picks on the other half, and the counts are pooled over both
    halves (two-fold cross-fitting). Tuning on half the samples makes the threshold a little
    noisier than the one tuned on all of them, so the estimate errs low, not high.

    logits: float (n, n_ff); active: bool (n, n_ff); n >= 2. Returns (recall, precision,
    predicted_sparsity), pooled over (sample, neuron) pairs as :func:`tune_threshold` pools.
    Raises PyinferError for fewer than 2 samples.
    """
    n = logits.shape[0]
    if n < 2:
        raise PyinferError(f"predictor: cross-fitting needs at least 2 held-out samples, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    halves = (np.sort(perm[: n // 2]), np.sort(perm[n // 2:]))
    tp = n_pred = n_pos = 0
    for fit, score in (halves, halves[::-1]):
        pred = logits[score] >= tune_threshold(logits[fit], active[fit], target_recall)
        tp += np.count_nonzero(pred & active[score])
        n_pred += np.count_nonzero(pred)
        n_pos += np.count_nonzero(active[score])
    return (float(tp / max(n_pos, 1)), float(tp / n_pred) if n_pred else 1.0,
            float(1.0 - n_pred / logits.size))


def train_predictor(
    x: np.ndarray,
    active: np.ndarray,
    rank: int,
    *,
    target_recall: float = 0.95,
    seed: int = 0,
    max_epochs: int = 60,
    batch_size: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 0.0,
    holdout: float = 0.15,
    patience: int = 6,
    max_pos_weight: float = 20.0,
    n_threads: int | None = None,
    device: str = "cpu",
) -> PredictorResult:
    """Train one layer's predictor ``logits = fc2 @ relu(fc1 @ x)`` and tune its threshold.

    Recipe (Deja Vu / PowerInfer §5.1, details ours): binary cross-entropy on the logits with a
    per-neuron ``pos_weight = clip(n_inactive / n_active, 1, max_pos_weight)`` for the imbalance,
    Adam, shuffled minibatches, inputs scaled by the per-feature RMS (folded into fc1 afterwards,
    see the module docstring). A deterministic ``holdout`` fraction of samples (by ``seed``) is kept
    out: training stops after ``patience`` epochs without a better held-out BCE and the best
    weights are kept; the threshold is then the largest one reaching ``target_recall`` on the
    held-out samples (:func:`tune_threshold`), and recall, precision and predicted sparsity are
    estimated there by two-fold cross-fitting (:func:`cross_fit_quality`), not on the samples the
    threshold was tuned on.

    Args:
        x: float32 (n_samples, n_embd), FFN inputs before the norm (profiler output).
        active: bool (n_samples, n_ff), ground-truth activity of each neuron.
        rank: hidden width of the predictor (see :func:`choose_rank`).
        target_recall: pooled recall the threshold must reach on the held-out samples.
        seed: seeds the split, the initialisation and the batch order (same seed, same result
            on the same machine and thread count).
        max_epochs, batch_size, lr, weight_decay, patience: optimiser settings.
        holdout: fraction of samples held out (0.1-0.2 recommended).
        max_pos_weight: cap on the per-neuron positive weight.
        n_threads: torch intra-op threads for the call (None: leave torch's setting).
        device: "cpu" (default) | "cuda" | "auto" (:func:`torch_device`; the offline stage passes
            ``--train-device``); the split, initialisation and batch order are drawn on the CPU
            either way, so only the float sums differ between devices.

    Returns:
        PredictorResult (fc1 float32 (rank, n_embd), fc2 float32 (n_ff, rank), threshold, ...).

    Raises:
        PyinferError: PyTorch missing; shapes that disagree; non-finite x; rank < 1;
            target_recall outside (0, 1]; too few samples for the holdout; no active neuron;
            a device PyTorch cannot use.
    """
    torch = _import_torch()
    dev = torch_device(torch, device)
    x = np.asarray(x)
    active = np.asarray(active).astype(bool, copy=False)
    _check(x, active, rank, target_recall, holdout)
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    if n_threads is not None:
        torch.set_num_threads(int(n_threads))
    try:
        return _train(torch, dev, x.astype(np.float32, copy=False), active, int(rank), target_recall,
                      seed, max_epochs, batch_size, lr, weight_decay, holdout, patience,
                      max_pos_weight, t0)
    finally:
        torch.set_num_threads(old_threads)


def _train(torch, dev, x, active, rank, target_recall, seed, max_epochs, batch_size, lr,
           weight_decay, holdout, patience, max_pos_weight, t0) -> PredictorResult:
    n, n_embd = x.shape
    n_ff = active.shape[1]
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    n_val = int(round(n * holdout))
    val_idx, tr_idx = np.sort(perm[:n_val]), perm[n_val:]

    # Per-feature RMS over the training samples; floor avoids dividing by ~0 for dead features.
    rms = np.sqrt(np.mean(np.square(x[tr_idx], dtype=np.float64), axis=0))
    scale = np.maximum(rms, 1e-6 * max(float(rms.mean()), 1e-30)).astype(np.float32)

    gen = torch.Generator().manual_seed(int(seed))
    xt = torch.from_numpy(np.ascontiguousarray(x[tr_idx] / scale)).to(dev)
    yt = torch.from_numpy(active[tr_idx].astype(np.float32)).to(dev)
    xv = torch.from_numpy(np.ascontiguousarray(x[val_idx] / scale)).to(dev)
    yv = torch.from_numpy(active[val_idx].astype(np.float32)).to(dev)
    p = yt.mean(0).clamp_min(1e-6)
    pos_weight = ((1 - p) / p).clamp(1.0, max_pos_weight)

    # Kaiming-uniform-like init, drawn from our generator for determinism.
    fc1 = (torch.empty(rank, n_embd).uniform_(-1, 1, generator=gen) * (3.0 / n_embd) ** 0.5).to(dev)
    fc2 = (torch.empty(n_ff, rank).uniform_(-1, 1, generator=gen) * (3.0 / rank) ** 0.5).to(dev)
    fc1.requires_grad_(True)
    fc2.requires_grad_(True)
    opt = torch.optim.Adam([fc1, fc2], lr=lr, weight_decay=weight_decay)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    def forward(xb):
        return torch.relu(xb @ fc1.T) @ fc2.T

    best = (float("inf"), fc1.detach().clone(), fc2.detach().clone())
    since_best = 0
    epochs = 0
    for epoch in range(max_epochs):
        epochs = epoch + 1
        order = torch.randperm(xt.shape[0], generator=gen)
        for i in range(0, xt.shape[0], batch_size):
            b = order[i:i + batch_size].to(dev)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(forward(xt[b]), yt[b])
            loss.backward()
            opt.step()
        with torch.no_grad():
            val_loss = float(loss_fn(forward(xv), yv))
        if val_loss < best[0] - 1e-5:
            best = (val_loss, fc1.detach().clone(), fc2.detach().clone())
            since_best = 0
        else:
            since_best += 1
            if since_best >= patience:
                break

    w1 = (best[1].cpu().numpy() / scale[None, :]).astype(np.float32)  # fold the input scale into fc1
    w2 = best[2].cpu().numpy().astype(np.float32)
    logits = predict_logits(w1, w2, x[val_idx])  # numpy, exactly what the runtime computes
    threshold = tune_threshold(logits, active[val_idx], target_recall)
    tuned_recall = _quality(logits, active[val_idx], threshold)[0]
    recall, precision, sparsity = cross_fit_quality(logits, active[val_idx], target_recall, seed=seed)
    return PredictorResult(
        fc1=np.ascontiguousarray(w1), fc2=np.ascontiguousarray(w2), threshold=threshold, recall=recall,
        precision=precision, predicted_sparsity=sparsity, tuned_recall=tuned_recall, epochs=epochs,
        train_seconds=time.perf_counter() - t0, holdout_idx=val_idx.astype(np.int64), best_val_loss=best[0])


def layer_stats(active: np.ndarray, hot_fraction: float = 0.2) -> tuple[float, float]:
    """Sparsity and skewness of one layer's activity.

    active: bool (n_samples, n_ff). Returns (density, hot_share): density = mean fraction of
    neurons active per sample; hot_share = share of all activations taken by the hottest
    ``hot_fraction`` of neurons (= hot_fraction for a uniform layer, -> 1 for a power law).
    """
    active = np.asarray(active, dtype=bool)
    counts = active.sum(0).astype(np.float64)
    density = float(counts.sum() / active.size) if active.size else 0.0
    k = max(1, int(round(hot_fraction * counts.size)))
    total = counts.sum()
    hot_share = float(np.sort(counts)[::-1][:k].sum() / total) if total > 0 else 1.0
    return density, hot_share


def choose_rank(active: np.ndarray, n_embd: int, *, hot_fraction: float = 0.2,
                table: tuple[int, ...] = RANK_TABLE_4096, edges: tuple[float, ...] = RANK_SCORE_EDGES) -> int:
    """Predictor rank for one layer from its sparsity and skewness (``--predictor-rank auto``).

    PowerInfer §5.1: sparser and more skewed layers are easier to predict and get smaller
    predictors. Rule (ours; the paper gives no formula):

        density, hot_share = layer_stats(active)             # see layer_stats
        flatness = (1 - hot_share) / (1 - hot_fraction)        # 1 = uniform, 0 = all in the hot set
        score = density * flatness
        tier  = first i with score <= edges[i] (else the last)
        rank  = table[tier] * n_embd / 4096, rounded up to a multiple of 32, within [32, n_embd]

    e.g. a 4096-wide layer with 10% density and the hottest 20% of neurons taking 60% of the
    activations scores 0.05 -> rank 256; a dense, flat layer (score > 0.2) gets 2048.

    active: bool (n_samples, n_ff); n_embd: model width. Returns an int rank.
    Raises PyinferError for an empty ``active`` or n_embd < 1.
    """
    active = np.asarray(active)
    if active.ndim != 2 or active.size == 0:
        raise PyinferError(f"choose_rank: active must be a non-empty (n_samples, n_ff) array, got {active.shape}")
    if n_embd < 1:
        raise PyinferError(f"choose_rank: n_embd must be >= 1, got {n_embd}")
    density, hot_share = layer_stats(active, hot_fraction)
    flatness = min(max((1.0 - hot_share) / (1.0 - hot_fraction), 0.0), 1.0)
    score = density * flatness
    tier = next((i for i, e in enumerate(edges) if score <= e), len(table) - 1)
    rank = table[min(tier, len(table) - 1)] * n_embd / 4096
    rank = int(np.ceil(rank / RANK_MULTIPLE) * RANK_MULTIPLE)
    return int(min(max(rank, MIN_RANK), max(n_embd, MIN_RANK)))
