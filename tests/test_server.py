"""pyinfer-serve for real: started on a free loopback port, called with the official ``openai`` client
(streaming and not) and with raw malformed requests (httpx). Every call has a timeout; every answer
is short (max_tokens <= 24)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from pyinfer.server import EngineWorker, chat_messages, completion_prompt, sampling_options, BadRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]


# ---- request validation, no server needed ---------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"max_tokens": "ten"}, {"max_tokens": 0}, {"max_tokens": True}, {"temperature": "hot"},
    {"temperature": -1}, {"top_p": 2}, {"stop": 3}, {"stop": ["a", 1]}, {"n": 2}, {"stream": "yes"},
    {"seed": 1.5},
])
def test_bad_sampling_options(body):
    with pytest.raises(BadRequest):
        sampling_options(body, 16)


def test_good_sampling_options():
    o = sampling_options({"max_tokens": 5, "temperature": 0, "stop": "x", "seed": 3, "model": "any"}, 16)
    assert o["max_tokens"] == 5 and o["temperature"] == 0 and o["stop"] == ["x"] and o["seed"] == 3
    assert sampling_options({}, None)["max_tokens"] is None
    # llama.cpp server's repeat_last_n (was refused as an unknown field); -1: the whole context
    from pyinfer.server import check_fields

    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        check_fields({"repeat_last_n": -1, "top_k": -1}, endpoint)
    o = sampling_options({"repeat_last_n": -1, "top_k": -1}, None)
    assert o["repeat_last_n"] == -1 and o["top_k"] == -1
    assert sampling_options({}, None)["repeat_last_n"] == 64
    with pytest.raises(BadRequest):
        sampling_options({"repeat_last_n": -2}, None)


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "wizard", "content": "x"}],
                                      [{"role": "user"}], [{"role": "user", "content": 5}], ["x"],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages(messages):
    with pytest.raises(BadRequest):
        chat_messages({"messages": messages})


@pytest.mark.parametrize("texts, joined", [(["a", "b"], "a\nb"), (["", "b"], "b"), (["a", ""], "a\n"),
                                           (["a", "", "b"], "a\n\nb")])
def test_message_text_parts_are_joined(texts, joined):
    """as llama.cpp's common_chat_msg::to_json_oaicompat(concat_typed_text): a newline before a
    part wherever some text came before it"""
    m = chat_messages({"messages": [{"role": "user",
                                     "content": [{"type": "text", "text": t} for t in texts]}]})
    assert m == [{"role": "user", "content": joined}]


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], ["a", "b"]])
def test_bad_prompt(prompt):
    with pytest.raises(BadRequest):
        completion_prompt({"prompt": prompt})


def test_worker_queue_bound():
    gate = threading.Event()
    w = EngineWorker(max_queue=1)
    w.submit(lambda cancel: gate.wait(10))  # running
    w.submit(lambda cancel: None)  # waiting
    with pytest.raises(EngineWorker.QueueFull):
        w.submit(lambda cancel: None)
    gate.set()
    deadline = time.monotonic() + 10
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    w.submit(lambda cancel: None)  # room again


# ---- the server ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_q8):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "pyinfer.server", smollm2_q8, "--host", "127.0.0.1",
                             "--port", str(port), "-c", "512", "--queue-size", "1", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not start in 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=180, max_retries=0)


@pytest.mark.slow
def test_health_and_models(server, client):
    import httpx

    r = httpx.get(server + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m-instruct-q8_0.gguf"]


# The server keeps its KV cache between requests. A prompt evaluated as one batch and one whose last
# token is evaluated alone round differently, so before comparing two answers, one warm-up request
# with the same prompt puts the cache in the state both compared requests then find.
@pytest.mark.slow
def test_chat_completion_with_the_openai_client(client):
    client.chat.completions.create(model="smollm2", messages=GERMANY, max_tokens=1)
    full = client.chat.completions.create(model="smollm2", messages=GERMANY, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert "Berlin" in text and full.choices[0].finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(model="smollm2", messages=GERMANY, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.slow
def test_ignore_eos_runs_the_answer_to_max_tokens(server, client):
    """llama.cpp server's ``ignore_eos``: the end-of-generation tokens are never drawn, so a chat
    answer that ends by itself within 24 tokens runs to all 24 ("length"); a non-boolean is a 400."""
    import httpx

    kw = dict(model="smollm2", messages=GERMANY, temperature=0, max_tokens=24)
    client.chat.completions.create(**dict(kw, max_tokens=1))
    own = client.chat.completions.create(**kw)
    assert own.choices[0].finish_reason == "stop" and own.usage.completion_tokens < 24
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    assert full.choices[0].message.content.startswith(own.choices[0].message.content)
    r = httpx.post(server + "/v1/chat/completions", json=dict(kw, ignore_eos="yes"), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


@pytest.mark.slow
def test_completion_with_the_openai_client(client):
    kw = dict(model="smollm2", prompt="The capital of Germany is", temperature=0, max_tokens=8)
    client.completions.create(**dict(kw, max_tokens=1))
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    cut = client.completions.create(**kw, stop=["Berlin"])
    assert "Berlin" in full.choices[0].text
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index("Berlin")]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": GERMANY, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": GERMANY, "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": GERMANY, "temperature": "warm"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),  # was "messages"
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-320, "max_tokens": 2}, 200, None),
    ("/v1/nothing", {}, 404, None),
])
def test_malformed_requests_get_4xx(server, path, body, status, param):
    """Bad requests get 4xx naming the field; extreme but valid values are served."""
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    if status == 200:  # a vanishing temperature is greedy, not a 500 (NaN probabilities)
        assert r.json()["choices"][0]["text"] is not None
        return
    err = r.json()["error"]
    assert err["message"] and err["param"] == param
    assert httpx.get(server + "/health", timeout=10).status_code == 200  # still alive


@pytest.mark.slow
def test_wrong_method_and_openai_error_type(server, client):
    import httpx
    import openai

    assert httpx.get(server + "/v1/chat/completions", timeout=10).status_code == 405
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=GERMANY, max_tokens=10**6)


@pytest.mark.slow
def test_busy_server_answers_503_and_recovers(server):
    import httpx

    def pending():
        return httpx.get(server + "/health", timeout=10).json()["requests_pending"]

    long = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 400, "stream": True, "temperature": 0}
    short = {"prompt": "Hello", "max_tokens": 1}
    results = {}
    with httpx.Client(timeout=180) as c:
        with c.stream("POST", server + "/v1/chat/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # generating now
            t = threading.Thread(target=lambda: results.setdefault(
                "queued", httpx.post(server + "/v1/completions", json=short, timeout=180).status_code))
            t.start()
            deadline = time.monotonic() + 30
            while pending() < 2:
                assert time.monotonic() < deadline, "the second request never reached the queue"
                time.sleep(0.1)
            r = httpx.post(server + "/v1/completions", json=short, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "server_busy"
        # leaving the stream disconnects: the server stops that answer and runs the queued request
        t.join(120)
    assert results["queued"] == 200
    deadline = time.monotonic() + 60
    while pending():
        assert time.monotonic() < deadline
        time.sleep(0.2)


# ---- hostile requests against the app in-process (a scripted model; fast) ----------------------
class _FakeTokenizer:
    n_vocab = 100


class FakeLLM:
    """Enough of ``pyinfer.LLM`` for the app: one token per character, answers "ok"."""

    n_ctx = 256
    model_name = "fake"
    tokenizer = _FakeTokenizer()

    def __init__(self, chat_tokens=None):
        self.calls = []
        if chat_tokens is not None:
            self.chat_tokens = chat_tokens

    def tokenize(self, text):
        text.encode("utf-8")  # as the real tokenizer: a lone surrogate would raise here
        return [1] * len(text)

    def prompt_ids(self, prompt):
        return self.tokenize(prompt) or [1] if isinstance(prompt, str) else list(prompt)

    def chat_tokens(self, messages, template_kwargs=None, tools=None):
        return [1] * sum(len(m["content"]) for m in messages)

    def usage(self):
        return {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}

    def create_completion(self, ids, should_stop=None, **opts):
        self.calls.append(opts)
        return {"object": "text_completion", "choices": [{"text": "ok", "index": 0, "finish_reason": "stop"}]}

    def create_chat_completion(self, messages, should_stop=None, **opts):
        self.calls.append(opts)
        return {"object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}


def _client(llm=None, api_key=None):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyinfer.server import create_app

    return TestClient(create_app(llm or FakeLLM(), api_key=api_key), raise_server_exceptions=False)


@pytest.mark.parametrize("raw,message", [
    (b'{"prompt": "hi", "temperature": NaN}', "'temperature' must be a finite number >= 0, got nan"),
    (b'{"prompt": "hi", "temperature": Infinity}', "'temperature' must be a finite number"),
    (b'{"prompt": "hi", "repeat_penalty": NaN}', "'repeat_penalty' must be a finite number > 0"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "'top_p' must be a finite number"),
    (b'{"prompt": "hi", "seed": -2}', "'seed' must be an integer in 0..18446744073709551615 (or -1)"),
    (b'{"prompt": "hi", "seed": 1e30}', "'seed' must be an integer"),
    (b'{"prompt": "hi", "top_k": -2}', "'top_k' must be an integer in 0.."),
    (b'{"prompt": "hi", "max_tokens": 99999999999999999999}', "'max_tokens' must be an integer in 1..16777216"),
    (b'{"prompt": "\\ud800"}', "not valid Unicode"),
    (b'{"prompt": "hi", "stop": ["\\udfff"]}', "not valid Unicode"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    (b"[" * 100000, "nested too deeply"),
])
def test_hostile_bodies_get_400_not_500(raw, message):
    r = _client().post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_seed_minus_one_means_random():
    llm = FakeLLM()
    r = _client(llm).post("/v1/chat/completions", json={"messages": GERMANY, "seed": -1})
    assert r.status_code == 200, r.text
    assert llm.calls[-1]["seed"] == -1  # LLM turns -1 into a fresh seed (tests/test_api.py)


def test_chat_template_kwargs_reach_the_template_or_get_400():
    """llama.cpp's / vLLM's chat_template_kwargs: passed on to the chat (the rendering and the
    answer); anything but an object of template variable names is a 400 naming the field."""
    llm = FakeLLM()
    r = _client(llm).post("/v1/chat/completions",
                          json={"messages": GERMANY, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert llm.calls[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    for bad, words in (([1], "must be a JSON object"), ({"messages": []}, "set by the renderer"),
                       ({"no-name": 1}, "not a template variable name")):
        r = _client(llm).post("/v1/chat/completions",
                              json={"messages": GERMANY, "chat_template_kwargs": bad})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and words in err["message"], err


def test_reasoning_content_sent_back_reaches_the_template():
    """An assistant message's reasoning_content (what the server gave out) is kept for the chat
    template, as llama.cpp's server keeps it; not a string: 400."""
    from pyinfer.server import BadRequest, chat_messages

    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "q2", "reasoning_content": "ignored"}]
    assert chat_messages({"messages": msgs}) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
        {"role": "user", "content": "q2"}]
    with pytest.raises(BadRequest, match="reasoning_content must be a string"):
        chat_messages({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]})


def test_a_tool_using_history_reaches_the_template():
    """tool_calls, tool_call_id and name of OpenAI's tool messages are kept for the template
    (they were dropped: a tool result rendered with no call before it): a template that reads
    them renders the call, then its result; other shapes of them are a 400."""
    from pyinfer.chat import render_chat
    from pyinfer.server import BadRequest, chat_messages

    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22C"}]
    kept = chat_messages({"messages": msgs})
    assert kept[1]["tool_calls"] == [call] and kept[2]["tool_call_id"] == "c1"
    assert kept[2]["name"] == "get_weather"
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
                "{% elif m.role == 'tool' %}<result {{ m.tool_call_id }}: {{ m.content }}>"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert render_chat(template, kept, add_generation_prompt=False) == (
        'Weather in Paris?<call get_weather {"city": "Paris"}><result c1: 22C>')
    for bad in ({"role": "user", "content": "x", "tool_calls": [call]},
                {"role": "assistant", "content": "x", "tool_calls": "call"},
                {"role": "tool", "content": "x", "tool_call_id": 5}):
        with pytest.raises(BadRequest):
            chat_messages({"messages": [bad]})


def test_reasoning_format_default_and_per_request():
    """The server splits thinking blocks by default (llama.cpp's "auto"; --reasoning-format
    sets the default), a request's reasoning_format wins, anything else is a 400."""
    from pyinfer.server import create_app

    llm = FakeLLM()
    assert _client(llm).post("/v1/chat/completions", json={"messages": GERMANY}).status_code == 200
    assert llm.calls[-1]["reasoning_format"] == "auto"
    r = _client(llm).post("/v1/chat/completions", json={"messages": GERMANY, "reasoning_format": "none"})
    assert r.status_code == 200 and llm.calls[-1]["reasoning_format"] == "none"
    r = _client(llm).post("/v1/chat/completions", json={"messages": GERMANY, "reasoning_format": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format", r.text
    r = _client(llm).post("/v1/chat/completions", json={"messages": GERMANY, "reasoning_format": None})
    assert r.status_code == 200 and llm.calls[-1]["reasoning_format"] == "auto"  # null: not given
    from pyinfer.errors import PyinferError

    with pytest.raises(PyinferError, match="reasoning_format must be one of"):
        create_app(llm, reasoning_format="think")
    from starlette.testclient import TestClient

    c = TestClient(create_app(llm, reasoning_format="none"))
    assert c.post("/v1/chat/completions", json={"messages": GERMANY}).status_code == 200
    assert llm.calls[-1]["reasoning_format"] == "none"


def test_body_over_the_limit_is_refused_from_content_length():
    from pyinfer.server import MAX_BODY_BYTES

    # The header alone decides: the few bytes sent are never parsed.
    r = _client().post("/v1/completions", content=b"{}",
                       headers={"Content-Type": "application/json", "Content-Length": str(300 << 20)})
    assert r.status_code == 413, r.text
    assert f"larger than {MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]


def test_chunked_body_over_the_limit_is_refused_while_reading():
    from pyinfer.server import MAX_BODY_BYTES

    sent = []

    def body():  # a generator: sent chunked, with no Content-Length
        for _ in range(64):
            sent.append(1)
            yield b" " * (64 << 10)

    r = _client().post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert f"larger than {MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]


def test_api_key():
    c = _client(api_key="s3cret")
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}):
        r = c.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert c.get("/v1/models").status_code == 401
    assert c.get("/health").status_code == 200  # open, as llama.cpp's
    assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
    assert _client().post("/v1/completions", json=body).status_code == 200  # no key: open


def test_loopback_detection():
    from pyinfer.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]")
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com", ""):
        assert not is_loopback(host), host


@pytest.mark.parametrize("args,ok", [
    (["--host", "0.0.0.0"], False), (["--host", "192.168.0.1"], False), (["--host", "::"], False),
    (["--host", "0.0.0.0", "--api-key", "k"], True), (["--host", "0.0.0.0", "--no-api-key"], True),
])
def test_non_loopback_host_needs_an_api_key(tmp_path, args, ok):
    """Checked before the model loads: a missing model file is the next error when the host is fine."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PYINFER_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "pyinfer.server", str(tmp_path / "m.gguf"), *args],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if ok:
        assert "not found" in r.stderr or "does not exist" in r.stderr or "no such" in r.stderr.lower(), r.stderr
    else:
        assert "without --api-key KEY (or pass --no-api-key" in r.stderr, r.stderr


@pytest.mark.parametrize("flag,value", [("-t", "100000"), ("-t", "2147483648"), ("-c", "9999999999999999999"),
                                        ("--vram-budget", "nan"), ("-ngl", "-1"), ("-s", "-7")])
def test_server_flags_are_range_checked(tmp_path, flag, value):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pyinfer.server", str(tmp_path / "m.gguf"), flag, value],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 1 and r.stderr.startswith(f"error: argument {flag}"), r.stderr
    assert "must be" in r.stderr


@pytest.mark.slow
def test_non_streaming_request_stops_when_its_client_disconnects(server):
    """A client that gives up on a non-streaming answer frees the engine within a token or so, as a
    streaming client does: the server does not generate the rest of max_tokens for nobody."""
    import httpx

    def pending():
        return httpx.get(server + "/health", timeout=10).json()["requests_pending"]

    # counting goes on and on: greedy decoding runs to max_tokens unless stopped
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(server + "/v1/completions", json=dict(body, max_tokens=32), timeout=120)
    per_token = (time.monotonic() - t0) / 32  # an upper bound: includes the prompt
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

    host, port = server.rsplit("/", 1)[1].split(":")
    raw = json.dumps(dict(body, max_tokens=440)).encode()  # the prompt + 440 fit the fixture's -c 512
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        deadline = time.monotonic() + 30
        while pending() < 1:
            assert time.monotonic() < deadline, f"the request never started: {sock.recv(4096)!r}"
            time.sleep(0.05)
        time.sleep(0.3)
    gone = time.monotonic()  # the socket is closed: the client has left
    while pending():
        assert time.monotonic() - gone < 30, "the abandoned request never ended"
        time.sleep(0.05)
    stopped_after = time.monotonic() - gone
    # the rest of the 440 tokens would have taken far longer than the stop did
    assert stopped_after < max(1.0, 0.25 * 440 * per_token), (stopped_after, per_token)
    r = httpx.post(server + "/v1/completions", json=dict(body, max_tokens=2), timeout=60)
    assert r.status_code == 200


_SLOW_TEMPLATE_SERVER = """
import sys
import uvicorn
from pyinfer.chat import render_chat
from pyinfer.server import create_app
from tests.test_server import FakeLLM

# two seconds of template work (the render time bound) per chat request
SLOW = "{% macro f(n) %}{{ f(n - 1) ~ f(n - 1) if n else 'x' }}{% endmacro %}{{ f(60) }}"
llm = FakeLLM(chat_tokens=lambda messages, kw=None, tools=None: [1] * len(render_chat(SLOW, messages)))
uvicorn.run(create_app(llm), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            timeout_graceful_shutdown=5)
"""


def test_slow_template_blocks_no_endpoint_and_sigterm_still_stops_the_server():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TEMPLATE_SERVER, str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("chat", httpx.post(
            url + "/v1/chat/completions", json={"messages": GERMANY}, timeout=30)))
        t.start()
        time.sleep(0.5)  # rendering now
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.0  # the event loop is free while the template renders
        t.join(30)
        r = results["chat"]
        assert r.status_code == 400 and "chat template refused" in r.json()["error"]["message"], r.text
        # SIGTERM in the middle of another slow rendering: the server still stops, promptly
        t = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions",
                                                       json={"messages": GERMANY}, timeout=30))
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.terminate()
        proc.wait(timeout=15)
        assert time.monotonic() - t0 < 10
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)


def test_an_address_it_cannot_listen_on_is_one_line_before_the_load(tmp_path):
    """A port in use, or a host that is no address of this machine: uvicorn's multi-line log
    and status 3 after the model loaded and "serving at" was printed; now one error line."""
    import socket

    from tests._tiny_gguf import write_tiny_gguf

    model = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, words in ((["--port", str(port)], "Address already in use"),
                            (["--host", "256.1.1.1", "--no-api-key"], "cannot listen on 256.1.1.1")):
            r = subprocess.run([sys.executable, "-m", "pyinfer.server", model, "-t", "1", *args],
                               capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 1 and len(lines) == 1 and words in lines[0], r.stderr


def test_a_queued_stream_whose_client_left_never_runs(capfd):
    """A streaming request whose client leaves while it waits in the queue is dropped there: it
    used to start once the engine was free and run its prompt's prefill for nobody."""
    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from pyinfer.server import create_app

    gate = threading.Event()

    class Blocking(FakeLLM):
        def create_completion(self, ids, should_stop=None, **opts):
            self.calls.append("completion")
            gate.wait(30)
            return {"object": "text_completion", "choices": []}

        def create_chat_completion(self, messages, should_stop=None, **opts):
            self.calls.append("chat")
            return iter([{"object": "chat.completion.chunk", "choices": []}])

    llm = Blocking()
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(llm), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

        def pending():
            return httpx.get(url + "/health", timeout=10).json()["requests_pending"]

        first = threading.Thread(target=lambda: httpx.post(url + "/v1/completions",
                                                           json={"prompt": "hi"}, timeout=60))
        first.start()

        def wait_for(ok):
            deadline = time.monotonic() + 30
            while not ok():
                assert time.monotonic() < deadline, "the server never got there"
                time.sleep(0.02)

        wait_for(lambda: pending() >= 1)
        raw = json.dumps({"messages": GERMANY, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\n" + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            wait_for(lambda: pending() >= 2)
        time.sleep(0.5)  # the socket is closed: the server sees the disconnect
        gate.set()
        first.join(30)
        wait_for(lambda: pending() == 0)
        assert llm.calls == ["completion"]
        # logged (uvicorn writes no access line for a response nobody takes)
        assert '"POST /v1/chat/completions" 499: the client left' in capfd.readouterr().err
    finally:
        gate.set()
        srv.should_exit = True
        thread.join(10)


def test_retrieve_model_and_method_not_allowed():
    """OpenAI's GET /v1/models/{model} (404 before) and a 405 that names the allowed methods."""
    client = _client()
    r = client.get("/v1/models/fake")
    assert r.status_code == 200 and r.json() == client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_empty_prompt_completes_from_bos(tmp_path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyinfer import LLM
    from pyinfer.server import create_app
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "t.gguf")), n_ctx=64, n_threads=1, device="cpu")
    r = TestClient(create_app(llm)).post("/v1/completions", json={
        "prompt": "", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1, r.text


def test_a_job_frees_its_place_before_its_answer_goes_out():
    """The place was freed only when the worker came back to its loop, after the answer had
    gone out: a client sending its next request at once could get a false 503 (2 of 200 with
    --queue-size 0)."""
    handed, hold = threading.Event(), threading.Event()

    def job(handle):
        handle.release()  # what run_job's job does just before its last item
        handed.set()
        hold.wait(10)  # (the worker not yet back in its loop)

    w = EngineWorker(max_queue=0)
    w.submit(job)
    assert handed.wait(10)
    ran = threading.Event()
    w.submit(lambda handle: ran.set())  # no QueueFull: the first one's place is free
    hold.set()
    assert ran.wait(10)


def test_a_waiting_job_whose_client_left_frees_its_place_at_once():
    """A client that left while its request waited kept its place until the engine reached it
    (503s meanwhile, requests_pending counting it)."""
    gate, ran = threading.Event(), []
    w = EngineWorker(max_queue=1)
    w.submit(lambda h: gate.wait(10))  # running
    abandoned = []
    queued = w.submit(lambda h: ran.append("queued"))
    queued.on_abandon = lambda: abandoned.append(True)
    with pytest.raises(EngineWorker.QueueFull):
        w.submit(lambda h: None)
    queued.set()  # its client left
    assert w.pending == 1 and abandoned == [True]
    later = w.submit(lambda h: ran.append("later"))  # its place is free
    gate.set()
    deadline = time.monotonic() + 10
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["later"] and later.released  # the abandoned job never ran


def test_a_shutdown_stops_every_job_and_takes_no_new_one():
    gate = threading.Event()
    w = EngineWorker(max_queue=2)
    running = w.submit(lambda h: gate.wait(10))
    told = []
    waiting = w.submit(lambda h: told.append("ran"))
    waiting.on_abandon = lambda: told.append("abandoned")
    w.cancel_all()
    assert running.is_set() and waiting.is_set() and told == ["abandoned"]
    with pytest.raises(EngineWorker.QueueFull):
        w.submit(lambda h: None)
    gate.set()
