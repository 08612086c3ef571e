"""The Python API: ``LLM``, shaped like llama-cpp-python's ``Llama``.

``LLM`` wraps one ``Engine`` and turns its token ids into text: completions and chat completions as
OpenAI-shaped dicts (or iterators of chunks with ``stream=True``), stop strings, usage counts.
The CLI, the REPL and the server are built on it.

Example::

    from pyinfer import LLM
    llm = LLM("smollm2-q8.gguf", n_ctx=2048)
    out = llm.create_chat_completion([{"role": "user", "content": "Hi!"}], temperature=0)
    print(out["choices"][0]["message"]["content"])
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from pyinfer import options
from pyinfer.errors import PyinferError
from pyinfer.logprobs import LogprobRecorder
from pyinfer.reasoning import ReasoningSplitter, check_format, opens_thinking, split_reasoning
from pyinfer.sampler import SamplingParams

#: Most inputs one embeddings call takes (OpenAI's limit for /v1/embeddings).
MAX_EMBEDDING_INPUTS = 2048


@dataclass
class GenerationStats:
    """What one completion did: counts, times (ms), FFN work, why it ended.

    ``prompt_evaluated`` is how many prompt tokens were run through the model; the rest
    (``prompt_tokens - prompt_evaluated``) were reused from the KV cache.
    """

    prompt_tokens: int = 0
    prompt_evaluated: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    eval_ms: float = 0.0
    neurons_computed: int = 0
    neurons_total: int = 0
    finish_reason: str | None = None
    interrupted: bool = False
    # the stop string that ended the text (cut just before it); None when none did
    stop_string: str | None = None
    # what ``ffn_sparsity`` counts: FFN neurons, or in sparse mode "input" projection weight bytes
    sparsity_label: str = "FFN sparsity"

    # decode passes (tokens run through the model after the prompt; the first generated token
    # comes from the prompt's own logits), what llama.cpp's "eval time" counts as runs
    eval_runs: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: ``eval_runs`` per second of their evaluation (``eval_ms``), the rate of
        llama.cpp's "eval time" line; 0.0 where no token was decoded."""
        return 1e3 * self.eval_runs / self.eval_ms if self.eval_ms > 0 and self.eval_runs else 0.0

    @property
    def ffn_sparsity(self) -> float:
        """Fraction of FFN neurons skipped (0.0 for the dense FFN); in sparse mode "input" the
        fraction of projection weight bytes not read (``sparsity_label`` says which)."""
        if self.neurons_total <= 0:
            return 0.0
        return 1.0 - self.neurons_computed / self.neurons_total


@dataclass
class _Snapshot:
    prompt_n: int
    prompt_ms: float
    eval_n: int
    eval_ms: float
    computed: int
    total: int


def stop_holdback(text: str, stops: Iterable[str]) -> int:
    """Index where the longest tail of ``text`` that could begin a stop string starts
    (``len(text)`` if none). Text before it is safe to emit while streaming."""
    for i in range(max(0, len(text) - max((len(s) for s in stops), default=0) + 1), len(text)):
        tail = text[i:]
        if any(s.startswith(tail) for s in stops):
            return i
    return len(text)


def first_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest stop string in ``text`` (of two at one index, the
    first listed); (-1, None) when none occurs."""
    best, which = -1, None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, s
    return best, which


def token_ids(ids, what: str = "tokens") -> list[int]:
    """``ids`` (an iterable of integers: ints, NumPy integers) as a list of int; PyinferError
    naming ``what`` for anything else (a str, None, floats, bools, nested lists)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise PyinferError(f"{what} must be a list of token ids, not {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise PyinferError(f"{what} must be a list of token ids: {t!r} is not an integer")
        out.append(int(t))
    return out


def text_of_parts(parts: list, where: str, prefill: bool = False) -> str:
    """A message content given as OpenAI's parts (``[{"type": "text", "text": ...}, ...]``)
    as one string: the texts joined by a newline after any text so far, as llama.cpp's
    ``common_chat_msg::to_json_oaicompat(concat_typed_text)`` joins them (``["Hello", "world"]``
    -> "Hello\nworld"); ``prefill``: the last assistant message a chat continues, whose parts
    llama.cpp's server appends as they are (nothing between). PyinferError naming ``where`` for
    a part that is not text (the API's ``text_messages`` and the server's ``chat_messages`` both
    read parts so)."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
        raise PyinferError(f"{where}: only text parts are supported")
    if prefill:
        return "".join(p["text"] for p in parts)
    text = ""
    for p in parts:
        text += ("\n" if text else "") + p["text"]
    return text


def continues_last(messages) -> bool:
    """True where a chat's last message is the assistant's, which the answer continues
    (llama.cpp's server, ``prefill_assistant``)."""
    return (isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant")


def text_messages(messages) -> list:
    """``messages`` (a list or tuple) as a list, each content given as OpenAI's parts joined
    into one string (``text_of_parts``); other messages as they are (the template checks them).
    PyinferError for another type, an empty sequence or a part that is not text."""
    if not isinstance(messages, (list, tuple)):
        raise PyinferError("messages must be a list of {\"role\", \"content\"} messages, not "
                           f"{type(messages).__name__}")
    if not messages:
        raise PyinferError("messages is empty: a chat needs at least one message")
    last = len(messages) - 1 if continues_last(messages) else -1
    return [dict(m, content=text_of_parts(m["content"], f"messages[{i}].content", i == last))
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m
            for i, m in enumerate(messages)]


class LLM:
    """A model loaded for generation.

    Args:
        model_path: a GGUF written by ``pyinfer-convert``, or a llama.cpp GGUF (architecture
            llama, qwen2 or qwen3) run dense on the CPU (``pyinfer.llamacpp``).
        n_ctx: context size in tokens (None or 0: min(4096, the model's training context)).
        n_threads: kernel threads (None: the physical cores this process may run on, as llama.cpp picks them).
        device: "cpu", "cuda", "auto" or None (None and "auto": the GPU when CuPy sees one, else
            the CPU); "cuda" without a usable GPU raises PyinferError.
        vram_budget: GiB of GPU memory for the GPU part (attention, KV cache, hot neurons).
        seed: seed of the random stream that per-call seeds are drawn from (None: fresh entropy).
        verbose: print load information to stderr.
        dense: compute every FFN neuron even when the file has predictors (the offline stage's).
        reset_gpu_index, disable_gpu_index, n_gpu_layers: GPU placement options of
            ``pyinfer.engine.Engine`` (re-solve the split, whole layers only, llama.cpp -ngl).
        cache_type: the KV cache's type, "auto" (f32 for an f32 file, f16 otherwise), "f16" or
            "f32" (llama.cpp's --cache-type-k/v).
    Raises PyinferError for a bad file or setting.
    """

    def __init__(self, model_path: str, *, n_ctx: int | None = None, n_threads: int | None = None,
                 device: str | None = None, vram_budget: float | None = None,
                 seed: int | None = None, verbose: bool = False, dense: bool = False,
                 reset_gpu_index: bool = False, disable_gpu_index: bool = False,
                 n_gpu_layers: int | None = None, cache_type: str = "auto"):
        from pyinfer.engine import Engine

        options.check_optional("threads", n_threads, "n_threads")
        options.check_optional("ctx_size", n_ctx, "n_ctx")
        options.check_optional("vram_budget", vram_budget, "vram_budget")
        options.check_optional("n_gpu_layers", n_gpu_layers, "n_gpu_layers")
        seed = options.seed_or_none(seed)
        from pyinfer.kv_cache import CACHE_TYPE_AUTO, CACHE_TYPES

        if cache_type not in (CACHE_TYPE_AUTO, *CACHE_TYPES):
            raise PyinferError(f"cache_type {cache_type!r}: expected one of "
                               f"{', '.join([CACHE_TYPE_AUTO, *CACHE_TYPES])}")

        # device None: the GPU when there is one, quietly (generation); "cpu" / "cuda" choose.
        extra: dict[str, Any] = dict(device=device, vram_budget=vram_budget,
                                     reset_gpu_index=reset_gpu_index,
                                     disable_gpu_index=disable_gpu_index, n_gpu_layers=n_gpu_layers)
        if not isinstance(model_path, (str, os.PathLike)):
            raise PyinferError(f"model_path must be a path, not {type(model_path).__name__}")
        self.model_path = model_path
        self._engine = Engine(model_path, n_ctx=n_ctx or None, n_threads=n_threads,
                              verbose=verbose, dense=dense, cache_type=cache_type, **extra)
        self.tokenizer = self.engine.tokenizer
        self.verbose = verbose
        self.model_name = os.path.basename(model_path)
        self._rng = np.random.default_rng(seed)
        self.last_stats = GenerationStats()
        tok = self.tokenizer
        self.bos_token = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else ""
        self.eos_token = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
        self.chat_template = tok.chat_template
        #: extra chat-template variables of every chat (``chat.template_kwargs``; the CLIs'
        #: --chat-template-kwargs), under a call's own ``chat_template_kwargs``
        self.chat_template_kwargs: dict = {}

    @property
    def engine(self):
        """The ``pyinfer.engine.Engine`` this LLM runs; PyinferError once ``close`` was called."""
        if self._engine is None:
            raise PyinferError("this LLM is closed")
        return self._engine

    def close(self) -> None:
        """Release the model: its file mapping, weights and KV cache go with the engine (once
        nothing else holds them), as llama-cpp-python's ``Llama.close``. Calls after it raise
        PyinferError; closing twice does nothing. ``with LLM(path) as llm:`` closes at the end."""
        self._engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- tokens --------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def tokenize(self, text: str | bytes, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text`` (bytes are read as UTF-8). ``add_bos`` None: the model's default;
        ``special``: control tokens written in the text (``<|im_end|>``) become one id each."""
        self.engine  # (PyinferError once closed, as every call)
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=special)

    def detokenize(self, tokens: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``tokens``. (llama-cpp-python returns bytes; this returns str.) PyinferError
        for anything but token ids of the model's vocabulary."""
        ids = token_ids(tokens)
        self.engine._check_ids(ids)
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def reset(self) -> None:
        """Forget the KV cache (the next prompt is evaluated from its first token)."""
        self.engine.reset()

    # ---- token generation ----------------------------------------------------------------------
    def _params(self, temperature, top_k, top_p, min_p, repeat_penalty,
                repeat_last_n=64, **dry) -> SamplingParams:
        """Checked SamplingParams (pyinfer/options.py ranges); PyinferError for a bad value.
        ``dry``: dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n."""
        return SamplingParams(**options.sampling(temperature, top_k, top_p, min_p, repeat_penalty,
                                                 repeat_last_n, **dry))

    def _seed(self, seed: int | None) -> int:
        seed = options.seed_or_none(seed)  # -1: random, as llama.cpp
        return int(self._rng.integers(2**63)) if seed is None else int(seed)

    @staticmethod
    def _check_request(max_tokens, stop, seed, should_stop=None, *, context_shift=None,
                       **flags) -> None:
        """PyinferError for a bad ``max_tokens`` (None, -1, 0 or a positive count), ``stop``
        (a string or a list of strings), ``seed``, ``should_stop`` (None or a callable),
        ``context_shift`` (None or an integer) or a flag of ``flags`` (``stream``,
        ``ignore_eos``: True, False or None; "false" was taken as True)."""
        for name, value in flags.items():
            if value is not None and not isinstance(value, bool):
                raise PyinferError(f"{name} must be true or false, got {value!r}")
        if context_shift is not None and (isinstance(context_shift, bool)
                                          or not isinstance(context_shift, (int, np.integer))):
            raise PyinferError(f"context_shift must be an integer (the tokens kept, -1: the "
                               f"whole prompt) or None, got {context_shift!r}")
        if should_stop is not None and not callable(should_stop):
            raise PyinferError("should_stop must be a function (called after every token) or None")
        options.check_optional("n_predict", max_tokens, "max_tokens")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop)):
            raise PyinferError("stop must be a string or a list of strings")
        options.seed_or_none(seed)

    def generate(self, tokens: list[int], *, max_tokens: int | None = None, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None,
                 stop_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                 constraint=None, on_token=None, dry_multiplier: float = 0.0,
                 dry_base: float = 1.75, dry_allowed_length: int = 2,
                 dry_penalty_last_n: int = -1, context_shift: int | None = None,
                 halt_ids: Iterable[int] | None = None) -> Iterator[int]:
        """Yield token ids that follow ``tokens`` until an end-of-text/turn id (not yielded),
        ``max_tokens`` (None or <= 0: until the context is full) or a full context.

        The KV cache keeps the longest common prefix with the previous call, so a prompt that
        extends the last one (a chat's next turn) evaluates only its new tokens.
        ``constraint``, ``on_token``, ``context_shift`` (llama.cpp's --context-shift with
        --keep N: None off) and ``halt_ids``: see ``pyinfer.engine.Engine.generate``. ``dry_*``: the DRY
        repetition penalty (``pyinfer.sampler.apply_dry``; multiplier 0, the default, is off).
        Raises PyinferError when ``tokens`` is empty or does not leave room for one token.
        """
        tokens = token_ids(tokens)
        if stop_ids is not None:
            stop_ids = token_ids(stop_ids, "stop_ids")
        self.check_fits(tokens)
        self._check_request(max_tokens, None, seed, context_shift=context_shift, ignore_eos=ignore_eos)
        params = self._params(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                              dry_multiplier=dry_multiplier, dry_base=dry_base,
                              dry_allowed_length=dry_allowed_length,
                              dry_penalty_last_n=dry_penalty_last_n)
        limit = -1 if max_tokens is None or max_tokens <= 0 else int(max_tokens)
        if halt_ids is not None:
            halt_ids = token_ids(halt_ids, "halt_ids")
            self.engine._check_ids(halt_ids)
        hooks = {k: v for k, v in (("constraint", constraint), ("on_token", on_token),
                                   ("context_shift", context_shift), ("halt_ids", halt_ids))
                 if v is not None}
        yield from self.engine.generate(tokens, params, max_tokens=limit, seed=self._seed(seed),
                                        ignore_eos=ignore_eos, stop_ids=stop_ids, **hooks)

    def check_fits(self, tokens: list[int]) -> None:
        """Raise PyinferError unless ``tokens`` is non-empty and leaves room for one more token."""
        if not tokens:
            raise PyinferError("empty prompt")
        if len(tokens) >= self.n_ctx:
            what = "longer than" if len(tokens) > self.n_ctx else "as long as"
            raise PyinferError(f"prompt is {len(tokens)} tokens, {what} the context ({self.n_ctx}), "
                               "which leaves no room for an answer; raise n_ctx (-c/--ctx-size) or "
                               "shorten the prompt")

    def _snapshot(self, engine=None) -> _Snapshot:
        engine = engine or self.engine
        t = engine.timings
        ffn = getattr(getattr(engine, "model", None), "ffn", None)
        # FFNs count neurons in ``ffn.stats`` (active of total, pyinfer/ffn.py FFNStats); read through
        # getattr so an FFN without counters reports no sparsity instead of failing.
        st = getattr(ffn, "stats", None)
        if st is not None:
            computed, total = getattr(st, "active", 0), getattr(st, "total", 0)
        else:
            computed, total = getattr(ffn, "neurons_computed", 0), getattr(ffn, "neurons_total", 0)
        return _Snapshot(t.prompt_n, t.prompt_ms, t.eval_n, t.eval_ms, int(computed), int(total))

    def stream_text(self, prompt_tokens: list[int], *, max_tokens: int | None = None,
                    stop: str | list[str] | None = None, temperature: float = 0.8, top_k: int = 40,
                    top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                    repeat_last_n: int = 64, seed: int | None = None, ignore_eos: bool = False,
                    should_stop=None, grammar=None, logprobs: "LogprobRecorder | None" = None,
                    context_shift: int | None = None, stats: GenerationStats | None = None,
                    halt_ids: Iterable[int] | None = None, **dry) -> Iterator[str]:
        """Yield the text that follows ``prompt_tokens``, piece by piece, as it is generated.

        Honours ``stop`` strings: the text ends just before the first one, and no part of a stop
        string is ever yielded (text that could begin one is held back until it cannot).
        ``should_stop``: a callable checked after every token; when it returns True generation ends
        (finish_reason "stop", ``interrupted`` set). On return, ``self.last_stats`` holds the counts
        and ``finish_reason`` ("stop" or "length").
        ``grammar``: a ``pyinfer.grammar.Grammar`` the text must follow (generation ends when it is
        complete). ``logprobs``: a ``LogprobRecorder`` that collects each generated token's
        log-probability. ``context_shift``, ``halt_ids`` and ``dry``: the options of
        ``generate``. ``stats``: a
        GenerationStats to fill (it is also ``last_stats`` until another call replaces it: a
        stream's caller keeps its own). Raises PyinferError for a grammar that does not compile,
        and when the LLM is closed while the stream is open (at its next piece).
        """
        stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]  # "" stops nothing
        engine = self.engine
        if stats is None:
            stats = GenerationStats()
        stats.prompt_tokens = len(prompt_tokens)
        self.last_stats = stats
        if getattr(getattr(getattr(engine, "model", None), "ffn", None), "is_input_sparse", False):
            stats.sparsity_label = "weight reads skipped"
        before = self._snapshot(engine)
        dec = self.tokenizer.stream_decoder(skip_special=True, continuation=True)
        limit = None if max_tokens is None or max_tokens <= 0 else int(max_tokens)
        constraint = None if grammar is None else grammar.matcher(self.tokenizer)
        engine.finish_reason = None  # not the last generation's, should this one fail early
        gen = self.generate(prompt_tokens, max_tokens=limit, temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                            repeat_last_n=repeat_last_n, seed=seed, ignore_eos=ignore_eos,
                            constraint=constraint, context_shift=context_shift, halt_ids=halt_ids,
                            on_token=None if logprobs is None else logprobs.on_token, **dry)
        pending = ""  # decoded text not yet yielded (could be the start of a stop string)
        sent = 0  # characters yielded
        finish = None
        try:
            for tok in gen:
                if self._engine is None:  # closed while this stream was paused
                    raise PyinferError("this LLM is closed")
                stats.completion_tokens += 1
                piece = dec.feed(tok)
                if logprobs is not None:
                    logprobs.commit(len(piece))
                pending += piece
                if stops:
                    cut, stats.stop_string = first_stop(pending, stops)
                    if cut >= 0:
                        pending = pending[:cut]
                        finish = "stop"
                        if logprobs is not None:
                            logprobs.trim(sent + cut)
                        break
                    safe = stop_holdback(pending, stops)
                else:
                    safe = len(pending)
                if safe:
                    sent += safe
                    yield pending[:safe]
                    pending = pending[safe:]
                if should_stop is not None and should_stop():
                    stats.interrupted = True
                    finish = "stop"
                    break
            else:
                pending += dec.flush()
                if stops:
                    cut, stats.stop_string = first_stop(pending, stops)
                    if cut >= 0:
                        pending = pending[:cut]
                        finish = "stop"
                        if logprobs is not None:
                            logprobs.trim(sent + cut)
            if pending:
                yield pending
        finally:
            gen.close()
            if finish is None and constraint is not None and constraint.done:
                finish = "stop"  # the grammar is complete: the natural end of this answer
            if finish is None:  # the generation ended by itself: the engine says why
                finish = engine.finish_reason or "stop"
            stats.finish_reason = finish
            after = self._snapshot(engine)
            stats.prompt_evaluated = after.prompt_n - before.prompt_n
            stats.prompt_ms = after.prompt_ms - before.prompt_ms
            stats.eval_ms = after.eval_ms - before.eval_ms
            stats.eval_runs = after.eval_n - before.eval_n
            stats.neurons_computed = after.computed - before.computed
            stats.neurons_total = after.total - before.total

    # ---- completions ---------------------------------------------------------------------------
    def create_completion(self, prompt: str | list[int], max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                          min_p: float = 0.05, repeat_penalty: float = 1.0,
                          stop: str | list[str] | None = None, seed: int | None = None,
                          stream: bool = False, ignore_eos: bool = False, should_stop=None,
                          logprobs: int | None = None, response_format: dict | None = None,
                          grammar: str | None = None, json_schema=None, dry_multiplier: float = 0.0,
                          dry_base: float = 1.75, dry_allowed_length: int = 2,
                          dry_penalty_last_n: int = -1, repeat_last_n: int = 64):
        """Complete ``prompt`` (text, or token ids). Returns an OpenAI ``text_completion`` dict::

            {"id", "object": "text_completion", "created", "model",
             "choices": [{"text", "index": 0, "logprobs": None | {...}, "finish_reason": "stop"|"length"}],
             "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

        or, with ``stream=True``, an iterator of chunks of the same shape whose ``text`` pieces add
        up to the full text (the last chunk carries the finish_reason and empty text).
        max_tokens None, 0 or -1: until end of text or a full context. seed None or -1: random.
        An empty prompt text is the start of a document: the BOS token (llama-cpp-python's
        rule); a model with no BOS refuses it (empty prompt).
        ``should_stop``: a callable checked after every token (see ``stream_text``); the server
        passes "the client has gone".
        ``logprobs`` N (0..20): each token's log-probability and its N most likely alternatives, in
        OpenAI's ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
        ``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
        {"schema": ...}}``), ``grammar`` (GBNF or Lark text) or ``json_schema`` (a dict): constrain
        the text (pyinfer/grammar.py; at most one of them).
        Raises PyinferError for a prompt that does not fit, bad sampling parameters or a bad
        grammar (before any chunk is produced). ``dry_*``: the DRY repetition penalty, as in
        ``generate`` (off by default, as llama.cpp's server). ``repeat_last_n``: the tokens
        ``repeat_penalty`` looks back over (0: none, -1: the whole context, as llama.cpp).
        """
        self._check_request(max_tokens, stop, seed, should_stop, stream=stream, ignore_eos=ignore_eos)
        ids = self.prompt_ids(prompt)
        self.check_fits(ids)
        dry = dict(dry_multiplier=dry_multiplier, dry_base=dry_base,
                   dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n)
        self._params(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, **dry)
        gram = grammar_of(response_format, grammar, json_schema)
        if gram is not None:
            gram.check(self.tokenizer)  # a bad grammar fails here, before a stream starts
        rec = None
        if logprobs is not None:
            options.check("top_logprobs", logprobs, "logprobs")
            rec = LogprobRecorder(self.tokenizer, logprobs)
        kw = dict(max_tokens=max_tokens, stop=stop, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                  seed=seed, ignore_eos=ignore_eos,
                  should_stop=should_stop, grammar=gram, logprobs=rec, **dry)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stats = GenerationStats()  # this answer's (last_stats may be a later call's by its end)

        sent = [0]  # characters streamed: a chunk's logprobs cover only tokens whose text it sent

        def chunk(text, finish):
            sent[0] += len(text)
            lp = None if rec is None else rec.completion(rec.take(None if finish else sent[0]))
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

        if stream:
            def chunks():
                for piece in self.stream_text(ids, stats=stats, **kw):
                    yield chunk(piece, None)
                yield chunk("", stats.finish_reason)
            return chunks()
        text = "".join(self.stream_text(ids, stats=stats, **kw))
        out = chunk(text, stats.finish_reason)
        out["usage"] = self.usage(stats)
        return out

    def usage(self, stats: GenerationStats | None = None) -> dict:
        """OpenAI ``usage`` of ``stats`` (default: the last completion's): prompt, completion
        and total tokens."""
        s = stats or self.last_stats
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "total_tokens": s.prompt_tokens + s.completion_tokens}

    def __call__(self, prompt, **kw):
        """Same as ``create_completion`` (as llama-cpp-python's ``Llama.__call__``)."""
        return self.create_completion(prompt, **kw)

    # ---- chat ----------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> str:
        """Prompt text for ``messages`` with the GGUF's chat template (sandboxed Jinja2).
        A message's content may be OpenAI's list of text parts (``text_messages``).
        ``template_kwargs``: more template variables (``chat.template_kwargs``), over
        ``self.chat_template_kwargs``. Tool calls and results in the history are given as
        ``chat_tokens`` gives them (``pyinfer.tools.template_messages``). Raises PyinferError
        for no messages, a part that is not text, a malformed tool call, or template variables
        that ``chat.template_kwargs`` refuses."""
        from pyinfer.tools import template_messages

        return self._render(template_messages(text_messages(messages), self.chat_template),
                            add_generation_prompt, template_kwargs)

    def _render(self, messages: list, add_generation_prompt: bool,
                template_kwargs: dict | None, tools: list | None = None) -> str:
        """``render_chat`` of messages ``text_messages`` has read (the list may be empty);
        ``tools``: the template's ``tools`` variable (OpenAI's definitions) or None."""
        self.engine  # (PyinferError once closed, as every call)
        from pyinfer.chat import render_chat, template_kwargs as check_kwargs

        from pyinfer.chat import wants_typed_content

        variables = {**check_kwargs(self.chat_template_kwargs, "LLM.chat_template_kwargs"),
                     **check_kwargs(template_kwargs)}
        if wants_typed_content(self.chat_template):  # (SmolVLM's: it reads only parts)
            messages = [dict(m, content=[{"type": "text", "text": m["content"]}])
                        if isinstance(m, dict) and isinstance(m.get("content"), str) else m
                        for m in messages]
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, variables=variables,
                           tools=tools)

    def prompt_ids(self, prompt: str | bytes | list[int]) -> list[int]:
        """A completion prompt's token ids: text tokenized, token ids checked (``token_ids``);
        text of no tokens ("") is the start of a document, the BOS token where the model has
        one (OpenAI's default prompt; llama-cpp-python evaluates [BOS]), else [] (the caller's
        ``check_fits`` refuses it)."""
        if not isinstance(prompt, (str, bytes)):
            return token_ids(prompt, "prompt")
        ids = self.tokenize(prompt)
        if not ids and self.tokenizer.bos_id is not None:
            ids = [self.tokenizer.bos_id]
        return ids

    def prompt_opens_thinking(self, ids: list[int]) -> bool:
        """Does the rendered prompt ``ids`` end inside an open ``<think>`` block?"""
        return opens_thinking(self.tokenizer.decode(ids[-8:], skip_special=False))

    def chat_tokens(self, messages: list[dict], template_kwargs: dict | None = None,
                    tools=None) -> list[int]:
        """Token ids of ``messages`` rendered with a generation prompt (the start of an assistant
        turn; ``template_kwargs`` as ``render_chat``'s). BOS is added only when the model wants
        it and the template did not write it. A last message of role "assistant" is continued,
        as llama.cpp's server does (its ``prefill_assistant``, on by default): the messages
        before it rendered with a generation prompt, then its content, so the answer goes on
        from that text (its parts joined with nothing between, as llama.cpp appends them).
        ``tools``: a ``pyinfer.tools.ToolUse`` (its messages and ``tools`` variable) or None.
        Tool calls and results of the history are written as the template can read them
        (``pyinfer.tools.template_messages``; ToolError, a PyinferError, for a malformed call).
        PyinferError for two assistant messages at the end, or a continued one with tools."""
        from pyinfer.tools import template_messages

        msgs = template_messages(text_messages(messages), self.chat_template)
        if tools is not None:
            if continues_last(msgs):
                raise PyinferError("a last assistant message is continued, which tools cannot be "
                                   "combined with")
            msgs = tools.messages(msgs, self.chat_template)
        defined = tools.definitions() if tools is not None else None
        last = msgs[-1]
        if continues_last(msgs):
            before = msgs[:-1]
            if continues_last(before):
                raise PyinferError("messages end with two assistant messages: only the last "
                                   "one can be continued")
            content = last.get("content")
            if content is not None and not isinstance(content, str):
                raise PyinferError(f"messages[{len(msgs) - 1}].content must be a string")
            text = self._render(before, True, template_kwargs) + (content or "")
        else:
            text = self._render(msgs, True, template_kwargs, defined)
        add_bos = False if self.bos_token and text.startswith(self.bos_token) else None
        return self.tokenize(text, add_bos=add_bos, special=True)

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None,
                               temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, repeat_penalty: float = 1.0,
                               stop: str | list[str] | None = None, seed: int | None = None,
                               stream: bool = False, should_stop=None, logprobs: bool = False,
                               top_logprobs: int | None = None, response_format: dict | None = None,
                               grammar: str | None = None, json_schema=None,
                               dry_multiplier: float = 0.0, dry_base: float = 1.75,
                               dry_allowed_length: int = 2, dry_penalty_last_n: int = -1,
                               chat_template_kwargs: dict | None = None,
                               reasoning_format: str = "none", ignore_eos: bool = False,
                               repeat_last_n: int = 64, tools: list[dict] | None = None,
                               tool_choice=None, parallel_tool_calls: bool | None = None):
        """Answer a conversation. ``messages``: ``[{"role": "system"|"user"|"assistant",
        "content": str}, ...]``; a last assistant message is continued (its text is the start of
        the answer, which holds only what follows it: ``chat_tokens``). Returns an OpenAI
        ``chat.completion`` dict::

            {"id", "object": "chat.completion", "created", "model",
             "choices": [{"index": 0, "message": {"role": "assistant", "content"},
                          "logprobs": None | {"content": [...]}, "finish_reason": "stop"|"length"}],
             "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

        or, with ``stream=True``, an iterator of ``chat.completion.chunk`` dicts: the first delta
        carries the role, the next ones ``content`` pieces, the last one the finish_reason.
        Generation ends at the model's end-of-turn token. max_tokens None: until the context is full.
        ``seed`` and ``should_stop`` as in ``create_completion``. ``logprobs`` True: each token's
        log-probability in OpenAI's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``
        with ``top_logprobs`` (0..20) alternatives. ``response_format``, ``grammar``,
        ``json_schema``: constrain the answer as in ``create_completion``; ``dry_*`` and
        ``repeat_last_n`` as there.
        ``chat_template_kwargs``: more chat-template variables (e.g. Qwen3's
        ``{"enable_thinking": False}``), as ``render_chat``'s ``template_kwargs``.
        ``reasoning_format``: "none" (the text as written) or, as llama.cpp's server, "deepseek" /
        "auto": a ``<think>...</think>`` block (opened in the answer or by the prompt) goes to
        ``message.reasoning_content`` (streamed: ``delta.reasoning_content``), the rest to
        ``content`` (``pyinfer.reasoning``); a message without one has no such key. A continued
        last assistant message takes "none" (llama.cpp's server does the same).
        ``ignore_eos``: the model's end-of-generation tokens are never drawn (llama.cpp's
        ``ignore_eos``), so the answer runs to ``max_tokens`` or the context's end.
        ``tools``, ``tool_choice`` ("auto" when tools are given, "none", "required" or
        ``{"type": "function", "function": {"name"}}``), ``parallel_tool_calls`` (default
        False, as llama.cpp's server): OpenAI's function calling, in the chat template's format
        or llama.cpp's generic JSON format (``pyinfer.tools``). An answer that calls tools has
        ``message.tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments":
        JSON text}}]``), ``content`` None unless the model also wrote text (a ``</think>`` a
        required call's grammar wrote to close a prompt's thinking block is not text), and finish_reason
        "tool_calls". Streamed, the text for the user streams as it is written (the generic
        format's ``response`` string decoded as it comes, a Hermes answer's text before its
        first ``<tool_call>``); the calls come in one chunk at the end (with the logprobs of
        the tokens the earlier chunks' text held). Tools cannot be combined with
        ``response_format``, ``grammar`` or ``json_schema``.
        """
        dry = dict(dry_multiplier=dry_multiplier, dry_base=dry_base,
                   dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n)
        self._params(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, **dry)
        self._check_request(max_tokens, stop, seed, should_stop, stream=stream, ignore_eos=ignore_eos)
        if not isinstance(logprobs, bool):
            raise PyinferError("logprobs must be true or false")
        check_format(reasoning_format)
        if top_logprobs is not None:
            options.check("top_logprobs", top_logprobs, "top_logprobs")
            if not logprobs:
                raise PyinferError("top_logprobs needs logprobs set to true")
        from pyinfer.tools import ToolStream, ToolUse

        gram = grammar_of(response_format, grammar, json_schema)
        tool_use = ToolUse.of(tools, tool_choice, parallel_tool_calls, self.chat_template)
        if tool_use is not None:
            if gram is not None:
                raise PyinferError("tools cannot be combined with response_format, grammar or "
                                   "json_schema (llama.cpp's server refuses it too)")
            if tool_use.format == "generic":  # (the answer is JSON: no thinking block to split)
                reasoning_format = "none"
        ids = (self.chat_tokens(messages, chat_template_kwargs) if tool_use is None
               else self.chat_tokens(messages, chat_template_kwargs, tool_use))
        prompt_thinks = self.prompt_opens_thinking(ids)
        if tool_use is not None:  # (a required call closes a thinking block the prompt opened)
            gram = tool_use.grammar(prompt_thinks)
        if gram is not None:
            gram.check(self.tokenizer)
        rec = LogprobRecorder(self.tokenizer, top_logprobs or 0) if logprobs else None
        if continues_last(messages):  # a continued message's text as written (llama.cpp's server)
            reasoning_format = "none"
        self.check_fits(ids)
        kw = dict(max_tokens=max_tokens, stop=stop, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                  seed=seed, should_stop=should_stop,
                  grammar=gram, logprobs=rec, ignore_eos=bool(ignore_eos), **dry)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stats = GenerationStats()  # this answer's (last_stats may be a later call's by its end)

        # the answer's thinking block apart (reasoning_format), or None: the text as written
        thinking = reasoning_format != "none" and prompt_thinks  # the prompt opened the block
        split = None if reasoning_format == "none" else ReasoningSplitter(thinking)
        # a required call's grammar wrote the </think> the prompt left open: not content where
        # no reasoning split takes it
        closed_thinking = (tool_use is not None and tool_use.required and prompt_thinks
                           and tool_use.format == "hermes" and split is None)
        sent = [0]  # characters decided: a chunk's logprobs cover only tokens whose text it sent

        def lp(upto=None):
            return None if rec is None else {"content": rec.chat_content(rec.take(upto)),
                                             "refusal": None}

        def chunk(delta, finish, upto=0):
            """A chunk of ``delta``; its logprobs: the tokens whose text it completes (``upto``
            None: all the rest, -1: none, kept for a later chunk)."""
            sent[0] = split.consumed if split else sent[0] + len(delta.get("content") or "")
            if rec is not None and upto == -1 and not finish:
                logprobs = {"content": [], "refusal": None}  # (kept for a later chunk)
            else:
                logprobs = lp(None if finish or upto is None else sent[0])
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]}

        def deltas(parts):  # (kind, text) pieces of the splitter as chunk deltas
            return [{"reasoning_content" if kind == "reasoning" else "content": text}
                    for kind, text in parts]

        def finish_reason(calls):
            return "tool_calls" if calls else stats.finish_reason

        if stream:
            def chunks():
                # (with tools the answer may be only calls: content null, as OpenAI sends it)
                yield chunk({"role": "assistant", "content": None if tool_use else ""}, None)
                # with tools: the content is what ToolStream finds in the text (the calls are
                # read from the whole answer); its chunks' logprobs come with the last one
                tools_out = ToolStream(tool_use, closed_thinking) if tool_use is not None else None

                def out(delta):
                    if tools_out is None or "content" not in delta:
                        return chunk(delta, None)
                    text = tools_out.feed(delta["content"])
                    return chunk({"content": text}, None, upto=-1) if text else None

                for piece in self.stream_text(ids, stats=stats, **kw):
                    for delta in deltas(split.feed(piece)) if split else [{"content": piece}]:
                        if (c := out(delta)) is not None:
                            yield c
                for delta in deltas(split.flush()) if split else []:
                    if (c := out(delta)) is not None:
                        yield c
                calls = []
                if tools_out is not None:
                    rest, calls = tools_out.finish()
                    delta = {"content": rest} if rest else {}
                    if calls:
                        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
                    if delta:
                        yield chunk(delta, None, upto=None)
                yield chunk({}, finish_reason(calls))
            return chunks()
        text = "".join(self.stream_text(ids, stats=stats, **kw))
        message = {"role": "assistant", "content": text}
        if split:
            thoughts, message["content"] = split_reasoning(text, thinking)
            if thoughts:
                message["reasoning_content"] = thoughts
        calls = []
        if tool_use is not None:
            message["content"], calls = tool_use.parse(message["content"], closed_thinking)
            if calls:
                message["tool_calls"] = calls
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": message,
                             "logprobs": lp(), "finish_reason": finish_reason(calls)}],
                "usage": self.usage(stats)}

    def create_embedding(self, input: str | list, model: str | None = None,  # noqa: A002
                         should_stop=None) -> dict:
        """OpenAI ``/v1/embeddings``: for each input (a string, a list of strings, or token ids),
        the mean over its tokens of the final hidden states after the output norm, scaled to unit
        L2 norm (llama.cpp's server: mean pooling, ``embd_normalize`` 2). Returns
        ``{"object": "list", "data": [{"object": "embedding", "index", "embedding": [n_embd floats]}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}``. ``should_stop``: a callable
        checked before each input; when it returns True the call ends with PyinferError
        ("interrupted"). Raises PyinferError for an empty input, one longer than the context, or
        more than MAX_EMBEDDING_INPUTS inputs (OpenAI's limit). ``model`` is accepted and ignored
        (one model)."""
        if isinstance(input, str) or (isinstance(input, list) and input and isinstance(input[0], int)):
            input = [input]
        if not isinstance(input, list) or not input:
            raise PyinferError("input must be a string, a list of strings or a list of token ids")
        if should_stop is not None and not callable(should_stop):
            raise PyinferError("should_stop must be a function (called before each input) or None")
        if len(input) > MAX_EMBEDDING_INPUTS:
            raise PyinferError(f"input has {len(input)} items, more than {MAX_EMBEDDING_INPUTS} "
                               "(OpenAI's limit): send them in several requests")
        data, n_tokens = [], 0
        for i, item in enumerate(input):
            if should_stop is not None and should_stop():
                raise PyinferError(f"the embeddings were interrupted after {i} of {len(input)} "
                                   "inputs")
            ids = self.tokenize(item) if isinstance(item, str) else token_ids(item, f"input[{i}]")
            if not ids:
                raise PyinferError(f"input[{i}] is empty")
            h = self.engine.embeddings(ids).astype(np.float64).mean(axis=0)  # (n_embd,)
            norm = float(np.linalg.norm(h))
            data.append({"object": "embedding", "index": i,
                         "embedding": (h / norm if norm > 0 else h).tolist()})
            n_tokens += len(ids)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def grammar_of(response_format: dict | None, grammar: str | None, json_schema=None):
    """The ``pyinfer.grammar.Grammar`` a request asks for, or None.

    ``response_format``: OpenAI's ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (and llama.cpp's
    ``{"type": "json_object", "schema": {...}}``, the schema applied); ``grammar``: GBNF or
    Lark text (llama.cpp's ``grammar``); ``json_schema``: a schema dict (llama.cpp's
    ``json_schema``). Raises PyinferError for a malformed value or more than one of them.
    """
    from pyinfer.grammar import Grammar

    given = []
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
                "text", "json_object", "json_schema"):
            raise PyinferError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                               "or {\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}")
        kind = response_format["type"]
        if kind == "json_object" and response_format.get("schema") is not None:
            given.append(Grammar.json_schema(response_format["schema"]))  # llama.cpp's form
        elif kind == "json_object":
            given.append(Grammar("json_object"))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise PyinferError("response_format.json_schema must be an object with a 'schema' object")
            given.append(Grammar.json_schema(spec.get("schema", {})))
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise PyinferError("grammar must be a non-empty string (GBNF or Lark)")
        given.append(Grammar("gbnf", grammar))
    if json_schema is not None:
        given.append(Grammar.json_schema(json_schema))
    if len(given) > 1:
        raise PyinferError("give at most one of response_format, grammar and json_schema")
    return given[0] if given else None
