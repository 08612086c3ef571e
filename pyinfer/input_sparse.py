"""Input sparsity for SwiGLU models (sparse mode "input"): skip the small input channels of every
projection, so the weight columns they multiply are never read.

TEAL (Liu et al. 2024, "Training-Free Activation Sparsity in Large Language Models", §3-4) drops
input channel j of a projection y = W x where |x_j| is below a per-layer, per-projection threshold
calibrated offline; WINA (2025, "Weight Informed Neuron Activation") ranks channels by
|x_j| * ||W[:, j]||_2 instead. Four groups per layer share one input and one threshold each
(``constants.IN_GROUPS``): q/k/v (input: the attention-normed x), the attention output projection
(input: the attention output), gate/up (input: the FFN-normed x) and down (input: the GLU output
act(gate) * up). A file of this mode stores those matrices transposed, one row per input channel
(``attn_qkv_t``, ``attn_output_t``, ``ffn_gate_up_t``, ``ffn_down_t``), and decode sums the rows of
the kept channels (``cpu.decode_attn_in`` / ``cpu.decode_ffn_in``), so the bytes read shrink with
the sparsity. The selection depends only on the activations and the thresholds, never on the
thread count, and the row sums are cut into chunks by the number of kept rows alone.

Prefill runs dense transposed products (``cpu.matmul_t``) on inputs whose dropped channels are
set to zero: the same channels the token-at-a-time path skips, so both compute one function.
"""
from __future__ import annotations

from collections.abc import MutableMapping

import numpy as np

from pyinfer import constants as C
from pyinfer.config import ModelConfig
from pyinfer.ffn import FFNStats
from pyinfer.ops import cpu


def in_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(input channels, outputs per channel) of each group's transposed matrix."""
    return {"attn_qkv": (cfg.n_embd, cfg.n_embd_q + 2 * cfg.n_embd_kv),
            "attn_output": (cfg.n_embd_q, cfg.n_embd),
            "ffn_gate_up": (cfg.n_embd, 2 * cfg.n_ff),
            "ffn_down": (cfg.n_ff, cfg.n_embd)}


class GroupThresholds(MutableMapping):
    """{group: (n_layer,) f32} thresholds whose rows are views of one (4, n_layer) f32 array,
    ``stacked`` (groups in C.IN_GROUPS order), the layout ``cpu.decode_layers_in`` takes: so a
    token's decode passes it as it is. Assigning a group copies into its row (any float dtype,
    n_layer values; tools reassign groups); writes into a row land in ``stacked``. No group can
    be removed. ValueError for another group or length."""

    def __init__(self, rows: dict, n_layer: int):
        self.stacked = np.empty((len(C.IN_GROUPS), n_layer), np.float32)
        for g in C.IN_GROUPS:
            self[g] = rows[g]

    def _row(self, group: str) -> int:
        if group not in C.IN_GROUPS:
            raise KeyError(group)
        return C.IN_GROUPS.index(group)

    def __getitem__(self, group: str) -> np.ndarray:
        return self.stacked[self._row(group)]

    def __setitem__(self, group: str, value) -> None:
        v = np.asarray(value, np.float32).reshape(-1)
        if v.shape[0] != self.stacked.shape[1]:
            raise ValueError(f"{group}: {v.shape[0]} thresholds for {self.stacked.shape[1]} layers")
        self.stacked[self._row(group)] = v

    def __delitem__(self, group: str) -> None:
        raise TypeError("thresholds of a group cannot be removed")

    def __iter__(self):
        return iter(C.IN_GROUPS)

    def __len__(self) -> int:
        return len(C.IN_GROUPS)


class InputSparseHead:
    """The lm head of a file that stores ``output_ib`` (sparse mode input; or, for any sparse
    mode, the two-stage head alone): ``lm_head`` computes the logits from ``output_ib``, an
    input-block copy of the head, skipping the input channels j whose score |h_j| (*
    ``w.output_in_scale``) is at or below ``lm_head_thr`` (-1: every channel), counted in
    ``head_stats`` (inputs of the tokens, inputs read). Where the file names K candidates
    (``C.K_LM_HEAD_CANDIDATES``), ``output_ib`` is a copy (q4_1 for a head wider than 4 bits, else
    the head's own numbers) whose logits pick the K largest, and those K come from the exact head
    (``w.output``, a gather-GEMV of K rows: the dense head's bits), the others stay the copy's
    (``_rescore``).

    thresholds: "output" the head's threshold (float; absent: the dense head, ``lm_head_thr``
    None), "output_candidates" K. dense=True: the exact head alone (``lm_head_thr`` None), or
    with an exact copy every input kept."""

    def __init__(self, cfg: ModelConfig, thresholds: dict, dense: bool = False):
        head = thresholds.get("output")
        #: K of the two-stage head (0: output_ib is the exact head)
        self.head_candidates = 0 if head is None else int(thresholds.get("output_candidates", 0))
        self.lm_head_thr = None if head is None else (-1.0 if dense else float(head))
        if dense and self.head_candidates:  # --dense: the exact head, not its copy
            self.lm_head_thr, self.head_candidates = None, 0
        self._cand = np.empty(max(self.head_candidates, 1), np.int32)
        self._cval = np.empty(max(self.head_candidates, 1), np.float32)
        self.head_stats = FFNStats()
        self._coef = np.empty(cfg.n_embd, np.float32)  # lm_head's kept inputs (one token)
        self._idx = np.empty(cfg.n_embd, np.int32)

    def head_on(self, w) -> bool:
        """True where ``lm_head`` computes this file's logits (``w.output_ib`` and a threshold)."""
        return self.lm_head_thr is not None and w.output_ib is not None

    def lm_head(self, w, h: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
        """out (n_tok, n_vocab) f32 = the logits of the output-normed h (n_tok, n_embd) with the
        head's input channels j of score |h_j| (* ``w.output_in_scale``) <= the threshold
        skipped: one token sums the kept rows of ``w.output_ib`` (``IBChunks.axpy_rows``), a
        batch multiplies the masked h (``IBChunks.matmul_t``): for q8_0 both the bits of the
        dense GEMV of the masked input (cython/ibsum.h)."""
        thr, scale, ib = self.lm_head_thr, w.output_in_scale, w.output_ib
        n_tok, n_in = h.shape
        if n_tok == 1:
            k = cpu.select_inputs(h[0], scale, thr, self._coef, self._idx)
            ib.axpy_rows(self._coef[:k], self._idx[:k], out[0], n_threads)
        else:
            hm = np.empty_like(h)
            k = cpu.mask_inputs(h, scale, thr, hm, n_threads)
            ib.matmul_t(hm, out, n_threads)
        self.head_stats.total += n_tok * n_in
        self.head_stats.active += k
        if self.head_candidates:
            for t in range(n_tok):
                self._rescore(w, h[t], out[t], n_threads)
        return out

    def _rescore(self, w, h: np.ndarray, logits: np.ndarray, n_threads: int) -> None:
        """The two-stage head's second stage, in place on one token's logits (n_vocab,) f32 of
        the copy: the head_candidates largest (``cpu.topk_indices``: ties to the lower
        index) replaced by the exact head's, ``w.output``'s rows for them times the output-normed
        h (n_embd,) f32 (``cpu.gather_matvec``: the dense head's bits for those tokens). Greedy
        decoding then picks the exact head's argmax wherever it is among the candidates; the
        other logits keep the copy's values (docs/benchmarks.md, session 18: on SmolLM2 with
        K = 256 within 0.2% of the exact copy's perplexity)."""
        m = cpu.topk_indices(logits, self.head_candidates, self._cand)
        idx = self._cand[:m]
        cpu.gather_matvec(w.output, h, idx, self._cval[:m], n_threads)
        logits[idx] = self._cval[:m]


class InputSparseFFN(InputSparseHead):
    """The model's FFN (and, through ``Model``, its attention projections) under input sparsity.

    thresholds: {group: (n_layer,) f32}, a channel is kept where its score exceeds the threshold
    (< 0: every channel; ``dense=True`` sets all to -1, the same kernels computing every
    product). Scores are |x_j|, times the file's per-channel ``in_scale`` (column norms) for WINA
    files. ``stats`` counts weight rows: ``total`` = rows a dense pass would read, weighted by
    row length (elements), ``active`` = those read, so ``stats.sparsity`` is the fraction of
    projection weight bytes skipped (the lm head and embeddings are not counted).

    The lm head (``InputSparseHead``): where the file stores ``output_ib`` and a threshold
    (``thresholds["output"]``), ``lm_head`` skips its small input channels too, counted in
    ``head_stats``; with ``thresholds["output_candidates"]`` it is the two-stage head.
    """

    is_input_sparse = True

    def __init__(self, cfg: ModelConfig, thresholds: dict[str, np.ndarray], dense: bool = False):
        super().__init__(cfg, thresholds, dense)
        self.cfg = cfg
        n = cfg.n_layer
        self.thr = GroupThresholds({g: (np.full(n, -1.0, np.float32) if dense else thresholds[g])
                                    for g in C.IN_GROUPS}, n)
        self.silu = cfg.hidden_act == "silu"
        self.is_sparse = not dense
        self.sizes = in_sizes(cfg)
        # stats per layer: elements of the rows a dense pass reads; outputs per row of each group
        self.dense_elems = sum(n_in * n_out for n_in, n_out in self.sizes.values())
        self.row_elems = tuple(self.sizes[g][1] for g in C.IN_GROUPS)
        self.stats = FFNStats()
        self._head_h = np.empty(cfg.n_embd, np.float32)  # decode_layers' output-normed x
        # decode every layer of a token in one kernel call (decode_layers); False: one call per
        # half-layer (decode_attn, decode), e.g. for a tool that wraps those to record inputs
        self.whole_token = True
        self._plan = None  # cpu.input_decode_plan of the layers last decoded (decode_layers)
        # the model's RoPE frequency divisors (Llama 3's rope_freqs; Model sets it), None: none
        self.rope_freqs = None
        self._bqkv_cache = {}  # id(lw) -> (lw, [bq; bk; bv] f32) for biased q/k/v (Qwen2)
        self._plan_layers = None
        self._plan_head = False  # the plan holds the lm head

    def _count(self, group: str, kept: int, n_tok: int = 1) -> None:
        n_in, n_out = self.sizes[group]
        self.stats.total += n_tok * n_in * n_out
        self.stats.active += kept * n_out

    def _mask(self, lw, layer: int, group: str, x: np.ndarray, n_threads: int) -> np.ndarray:
        """x (n_tok, n_in) with the dropped channels set to 0 (a copy, ``cpu.mask_inputs``),
        counted in stats."""
        out = np.empty_like(x)
        kept = cpu.mask_inputs(x, self._scale(lw, group), self.thr[group][layer], out, n_threads)
        self._count(group, kept, x.shape[0])
        return out

    @staticmethod
    def _scale(lw, group):
        return None if lw.in_scale is None else lw.in_scale.get(group)

    def _bqkv(self, lw) -> np.ndarray | None:
        """[bq; bk; bv] (n_embd_q + 2 n_embd_kv,) f32 of a layer with q/k/v biases (a missing one
        as zeros), made once per layer; None without biases."""
        if not lw.has_qkv_bias:
            return None
        hit = self._bqkv_cache.get(id(lw))
        if hit is None or hit[0] is not lw:
            hit = self._bqkv_cache[id(lw)] = (lw, lw.qkv_bias(self.cfg))
        return hit[1]

    # ---- one token: fused half-layers ----------------------------------------------------------
    def decode_attn(self, lw, layer: int, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    n_past: int, n_threads: int) -> None:
        """The attention half-layer of one token in place on x (n_embd,) (``cpu.decode_attn_in``)."""
        cfg = self.cfg
        n_in, n_mid = cpu.decode_attn_in(
            x, lw.attn_norm, cfg.rms_eps, lw.attn_qkv_t, lw.attn_output_t, k_cache, v_cache,
            n_past, cfg.n_head, cfg.rope_freq_base, self._scale(lw, "attn_qkv"),
            self.thr["attn_qkv"][layer], self._scale(lw, "attn_output"),
            self.thr["attn_output"][layer], n_threads, self.rope_freqs, self._bqkv(lw),
            lw.attn_q_norm, lw.attn_k_norm)
        self._count("attn_qkv", n_in)
        self._count("attn_output", n_mid)

    def decode(self, lw, layer: int, x: np.ndarray, eps: float, n_threads: int) -> bool:
        """The FFN half-layer of one token in place on x (n_embd,) (``cpu.decode_ffn_in``)."""
        n_in, n_mid = cpu.decode_ffn_in(
            x, lw.ffn_norm, eps, lw.ffn_gate_up_t, lw.ffn_down_t, self._scale(lw, "ffn_gate_up"),
            self.thr["ffn_gate_up"][layer], self._scale(lw, "ffn_down"),
            self.thr["ffn_down"][layer], self.silu, n_threads)
        self._count("ffn_gate_up", n_in)
        self._count("ffn_down", n_mid)
        return True

    def decode_layers(self, layers, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      n_past: int, first: int, n_threads: int, w=None,
                      logits: np.ndarray | None = None) -> None:
        """Layers first .. n_layer - 1 of one token in place on x (n_embd,): ``decode_attn`` and
        ``decode`` of each layer in one kernel call (``cpu.decode_layers_in``, the same bits),
        counted in stats as they count. layers: the model's LayerWeights; caches (n_layer, n_ctx,
        n_head_kv, head_dim). With w (the model's weights, ``head_fits(w)``) and logits
        (n_vocab,) f32, the same call also writes the lm head's logits of x (``lm_head``'s bits
        and head_stats), so a token's whole pass is one kernel call."""
        cfg = self.cfg
        head = logits is not None
        if self._plan is None or self._plan_layers is not layers or (head and not self._plan_head):
            self._plan = cpu.input_decode_plan(
                [(lw.attn_norm, lw.attn_qkv_t, lw.attn_output_t, lw.ffn_norm, lw.ffn_gate_up_t,
                  lw.ffn_down_t, *(self._scale(lw, g) for g in C.IN_GROUPS), self._bqkv(lw),
                  lw.attn_q_norm, lw.attn_k_norm)
                 for lw in layers],
                cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps, cfg.rope_freq_base,
                self.silu, (w.output_norm, w.output_ib, w.output_in_scale) if head else None,
                self.rope_freqs)
            self._plan_layers, self._plan_head = layers, head
        kept = cpu.decode_layers_in(self._plan, x, k_cache, v_cache, n_past, self.thr.stacked,
                                    None, first, n_threads, logits,
                                    self.lm_head_thr if head else -1.0)
        # as _count counts each group's half-layer calls, layers summed
        self.stats.total += (cfg.n_layer - first) * self.dense_elems
        self.stats.active += sum(k * n_out for k, n_out in zip(kept, self.row_elems))
        if head:
            self.head_stats.total += cfg.n_embd
            self.head_stats.active += kept[4]
            if self.head_candidates:  # x is the last layer's output: the exact head's input
                cpu.rmsnorm(x, w.output_norm, cfg.rms_eps, self._head_h)
                self._rescore(w, self._head_h, logits, n_threads)

    def head_fits(self, w) -> bool:
        """True where ``decode_layers`` can write the logits: the file's lm head is input-sparse
        (``lm_head``'s one-token path)."""
        return self.head_on(w)

    # ---- a batch (prefill): dense products over masked inputs ---------------------------------
    def qkv(self, lw, layer: int, h: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
            n_threads: int) -> None:
        """q, k, v (n_tok, n_embd_q / n_embd_kv) from the attention-normed h (n_tok, n_embd), with
        the layer's q/k/v biases where it has them."""
        cfg = self.cfg
        out = np.empty((h.shape[0], cfg.n_embd_q + 2 * cfg.n_embd_kv), np.float32)
        cpu.matmul_t(lw.attn_qkv_t, self._mask(lw, layer, "attn_qkv", h, n_threads), out, n_threads)
        b = self._bqkv(lw)
        if b is not None:  # (Qwen2) the biases, added as decode adds them
            out += b
        q[...] = out[:, :cfg.n_embd_q]
        k[...] = out[:, cfg.n_embd_q:cfg.n_embd_q + cfg.n_embd_kv]
        v[...] = out[:, cfg.n_embd_q + cfg.n_embd_kv:]

    def attn_out(self, lw, layer: int, att: np.ndarray, out: np.ndarray, n_threads: int) -> None:
        """out (n_tok, n_embd) = the output projection of att (n_tok, n_embd_q)."""
        cpu.matmul_t(lw.attn_output_t, self._mask(lw, layer, "attn_output", att, n_threads), out,
                     n_threads)

    def __call__(self, lw, layer: int, x: np.ndarray, h: np.ndarray, out: np.ndarray,
                 n_threads: int) -> np.ndarray:
        """FFN of n_tok tokens: h (n_tok, n_embd) FFN-normed; writes (n_tok, n_embd) into out."""
        n_tok, n_ff = h.shape[0], self.cfg.n_ff
        gu = np.empty((n_tok, 2 * n_ff), np.float32)  # (n_tok, 2 n_ff): gate | up
        cpu.matmul_t(lw.ffn_gate_up_t, self._mask(lw, layer, "ffn_gate_up", h, n_threads), gu,
                     n_threads)
        a = np.empty((n_tok, n_ff), np.float32)  # act(gate) * up, masked
        kept = cpu.glu_mask(gu, self.silu, self._scale(lw, "ffn_down"),
                            self.thr["ffn_down"][layer], a, n_threads)
        self._count("ffn_down", kept, n_tok)
        cpu.matmul_t(lw.ffn_down_t, a, out, n_threads)
        return out


def thresholds_from_reader(reader, cfg: ModelConfig) -> dict:
    """{group: (n_layer,) f32} from the file's ``pyinfer.sparse.input_threshold.*`` arrays,
    "output": the lm head's threshold (float) where the file has one, and with it
    "output_candidates": the two-stage head's K (int, ``C.K_LM_HEAD_CANDIDATES``) where given.
    Raises PyinferError when one is missing or has the wrong length or type."""
    from pyinfer.config import read_field
    from pyinfer.errors import PyinferError

    out = {}
    for g in C.IN_GROUPS:
        key = C.K_IN_THRESHOLD.format(group=g)
        v = read_field(reader, key, kind=list, item=float)
        if v is None or len(v) != cfg.n_layer:
            raise PyinferError(f"sparse mode input needs {key} with {cfg.n_layer} entries")
        out[g] = np.asarray(v, np.float32)
    if read_field(reader, C.K_LM_HEAD_THRESHOLD) is not None:
        out.update(_head_fields(reader, cfg))
    return out


def _head_fields(reader, cfg: ModelConfig) -> dict:
    """{"output": the head's threshold (-1.0 where the file has none: every input kept),
    "output_candidates": K (where given)}. PyinferError for a value of the wrong type."""
    from pyinfer.config import read_field
    from pyinfer.errors import PyinferError

    out = {"output": -1.0}
    head = read_field(reader, C.K_LM_HEAD_THRESHOLD)
    if head is not None:
        if not isinstance(head, float):
            raise PyinferError(f"{C.K_LM_HEAD_THRESHOLD} must be a float, got {head!r}")
        out["output"] = head
    k = read_field(reader, C.K_LM_HEAD_CANDIDATES)
    if k is not None:
        if not isinstance(k, int) or k < 0:
            raise PyinferError(f"{C.K_LM_HEAD_CANDIDATES} must be a count, got {k!r}")
        out["output_candidates"] = min(k, cfg.n_vocab)
    return out


def head_from_reader(reader, cfg: ModelConfig, weights, dense: bool = False):
    """The lm head of a file of another sparse mode (or a dense one) that stores ``output_ib``:
    an ``InputSparseHead`` (the two-stage head, maybe with input sparsity), or None (no
    ``output_ib``, or ``dense``: the exact head)."""
    if weights.output_ib is None or dense:
        return None
    return InputSparseHead(cfg, _head_fields(reader, cfg))
