"""The offline stage's summary table: per layer sparsity, predictor rank, held-out recall and
precision, then totals (printed to stderr at the end of ``pyinfer-convert``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerReport:
    """One layer: ``sparsity`` = fraction of (token, neuron) pairs inactive in the profile;
    ``predicted_sparsity`` = fraction the predictor skips on its held-out tokens; ``gpu`` =
    neurons placed on the GPU (None without a budget); ``seconds`` = training time;
    ``cpu_predictor`` = whether CPU decode runs the predictor (``offline.predictor_pays``)."""

    layer: int
    sparsity: float
    act_threshold: float
    rank: int
    recall: float
    precision: float
    predicted_sparsity: float
    epochs: int
    seconds: float
    gpu: int | None = None
    cpu_predictor: bool = True


def format_table(rows: list[LayerReport], mode: str, n_ff: int) -> str:
    has_gpu = any(r.gpu is not None for r in rows)
    head = (f"{'layer':>5} {'sparsity':>8} {'act_thr':>8} {'rank':>5} {'recall':>7} {'precision':>9} "
            f"{'skipped':>8} {'cpu':>4} {'epochs':>6} {'train_s':>7}" + (f" {'gpu':>6}" if has_gpu else ""))
    lines = [f"offline stage summary (sparse mode {mode}; 'skipped' = neurons the predictor skips "
             "on held-out calibration tokens; 'recall' is cross-fitted on those tokens (each half "
             "scored with a threshold tuned on the other half): text unlike the calibration "
             "text gives less; "
             "'cpu' = CPU decode runs the predictor, where it saves more bytes than it reads)",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.layer:>5} {r.sparsity:>8.1%} {r.act_threshold:>8.4f} {r.rank:>5} {r.recall:>7.4f} "
                     f"{r.precision:>9.4f} {r.predicted_sparsity:>8.1%} "
                     f"{'yes' if r.cpu_predictor else 'no':>4} {r.epochs:>6} {r.seconds:>7.1f}"
                     + (f" {r.gpu if r.gpu is not None else 0:>6}" if has_gpu else ""))
    n = max(len(rows), 1)
    mean = lambda f: sum(f(r) for r in rows) / n  # noqa: E731
    lines.append("-" * len(head))
    lines.append(f"{'mean':>5} {mean(lambda r: r.sparsity):>8.1%} {'':>8} {mean(lambda r: r.rank):>5.0f} "
                 f"{mean(lambda r: r.recall):>7.4f} {mean(lambda r: r.precision):>9.4f} "
                 f"{mean(lambda r: r.predicted_sparsity):>8.1%} "
                 f"{sum(r.cpu_predictor for r in rows):>4} {'':>6} "
                 f"{sum(r.seconds for r in rows):>7.1f}"
                 + (f" {sum(r.gpu or 0 for r in rows):>6}" if has_gpu else ""))
    if has_gpu:
        lines.append(f"gpu neurons: {sum(r.gpu or 0 for r in rows)} of {n_ff * len(rows)}")
    return "\n".join(lines)
