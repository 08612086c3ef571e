"""pyinfer-inspect: what a GGUF file holds, without loading its weights.

Reads the metadata and the tensor table with ``gguf``'s reader (after ``pyinfer.gguf_check``
bounds every count): architecture and sizes, tensor types and bytes, tokenizer, whether the file
is a pyinfer conversion or a llama.cpp file, the offline stage's sparse mode and targets, per layer
the activation threshold, the sparsity measured on the calibration text, the predictor's rank,
held-out recall and precision, and the hot-neuron split for the GPU when one is stored; for sparse
mode "input" instead the score, the allocation and per layer and projection group the input
threshold and the fraction of input channels skipped on the calibration text (and the lm head's).
``--json`` prints the same facts as one JSON object.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import numpy as np

from pyinfer import constants as C
from pyinfer.config import read_field
from pyinfer.errors import PyinferError, exit_code_of
from pyinfer.gguf_check import MAX_TENSORS
from pyinfer.options import Parser, add_model, add_version, model_path

#: gguf-split's keys (llama.cpp examples/gguf-split): the part number and how many parts there are
K_SPLIT_NO, K_SPLIT_COUNT = "split.no", "split.count"


def _arch_field(reader, arch: str, name: str, kind=int):
    return read_field(reader, f"{arch}.{name}", kind=kind)


def describe(path: str) -> dict:
    """The facts about the GGUF at ``path`` as a JSON-ready dict (see the module docstring).
    Sizes in bytes; per-layer lists have one entry per layer (None where the file has no value).
    Raises PyinferError for a missing or malformed file."""
    from pyinfer.engine import open_gguf

    reader = open_gguf(path)
    arch = read_field(reader, C.K_ARCH, kind=str)
    n_layer = _arch_field(reader, arch, "block_count") if arch else None
    if n_layer is not None and not 0 <= n_layer <= MAX_TENSORS:  # per-layer lists are built
        raise PyinferError(f"{path} is not a valid GGUF file: {arch}.block_count is {n_layer} "
                           f"(0 to {MAX_TENSORS} allowed)")
    info: dict = {
        "file": path, "bytes": os.path.getsize(path),
        "gguf_version": int(reader.fields["GGUF.version"].contents()) if "GGUF.version" in reader.fields else None,
        "architecture": arch, "name": read_field(reader, C.K_NAME, kind=str),
        "n_layer": n_layer,
        "n_embd": _arch_field(reader, arch, "embedding_length"),
        "n_ff": _arch_field(reader, arch, "feed_forward_length"),
        "n_head": _arch_field(reader, arch, "attention.head_count"),
        "n_head_kv": _arch_field(reader, arch, "attention.head_count_kv"),
        "head_dim": _arch_field(reader, arch, "attention.key_length"),
        "n_ctx_train": _arch_field(reader, arch, "context_length"),
        "rope_freq_base": _arch_field(reader, arch, "rope.freq_base", float),
        "hidden_act": read_field(reader, C.K_HIDDEN_ACT, kind=str),
        # the Hugging Face family a converted file came from (gemma3, qwen2, mistral, llama ...)
        "family": read_field(reader, C.K_FAMILY, kind=str),
        "sliding_window": read_field(reader, C.K_SLIDING_WINDOW, kind=int),
    }
    if info["head_dim"] is None and info["n_embd"] and info["n_head"]:  # (llama.cpp's default)
        info["head_dim"] = info["n_embd"] // info["n_head"]
    names = {t.name for t in reader.tensors}
    ffn_layout = read_field(reader, C.K_FFN_LAYOUT, kind=str)
    converted = ffn_layout in C.FFN_LAYOUTS
    if not converted and arch != C.ARCH:  # a llama.cpp qwen2 / qwen3 / gemma3 file: its own
        info["family"] = arch
    # per-head RMSNorms of Q and K before RoPE (Qwen3, Gemma 3)
    info["head_norms"] = C.ATTN_Q_NORM.format(bid=0) in names
    info["layout"] = "pyinfer" if converted else "llama.cpp"
    # "neuron_major" (ffn_down_t) or "rows" (ffn_down, a --dense file); None for a llama.cpp file
    info["ffn_layout"] = ffn_layout if converted else None
    # sparse mode "input": projections stored one row per input channel (q8_0 / q4_0 / q4_1 /
    # q5_0 / q5_1 in the input-block layout, others transposed), not as wq ... ffn_down
    info["by_input_channel"] = any(t.format(bid=0) in names
                                   for t in (*C.IB.values(), C.ATTN_QKV_T, C.FFN_GATE_UP_T))
    info["pyinfer_version"] = read_field(reader, C.K_PYINFER_VERSION, kind=str)
    info["source"] = read_field(reader, C.K_SOURCE, kind=str)

    by_type: dict = defaultdict(lambda: {"tensors": 0, "bytes": 0, "parameters": 0})
    for t in reader.tensors:
        row = by_type[t.tensor_type.name]
        row["tensors"] += 1
        row["bytes"] += int(t.n_bytes)
        row["parameters"] += int(t.n_elements)
    info["types"] = dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"]))
    info["n_tensors"] = len(reader.tensors)
    predictor_like = ("fc1", "fc2", "gpu_idx", "gpu_bucket", "act_count", "in_scale")
    # the model's parameters: not the offline stage's tensors, nor the lm head's input-block copy
    # (sparse mode input), which holds the numbers of token_embd / output again
    info["parameters"] = int(sum(int(t.n_elements) for t in reader.tensors
                                 if t.name != C.OUTPUT_IB
                                 and t.name.split(".")[-2 if t.name.endswith(".weight") else -1]
                                 not in predictor_like))
    info["tied_embeddings"] = C.OUTPUT not in names

    tokens = reader.fields.get(C.K_TOK_LIST)
    info["tokenizer"] = {
        "model": read_field(reader, C.K_TOK_MODEL, kind=str),
        "pre": read_field(reader, C.K_TOK_PRE, kind=str),
        "n_tokens": len(tokens.data) if tokens is not None else None,
        "bos_id": read_field(reader, C.K_TOK_BOS, kind=int),
        "eos_id": read_field(reader, C.K_TOK_EOS, kind=int),
        "chat_template": C.K_CHAT_TEMPLATE in reader.fields,
        # Hugging Face's tokenizer.json stored as it is (no ggml token list)
        "hf_json": C.K_HF_TOKENIZER_JSON in reader.fields,
    }
    split_count = read_field(reader, K_SPLIT_COUNT, kind=int)
    info["split"] = None if not split_count else {"part": read_field(reader, K_SPLIT_NO, kind=int),
                                                  "count": split_count}

    mode = read_field(reader, C.K_SPARSE_MODE, kind=str)
    info["sparse"] = None
    if mode is not None:
        calib_tokens = read_field(reader, C.K_CALIB_TOKENS, kind=int)
        info["sparse"] = {
            "mode": mode,
            "target_recall": read_field(reader, C.K_TARGET_RECALL, kind=float),
            "target_sparsity": read_field(reader, C.K_TARGET_SPARSITY, kind=float),
            "calibration": {"source": read_field(reader, C.K_CALIB_SOURCE, kind=str),
                            "tokens": calib_tokens, "seed": read_field(reader, C.K_CALIB_SEED, kind=int)},
            "vram_budget_bytes": read_field(reader, C.K_VRAM_BUDGET, kind=int),
            "layers": _layers(reader, n_layer or 0, info["n_ff"], calib_tokens, names),
        }
    ib = next((t for t in reader.tensors if t.name == C.OUTPUT_IB), None)
    if mode == C.SPARSE_MODE_INPUT:
        info["sparse"]["input"] = _input_sparsity(reader, n_layer or 0, ib)
    k = read_field(reader, C.K_LM_HEAD_CANDIDATES, kind=int)
    # the two-stage lm head of a file of another mode (sparse mode input lists its own head)
    info["two_stage_head"] = (None if ib is None or not k or mode == C.SPARSE_MODE_INPUT else
                              {"copy": ib.tensor_type.name.lower(), "candidates": k})
    return info


def _per_layer(reader, key: str, n_layer: int, item=float) -> list:
    """The per-layer array field ``key`` as a list, or n_layer Nones where the file has none of
    that length."""
    v = read_field(reader, key, kind=list, item=item)
    return list(v) if v is not None and len(v) == n_layer else [None] * n_layer


def _input_sparsity(reader, n_layer: int, ib) -> dict:
    """Sparse mode "input": score, allocation (and Fisher weight), per layer {group: {threshold,
    calibration_sparsity}} in ``C.IN_GROUPS`` order (None where the file has no value), and the
    lm head's threshold, calibrated sparsity, two-stage candidates (0: its copy is exact) and
    the type of its input-block copy ``ib`` (the OUTPUT_IB tensor; None for a dense head)."""
    thr = {g: _per_layer(reader, C.K_IN_THRESHOLD.format(group=g), n_layer) for g in C.IN_GROUPS}
    sp = {g: _per_layer(reader, C.K_IN_SPARSITY.format(group=g), n_layer) for g in C.IN_GROUPS}
    head_thr = read_field(reader, C.K_LM_HEAD_THRESHOLD, kind=float)
    return {"score": read_field(reader, C.K_IN_SCORE, kind=str),
            "allocation": read_field(reader, C.K_IN_ALLOC, kind=str),
            "fisher_weight": read_field(reader, C.K_IN_FISHER_WEIGHT, kind=float),
            "lm_head": None if head_thr is None else {
                "threshold": head_thr,
                "calibration_sparsity": read_field(reader, C.K_LM_HEAD_SPARSITY, kind=float),
                "candidates": read_field(reader, C.K_LM_HEAD_CANDIDATES, kind=int) or 0,
                "type": None if ib is None else ib.tensor_type.name.lower()},
            "layers": [{g: {"threshold": thr[g][i], "calibration_sparsity": sp[g][i]}
                        for g in C.IN_GROUPS} for i in range(n_layer)]}


def _layers(reader, n_layer: int, n_ff: int | None, calib_tokens: int | None, names: set) -> list[dict]:
    """Per layer: act_threshold, calibration sparsity (1 - activations / (n_ff * calibration
    tokens), from ``blk.N.act_count``), predictor rank/threshold/recall/precision/cpu, gpu neurons."""
    act_thr = _per_layer(reader, C.K_ACT_THRESHOLD, n_layer)
    pred_thr = _per_layer(reader, C.K_PRED_THRESHOLD, n_layer)
    rank = _per_layer(reader, C.K_PRED_RANK, n_layer, int)
    recall = _per_layer(reader, C.K_PRED_RECALL, n_layer)
    precision = _per_layer(reader, C.K_PRED_PRECISION, n_layer)
    cpu = _per_layer(reader, C.K_PRED_CPU, n_layer, int)
    tensors = {t.name: t for t in reader.tensors}
    rows = []
    for i in range(n_layer):
        row = {"layer": i, "act_threshold": act_thr[i], "predictor_threshold": pred_thr[i],
               "predictor_rank": rank[i], "recall": recall[i], "precision": precision[i],
               "cpu_predictor": None if cpu[i] is None else bool(cpu[i]),
               "calibration_sparsity": None, "gpu_neurons": None}
        if row["predictor_rank"] is None and C.FC1.format(bid=i) in names:
            row["predictor_rank"] = int(tensors[C.FC1.format(bid=i)].shape[-1])
        counts = tensors.get(C.ACT_COUNT.format(bid=i))
        if counts is not None and n_ff and calib_tokens:
            active = float(np.asarray(counts.data, dtype=np.int64).sum())
            row["calibration_sparsity"] = 1.0 - active / (n_ff * calib_tokens)
        gpu = tensors.get(C.GPU_IDX.format(bid=i))
        if gpu is not None:
            row["gpu_neurons"] = int(np.count_nonzero(np.asarray(gpu.data)))
        rows.append(row)
    return rows


def budget_text(nbytes: int) -> str:
    """The shortest decimal GiB figure that ``placement.budget_bytes`` turns back into ``nbytes``
    (what --vram-budget must be given to run a stored split: 3 decimals printed 0.014 for a split
    solved at 0.0141 GiB, which re-solved)."""
    from pyinfer.placement import budget_bytes

    for digits in range(3, 18):
        text = f"{nbytes / 2**30:.{digits}g}"
        if budget_bytes(float(text)) == nbytes:
            return text
    return repr(nbytes / 2**30)


def _fmt(v, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def render(info: dict) -> str:
    """``describe``'s dict as the text pyinfer-inspect prints."""
    mib = 2 ** 20
    out = [f"file:          {info['file']} ({info['bytes'] / mib:.1f} MiB, GGUF v{info['gguf_version']}, "
           f"{info['n_tensors']} tensors)"]
    out.append(f"architecture:  {info['architecture']} ({info['name'] or 'no name'}): "
               f"{info['n_layer']} layers, n_embd {info['n_embd']}, n_ff {info['n_ff']}, "
               f"{info['n_head']} heads, {info['n_head_kv']} KV heads"
               + (f" of {info['head_dim']}" if info["head_dim"] else "")
               + (" (Q/K head norms)" if info["head_norms"] else "")
               + f", context {info['n_ctx_train']}, "
               f"rope base {_fmt(info['rope_freq_base'], 'g')}"
               + (f", {info['hidden_act']}" if info["hidden_act"] else "")
               + (f"; family {info['family']}" if info["family"] else "")
               + (f", sliding window {info['sliding_window']}" if info["sliding_window"] else ""))
    out.append(f"parameters:    {info['parameters'] / 1e6:.1f} M"
               + (" (tied embeddings)" if info["tied_embeddings"] else ""))
    if info["layout"] == "pyinfer":
        down = ("ffn_down in row layout, dense only" if info["ffn_layout"] == C.FFN_LAYOUT_ROWS
                else "projections stored by input channel, for sparse mode input"
                if info["by_input_channel"] else "ffn_down_t, neuron-major")
        out.append(f"layout:        pyinfer conversion (version {info['pyinfer_version'] or '?'}"
                   + (f", from {info['source']}" if info["source"] else "") + f"; {down})")
    else:
        out.append("layout:        llama.cpp file (not converted; pyinfer-convert writes the pyinfer "
                   "layout and adds sparsity)")
    types = ", ".join(f"{k} {v['tensors']} ({v['bytes'] / mib:.1f} MiB)" for k, v in info["types"].items())
    out.append(f"types:         {types}")
    tk = info["tokenizer"]
    kind = (f"{tk['model']} (pre {tk['pre']}), {tk['n_tokens']} tokens" if tk["n_tokens"] is not None
            else "Hugging Face tokenizer.json" if tk["hf_json"] else "none")
    out.append(f"tokenizer:     {kind}, bos {tk['bos_id']}, "
               f"eos {tk['eos_id']}, chat template {'yes' if tk['chat_template'] else 'no'}")
    if info["split"]:
        # (split.no counts from 0; the parts' names, -00001-of-00003, and llama.cpp from 1)
        out.append(f"split:         part {info['split']['part'] + 1} of {info['split']['count']} "
                   "(gguf-split; the other parts hold more of the model: the figures here are this "
                   "part's)")
    head = info.get("two_stage_head")
    if head:
        out.append(f"lm head:       two-stage: a {head['copy']} copy picks {head['candidates']} "
                   "candidates for the exact head")
    sp = info["sparse"]
    if sp is None:
        out.append("sparse:        no (dense FFN)")
        return "\n".join(out)
    cal = sp["calibration"]
    calib = f"calibration:   {_fmt(cal['tokens'])} tokens of {cal['source'] or '?'}, seed {_fmt(cal['seed'])}"
    if "input" in sp:
        return "\n".join(out + _render_input(sp, calib))
    out.append(f"sparse:        mode {sp['mode']}, target recall {_fmt(sp['target_recall'], '.3g')}, "
               f"target sparsity {_fmt(sp['target_sparsity'], '.3g')}")
    out.append(calib)
    if sp["vram_budget_bytes"]:
        out.append(f"gpu split:     solved for {budget_text(sp['vram_budget_bytes'])} GiB "
                   f"({sp['vram_budget_bytes']:,} bytes): pyinfer-run --vram-budget with this "
                   "figure runs it")
    out.append("layer  act_thr  calib_sparsity  rank  recall  precision  cpu_pred  gpu_neurons")
    for r in sp["layers"]:
        out.append(f"{r['layer']:5d}  {_fmt(r['act_threshold'], '7.4f'):>7}  "
                   f"{_fmt(r['calibration_sparsity'], '14.1%'):>14}  {_fmt(r['predictor_rank'], '4d'):>4}  "
                   f"{_fmt(r['recall'], '6.3f'):>6}  {_fmt(r['precision'], '9.3f'):>9}  "
                   f"{_fmt(r['cpu_predictor']):>8}  {_fmt(r['gpu_neurons']):>11}")
    return "\n".join(out)


def _render_input(sp: dict, calib: str) -> list[str]:
    """The lines of a sparse mode "input" file: its settings, then per layer the fraction of each
    projection group's input channels skipped on the calibration text (thresholds: --json)."""
    inp = sp["input"]
    alloc = inp["allocation"] or "?"
    if inp["fisher_weight"] is not None:
        alloc += f" (weight {inp['fisher_weight']:g})"
    head = ("dense" if inp["lm_head"] is None else
            f"{_fmt(inp['lm_head']['calibration_sparsity'], '.1%')} of its inputs skipped"
            + (f", a {inp['lm_head']['type']} copy picking {inp['lm_head']['candidates']} "
               "candidates for the exact head"
               if inp["lm_head"]["candidates"] else ""))
    out = [f"sparse:        mode input, score {inp['score'] or '?'}, allocation {alloc}, target "
           f"sparsity {_fmt(sp['target_sparsity'], '.3g')} of projection weight bytes; lm head {head}",
           calib,
           "input channels skipped on the calibration text, per projection group:",
           "layer  " + "  ".join(f"{g:>11}" for g in C.IN_GROUPS)]
    for i, row in enumerate(inp["layers"]):
        out.append(f"{i:5d}  " + "  ".join(
            f"{_fmt(row[g]['calibration_sparsity'], '.1%'):>11}" for g in C.IN_GROUPS))
    return out


def build_parser() -> Parser:
    p = Parser(prog="pyinfer-inspect", description=__doc__.splitlines()[0])
    add_version(p)
    add_model(p, "GGUF file (a pyinfer conversion or a llama.cpp file)")
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    return p


def _run(args) -> int:
    info = describe(model_path(args, "pyinfer-inspect MODEL.gguf"))
    print(json.dumps(info, indent=1) if args.json else render(info))
    return 0


def main(argv=None) -> int:
    return exit_code_of(_run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
