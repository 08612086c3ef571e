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


@pytest.mark.parametrize("messages", [None, [], "hi", [{"role": "wizard", "content": "x"}],
                                      [{"role": "user"}], [{"role": "user", "content": 5}], ["x"],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages(messages):
    with pytest.raises(BadRequest):
        chat_messages({"messages": messages})


def test_message_text_parts_are_joined():
    m = chat_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}]})
    assert m == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("prompt", [None, "", 5, [], [1, "a"], ["a", "b"]])
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
    ("/v1/nothing", {}, 404, None),
])
def test_malformed_requests_get_4xx(server, path, body, status, param):
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
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
