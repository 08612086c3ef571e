#!/usr/bin/env python3
"""Sparsity-aware distillation for sparse mode input, measured in PyTorch (issue 12's open lead):
how much of the perplexity that input sparsity costs does training the weights under the input
masks buy back, given far more text and steps than a 2-core box affords?

The model is ``predictors.input_fisher.TorchLlama`` over a dense file's weights (f32, on the GPU
where PyTorch sees one): a student whose layer matrices and norms train (the tied embedding and
head stay; with ``--scales`` only a scale per output channel of every projection, which folds into
the matrix's rows), and a frozen dense teacher. Every projection's input is masked as sparse mode input
masks it (``constants.IN_GROUPS``: q/k/v share one mask, gate/up one; channel j kept where |x_j|
> the site's threshold), with one uniform target for every site: thresholds are the
``--sparsity`` quantile of |x| per (layer, site) over calibration tokens (the last
``4 x --ctx`` tokens of the training text, never trained on), recalibrated at each report. A
step is the KL divergence of the student's masked logits from the teacher's dense ones, summed
over ``--batch`` windows of ``--ctx`` tokens drawn without repetition from the training text,
then one Adam step. Perplexity is over ``--eval-chunks`` windows of each held-out text, the
second half of each window scored.

Reports, per held-out text: the dense model; the masked model before training; the masked model
every ``--eval-every`` steps; the trained model dense; and, with gguf installed, both models'
weights rounded through q4_0 (``gguf.quants``) dense and masked. The converter's Fisher
allocation would spread the same sparsity better than the uniform target here: this measures
what training buys, not the shipped file's numbers. The masked model is touchy: a change of the
weights too small to move the dense perplexity (a scale step of 1e-6) moved the masked one by
-2% and +6% on 128 scored tokens (channels at a threshold flip), so score thousands of tokens
(8 windows of 512 per text by default) and read differences of a few percent with care.

    python tools/distill_input.py MODEL.gguf --train A.txt B.txt ... --held lic.txt code.txt
        [--sparsity 0.4] [--steps 2000] [--batch 4] [--ctx 512] [--lr 1e-4] [--device auto]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyinfer.engine import Engine  # noqa: E402
from predictors.input_fisher import TorchLlama  # noqa: E402
from predictors.train import _import_torch, torch_device  # noqa: E402

MATRICES = ("wqkv", "wo", "wgu", "wd")
TRAINED = MATRICES + ("attn_norm", "ffn_norm")


class Masks:
    """The input masks of every (layer, site): ``hook`` for TorchLlama.forward. mode "dense"
    passes inputs through, "collect" samples |x| for the thresholds, "sparse" masks."""

    def __init__(self, torch, n_layer: int):
        self.torch, self.mode = torch, "dense"
        self.thr = np.zeros((n_layer, 4), np.float32)
        self.samples: dict = {}

    def hook(self, i, g, x):
        if self.mode == "collect":
            self.samples.setdefault((i, g), []).append(x.detach().abs().flatten()[::7].float().cpu())
            return x
        if self.mode == "sparse":
            return x * (x.abs() > float(self.thr[i, g]))
        return x

    def calibrate(self, model, pieces, sparsity: float) -> None:
        self.mode, self.samples = "collect", {}
        with self.torch.no_grad():
            for p in pieces:
                model.forward(p, self.hook)
        for (i, g), v in self.samples.items():
            a = self.torch.cat(v).numpy()
            self.thr[i, g] = np.quantile(a, sparsity) if sparsity > 0 else -1.0
        self.samples, self.mode = {}, "sparse"


def perplexity(torch, model, masks, mode: str, tokens: list[int], ctx: int, n_chunks: int) -> float:
    """exp(mean NLL) over the second halves of n_chunks windows of ctx tokens."""
    masks.mode = mode
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in range(n_chunks):
            w = tokens[c * ctx:(c + 1) * ctx]
            if len(w) < ctx:
                break
            lp = torch.log_softmax(model.forward(w, masks.hook)[:-1].double(), -1)
            t = torch.as_tensor(w[1:], device=lp.device)
            h = ctx // 2
            nll -= float(lp[h:].gather(1, t[h:, None]).sum())
            n += len(w) - 1 - h
    return math.exp(nll / max(n, 1))


def q4_0_round_trip(torch, model) -> None:
    """Every trained matrix of model rounded through q4_0 in place (gguf.quants)."""
    import gguf

    q = gguf.GGMLQuantizationType.Q4_0
    with torch.no_grad():
        for W in model.layers:
            for k in ("wqkv", "wo", "wgu", "wd"):
                a = W[k].detach().cpu().numpy().astype(np.float32)
                r = gguf.quants.dequantize(gguf.quants.quantize(a, q), q).reshape(a.shape)
                W[k].copy_(torch.from_numpy(np.ascontiguousarray(r)).to(W[k].device))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a dense GGUF pyinfer runs (a llama.cpp file or pyinfer's own)")
    ap.add_argument("--train", nargs="+", required=True, help="training text files")
    ap.add_argument("--held", nargs="+", required=True, help="held-out text files")
    ap.add_argument("--sparsity", type=float, default=0.4, help="input sparsity of every site")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-chunks", type=int, default=8)
    ap.add_argument("--scales", action="store_true",
                    help="train only a scale per output channel of every projection (foldable "
                         "into the rows: free at run time), the weights frozen")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0.0 <= args.sparsity < 1.0:
        ap.error("--sparsity must be in [0, 1)")
    torch = _import_torch()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    dev = torch_device(torch, args.device)
    t0 = time.perf_counter()
    eng = Engine(args.model, n_ctx=args.ctx, n_threads=args.threads, dense=True)
    enc = eng.tokenizer.encode
    train = []
    for f in args.train:
        with open(f, encoding="utf-8", errors="replace") as fh:
            train.extend(enc(fh.read()))
    held = {}
    for f in args.held:
        with open(f, encoding="utf-8", errors="replace") as fh:
            held[os.path.basename(f)] = enc(fh.read())
    C = args.ctx
    calib = [train[len(train) - (k + 1) * C:len(train) - k * C] for k in range(4)]
    n_win = (len(train) - 4 * C) // C
    if n_win < 1:
        ap.error(f"--train holds {len(train)} tokens: too few for --ctx {C}")
    student, teacher = TorchLlama(eng, torch, dev), TorchLlama(eng, torch, dev)
    masks = Masks(torch, eng.cfg.n_layer)
    params, scaled = [], []
    for W in student.layers:
        for k in (MATRICES if args.scales else TRAINED):
            if args.scales:  # W[k] = s[:, None] * W0[k], s trains (the rows of W0 stay)
                s0 = torch.ones(W[k].shape[0], device=dev, requires_grad=True)
                scaled.append((W, k, W[k], s0))
                params.append(s0)
            else:
                W[k] = W[k].clone().requires_grad_(True)
                params.append(W[k])

    def apply_scales():
        for W, k, w0, s0 in scaled:
            W[k] = s0[:, None] * w0
    n_par = sum(p.numel() for p in params)
    print(f"{os.path.basename(args.model)} on {dev}: {len(train)} training tokens "
          f"({n_win} windows of {C}), {args.steps} steps x {args.batch} windows = "
          f"{args.steps * args.batch * C / 1e6:.2f} M tokens"
          f"{' (windows repeat)' if args.steps * args.batch > n_win else ''}; "
          f"{n_par / 1e6:.1f} M trained parameters; setup {time.perf_counter() - t0:.0f} s",
          flush=True)

    def report(tag, model, mode):
        r = {name: perplexity(torch, model, masks, mode, toks, C, args.eval_chunks)
             for name, toks in held.items()}
        cells = " | ".join(f"{r[n]:.4f} ({100 * (r[n] / base[n] - 1):+.2f}%)" for n in held)
        print(f"| {tag} | {cells} |", flush=True)
        return r

    base = {name: perplexity(torch, teacher, masks, "dense", toks, C, args.eval_chunks)
            for name, toks in held.items()}
    print(f"\n| model ({args.sparsity:.0%} of every site's inputs skipped) | "
          + " | ".join(held) + " |")
    print("|---|" + "---|" * len(held))
    report("dense", teacher, "dense")
    masks.calibrate(student, calib, args.sparsity)
    report("masked, before training", student, "sparse")
    opt = torch.optim.Adam(params, lr=args.lr)
    order = list(range(n_win))
    rng.shuffle(order)
    t1 = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for b in range(args.batch):
            c = order[(step * args.batch + b) % n_win]
            w = train[c * C:(c + 1) * C]
            with torch.no_grad():
                masks.mode = "dense"
                target = torch.log_softmax(teacher.forward(w, masks.hook), -1)
            masks.mode = "sparse"
            apply_scales()
            out = torch.log_softmax(student.forward(w, masks.hook), -1)
            loss = torch.nn.functional.kl_div(out, target, log_target=True,
                                              reduction="batchmean") / args.batch
            loss.backward()
            loss_sum += float(loss.detach())
        opt.step()
        with torch.no_grad():
            apply_scales()  # the reports read the scaled matrices
        if (step + 1) % max(1, args.eval_every // 5) == 0:
            print(f"  step {step + 1}: KL {loss_sum:.4f}, {time.perf_counter() - t1:.0f} s",
                  file=sys.stderr, flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            masks.calibrate(student, calib, args.sparsity)
            report(f"masked, {step + 1} steps ({time.perf_counter() - t1:.0f} s)", student,
                   "sparse")
    report("trained, dense", student, "dense")
    if importlib.util.find_spec("gguf") is None:
        return 0
    q4_0_round_trip(torch, teacher)
    report("dense, q4_0", teacher, "dense")
    masks.calibrate(teacher, calib, args.sparsity)
    report("masked, q4_0", teacher, "sparse")
    q4_0_round_trip(torch, student)
    report("trained, q4_0, dense", student, "dense")
    masks.calibrate(student, calib, args.sparsity)
    report("trained, q4_0, masked", student, "sparse")
    return 0


if __name__ == "__main__":
    sys.exit(main())
