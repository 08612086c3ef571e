"""pyinfer-run: generate text from a pyinfer GGUF with llama.cpp-style flags.

Streams the continuation to stdout and prints a llama.cpp-style timing summary to stderr.
``-i`` starts the interactive chat (pyinfer/repl.py). Built on the Python API (pyinfer/api.py).
User mistakes end with a one-line ``error: ...`` and exit status 1.
"""
from __future__ import annotations

import argparse
import sys

from pyinfer.errors import EXIT_INTERRUPTED, PyinferError, exit_code_of
from pyinfer.options import Parser as _Parser
from pyinfer.options import (add_engine_flags, add_model, add_version, arg_type, process_escapes,
                             prompt_file_limit, read_text_file, temperature_arg, threads_arg,
                             warn_past_training)
from pyinfer.options import model_path as _model_path


#: Longest answer of the interactive chat unless -n says otherwise (llama.cpp's n_predict is -1,
#: but an unbounded answer of a small model can loop for thousands of tokens: issue 13).
CHAT_N_PREDICT = 512
#: the chat's DRY strength (llama.cpp's is 0, off): 0.8, DRY's recommended value, ends the
#: loops SmolLM2-135M falls into at temperature 0.8 (tests/test_sampler.py)
CHAT_DRY_MULTIPLIER = 0.8
#: Tokens pyinfer-run generates without -n.
RUN_N_PREDICT = 256
CHAT_DESCRIPTION = """pyinfer-chat: chat with a model in the terminal (same as pyinfer-run -i).

Each message you type is sent with the conversation so far, rendered with the model's chat
template; the answer streams back. /help lists the commands, Ctrl-C stops an answer, Ctrl-D or
/exit leaves. Sampling follows llama.cpp's defaults (top-k 40, top-p 0.95, min-p 0.05,
temperature 0.8); an answer stops at %d tokens unless -n says otherwise.""" % CHAT_N_PREDICT


def build_parser(prog: str = "pyinfer-run", chat: bool = False) -> argparse.ArgumentParser:
    """The flags of pyinfer-run, or with ``chat`` those of pyinfer-chat (no -p/-f/--chat: the
    prompt comes from the terminal)."""
    p = _Parser(prog=prog, description=CHAT_DESCRIPTION if chat else __doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p)
    add_model(p)
    if not chat:
        src = p.add_mutually_exclusive_group()
        src.add_argument("-p", "--prompt", help="raw completion prompt (as llama.cpp's -p)")
        src.add_argument("-f", "--file", help="read the prompt from this file")
        p.add_argument("-i", "--interactive", action="store_true",
                       help="chat in a read-eval-print loop (same as pyinfer-chat)")
        p.add_argument("-n", "--n-predict", type=n_predict_arg, default=None,
                       help=f"tokens to generate (-1: until end of text or a full context; -2: "
                            f"the same, never shifting the context (llama.cpp's); default "
                            f"{RUN_N_PREDICT}, with -i {CHAT_N_PREDICT} per answer)")
    else:
        p.add_argument("-n", "--n-predict", type=arg_type("n_predict"), default=None,
                       help=f"longest answer in tokens (default {CHAT_N_PREDICT}; -1: until the "
                            "end of the turn or a full context)")
    esc = p.add_mutually_exclusive_group()
    esc.add_argument("-e", "--escape", action="store_true", default=True,
                     help="process escapes (\\n, \\t, \\xNN ...) in " + ("" if chat else "the prompt and ")
                     + "reverse prompts (the default, as llama.cpp)")
    esc.add_argument("--no-escape", dest="escape", action="store_false",
                     help="take " + ("" if chat else "the prompt and ") + "reverse prompts as written")
    p.add_argument("-t", "--threads", type=threads_arg, default=None,
                   help="kernel threads (default, or 0 or less: the physical cores this process may use)")
    p.add_argument("-c", "--ctx-size", type=arg_type("ctx_size"), default=0,
                   help="context size in tokens (0: min(4096, the model's))")
    p.add_argument("-ctk", "--cache-type", choices=["auto", "f16", "f32"], default="auto",
                   help="KV cache type (llama.cpp's --cache-type-k/v): f16 halves the bytes each "
                        "token's attention reads; auto: f32 for an f32 file, else f16")
    p.add_argument("--temp", type=temperature_arg, default=0.8,
                   help="temperature (0 or less: greedy, as llama.cpp)")
    p.add_argument("--top-k", type=arg_type("top_k"), default=40,
                   help="keep the k most likely tokens (0 or -1: all; default 40)")
    p.add_argument("--top-p", type=arg_type("top_p"), default=0.95)
    p.add_argument("--min-p", type=arg_type("min_p"), default=0.05)
    p.add_argument("--repeat-penalty", type=arg_type("repeat_penalty"), default=1.0)
    p.add_argument("--repeat-last-n", type=arg_type("repeat_last_n"), default=64,
                   help="tokens the repeat penalty looks back over (0: none, -1: the whole "
                        "context; default 64)")
    p.add_argument("--dry-multiplier", type=arg_type("dry_multiplier"), default=None,
                   help=f"DRY repetition penalty strength (0: off; default {CHAT_DRY_MULTIPLIER} "
                        "in the chat, 0 otherwise)")
    p.add_argument("--dry-base", type=arg_type("dry_base"), default=1.75,
                   help="DRY: the penalty grows by this factor per repeated token (default 1.75)")
    p.add_argument("--dry-allowed-length", type=arg_type("dry_allowed_length"), default=2,
                   help="DRY: repeats this long go unpenalised (default 2)")
    p.add_argument("--dry-penalty-last-n", type=arg_type("dry_penalty_last_n"), default=-1,
                   help="DRY: tokens of history scanned (-1: the whole context, 0: off)")
    p.add_argument("-s", "--seed", type=arg_type("seed"), default=-1, help="RNG seed (-1: random)")
    g = p.add_mutually_exclusive_group()  # llama.cpp's spelling of the four
    g.add_argument("--grammar", default=None, help="constrain the output with a GBNF (or Lark) grammar")
    g.add_argument("--grammar-file", default=None, help="read the grammar from this file")
    g.add_argument("-j", "--json-schema", default=None,
                   help="constrain the output to JSON valid under this schema, e.g. '{\"type\": \"object\"}'")
    g.add_argument("-jf", "--json-schema-file", default=None, help="read the JSON schema from this file")
    p.add_argument("-r", "--reverse-prompt", action="append", default=None, metavar="PROMPT",
                   help="halt generation at PROMPT (llama.cpp's flag; give it again for more: the "
                        "first to appear ends the text)" + ("" if chat else
                        "; printed, as llama.cpp prints it, after a -p/-f prompt's text, left out of "
                        "a chat's answer"))
    if not chat:
        p.add_argument("--context-shift", action="store_true",
                       help="where the context fills, drop the oldest half of the text after "
                            "--keep tokens and go on (llama.cpp's flag; off: generation stops "
                            "at a full context)")
        p.add_argument("--keep", type=arg_type("keep"), default=0,
                       help="with --context-shift, the prompt's first N tokens always kept (-1: "
                            "the whole prompt; BOS is always kept; default 0)")
        p.add_argument("--ignore-eos", action="store_true", help="keep generating past end of text")
        p.add_argument("--chat", action="store_true",
                       help="render the prompt as one user turn with the GGUF's chat template")
        p.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    p.add_argument("--system", default=None,
                   help="system message of the conversation" if chat else "system message for --chat and -i")
    add_template_kwargs_flag(p)
    add_engine_flags(p)
    p.add_argument("--verbose", action="store_true",
                   help="print speed and FFN sparsity after every answer" if chat else
                   "print the FFN sparsity after the timings (in a chat: speed and sparsity "
                   "after every answer)")
    return p


def print_timings(t, file=None):
    """llama.cpp's perf summary (llama_perf_context_print), same fields and units; to ``file``
    (default: the current sys.stderr, looked up at call time)."""
    file = file or sys.stderr
    def line(label, ms, n, unit):
        per = ms / n if n else 0.0
        tps = 1e3 * n / ms if ms > 0 else 0.0
        print(f"pyinfer_perf: {label:>16} = {ms:10.2f} ms / {n:5d} {unit:6} "
              f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)", file=file)
    print(f"pyinfer_perf: {'load time':>16} = {t.load_ms:10.2f} ms", file=file)
    line("sampling time", t.sample_ms, t.sample_n, "runs")  # llama_perf_sampler_print
    line("prompt eval time", t.prompt_ms, t.prompt_n, "tokens")
    line("eval time", t.eval_ms, t.eval_n, "runs")
    if getattr(t, "passes_reduced", 0):  # the thread governor (pyinfer.threads) stepped in
        print(f"pyinfer_perf: {'threads':>16} = {t.n_threads} asked; {t.passes_reduced} of "
              f"{t.passes} passes ran on fewer while other processes were runnable", file=file)
    total = t.load_ms + t.prompt_ms + t.eval_ms + t.sample_ms
    print(f"pyinfer_perf: {'total time':>16} = {total:10.2f} ms / {t.prompt_n + t.eval_n:5d} tokens",
          file=file)


def check_args(args) -> str:
    """Validate what argparse cannot (each numeric flag's range is checked by its ``type``,
    pyinfer/options.py); return the model path. Raises PyinferError."""
    return _model_path(args, "pyinfer-run MODEL.gguf -p PROMPT (or -m MODEL.gguf)")


def add_control_token_stops(llm, sampling: dict) -> None:
    """``sampling["halt_ids"]``: the ids of its reverse prompts (``stop``) that are one control
    token (``<|im_start|>``), where there are any. The text never shows such a token, so
    llama.cpp's main matches them against the sampled token (``antiprompt_token``); text
    matching alone never halted at them."""
    halt = []
    for s in sampling.get("stop", ()):
        ids = llm.tokenize(s, add_bos=False, special=True)
        if len(ids) == 1 and llm.tokenizer.is_control(ids[0]):
            halt.append(ids[0])
    if halt:
        sampling["halt_ids"] = halt


def n_predict_arg(text: str) -> int:
    """argparse ``type=`` of pyinfer-run's ``-n``: ``n_predict``'s range, and llama.cpp's -2."""
    if text.strip() == "-2":
        return -2
    return arg_type("n_predict")(text)


def sampling_kwargs(args, chat: bool = False) -> dict:
    """Keyword arguments of ``LLM.stream_text`` for the sampling and grammar flags (``chat``: for
    the interactive chat, whose DRY default is CHAT_DRY_MULTIPLIER). Raises PyinferError for a
    grammar or schema file that cannot be read or does not parse."""
    dry = args.dry_multiplier
    if dry is None:
        dry = CHAT_DRY_MULTIPLIER if chat else 0.0
    kw = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
              repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
              dry_multiplier=dry, dry_base=args.dry_base,
              dry_allowed_length=args.dry_allowed_length, dry_penalty_last_n=args.dry_penalty_last_n)
    grammar = grammar_of_args(args)
    if grammar is not None:
        kw["grammar"] = grammar
    stops = getattr(args, "reverse_prompt", None)
    if stops:
        if getattr(args, "escape", False):
            stops = [process_escapes(s) for s in stops]
        if not all(stops):
            raise PyinferError("-r/--reverse-prompt: an empty reverse prompt stops nothing")
        kw["stop"] = list(stops)
    return kw


#: Largest grammar or schema file read (llama.cpp's grammars are a few KiB).
MAX_GRAMMAR_BYTES = 1 << 20


def grammar_of_args(args):
    """The ``pyinfer.grammar.Grammar`` of --grammar/--grammar-file/-j/-jf, or None; compiled and
    checked by llguidance here (an unknown type or ``$ref``, an unsatisfiable schema) so a bad one
    is an error before the model loads."""
    from pyinfer.grammar import Grammar

    if getattr(args, "grammar_file", None):
        args.grammar = read_text_file(args.grammar_file, MAX_GRAMMAR_BYTES, "grammar file", hint="is it the right file?")
    if getattr(args, "json_schema_file", None):
        args.json_schema = read_text_file(args.json_schema_file, MAX_GRAMMAR_BYTES, "JSON schema file",
                                          hint="is it the right file?")
    if getattr(args, "grammar", None) is not None:
        g = Grammar("gbnf", args.grammar)
    elif getattr(args, "json_schema", None) is not None:
        g = Grammar.json_schema(args.json_schema)
    else:
        return None
    g.check()
    return g


def gpu_flags(args) -> list[str]:
    """The GPU placement flags given in ``args`` (as a user spells them)."""
    given = [("--vram-budget", getattr(args, "vram_budget", None) is not None),
             ("-ngl", bool(getattr(args, "n_gpu_layers", None))),
             ("--reset-gpu-index", getattr(args, "reset_gpu_index", False)),
             ("--disable-gpu-index", getattr(args, "disable_gpu_index", False))]
    return [name for name, on in given if on]


def warn_ignored_gpu_flags(args) -> None:
    """Say on stderr, once, that GPU flags are ignored when the run falls back to the CPU (device
    auto without a GPU); ``--device cpu`` with them stays an error (pyinfer/hybrid.py)."""
    flags = gpu_flags(args)
    if not flags or getattr(args, "device", None) not in (None, "auto"):
        return
    from pyinfer.ops import cuda

    if not cuda.available():
        print(f"pyinfer: no GPU ({cuda.unavailable_reason()}): {', '.join(flags)} ignored; "
              "running on the CPU", file=sys.stderr)


def show_prompt_progress(engine, file=None) -> None:
    """Report a long prompt's evaluation (more than ``engine.PROMPT_BATCH`` new tokens) with
    ``pyinfer.progress.progress_bar`` on ``file`` (default stderr): a bar on a terminal, else a
    line now and then; it is gone when the prompt is evaluated."""
    from pyinfer.progress import progress_bar

    bar = []

    def report(done: int, total: int) -> None:
        if done == 0 and bar:  # a new prompt: the last one's bar was left by an interrupt
            bar.pop().close()
        if not bar:
            bar.append(progress_bar(total=total, desc="prompt", unit="tok", file=file))
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar.pop().close()

    engine.prompt_progress = report


def add_template_kwargs_flag(p) -> None:
    """llama.cpp's --chat-template-kwargs (pyinfer-run, -chat, -serve)."""
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="more chat-template variables, a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' (Qwen3)")


def load(args, model_path: str):
    """``LLM`` for the parsed run/chat/serve flags (a notice first when GPU flags are ignored).
    Raises PyinferError for a --chat-template-kwargs that is not a JSON object of variables
    (before the model loads)."""
    from pyinfer.api import LLM
    from pyinfer.chat import parse_template_kwargs

    text = getattr(args, "chat_template_kwargs", None)
    template_kwargs = parse_template_kwargs(text) if text is not None else {}
    warn_ignored_gpu_flags(args)
    llm = LLM(model_path, n_ctx=args.ctx_size or None, n_threads=args.threads, device=args.device,
              vram_budget=args.vram_budget, seed=None if args.seed == -1 else args.seed,
              dense=args.dense, reset_gpu_index=args.reset_gpu_index,
              disable_gpu_index=args.disable_gpu_index, n_gpu_layers=args.n_gpu_layers,
              cache_type=getattr(args, "cache_type", "auto"))
    llm.chat_template_kwargs = template_kwargs
    warn_past_training(llm.n_ctx, llm.engine.cfg.n_ctx_train)
    if not getattr(args, "no_warmup", False):  # llama.cpp's warm-up pass
        llm.engine.warmup()
    return llm


def run_chat(args) -> int:
    """Start the chat REPL for parsed pyinfer-run -i / pyinfer-chat flags."""
    from pyinfer.repl import ChatSession, describe_settings, repl

    model_path = check_args(args)
    if getattr(args, "prompt", None) is not None or getattr(args, "file", None):
        raise PyinferError("-p/-f cannot be used with the interactive chat")
    n = CHAT_N_PREDICT if args.n_predict is None else args.n_predict
    if n == 0:
        raise PyinferError("-n 0 leaves no room for an answer")
    sampling = sampling_kwargs(args, chat=True)
    llm = load(args, model_path)
    show_prompt_progress(llm.engine)
    add_control_token_stops(llm, sampling)
    session = ChatSession(llm, system=args.system, max_tokens=None if n < 0 else n, **sampling)
    print(f"pyinfer chat: {llm.model_name}, context {llm.n_ctx} tokens. "
          "/help for commands, Ctrl-C stops an answer, Ctrl-D exits.", file=sys.stderr)
    print(describe_settings(session), file=sys.stderr)
    status = repl(session, verbose=args.verbose)
    print_timings(llm.engine.timings)  # the whole session's, as llama.cpp's main at its end
    return status


def run(args) -> int:
    model_path = check_args(args)
    if args.interactive:
        one_shot = [f for f, on in (("--chat", args.chat), ("--ignore-eos", args.ignore_eos),
                                    ("--no-display-prompt", args.no_display_prompt),
                                    ("--context-shift", args.context_shift),
                                    ("--keep", args.keep != 0)) if on]
        if one_shot:
            raise PyinferError(f"{', '.join(one_shot)} go{'es' if len(one_shot) == 1 else ''} "
                               "with a one-shot prompt (-p/-f), not -i (the chat always "
                               "renders its template and stops at the end of a turn)")
        return run_chat(args)
    if args.system is not None and not args.chat:
        raise PyinferError("--system needs --chat or -i (a raw -p/-f prompt has no system turn)")
    if args.chat_template_kwargs is not None and not args.chat:
        raise PyinferError("--chat-template-kwargs needs --chat or -i (a raw -p/-f prompt "
                           "renders no template)")
    if args.file:
        prompt = read_text_file(args.file, prompt_file_limit(args.ctx_size), "prompt file")
        if prompt.endswith("\n"):  # llama.cpp's -f drops one trailing newline
            prompt = prompt[:-1]
    else:
        prompt = args.prompt
    if prompt is None:
        raise PyinferError("no prompt given: use -p PROMPT, -f FILE or -i")
    if args.escape:
        prompt = process_escapes(prompt)
    n_predict = RUN_N_PREDICT if args.n_predict is None else args.n_predict
    if n_predict == -2:  # llama.cpp's "until the context is filled": no shift, even if asked
        n_predict, args.context_shift, args.keep = -1, False, 0
    sampling = sampling_kwargs(args)  # a bad grammar is reported before the model loads
    if args.seed != -1:  # the request's seed, as llama.cpp's -s and the API's / server's seed
        sampling["seed"] = args.seed

    if args.keep != 0 and not args.context_shift:
        raise PyinferError("--keep goes with --context-shift (without it nothing is dropped)")
    shift = args.keep if args.context_shift else None
    llm = load(args, model_path)
    show_prompt_progress(llm.engine)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None
                    else [])
        messages.append({"role": "user", "content": prompt})
        ids = llm.chat_tokens(messages)
    else:
        ids = llm.tokenize(prompt)
    llm.check_fits(ids)
    add_control_token_stops(llm, sampling)
    if not args.no_display_prompt and not args.chat:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    status = 0
    if n_predict != 0:
        try:
            for piece in llm.stream_text(ids, max_tokens=None if n_predict < 0 else n_predict,
                                         ignore_eos=args.ignore_eos, context_shift=shift,
                                         **sampling):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # the text so far and the timings stay, as in llama.cpp
            print("\n[interrupted]", file=sys.stderr)
            status = EXIT_INTERRUPTED
    s = llm.last_stats
    if status == 0 and s is not None and s.stop_string is not None and not args.chat:
        sys.stdout.write(s.stop_string)  # llama.cpp prints the reverse prompt it halted at
    sys.stdout.write("\n")
    sys.stdout.flush()
    if n_predict != 0 and status == 0 and s is not None and s.finish_reason == "length" and (
            n_predict < 0 or s.completion_tokens < n_predict):
        hint = ("--context-shift has nothing left to drop after --keep's tokens; raise -c or "
                "lower --keep" if shift is not None else "raise -c, or --context-shift")
        print(f"[generation stopped after {s.completion_tokens} tokens: the context "
              f"({llm.n_ctx} tokens) is full; {hint}]", file=sys.stderr)
    print(file=sys.stderr)
    # llama.cpp's system_info line, with the summary (so that an error stays one line)
    from pyinfer.ops import cpu

    print(f"system_info: {cpu.system_info(getattr(llm.engine, 'n_threads', args.threads))}",
          file=sys.stderr)
    print_timings(llm.engine.timings)
    if args.verbose and n_predict != 0 and s is not None:
        print(f"pyinfer_perf: {s.sparsity_label:>16} = {100 * s.ffn_sparsity:.1f}%",
              file=sys.stderr)
    return status


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return exit_code_of(run, args)


def chat_main(argv=None) -> int:
    """Entry point of pyinfer-chat: pyinfer-run -i with the chat's own --help."""
    args = build_parser("pyinfer-chat", chat=True).parse_args(argv)
    args.interactive = True
    return exit_code_of(run_chat, args)


if __name__ == "__main__":
    sys.exit(main())
