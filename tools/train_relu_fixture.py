"""Train the small ReLU Llama that the tests use (tests/fixtures/relu-llama/).

No registry ships a ReLU language model, so this script makes one from scratch on public text that
Debian packages carry: the Jargon File (package `jargon-text`, public domain) and the fortune
cookie files (package `fortunes`). Everything is deterministic given --seed (2 CPU threads).

Steps: clean text -> split train / held-out -> SentencePiece BPE tokenizer -> LlamaForCausalLM with
hidden_act="relu", trained with AdamW + cosine LR and an L1 penalty on the ReLU outputs (which pushes
activations to exact zeros; the config stays plain relu) -> held-out perplexity, per-layer sparsity,
hot-neuron concentration -> save_pretrained (config, safetensors, tokenizer) + heldout.txt + metrics.json.

Usage (the recipe in docs/relu-fixture.md):
    python tools/train_relu_fixture.py --out tests/fixtures/relu-llama --steps 1200 --seed 0 --threads 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

FORTUNES_DIR = Path("/usr/share/games/fortunes")
JARGON_TXT = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
# Pictures, not prose.
FORTUNES_SKIP = {"ascii-art"}
# Held out (never trained on): the slice [start, end) of the Jargon File's glossary, by character position.
HELDOUT_SLICE = (0.60, 0.625)

PUNCT_MAP = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                           "\u2013": "-", "\u2014": "--", "\u00a0": " ", "\t": " "})
BOX_DRAWING = re.compile(r"[\u2500-\u257f]")


def clean_lines(text: str) -> str:
    """Light cleaning: ASCII quotes and dashes, strip indentation, drop box-drawing lines, squeeze blanks."""
    out: list[str] = []
    for line in text.translate(PUNCT_MAP).splitlines():
        line = line.strip()
        if BOX_DRAWING.search(line):
            continue
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def load_fortunes() -> list[str]:
    """One string per fortune, in sorted file order; the '%' separators are removed."""
    docs: list[str] = []
    for path in sorted(FORTUNES_DIR.iterdir()):
        if path.suffix in (".dat", ".u8") or path.name in FORTUNES_SKIP or not path.is_file():
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for entry in re.split(r"^%\s*$", raw, flags=re.M):
            entry = clean_lines(entry)
            if len(entry) >= 20:
                docs.append(entry)
    return docs


def load_jargon() -> tuple[str, str]:
    """The cleaned Jargon File, split into (train text, held-out text) at paragraph boundaries."""
    text = clean_lines(gzip.decompress(JARGON_TXT.read_bytes()).decode("utf-8"))
    paras = text.split("\n\n")
    total = sum(len(p) + 2 for p in paras)
    train, held, pos = [], [], 0
    for p in paras:
        frac = pos / total
        (held if HELDOUT_SLICE[0] <= frac < HELDOUT_SLICE[1] else train).append(p)
        pos += len(p) + 2
    return "\n\n".join(train), "\n\n".join(held) + "\n"


def train_tokenizer(train_text: str, vocab_size: int, seed: int, model_dir: Path):
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "train.txt"
        corpus.write_text(train_text, encoding="utf-8")
        prefix = Path(tmp) / "sp"
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(prefix), model_type="bpe", vocab_size=vocab_size,
            byte_fallback=True, character_coverage=1.0, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, max_sentence_length=16384,
            shuffle_input_sentence=False, seed_sentencepiece_size=1000000,
            num_threads=1, minloglevel=2)
        model_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{prefix}.model", model_dir / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    return sp


def save_hf_tokenizer(sp, model_dir: Path, sample: str) -> None:
    """Wrap tokenizer.model as a transformers LlamaTokenizer; check it tokenizes like sentencepiece."""
    from transformers import AutoTokenizer, LlamaTokenizer

    tok = LlamaTokenizer.from_pretrained(str(model_dir), legacy=False, add_bos_token=True,
                                         add_eos_token=False)
    tok.save_pretrained(str(model_dir))
    back = AutoTokenizer.from_pretrained(str(model_dir))
    for line in sample.splitlines()[:200] + [sample[:4000]]:
        want = [sp.bos_id()] + sp.encode(line)
        got = back(line)["input_ids"]
        if got != want:
            raise RuntimeError(f"HF tokenizer differs from sentencepiece on {line!r}:\n{got}\n{want}")


def encode_stream(sp, docs: list[str]) -> np.ndarray:
    """Documents as one token stream, each document as <s> tokens."""
    ids: list[int] = []
    for d in docs:
        ids.append(sp.bos_id())
        ids.extend(sp.encode(d))
    return np.asarray(ids, dtype=np.int32)


def heldout_windows(sp, text: str, seq_len: int) -> "torch.Tensor":
    """The evaluation recipe: [<s>] + encode(heldout.txt), cut into non-overlapping windows of seq_len."""
    import torch

    ids = [sp.bos_id()] + sp.encode(text)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class ReluTap:
    """Forward hooks on each layer's mlp.act_fn: keeps relu(gate_proj(x)), shape (batch, seq, n_ff)."""

    def __init__(self, model):
        self.acts: list = [None] * len(model.model.layers)
        self.handles = [layer.mlp.act_fn.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.model.layers)]

    def _hook(self, i):
        def fn(_module, _inp, out):
            self.acts[i] = out
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


def evaluate(model, windows, batch: int = 8) -> dict:
    """Held-out perplexity, per-layer fraction of exact zeros in relu(gate(x)), top-20% neuron share."""
    import torch
    import torch.nn.functional as F

    model.eval()
    tap = ReluTap(model)
    n_layer = len(model.model.layers)
    n_ff = model.config.intermediate_size
    zeros = np.zeros(n_layer)
    counts = np.zeros((n_layer, n_ff))  # tokens on which each neuron is nonzero
    nll_sum, n_tok, n_act_tok = 0.0, 0, 0
    with torch.no_grad():
        for b in range(0, len(windows), batch):
            x = windows[b:b + batch]
            logits = model(input_ids=x).logits.float()
            nll_sum += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       x[:, 1:].reshape(-1), reduction="sum").item()
            n_tok += x[:, 1:].numel()
            n_act_tok += x.numel()
            for i, a in enumerate(tap.acts):
                nz = (a != 0).reshape(-1, n_ff)
                zeros[i] += (~nz).sum().item()
                counts[i] += nz.sum(0).numpy()
    tap.remove()
    k = int(round(0.2 * n_ff))
    top20 = [float(np.sort(c)[::-1][:k].sum() / max(c.sum(), 1)) for c in counts]
    never = [int((c == 0).sum()) for c in counts]
    return {
        "heldout_tokens": n_tok,
        "heldout_nll": nll_sum / n_tok,
        "heldout_ppl": math.exp(nll_sum / n_tok),
        "zero_fraction": [float(z / (n_act_tok * n_ff)) for z in zeros],
        "top20_share": top20,
        "dead_neurons": never,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/relu-llama"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=3000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--l1", type=float, default=0.1,
                    help="weight of the L1 penalty on relu(gate(x)) (mean over layers, tokens, neurons)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="only time this many steps (no saving), to choose --steps")
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    t_start = time.time()

    # 1. Text.
    fortunes = load_fortunes()
    jargon_train, heldout = load_jargon()
    jargon_docs = [p for p in jargon_train.split("\n\n") if p]
    train_text = "\n\n".join(fortunes + jargon_docs)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    print(f"text: {len(fortunes)} fortunes, {len(jargon_docs)} jargon paragraphs, "
          f"train {len(train_text)} chars, held-out {len(heldout)} chars", flush=True)

    # 2. Tokenizer.
    sp = train_tokenizer(train_text, args.vocab_size, args.seed, out)
    save_hf_tokenizer(sp, out, heldout)
    # Jargon paragraphs go in as runs of ~20 paragraphs so that windows see running text.
    jargon_chunks = ["\n\n".join(jargon_docs[i:i + 20]) for i in range(0, len(jargon_docs), 20)]
    stream = torch.from_numpy(encode_stream(sp, fortunes + jargon_chunks).astype(np.int64))
    print(f"tokenizer: vocab {sp.get_piece_size()}, train stream {len(stream)} tokens", flush=True)

    # 3. Model.
    config = LlamaConfig(
        vocab_size=sp.get_piece_size(), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        hidden_act="relu", max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(), pad_token_id=None,
        attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    steps = args.time_steps or args.steps

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    tap = ReluTap(model)
    model.train()
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.from_numpy(rng.integers(0, len(stream) - args.seq_len - 1, size=args.batch))
        idx = starts[:, None] + torch.arange(args.seq_len + 1)[None, :]
        batch = stream[idx]
        logits = model(input_ids=batch[:, :-1]).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        l1 = torch.stack([a.mean() for a in tap.acts]).mean()  # relu output is >= 0: mean == L1
        loss = ce + args.l1 * l1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == steps - 1:
            with torch.no_grad():
                zf = [float((a == 0).float().mean()) for a in tap.acts]
            el = time.time() - t0
            print(f"step {step} ce {ce.item():.4f} l1 {l1.item():.4f} lr {lr_at(step):.2e} "
                  f"zeros {' '.join(f'{z:.3f}' for z in zf)} {el:.0f}s ({(step + 1) / el:.2f} steps/s)",
                  flush=True)
    tap.remove()
    train_s = time.time() - t0
    if args.time_steps:
        print(f"timing: {steps / train_s:.3f} steps/s", flush=True)
        return

    # 4. Measure.
    windows = heldout_windows(sp, heldout, args.seq_len)
    metrics = evaluate(model, windows)
    print(json.dumps(metrics, indent=1), flush=True)

    # 5. Save.
    if args.dtype == "float16":
        model = model.half()
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)
    # Generation sanity check from the saved files.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out))
    m2 = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    samples = {}
    for prompt in ["A hacker is", "The Tao of programming", "Life is"]:
        enc = tok(prompt, return_tensors="pt")
        gen = m2.generate(**enc, max_new_tokens=30, do_sample=False)
        samples[prompt] = tok.decode(gen[0], skip_special_tokens=True)
        print(f"sample: {samples[prompt]!r}", flush=True)
    saved_metrics = evaluate(m2, windows)
    record = {
        "command": f"python tools/train_relu_fixture.py --out {out} --steps {args.steps} --seed {args.seed}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "n_params": n_params, "train_tokens": int(len(stream)), "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_start, 1), "seq_len_eval": args.seq_len,
        "metrics_saved_model": saved_metrics, "greedy_samples": samples,
        "torch": torch.__version__,
    }
    (out / "metrics.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=1), flush=True)


if __name__ == "__main__":
    main()
