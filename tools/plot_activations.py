"""Plot the activation-count distribution of every layer, hot neurons first, from converted files.

    python tools/plot_activations.py MODEL.gguf [MODEL2.gguf ...] -o docs/activation_counts.png

Reads ``blk.N.act_count`` (written by pyinfer-convert's offline stage) and the number of
calibration tokens; one panel per file, one line per layer (colour = depth): the fraction of
calibration tokens on which each neuron was active, neurons sorted from hottest to coldest. A flat
line is a layer without hot neurons; a steep head is a power law (PowerInfer §3, Fig. 5).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-o", "--out", default="docs/activation_counts.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pyinfer import constants as C
    from pyinfer.config import ModelConfig, read_field
    from pyinfer.engine import open_gguf
    from pyinfer.placement import stored_counts

    fig, axes = plt.subplots(1, len(args.models), figsize=(6.5 * len(args.models), 4.5), squeeze=False)
    for ax, path in zip(axes[0], args.models):
        r = open_gguf(path)
        cfg = ModelConfig.from_gguf(r)
        counts = stored_counts(r, cfg)
        if counts is None:
            print(f"error: {path} has no activation counts (converted with --dense?)", file=sys.stderr)
            return 1
        n_tok = int(read_field(r, C.K_CALIB_TOKENS, 1))
        mode = read_field(r, C.K_SPARSE_MODE, "?")
        cmap = plt.get_cmap("viridis")
        x = np.arange(cfg.n_ff) / cfg.n_ff
        top20 = []
        for i, c in enumerate(counts):
            s = np.sort(c)[::-1] / n_tok
            ax.plot(x, s, color=cmap(i / max(cfg.n_layer - 1, 1)), lw=0.9)
            top20.append(s[: max(1, cfg.n_ff // 5)].sum() / max(s.sum(), 1e-12))
        ax.set_title(f"{os.path.basename(path)}\n{cfg.n_layer} layers x {cfg.n_ff} neurons, mode {mode}, "
                     f"{n_tok} calib tokens\nhottest 20% of neurons take {min(top20):.0%}-{max(top20):.0%} "
                     "of activations", fontsize=9)
        ax.set_xlabel("neuron rank within its layer (fraction, hottest first)")
        ax.set_ylabel("fraction of calibration tokens active")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, cfg.n_layer - 1))
        fig.colorbar(sm, ax=ax, label="layer")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
