"""End-of-model sensitivity of input sparsity (``pyinfer-convert --sparse-alloc fisher``).

For every (layer, group) unit and every sparsity level k of its calibration curve, an estimate of
what skipping that unit's channels at level k costs in the model's *output* distribution, from one
backward pass per calibration piece (PyTorch, the ``train`` extra):

    cost[i, g, k] = 1/2 * sum_t ( sum_{j dropped at level k} grad_tj * x_tj )^2

x (n_tok, n_in) is the unit's input, grad the gradient of -log p(y) summed over positions with
each y_t drawn from the model's own next-token distribution (seeded). Zeroing the dropped channels
moves the input by delta = -x on them; to second order the expected KL divergence of the output
distribution is 1/2 * delta^T F delta with F the Fisher information, and the outer product of such
sampled gradients is an unbiased estimate of F (Fisher-information pruning, LeCun et al. 1990
"Optimal Brain Damage" uses its diagonal; here the cross terms inside a token's group are kept,
the terms across tokens and units dropped). The allocation (``input_sparse.allocate_levels``) then
assumes the units' costs add up.

Measured on SmolLM2-135M q8_0 (docs/benchmarks.md, "Input sparsity quality (issue 12)", sessions
7 and 8): against the uniform allocation the KL divergence from the dense model is 35-40% lower at
30-35% sparsity, but perplexity follows only once the allocation is shrunk half-way back to
uniform (``input_sparse.blend_levels``, ``--fisher-weight 0.5``, the default): on two held-out
texts (4,080 scored tokens each) -5.1% perplexity against uniform at a 40% target, -1.5% at 35%,
a tie at 30%; the unshrunk levels tie with uniform or lose. The pass runs over the first 256
calibration tokens (``input_sparse.FISHER_TOKENS``): 3.6 s, the offline stage 35-39 s against
24-30 s uniform (2 threads, nice 0). It needs PyTorch: the default allocation where PyTorch is
installed, uniform otherwise (predictors/offline.py).

The forward is the Llama forward of ``pyinfer.model`` (RMSNorm, NeoX RoPE, grouped-query causal
attention, SiLU/ReLU GLU, tied or separate head) in float32 over the dense engine's dequantized
row-layout weights, one piece at a time.
"""
from __future__ import annotations

import numpy as np

from pyinfer import constants as C
from pyinfer.ops.reference import dequantize


class TorchLlama:
    """The dense model of ``eng`` (its down projection neuron-major or in row layout) as float32
    torch tensors on ``device`` (a ``torch.device``, default the CPU; 4 bytes per weight: 540 MB
    for SmolLM2-135M). ``forward(tokens, hook)``: tokens (T,) int, returns logits (T, n_vocab);
    ``hook(layer, group_index, x)`` sees each group's input x (T, n_in) and returns what the
    projection multiplies (``constants.IN_GROUPS`` order). ``layers`` holds each layer's tensors
    by name (wqkv, wo, wgu, wd, norms): a caller may train them (requires_grad)."""

    def __init__(self, eng, torch, device=None):
        self.torch, self.cfg = torch, eng.cfg
        self.device = device = device if device is not None else torch.device("cpu")
        cfg, w = eng.cfg, eng.weights

        def t(a):
            return torch.from_numpy(np.array(dequantize(a), np.float32)).to(device)

        def v(a):
            return torch.from_numpy(np.array(a, np.float32)).to(device)

        self.layers = []
        for lw in w.layers:
            self.layers.append(dict(
                attn_norm=v(lw.attn_norm), ffn_norm=v(lw.ffn_norm),
                wqkv=torch.cat([t(lw.wq), t(lw.wk), t(lw.wv)]),  # (n_embd_q + 2 n_embd_kv, n_embd)
                # [bq; bk; bv] (Qwen2) or None
                bqkv=v(lw.qkv_bias(cfg)) if lw.has_qkv_bias else None,
                # (head_dim,) per-head RMSNorms of Q and K before RoPE (Qwen3) or None
                qn=v(lw.attn_q_norm) if lw.attn_q_norm is not None else None,
                kn=v(lw.attn_k_norm) if lw.attn_k_norm is not None else None,
                wo=t(lw.wo),  # (n_embd, n_embd_q)
                wgu=torch.cat([t(lw.ffn_gate), t(lw.ffn_up)]),  # (2 n_ff, n_embd)
                # (n_embd, n_ff): a neuron-major file's ffn_down_t transposed back, or the
                # row layout as stored (a llama.cpp file run as it is, a --dense file)
                wd=(t(lw.ffn_down) if lw.ffn_down_t is None
                    else t(lw.ffn_down_t).T.contiguous())))
        self.embd = t(w.token_embd)  # (n_vocab, n_embd)
        self.head = self.embd if w.output is w.token_embd else t(w.output)
        self.out_norm = v(w.output_norm)
        hd = cfg.head_dim
        self.inv_freq = 1.0 / cfg.rope_freq_base ** (
            torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd)  # (hd / 2,)
        if w.rope_freqs is not None:  # Llama 3's frequency divisors (families.rope_scaled)
            self.inv_freq = self.inv_freq / torch.from_numpy(
                np.asarray(w.rope_freqs, np.float64)).to(device)

    def _rms(self, x, w):
        return x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_eps) * w

    def _rope(self, x, ang):  # x (n_head, T, hd), NeoX / rotate_half layout
        h = x.shape[-1] // 2
        cos, sin = ang.cos().float(), ang.sin().float()
        return self.torch.cat([x[..., :h] * cos - x[..., h:] * sin,
                               x[..., h:] * cos + x[..., :h] * sin], -1)

    def forward(self, tokens, hook):
        torch, cfg = self.torch, self.cfg
        F = torch.nn.functional
        T, hd = len(tokens), cfg.head_dim
        ang = torch.outer(torch.arange(T, dtype=torch.float64, device=self.device),
                          self.inv_freq)  # (T, hd / 2)
        x = self.embd[torch.as_tensor(tokens, dtype=torch.long, device=self.device)]  # (T, n_embd)
        nq, nkv = cfg.n_embd_q, cfg.n_embd_kv
        for i, W in enumerate(self.layers):
            qkv = hook(i, 0, self._rms(x, W["attn_norm"])) @ W["wqkv"].T
            if W["bqkv"] is not None:
                qkv = qkv + W["bqkv"]
            q = qkv[:, :nq].reshape(T, cfg.n_head, hd)
            k = qkv[:, nq:nq + nkv].reshape(T, cfg.n_head_kv, hd)
            if W["qn"] is not None:
                q, k = self._rms(q, W["qn"]), self._rms(k, W["kn"])
            q = self._rope(q.transpose(0, 1), ang)
            k = self._rope(k.transpose(0, 1), ang)
            v = qkv[:, nq + nkv:].reshape(T, cfg.n_head_kv, hd).transpose(0, 1)
            k, v = k.repeat_interleave(cfg.n_gqa, 0), v.repeat_interleave(cfg.n_gqa, 0)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
            x = x + hook(i, 1, att.reshape(T, nq)) @ W["wo"].T
            gu = hook(i, 2, self._rms(x, W["ffn_norm"])) @ W["wgu"].T
            act = F.silu(gu[:, :cfg.n_ff]) if cfg.hidden_act == "silu" else F.relu(gu[:, :cfg.n_ff])
            x = x + hook(i, 3, act * gu[:, cfg.n_ff:]) @ W["wd"].T
        return self._rms(x, self.out_norm) @ self.head.T


def fisher_pieces(pieces: list[list[int]], n_tokens: int | None) -> list[list[int]]:
    """The first ``n_tokens`` tokens of the calibration ``pieces`` (None: all), as pieces: whole
    pieces in order, the last one cut (each piece still starts at position 0)."""
    if n_tokens is None:
        return list(pieces)
    out, left = [], n_tokens
    for p in pieces:
        if left <= 0:
            break
        out.append(list(p[:left]))
        left -= len(out[-1])
    return out


def fisher_costs(eng, pieces: list[list[int]], thr: np.ndarray, seed: int,
                 n_threads: int | None = None, scales: list[dict] | None = None,
                 device: str = "cpu") -> np.ndarray:
    """cost (n_layer, 4, n_levels) f64 (module docstring) over the calibration ``pieces`` (token
    lists, each from position 0) of the dense row-layout engine ``eng``; thr (n_layer, 4,
    n_levels) f32 the units' thresholds per level (``UnitCurve.thr``; level 0 keeps all, so
    cost[..., 0] = 0) on the score |x_j|, times ``scales[i][group]`` (n_in,) when given (WINA).
    Non-decreasing in the level only up to the estimate's noise. Deterministic for a seed,
    thread count and ``device`` ("cpu" | "cuda" | "auto": ``train.torch_device``; the sampled
    targets are drawn on the CPU either way). Raises PyinferError without PyTorch or for a
    device PyTorch cannot use.

    Cost: one float32 forward and backward per piece plus a bucketing pass over every unit's
    inputs; linear in the tokens (``fisher_pieces`` picks fewer: ``input_sparse.FISHER_TOKENS``)."""
    from predictors.train import _import_torch, torch_device

    torch = _import_torch()
    dev = torch_device(torch, device)
    old = torch.get_num_threads()
    if n_threads:
        torch.set_num_threads(n_threads)
    try:
        model = TorchLlama(eng, torch, dev)
        L, n_groups, N = thr.shape
        cost = np.zeros((L, n_groups, N))
        gen = torch.Generator().manual_seed(seed)
        for piece in pieces:
            store = {}

            def hook(i, gi, x):
                if x.requires_grad:  # inside the graph: keep its gradient (no copy, no add)
                    x.retain_grad()
                else:  # layer 0's input (the embedding rows need no gradient): a leaf
                    x = x.detach().requires_grad_(True)
                store[(i, gi)] = x
                return x

            with torch.enable_grad():
                logits = model.forward(piece, hook)
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=gen)[:, 0]
                    y = y.to(dev)
                torch.nn.functional.cross_entropy(logits, y, reduction="sum").backward()
            for (i, gi), xt in store.items():
                x = xt.detach().cpu().numpy()  # (T, n_in) f32
                gx = xt.grad.cpu().numpy() * x  # (T, n_in) f32; bincount sums it in f64
                # level k drops the pairs with |x| <= thr[k]: bucket < k (as unit_curve counts)
                score = np.abs(x)
                if scales is not None:
                    score *= scales[i][C.IN_GROUPS[gi]]
                bucket = np.searchsorted(thr[i, gi, 1:], score, side="left")  # (T, n_in) in [0, N)
                T = gx.shape[0]
                per = np.bincount((bucket + N * np.arange(T)[:, None]).ravel(), weights=gx.ravel(),
                                  minlength=T * N).reshape(T, N)  # per-token sums by bucket
                s = np.cumsum(per, 1)[:, :N - 1]  # s[:, k - 1]: sum over the pairs level k drops
                cost[i, gi, 1:] += 0.5 * (s ** 2).sum(0)
        return cost
    finally:
        torch.set_num_threads(old)
