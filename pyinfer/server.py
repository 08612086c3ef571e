"""pyinfer-serve: an OpenAI-compatible HTTP server over one model (Starlette + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers with
server-sent events, ending with ``data: [DONE]``), ``POST /v1/embeddings`` (mean-pooled final hidden
states, unit length), ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``.
Requests take OpenAI's fields plus llama.cpp's ``top_k``, ``min_p``, ``repeat_penalty``,
``repeat_last_n``, ``dry_*``,
``ignore_eos``, ``grammar`` and ``json_schema``; ``response_format`` (json_object, json_schema) and ``grammar`` constrain the
output (pyinfer/grammar.py), ``logprobs``/``top_logprobs`` return log-probabilities in OpenAI's
shapes. A field the server does not implement is refused with 400 naming it (``FIELDS``), and so is
a value it cannot honour (``presence_penalty`` other than 0, ``echo``, ``n`` > 1 ...); ``tools``,
``tool_choice`` and ``parallel_tool_calls`` are OpenAI's function calling (``pyinfer.tools``);
``model``, ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and have no effect.
One engine serves one request at a time: requests wait in a bounded queue, and a request that finds
it full gets 503. A malformed request gets a 4xx with an OpenAI-style error body; nothing a client
sends stops the server: bodies are bounded before they are read, chat templates render in a worker
thread under a time and size bound (pyinfer/chat.py), and a client that leaves stops its answer.
``--api-key KEY`` asks every request but ``/health`` for ``Authorization: Bearer KEY`` (as
llama.cpp's server and the OpenAI client do); a non-loopback ``--host`` needs it (or ``--no-api-key``).
Install with ``pip install -e '.[server]'`` in the checkout.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import os
import queue
import sys
import threading
import time
from typing import Any, Callable

from pyinfer import options
from pyinfer.api import text_of_parts
from pyinfer.chat import template_kwargs
from pyinfer.reasoning import REASONING_FORMATS, check_format
from pyinfer.tools import ToolError, ToolUse
from pyinfer.errors import PyinferError, exit_code_of

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt that fits a context
_ROLES = ("system", "user", "assistant", "tool", "developer")


class BadRequest(Exception):
    """A request the server refuses, with its HTTP status and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---- request validation ------------------------------------------------------------------------
_COMMON = {"model", "user", "metadata", "store", "service_tier",  # informational: no effect
           "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
           "seed", "stop",
           "stream", "stream_options", "n", "logprobs", "response_format", "grammar", "json_schema",
           "presence_penalty", "frequency_penalty", "logit_bias",
           "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "ignore_eos"}
#: The request fields each endpoint reads; any other field is refused with 400.
FIELDS = {
    "/v1/completions": _COMMON | {"prompt", "echo", "best_of", "suffix"},
    "/v1/chat/completions": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                       "tool_choice", "parallel_tool_calls",
                                       "chat_template_kwargs", "reasoning_format"},
    "/v1/embeddings": {"model", "user", "input", "encoding_format", "dimensions"},
}
#: Fields accepted only at the value that asks for nothing (OpenAI's defaults).
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
            "echo": (False,), "best_of": (1,), "suffix": ("",)}


def check_fields(body: dict, endpoint: str) -> None:
    """BadRequest for a field ``endpoint`` does not implement, or one given a value it cannot
    honour (``_NEUTRAL``); null counts as absent."""
    unknown = sorted(k for k in body if k not in FIELDS[endpoint])
    if unknown:
        raise BadRequest(f"unsupported field{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(k) for k in unknown)} (pyinfer-serve implements "
                         f"{', '.join(sorted(FIELDS[endpoint]))})", unknown[0])
    for k, ok in _NEUTRAL.items():
        v = body.get(k)
        if v is not None and not any(v == o and type(v) is type(o) for o in ok):
            raise BadRequest(f"'{k}' is not supported (only {' or '.join(json.dumps(o) for o in ok)})", k)

def _number(body: dict, name: str, default, option: str):
    """``body[name]`` checked against ``option``'s range (pyinfer/options.py, shared with the CLI
    and the API); ``default`` when absent or null. NaN and infinities are refused."""
    v = body.get(name, default)
    if v is None:
        return default
    try:
        return options.check(option, v, f"'{name}'")
    except PyinferError as e:
        raise BadRequest(str(e), name) from None


def sampling_options(body: dict, max_tokens_default: int | None) -> dict:
    """Keyword arguments for ``LLM.create_*completion`` from an OpenAI request body.

    Raises BadRequest for a wrong type or range (unknown fields are refused before, by
    ``check_fields``); ``n`` must be 1.
    """
    if body.get("n", 1) not in (1, None) or isinstance(body.get("n"), (bool, float)):
        raise BadRequest("only n=1 is supported", "n")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise BadRequest("'stop' must be a string or a list of at most 16 strings", "stop")
    stream = False if body.get("stream") is None else body["stream"]  # (null counts as absent)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    # llama.cpp server's: the end tokens never drawn
    ignore_eos = False if body.get("ignore_eos") is None else body["ignore_eos"]
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be a boolean", "ignore_eos")
    grammar_fields = _grammar_fields(body)
    request_grammar(body)  # its shape; check_grammar converts it, off the event loop
    opts = dict(
        max_tokens=_number(body, "max_tokens", max_tokens_default, "max_tokens"),
        # llama.cpp server's defaults, not OpenAI's (temperature 1, no filters): kinder to small models
        temperature=_number(body, "temperature", 0.8, "temperature"),
        top_p=_number(body, "top_p", 0.95, "top_p"),  # 0: greedy (OpenAI; options.sampling)
        top_k=_number(body, "top_k", 40, "top_k"),
        min_p=_number(body, "min_p", 0.05, "min_p"),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, "repeat_penalty"),
        repeat_last_n=_number(body, "repeat_last_n", 64, "repeat_last_n"),  # -1: whole context
        # llama.cpp server's DRY fields and defaults (multiplier 0: off)
        dry_multiplier=_number(body, "dry_multiplier", 0.0, "dry_multiplier"),
        dry_base=_number(body, "dry_base", 1.75, "dry_base"),
        dry_allowed_length=_number(body, "dry_allowed_length", 2, "dry_allowed_length"),
        dry_penalty_last_n=_number(body, "dry_penalty_last_n", -1, "dry_penalty_last_n"),
        seed=_number(body, "seed", None, "seed"),  # -1: random, as llama.cpp's server
        stop=stop,
        stream=stream,
        ignore_eos=ignore_eos,
        **{k: v for k, v in grammar_fields.items() if v is not None},
    )
    return opts


def _grammar_fields(body: dict) -> dict:
    return dict(response_format=body.get("response_format"), grammar=body.get("grammar"),
                json_schema=body.get("json_schema"))


def _grammar_error(body: dict, e: PyinferError) -> BadRequest:
    """A grammar's PyinferError as a 400 naming the field that gave it (the first one set)."""
    given = [k for k, v in _grammar_fields(body).items() if v is not None]
    return BadRequest(str(e), given[0] if given else None)


def request_grammar(body: dict):
    """The ``pyinfer.grammar.Grammar`` the body asks for, or None. Raises BadRequest naming the
    field for a malformed one."""
    from pyinfer.api import grammar_of

    try:
        return grammar_of(**_grammar_fields(body))
    except PyinferError as e:
        raise _grammar_error(body, e) from None


def check_grammar(body: dict, tokenizer) -> None:
    """BadRequest naming the field when the body's grammar does not convert or llguidance
    refuses it with ``tokenizer`` (an unsatisfiable schema, an unknown $ref, too many GBNF
    rules): the request's fault, answered 400 before it waits in the queue. Converting a GBNF
    grammar can take a second: call it off the event loop. The conversion is cached for the
    engine's use."""
    g = request_grammar(body)
    if g is None:
        return
    try:
        g.check(tokenizer)
    except PyinferError as e:
        raise _grammar_error(body, e) from None


def encode_embeddings(result: dict, fmt: str) -> dict:
    """``result`` of ``LLM.create_embedding`` with each vector as OpenAI's ``encoding_format`` asks:
    "float" (a list) or "base64" (little-endian float32 bytes, base64; what the openai client
    requests by default)."""
    if fmt == "base64":
        import base64

        import numpy as np

        for d in result["data"]:
            d["embedding"] = base64.b64encode(np.asarray(d["embedding"], "<f4").tobytes()).decode("ascii")
    return result


def logprob_options(body: dict, chat: bool) -> dict:
    """``logprobs`` (completions: an integer 0..20 of alternatives; chat: a boolean, with
    ``top_logprobs`` 0..20) as keyword arguments of ``LLM.create_*completion``."""
    lp = body.get("logprobs")
    if not chat:
        if lp is None:
            return {}
        return {"logprobs": _number(body, "logprobs", None, "top_logprobs")}
    if lp is not None and not isinstance(lp, bool):
        raise BadRequest("'logprobs' must be a boolean", "logprobs")
    top = _number(body, "top_logprobs", None, "top_logprobs")
    if top is not None and not lp:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return {"logprobs": bool(lp), "top_logprobs": top} if lp else {}


def include_usage(body: dict) -> bool:
    """``stream_options.include_usage``: end a stream with a chunk that carries ``usage``."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    if body.get("stream") is not True:  # OpenAI's rule
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return so.get("include_usage", False)


def chat_messages(body: dict) -> list[dict]:
    """``messages`` of a chat request as ``[{"role", "content": str}]``; text parts are joined;
    an assistant message's ``reasoning_content`` (a string: the thinking block this server gave
    out, sent back) is kept for the template, as llama.cpp's server keeps it (Qwen3's template
    renders it for the turns after the last user message), and so are ``tool_calls`` (an
    assistant's list of objects), ``tool_call_id`` and ``name`` (strings)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}", "messages")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            try:  # (the last assistant message, which the answer continues: joined as they are)
                content = text_of_parts(content, f"messages[{i}].content",
                                        role == "assistant" and i == len(msgs) - 1)
            except PyinferError as e:
                raise BadRequest(str(e), "messages") from None
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        thoughts = m.get("reasoning_content")
        if thoughts is not None and role == "assistant":
            if not isinstance(thoughts, str):
                raise BadRequest(f"messages[{i}].reasoning_content must be a string", "messages")
            msg["reasoning_content"] = thoughts
        # a tool-using history, passed to the template as given (transformers' and llama.cpp's
        # servers pass them; dropped, a tool result rendered with no call before it)
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) for c in calls):
                raise BadRequest(f"messages[{i}].tool_calls must be a list of objects on an "
                                 "assistant message", "messages")
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise BadRequest(f"messages[{i}].{key} must be a string", "messages")
                msg[key] = m[key]
        out.append(msg)
    return out


def completion_prompt(body: dict):
    """``prompt`` of a completion request: a string, a list of one string, or token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):  # ("" is the start of a document: the API generates from BOS)
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise BadRequest("'prompt' must be a string (or a non-empty list of token ids)", "prompt")


# ---- the engine worker -------------------------------------------------------------------------
class ShuttingDown(Exception):
    """What a request gets when the server stops before or while it runs (a 503, or an error
    event before a stream's [DONE])."""

    def __init__(self):
        super().__init__("the server is shutting down; retry on another instance or later")


class Job:
    """A request's place in the EngineWorker: ``set()`` says its client has gone (a waiting job
    then gives its place up at once; a running one sees ``is_set()`` within a token), and
    ``release()``, called by the job just before it hands out its last item, frees its place
    then (freed only when the worker came back to its loop, a client that sent its next request
    at once could find the queue "full": a false 503)."""

    def __init__(self, worker: "EngineWorker", fn: Callable[["Job"], None]):
        self.worker, self.fn = worker, fn
        self._cancel = threading.Event()
        self.started = False
        self.released = False
        #: called (any thread) when the job gives its place up before it ran, so that whoever
        #: waits for its answer hears of it (a shutdown's 503)
        self.on_abandon: Callable[[], None] | None = None

    def set(self) -> None:
        self._cancel.set()
        with self.worker._lock:
            abandoned = not self.started and not self.released
            if not self.started:
                self._release()
        if abandoned and self.on_abandon is not None:
            self.on_abandon()

    def is_set(self) -> bool:
        return self._cancel.is_set()

    def release(self) -> None:
        with self.worker._lock:
            self._release()

    def _release(self) -> None:  # (under the worker's lock)
        if not self.released:
            self.released = True
            self.worker._pending -= 1


class EngineWorker:
    """Runs jobs on the model one at a time in a daemon thread; at most ``max_queue`` wait.

    ``submit(fn, on_abandon)`` raises ``QueueFull`` when ``max_queue`` jobs are already waiting
    behind the running one or the server is shutting down, and otherwise returns the ``Job``;
    ``fn`` is called with it (``is_set()``: its client has gone). ``cancel_all()`` sets every
    job (a shutdown; call it from a thread of its own, not a signal handler: it takes the lock).
    """

    class QueueFull(Exception):
        pass

    def __init__(self, max_queue: int = 4):
        self.max_queue = max_queue
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # waiting + running, not released
        self._live: set[Job] = set()
        self.shutting_down = False
        self._thread = threading.Thread(target=self._loop, name="pyinfer-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return self._pending

    def submit(self, fn: Callable[[Job], None], on_abandon: Callable[[], None] | None = None) -> Job:
        job = Job(self, fn)
        job.on_abandon = on_abandon  # (before the job is visible to a shutdown)
        with self._lock:
            if self._pending >= 1 + self.max_queue or self.shutting_down:
                raise self.QueueFull()
            self._pending += 1
            self._live.add(job)
        self._jobs.put(job)
        return job

    def cancel_all(self) -> None:
        """The server is stopping: every job is set (a stream stops within a token, a waiting
        request is answered 503 at once) and no new one is taken."""
        self.shutting_down = True
        with self._lock:
            live = list(self._live)
        for job in live:
            job.set()

    def _loop(self):
        while True:
            job = self._jobs.get()
            with self._lock:
                if job.released:  # its client left while it waited
                    self._live.discard(job)
                    continue
                job.started = True
            try:
                job.fn(job)
            except BaseException:  # noqa: BLE001 - fn reports its own errors; the worker must live
                pass
            finally:
                job.release()
                with self._lock:
                    self._live.discard(job)


# ---- the app -----------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, "localhost")."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def bearer_ok(authorization: bytes, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (constant-time compare)."""
    scheme, _, token = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


class ApiKeyMiddleware:
    """ASGI middleware: 401 with an OpenAI-shaped error unless the request carries
    ``Authorization: Bearer <api_key>``; ``/health`` stays open (as llama.cpp's server keeps it)."""

    PUBLIC = ("/health",)

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.PUBLIC:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not bearer_ok(auth, self.api_key):
                from starlette.responses import JSONResponse

                body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  kind="authentication_error")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def next_or_gone(out: asyncio.Queue, request) -> tuple[Any, bool]:
    """(the next item of ``out``, or None where the client left first; whether it left) -
    whichever comes first of a job's next item and the client's disconnect."""
    got = asyncio.ensure_future(out.get())
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = gone.done() and not gone.cancelled()
        gone.cancel()
    if not got.done():
        got.cancel()
        return None, left
    return got.result(), left


def _log_gone(request) -> None:
    """One log line for a request whose client left before its answer (uvicorn writes no access
    line for a response nobody takes)."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "?"
    print(f"pyinfer-serve: {client} - \"{request.method} {request.url.path}\" 499: the client "
          "left before the answer (stopped)", file=sys.stderr)


async def _until_disconnect(receive) -> None:
    """Return when the client has gone (the body has been read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(llm, max_queue: int = 4, api_key: str | None = None,
               reasoning_format: str = "auto"):
    """The Starlette app serving ``llm`` (a ``pyinfer.LLM``); ``api_key``: see ApiKeyMiddleware;
    ``reasoning_format``: a chat request's default (``pyinfer.reasoning``; llama.cpp's server
    splits a thinking block into ``reasoning_content`` by default too)."""
    check_format(reasoning_format)
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    worker = EngineWorker(max_queue)
    created = int(time.time())

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse(error_body(message, param, kind), status_code=status)

    async def read_json(request: Request) -> dict:
        """The JSON object of the body, read only while it stays under MAX_BODY_BYTES (refused
        from Content-Length before reading, or as soon as a chunked body passes the limit)."""
        too_big = BadRequest(f"request body larger than {MAX_BODY_BYTES} bytes", status=413)
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise BadRequest("invalid Content-Length header")
            if int(length) > MAX_BODY_BYTES:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        try:  # a lone surrogate ("\ud800") parses, but no tokenizer can encode it
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("request body has a string that is not valid Unicode "
                             "(a lone surrogate escape such as \\ud800)") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        return body

    def check_room(prompt_ids: list[int], max_tokens: int | None, field: str) -> None:
        """BadRequest naming ``field`` (the request's prompt field: "prompt" or "messages")
        where the prompt leaves no room in the context, or "max_tokens" where it and the
        prompt do not fit together."""
        n_ctx = llm.n_ctx
        if len(prompt_ids) >= n_ctx:
            raise BadRequest(f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                             f"{n_ctx} tokens", field)
        if max_tokens is not None and len(prompt_ids) + max_tokens > n_ctx:
            raise BadRequest(f"this model's context is {n_ctx} tokens, but {len(prompt_ids)} prompt "
                             f"tokens + max_tokens {max_tokens} = {len(prompt_ids) + max_tokens}",
                             "max_tokens")

    def outside_vocab(ids: list[int]) -> bool:
        """Does ``ids`` hold a token id outside the model's vocabulary?"""
        return any(not 0 <= t < llm.tokenizer.n_vocab for t in ids)

    def error_of(item) -> Response | None:
        """The error response of a job's item (a shutdown, a bad request, an internal error),
        or None for an answer."""
        if isinstance(item, ShuttingDown):
            return error(503, str(item), kind="server_busy")
        if isinstance(item, BadRequest):
            return error(item.status, str(item), item.param)
        if isinstance(item, Exception):
            return error(500, f"internal error: {type(item).__name__}: {item}", kind="server_error")
        return None

    async def run_job(request: Request, make: Callable[[Callable[[], bool]], Any], stream: bool,
                      usage: bool = False):
        """Queue ``make(should_stop)`` (which returns a dict, or an iterator of chunk dicts) on the
        worker; ``should_stop()`` turns True when the client has gone, and generation ends there."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        done = object()

        def job(cancel: Job):
            def last(item):  # the job's place is free before its client can send the next request
                cancel.release()
                loop.call_soon_threadsafe(out.put_nowait, item)

            if cancel.is_set():  # the client left while the job waited
                last(done)
                return
            try:
                result = make(cancel.is_set)
                if not stream:
                    last(ShuttingDown() if worker.shutting_down else result)
                    return
                chunk = None
                for chunk in result:
                    if cancel.is_set():
                        result.close()
                        if worker.shutting_down:  # (said in the stream, before its [DONE])
                            loop.call_soon_threadsafe(out.put_nowait, ShuttingDown())
                        break
                    if usage:  # OpenAI: "usage": null on every chunk before the last
                        chunk = dict(chunk, usage=None)
                    loop.call_soon_threadsafe(out.put_nowait, chunk)
                else:
                    if usage and chunk is not None:
                        loop.call_soon_threadsafe(out.put_nowait, dict(chunk, choices=[],
                                                                       usage=llm.usage()))
                last(done)
            except PyinferError as e:  # (stopped by a shutdown: a 503, as the other requests)
                last(ShuttingDown() if worker.shutting_down else BadRequest(str(e)))
            except Exception as e:  # noqa: BLE001 - reported to the client, the server lives on
                print(f"pyinfer-serve: internal error: {type(e).__name__}: {e}", file=sys.stderr)
                last(e)

        try:
            cancel = worker.submit(job, on_abandon=lambda: loop.call_soon_threadsafe(
                out.put_nowait, ShuttingDown() if worker.shutting_down else done))
        except EngineWorker.QueueFull:
            if worker.shutting_down:
                return error(503, str(ShuttingDown()), kind="server_busy")
            return error(503, "the server is busy (request queue full); retry later",
                         kind="server_busy")
        if not stream:
            # Wait for the answer or the client's disconnect, whichever comes first; on a
            # disconnect the job's should_stop turns True and the engine is free within a token.
            try:
                result, _ = await next_or_gone(out, request)
            finally:
                cancel.set()
            if result is None:
                _log_gone(request)
                return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
            return error_of(result) or JSONResponse(result)

        # an error before the first chunk is still a proper status code; a client that leaves
        # while its request waits in the queue cancels it there (it ran its prefill before)
        first, left = await next_or_gone(out, request)
        if left or first is None:
            cancel.set()
            _log_gone(request)
            return Response(status_code=499)
        failed = error_of(first)
        if failed is not None:
            cancel.set()
            return failed

        async def events():
            item = first
            try:
                while item is not done:
                    if isinstance(item, Exception):
                        yield f"data: {json.dumps(error_body(str(item), kind='server_error'))}\n\n"
                        break
                    yield f"data: {json.dumps(item)}\n\n"
                    item = await out.get()
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # the client went away, or we are done: stop generating

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(request: Request):
        try:
            body = await read_json(request)
            check_fields(body, "/v1/completions")
            prompt = completion_prompt(body)
            opts = sampling_options(body, max_tokens_default=16)
            opts.update(logprob_options(body, chat=False))
            usage = include_usage(body)
            await run_in_threadpool(check_grammar, body, llm.tokenizer)
            # tokenizing up to 1 MiB takes a while: off the event loop, which keeps serving
            ids = await run_in_threadpool(llm.prompt_ids, prompt)  # ("": BOS, as the API has it)
            if isinstance(prompt, list) and outside_vocab(prompt):
                raise BadRequest("'prompt' has a token id outside the vocabulary", "prompt")
            if not ids:
                raise BadRequest("'prompt' is empty and the model has no BOS token to start "
                                 "from", "prompt")
            check_room(ids, opts["max_tokens"], "prompt")
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        return await run_job(request, lambda stop: llm.create_completion(ids, should_stop=stop, **opts),
                             opts["stream"], usage)

    async def chat_completions(request: Request):
        try:
            body = await read_json(request)
            check_fields(body, "/v1/chat/completions")
            messages = chat_messages(body)
            opts = sampling_options(body, max_tokens_default=None)
            opts.update(logprob_options(body, chat=True))
            usage = include_usage(body)
            await run_in_threadpool(check_grammar, body, llm.tokenizer)
            # OpenAI's newer name; checked even beside max_tokens (which wins, as in llama.cpp)
            completion_cap = _number(body, "max_completion_tokens", None, "max_tokens")
            if completion_cap is not None and body.get("max_tokens") is None:
                opts["max_tokens"] = completion_cap
            try:  # (llama.cpp's and vLLM's field: more template variables, over --chat-template-kwargs)
                opts["chat_template_kwargs"] = template_kwargs(body.get("chat_template_kwargs"))
            except PyinferError as e:
                raise BadRequest(str(e), "chat_template_kwargs") from None
            for key in ("tools", "tool_choice", "parallel_tool_calls"):
                opts[key] = body.get(key)
            try:
                tool_use = ToolUse.of(opts["tools"], opts["tool_choice"], opts["parallel_tool_calls"],
                                      llm.chat_template if opts["tools"] is not None else None)
            except ToolError as e:
                raise BadRequest(str(e), e.param) from None
            if tool_use is not None and request_grammar(body) is not None:
                raise BadRequest("tools cannot be combined with response_format, grammar or "
                                 "json_schema", "tools")
            fmt = body.get("reasoning_format")
            try:  # (null: not given, as every field here)
                opts["reasoning_format"] = check_format(reasoning_format if fmt is None else fmt)
            except PyinferError as e:
                raise BadRequest(str(e), "reasoning_format") from None
            try:
                # the template is the model file's code: rendered in a worker thread (bounded in
                # time and size by pyinfer/chat.py), so a slow one never blocks other requests
                ids = await run_in_threadpool(llm.chat_tokens, messages, opts["chat_template_kwargs"],
                                              tool_use)
            except PyinferError as e:
                raise BadRequest(str(e), "messages") from None
            if tool_use is not None:  # a tool schema llguidance refuses: 400 before the queue
                gram = tool_use.grammar(llm.prompt_opens_thinking(ids))
                if gram is not None:
                    try:
                        await run_in_threadpool(gram.check, llm.tokenizer)
                    except PyinferError as e:
                        raise BadRequest(str(e), "tools") from None
            check_room(ids, opts["max_tokens"], "messages")
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        return await run_job(request, lambda stop: llm.create_chat_completion(messages, should_stop=stop,
                                                                              **opts),
                             opts["stream"], usage)

    async def embeddings(request: Request):
        try:
            body = await read_json(request)
            check_fields(body, "/v1/embeddings")
            inp = body.get("input")
            ok = isinstance(inp, str) or (isinstance(inp, list) and inp and (
                all(isinstance(x, str) for x in inp) or all(isinstance(x, int) and not isinstance(x, bool)
                                                            for x in inp)
                or all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                       for x in inp)))
            if not ok:
                raise BadRequest("'input' must be a string, a list of strings or token ids", "input")
            from pyinfer.api import MAX_EMBEDDING_INPUTS

            n_inputs = len(inp) if isinstance(inp, list) and not isinstance(inp[0], int) else 1
            if n_inputs > MAX_EMBEDDING_INPUTS:
                raise BadRequest(f"'input' has {n_inputs} items, more than {MAX_EMBEDDING_INPUTS}",
                                 "input")
            if not hasattr(llm.engine.model, "run_layers"):
                return error(501, "embeddings are computed by the CPU model only: start pyinfer-serve "
                             "with --device cpu", kind="not_implemented")
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise BadRequest("'encoding_format' must be \"float\" or \"base64\"", "encoding_format")
            dims = body.get("dimensions")
            if dims is not None and dims != llm.engine.cfg.n_embd:
                raise BadRequest(f"'dimensions' must be {llm.engine.cfg.n_embd} (the model's n_embd)",
                                 "dimensions")
            # every input's tokens checked before the queue, as a prompt's are (an input longer
            # than the context was refused only when its turn came); handed on as token ids
            items = [inp] if isinstance(inp, str) or isinstance(inp[0], int) else inp
            ids = await run_in_threadpool(
                lambda: [llm.tokenize(x) if isinstance(x, str) else list(x) for x in items])
            for i, t in enumerate(ids):
                if not t or len(t) > llm.n_ctx:
                    raise BadRequest(f"input[{i}] is {len(t)} tokens; it must be 1..{llm.n_ctx} "
                                     "(this model's context)", "input")
                if outside_vocab(t):
                    raise BadRequest(f"input[{i}] has a token id outside the vocabulary", "input")
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        return await run_job(request, lambda stop: encode_embeddings(
            llm.create_embedding(ids, should_stop=stop), fmt), stream=False)

    model_card = {"id": llm.model_name, "object": "model", "created": created, "owned_by": "pyinfer"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: Request):  # OpenAI's GET /v1/models/{model}
        name = request.path_params["name"]
        if name != llm.model_name:
            body = error_body(f"The model '{name}' does not exist (this server serves "
                              f"'{llm.model_name}')", "model")
            body["error"]["code"] = "model_not_found"
            return JSONResponse(body, status_code=404)
        return JSONResponse(model_card)

    async def health(request: Request):
        return JSONResponse({"status": "ok", "requests_pending": worker.pending})

    async def not_found(request: Request, exc):
        r = error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        r.headers.update(exc.headers or {})  # (405's Allow: the methods the path takes)
        return r

    async def server_error(request: Request, exc):
        print(f"pyinfer-serve: internal error in {request.method} {request.url.path}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)  # (the log had no trace of it)
        return error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    from starlette.exceptions import HTTPException

    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: not_found, Exception: server_error})
    app.state.worker = worker  # (main stops its jobs at a shutdown)
    return app


def build_parser() -> argparse.ArgumentParser:
    from pyinfer.options import Parser, add_engine_flags, add_model, add_version, arg_type

    p = Parser(prog="pyinfer-serve", description=__doc__.splitlines()[0])
    add_version(p)
    add_model(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs --api-key or --no-api-key)")
    p.add_argument("--api-key", default=os.environ.get("PYINFER_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request but /health "
                        "(default: $PYINFER_API_KEY; none)")
    p.add_argument("--no-api-key", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches it may use it)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-c", "--ctx-size", type=arg_type("ctx_size"), default=0,
                   help="context size in tokens (0: min(4096, the model's))")
    p.add_argument("-ctk", "--cache-type", choices=["auto", "f16", "f32"], default="auto",
                   help="KV cache type (auto: f32 for an f32 file, else f16)")
    p.add_argument("-t", "--threads", type=options.threads_arg, default=None,
                   help="kernel threads (default, or 0 or less: the physical cores this process may use)")
    p.add_argument("--queue-size", type=int, default=4,
                   help="requests that may wait behind the running one before 503 (default 4)")
    add_engine_flags(p)
    p.add_argument("-s", "--seed", type=arg_type("seed"), default=-1, help="RNG seed (-1: random)")
    from pyinfer.cli import add_template_kwargs_flag

    add_template_kwargs_flag(p)
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                   help="where a chat answer's <think>...</think> block goes: auto / deepseek "
                        "(the default, as llama.cpp's server): message.reasoning_content; none: "
                        "left in content")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def check_listen(host: str, port: int) -> None:
    """Raise PyinferError unless this process can listen on host:port now (an address in use, a
    host that does not resolve or is not this machine's): uvicorn would say so in several log
    lines after the model loaded and the "serving at" line was printed."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise PyinferError(f"cannot listen on {host}: {getattr(e, 'strerror', None) or e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            raise PyinferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ready = {}
    status = exit_code_of(_setup, args, ready)  # one error line, Ctrl-C while loading too
    if status:
        return status
    import uvicorn

    print(f"pyinfer-serve: {ready['llm'].model_name}, context {ready['llm'].n_ctx} tokens, "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # Ctrl-C / SIGTERM: every request is stopped at once (a stream within a token, with an
    # error event before its [DONE]; a waiting one answered 503), so the graceful shutdown does
    # not wait out its timeout and cut them (plain-text 500s, a traceback a request)
    server = uvicorn.Server(uvicorn.Config(ready["app"], host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5))
    stop = server.handle_exit

    def handle_exit(sig, frame):
        # (a thread: this runs as a signal handler in the event loop's thread, which may hold
        # the worker's lock at that moment, in submit or Job.set)
        threading.Thread(target=ready["app"].state.worker.cancel_all, daemon=True).start()
        stop(sig, frame)

    server.handle_exit = handle_exit
    server.run()
    return 0


def _setup(args, ready: dict) -> int:
    """main's checks and the model's load, into ``ready`` (llm, app). Raises PyinferError."""
    import importlib.util

    if importlib.util.find_spec("uvicorn") is None:
        raise PyinferError("the server needs Starlette and uvicorn: pip install -e '.[server]' "
                           "in the pyinfer checkout")
    if args.api_key is not None and (not args.api_key or any(c.isspace() for c in args.api_key)):
        raise PyinferError("--api-key must be a non-empty key without spaces")
    if not is_loopback(args.host) and not args.api_key and not args.no_api_key:
        raise PyinferError(f"refusing to listen on {args.host}, which other machines can reach, "
                           "without --api-key KEY (or pass --no-api-key to serve anyone)")
    if not 0 <= args.port <= 65535:
        raise PyinferError(f"--port must be in 0..65535, got {args.port}")
    if args.queue_size < 0:
        raise PyinferError("--queue-size must be >= 0")
    check_listen(args.host, args.port)
    from pyinfer.cli import load

    llm = load(args, options.model_path(args, "pyinfer-serve MODEL.gguf (or -m MODEL.gguf)"))
    ready["llm"] = llm
    ready["app"] = create_app(llm, max_queue=args.queue_size, api_key=args.api_key,
                              reasoning_format=args.reasoning_format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
