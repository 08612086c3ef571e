"""pyinfer-run: generate text from a pyinfer GGUF with llama.cpp-style flags.

Streams the continuation to stdout and prints a llama.cpp-style timing summary to stderr.
User mistakes end with a one-line ``error: ...`` and exit status 1.
"""
from __future__ import annotations

import argparse
import sys
import time

from pyinfer.errors import PyinferError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyinfer-run", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="GGUF written by pyinfer-convert")
    p.add_argument("-m", "--model", dest="model_opt", help="same as the positional MODEL")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="raw completion prompt (as llama.cpp's -p)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=256,
                   help="tokens to generate (-1: until end of text or a full context; default 256)")
    p.add_argument("-t", "--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="context size in tokens (0: min(4096, the model's))")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end of text")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as one user turn with the GGUF's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    return p


def print_timings(t, file=sys.stderr):
    """llama.cpp's perf summary (llama_perf_context_print), same fields and units."""
    def line(label, ms, n, unit):
        per = ms / n if n else 0.0
        tps = 1e3 * n / ms if ms > 0 else 0.0
        print(f"pyinfer_perf: {label:>16} = {ms:10.2f} ms / {n:5d} {unit:6} "
              f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)", file=file)
    print(f"pyinfer_perf: {'load time':>16} = {t.load_ms:10.2f} ms", file=file)
    line("prompt eval time", t.prompt_ms, t.prompt_n, "tokens")
    line("eval time", t.eval_ms, t.eval_n, "runs")
    total = t.load_ms + t.prompt_ms + t.eval_ms + t.sample_ms
    print(f"pyinfer_perf: {'total time':>16} = {total:10.2f} ms / {t.prompt_n + t.eval_n:5d} tokens",
          file=file)


def run(args) -> int:
    from pyinfer.chat import render_chat
    from pyinfer.engine import Engine
    from pyinfer.sampler import SamplingParams
    from pyinfer.tokenizer import StreamDecoder

    model_path = args.model_opt or args.model
    if not model_path:
        raise PyinferError("no model given: pyinfer-run MODEL.gguf -p PROMPT")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PyinferError(f"cannot read prompt file {args.file}: {e}") from None
    else:
        prompt = args.prompt
    if prompt is None:
        raise PyinferError("no prompt given: use -p PROMPT or -f FILE")
    if args.threads is not None and args.threads <= 0:
        raise PyinferError("-t/--threads must be >= 1")
    try:
        params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                                repeat_last_n=args.repeat_last_n)
    except ValueError as e:
        raise PyinferError(str(e)) from None

    eng = Engine(model_path, n_ctx=args.ctx_size or None, n_threads=args.threads)
    tok = eng.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        text = render_chat(tok.chat_template, messages, add_generation_prompt=True,
                           bos_token=tok.bos_token, eos_token=tok.eos_token)
        ids = tok.encode(text, add_bos=False if text.startswith(tok.bos_token or "\0") else None)
    else:
        text = prompt
        ids = tok.encode(prompt)
    if len(ids) >= eng.n_ctx:
        raise PyinferError(f"prompt is {len(ids)} tokens, longer than the context ({eng.n_ctx}); "
                           "raise -c/--ctx-size or shorten the prompt")
    if not args.no_display_prompt and not args.chat:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    seed = None if args.seed < 0 else args.seed
    dec = StreamDecoder(tok)
    t0 = time.perf_counter()
    try:
        for t in eng.generate(ids, params, max_tokens=args.n_predict, seed=seed,
                              ignore_eos=args.ignore_eos):
            sys.stdout.write(dec.feed(t))
            sys.stdout.flush()
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
    sys.stdout.write(dec.flush() + "\n")
    sys.stdout.flush()
    eng.timings.total_ms = (time.perf_counter() - t0) * 1e3
    print(file=sys.stderr)
    print_timings(eng.timings)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except PyinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
