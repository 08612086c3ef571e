#!/usr/bin/env python3
"""How much of an FFN layer a sparse prefill would have to read: the fraction of neurons active
in at least one token of a batch, by batch size (mean over layers), on a text file.

    python tools/prefill_union.py models/smollm2.sparse.q8_0.gguf heldout.txt [--tokens 1024]

Active = the file's own criterion (ReLU: act > 0; SwiGLU "glu": |silu(gate) * up| above the
layer's stored threshold), profiled with ``predictors.profile`` over the first --tokens tokens.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from predictors.profile import profile  # noqa: E402
from pyinfer.engine import Engine  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a sparse pyinfer GGUF")
    ap.add_argument("text")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args(argv)
    eng = Engine(args.model, n_ctx=512, n_threads=args.threads)
    if not eng.is_sparse:
        sys.exit(f"error: {args.model} has no offline stage (convert without --dense)")
    with open(args.text, encoding="utf-8") as f:
        toks = eng.tokenizer.encode(f.read(), add_bos=False)[:args.tokens]
    prof = profile(eng, [toks], 512, progress=False)
    thr = eng.model.ffn.act_threshold
    print("| batch | neurons active in at least one token |")
    print("|---|---|")
    for b in args.batches:
        fracs = []
        for i in range(eng.cfg.n_layer):
            act = prof.act[i] > thr[i]  # (n_tok, n_ff)
            n = act.shape[0] // b * b
            fracs.append(act[:n].reshape(-1, b, act.shape[1]).any(axis=1).mean())
        print(f"| {b} | {np.mean(fracs):.1%} |")


if __name__ == "__main__":
    main()
