"""The chat REPL: conversation fitting and commands over a scripted model (fast), and pyinfer-chat
driven through a pseudo-terminal on the converted SmolLM2 (slow)."""
from __future__ import annotations

import io
import os
import re
import shutil
import sys
import time
import types
from contextlib import contextmanager

import pytest

from pyinfer.api import GenerationStats
from pyinfer.errors import PyinferError
from pyinfer.repl import ChatSession, repl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeLLM:
    """Each message costs 4 tokens plus one per word; every answer is ``answer``."""

    def __init__(self, n_ctx=64, answer="ok then"):
        self.n_ctx = n_ctx
        self.answer = answer
        self.prompts = []
        self.last_stats = GenerationStats()
        self.model_name = "fake"
        self.engine = types.SimpleNamespace(reuse_decoded_rows=False)

    def chat_tokens(self, messages):
        n = sum(4 + len(m["content"].split()) for m in messages) + 3
        return list(range(n))

    def stream_text(self, ids, max_tokens=None, should_stop=None, **kw):
        self.prompts.append(len(ids))
        self.last_stats = GenerationStats(prompt_tokens=len(ids), prompt_evaluated=len(ids),
                                          completion_tokens=2, finish_reason="stop")
        for w in self.answer.split(" "):
            yield w + " "


def test_session_keeps_turns_and_drops_the_oldest_when_full():
    llm = FakeLLM(n_ctx=64)
    s = ChatSession(llm, system="be brief", max_tokens=16)  # 48 tokens of room for the prompt
    s.ask("one two three")
    s.ask("four five six")
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert s.last_dropped == 0
    s.ask("seven " * 10)
    assert s.last_dropped == 2  # the first user/assistant pair went, the system message stayed
    assert s.messages[0] == {"role": "system", "content": "be brief"}
    assert s.messages[1]["content"] == "four five six"
    assert len(llm.chat_tokens(s.messages[:-1])) <= 48


def test_session_refuses_a_message_longer_than_the_context():
    s = ChatSession(FakeLLM(n_ctx=32), max_tokens=8)
    with pytest.raises(PyinferError, match="more than the context"):
        s.ask("word " * 40)
    assert s.messages == []  # unchanged: the REPL goes on


def test_a_system_message_longer_than_the_context_is_refused_at_once():
    """It used to fail every turn as 'the message is N tokens', the chat unusable."""
    with pytest.raises(PyinferError, match="the system message is 51 tokens"):
        ChatSession(FakeLLM(n_ctx=32), system="rule " * 40)
    s = ChatSession(FakeLLM(n_ctx=32), system="rule " * 10, max_tokens=8)
    with pytest.raises(PyinferError, match="the system message and the message are"):
        s.ask("word " * 20)


def test_reset_keeps_the_system_message():
    s = ChatSession(FakeLLM(), system="sys")
    s.ask("hi")
    s.reset()
    assert s.messages == [{"role": "system", "content": "sys"}]


def test_repl_commands(monkeypatch):
    lines = iter(["/help", "hello", "/stats", "/nope", "/reset", "multi \\", "line", "/exit", "never"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    llm = FakeLLM()
    s = ChatSession(llm)
    out, err = io.StringIO(), io.StringIO()
    assert repl(s, verbose=True, out=out, err=err) == 0
    assert "/reset" in err.getvalue() and "/exit" in err.getvalue()  # /help
    assert "ok then" in out.getvalue()
    assert err.getvalue().count("tokens evaluated") == 3  # --verbose twice, /stats once
    assert "unknown command /nope" in err.getvalue()
    assert "[new conversation]" in err.getvalue()
    assert s.messages[0]["content"] == "multi \nline"  # the backslash joined the lines
    assert next(lines) == "never"  # /exit stopped reading


def test_a_continued_line_cut_by_end_of_input_is_still_sent(monkeypatch):
    """'abc\\' as the last line, then end of input: the message was dropped silently; it is
    answered, and the REPL ends on the next read."""
    lines = iter(["abc\\"])

    def read(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", read)
    s = ChatSession(FakeLLM())
    out = io.StringIO()
    assert repl(s, out=out, err=io.StringIO()) == 0
    assert s.messages[0] == {"role": "user", "content": "abc"} and "ok then" in out.getvalue()


def test_a_message_beginning_with_a_slash_is_sent_after_a_second_slash(monkeypatch):
    """'/usr/bin is on PATH?' was an unknown command and could not be sent at all; '//' escapes
    the slash (the message keeps one)."""
    lines = iter(["//usr/bin is on PATH?", "  //etc"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    s = ChatSession(FakeLLM())
    err = io.StringIO()
    with pytest.raises(StopIteration):
        repl(s, out=io.StringIO(), err=err)
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["/usr/bin is on PATH?",
                                                                          "/etc"]
    assert "unknown command" not in err.getvalue()


def test_repl_ends_on_eof(monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert repl(ChatSession(FakeLLM()), out=io.StringIO(), err=io.StringIO()) == 0


class SlowLLM(FakeLLM):
    """Spends up to 10 s rendering the template or evaluating the prompt (before the first token)."""

    def __init__(self, slow_in):
        super().__init__()
        self.slow_in = slow_in
        self.resets = 0

    def _busy(self):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # Python code: a signal handler runs in between
            sum(range(1000))

    def chat_tokens(self, messages):
        if self.slow_in == "render" and messages[-1]["content"] == "slow":
            self._busy()
        return super().chat_tokens(messages)

    def stream_text(self, ids, max_tokens=None, should_stop=None, **kw):
        if self.slow_in == "prefill" and self.prompts == []:
            self.prompts.append(len(ids))
            self._busy()
        yield from super().stream_text(ids, max_tokens=max_tokens, should_stop=should_stop, **kw)

    def reset(self):
        self.resets += 1


@pytest.mark.parametrize("slow_in", ["render", "prefill"])
def test_ctrl_c_works_while_rendering_and_evaluating_the_prompt(monkeypatch, slow_in):
    import signal
    import threading

    lines = iter(["slow", "hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    llm = SlowLLM(slow_in)
    out, err = io.StringIO(), io.StringIO()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    session = ChatSession(llm)
    try:
        assert repl(session, out=out, err=err) == 0
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 5  # not the 10 s of the slow step
    assert "[interrupted: the message was not sent]" in err.getvalue()
    # the interrupted message is not in the conversation (it was kept with an empty answer, and
    # the whole cache thrown away: the next turn evaluated everything again); the cache keeps
    # the batches evaluated (Engine.eval_prompt claims a batch only once it is written)
    assert [m["content"] for m in session.messages] == ["hello", "ok then "]
    assert llm.resets == 0
    assert "ok then" in out.getvalue()  # the next message was answered


# ---- the real thing: pyinfer-chat in a pseudo-terminal -------------------------------------------
PROMPT = re.compile(r"\n(\x1b\[[0-9;?]*[a-zA-Z])*> ")


def _spawn(model, *args):
    pexpect = pytest.importorskip("pexpect")
    exe = shutil.which("pyinfer-chat", path=os.path.dirname(sys.executable))
    cmd, argv = (exe, []) if exe else (sys.executable, ["-m", "pyinfer.repl"])
    env = dict(os.environ, PYTHONPATH=ROOT, TERM="dumb", PYTHONUNBUFFERED="1")
    child = pexpect.spawn(cmd, argv + [model, *args], cwd=ROOT, env=env, encoding="utf-8",
                          timeout=240, dimensions=(40, 200))
    return child


def _answer(child, question: str) -> str:
    """Send one message and return what the REPL printed before the next prompt."""
    child.sendline(question)
    child.expect(re.escape(question))  # the terminal echo
    child.expect(PROMPT)
    return child.before


def _reply(answer: str) -> str:
    """The model's words only: without the bracketed status lines of --verbose, whose figures
    (tokens/s) can contain any number."""
    return "\n".join(ln for ln in answer.splitlines() if not ln.strip().startswith("["))


# Greedy answers of the 135M model (checked at q8_0): it repeats the number back when asked, and has
# no number to give after /reset. Name-based phrasings ("My name is Alice.") get invented names.
SYSTEM = "You are a helpful assistant."
TELL, ASK = "Remember the number 42.", "What number did I ask you to remember?"


@pytest.mark.slow
def test_chat_remembers_the_first_turn_and_reset_forgets_it(smollm2_q8):
    child = _spawn(smollm2_q8, "--temp", "0", "-c", "1024", "-n", "24", "--verbose", "--system", SYSTEM)
    try:
        child.expect("Ctrl-D exits")
        child.expect("> ")
        a1 = _answer(child, TELL)
        assert "tokens evaluated" in a1
        a2 = _answer(child, ASK)
        assert re.search(r"\b42\b", _reply(a2)), a2
        # the second turn ran only its new tokens; the first turn came from the KV cache
        evaluated, reused = map(int, re.search(r"prompt: (\d+) tokens evaluated, (\d+) reused", a2).groups())
        assert reused > evaluated > 0

        child.sendline("/reset")
        child.expect(r"\[new conversation\]")
        child.expect(PROMPT)
        a3 = _answer(child, ASK)
        assert not re.search(r"\b42\b", _reply(a3)), a3
        child.sendline("/exit")
        child.expect(pytest.importorskip("pexpect").EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_returns_to_the_prompt(smollm2_q8):
    child = _spawn(smollm2_q8, "--temp", "0", "-c", "1024", "-n", "300")
    try:
        child.expect("Ctrl-D exits")
        child.expect("> ")
        child.sendline("Write a long story about a dragon who loves to read books.")
        child.expect("dragon who loves to read books")
        child.expect(r"\w+ \w+ \w+")  # the answer is streaming
        t0 = time.monotonic()
        child.sendintr()
        child.expect(r"\[interrupted\]")
        child.expect(PROMPT)
        assert time.monotonic() - t0 < 30
        child.sendline("/stats")  # the session goes on after the interruption
        child.expect(r"answer: (\d+) tokens")
        assert 0 < int(child.match.group(1)) < 300
        child.expect(PROMPT)
        child.sendeof()  # Ctrl-D leaves
        child.expect(pytest.importorskip("pexpect").EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


# ---- defaults, through a pseudo-terminal on the tiny model (fast) --------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests._tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def test_chat_parser_defaults_are_llama_cpp_s_and_cap_answers():
    from pyinfer.cli import CHAT_N_PREDICT, build_parser, sampling_kwargs
    from pyinfer.sampler import SamplingParams

    args = build_parser("pyinfer-chat", chat=True).parse_args(["m.gguf"])
    assert SamplingParams(**sampling_kwargs(args)) == SamplingParams()  # llama.cpp's (test_sampler)
    # ... but for DRY, which llama.cpp leaves off: the chat turns it on (tests/test_dry.py)
    assert SamplingParams(**sampling_kwargs(args, chat=True)) == SamplingParams(dry_multiplier=0.8)
    assert args.n_predict is None and 0 < CHAT_N_PREDICT <= 2048


def test_chat_help_describes_the_chat(capsys):
    from pyinfer.cli import chat_main as main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: pyinfer-chat") and "chat with a model" in text
    import re

    for flag in ("--prompt", "--file", "--chat", "--ignore-eos"):  # they make no sense in a chat
        assert not re.search(rf"{flag}(?![\w-])", text), flag  # (--chat-template-kwargs does)
    assert "--chat-template-kwargs" in text


def test_chat_shows_its_defaults_and_says_when_an_answer_is_cut(tiny_model):
    pexpect = pytest.importorskip("pexpect")
    child = _spawn(tiny_model, "-t", "1")  # all defaults
    try:
        child.expect("Ctrl-D exits", timeout=60)
        child.expect(r"sampling: temp 0\.80, top-k 40, top-p 0\.95, min-p 0\.05, no repeat penalty, "
                     r"DRY 0\.8 \(base 1\.75, allowed length 2, whole context\); "
                     r"answers capped at 512 tokens \(-n\)")
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    child = _spawn(tiny_model, "-t", "1", "-n", "3", "-s", "1", "--repeat-penalty", "1.1")
    try:
        child.expect("Ctrl-D exits", timeout=60)
        child.expect(r"repeat-penalty 1\.10 over the last 64 tokens, DRY 0\.8 \(base 1\.75, allowed "
                     r"length 2, whole context\); answers capped at 3 tokens")
        child.expect("> ")
        child.sendline("the")
        child.expect(r"\[answer cut at 3 tokens \(-n 3\)")
        child.expect(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.parametrize("encoding", ["utf-8:surrogateescape", "utf-8:strict"])
def test_a_message_that_is_not_utf8_is_refused_and_the_chat_goes_on(tiny_model, encoding):
    """Bytes that are not UTF-8 on stdin (Latin-1 from a terminal) ended the chat with a
    traceback, the conversation lost: kept as lone surrogates by a surrogateescape decoder (the
    C.UTF-8 locale's), they failed in the tokenizer; a strict decoder failed in input(). Either
    way: a one-line error, and the chat goes on (with the strict decoder the pipe's bytes after
    the bad ones go with them: the next message is answered where it came in a later read)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONIOENCODING=encoding)
    # (greedy: a sampled answer ended by itself within 3 tokens in about 1 run of 20)
    r = subprocess.run([sys.executable, "-m", "pyinfer.repl", tiny_model, "-t", "1", "-n", "3",
                        "--temp", "0"], input=b"caf\xe9\nthe\n", capture_output=True, cwd=ROOT,
                       env=env, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8" in err, err
    if encoding.endswith("surrogateescape"):
        assert "[answer cut at 3 tokens" in err, err


# ---- text typed while an answer streams (a scripted slow model, tests/_slow_chat.py) ------------
def _spawn_slow():
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PYTHONPATH=ROOT, TERM="dumb", PYTHONUNBUFFERED="1")
    return pexpect.spawn(sys.executable, ["-m", "tests._slow_chat"], cwd=ROOT, env=env,
                         encoding="utf-8", timeout=30, dimensions=(40, 200))


@contextmanager
def _slow_chat():
    """(child, pexpect) of the scripted slow chat at its first prompt; closed afterwards, its
    exit status then checked (0)."""
    pexpect = pytest.importorskip("pexpect")
    child = _spawn_slow()
    try:
        child.expect("> ")
        yield child, pexpect
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.parametrize("ctrl_c", [False, True])
def test_text_typed_while_an_answer_streams_starts_the_next_message(ctrl_c):
    """Typed during an answer: not echoed into it, not dropped by Ctrl-C (the terminal flushes
    its input on SIGINT unless NOFLSH is set), and read as the start of the next message."""
    with _slow_chat() as (child, pexpect):
        child.sendline("first")
        child.expect(r"<<GOT:'first'>>")
        child.expect("w3 ")
        child.send("typed ahead")
        child.expect("w5 ")
        if ctrl_c:
            child.sendintr()
            child.expect(r"\[interrupted\]")
        else:
            child.expect("w19 ")
        assert "typed ahead" not in child.before  # not echoed into the answer
        child.expect(PROMPT)
        child.send(" and more\r")
        child.expect(r"<<GOT:'(.*?)'>>")
        assert child.match.group(1) == "typed ahead and more"
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)


def test_a_whole_line_typed_ahead_is_the_next_message():
    with _slow_chat() as (child, pexpect):
        child.sendline("first")
        child.expect("w3 ")
        child.send("second\r")
        child.send("third")
        child.expect(r"<<GOT:'second'>>")  # sent when the first answer ended
        child.expect("w19 ")
        child.expect(PROMPT)
        child.send("\r")
        child.expect(r"<<GOT:'third'>>")
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)


def test_ctrl_d_typed_while_an_answer_streams_ends_the_chat_after_it():
    """End of input (Ctrl-D on an empty line) typed during an answer ends the chat once the
    answer is complete, as it does at the prompt (it was lost: the chat waited for input)."""
    with _slow_chat() as (child, pexpect):
        child.sendline("first")
        child.expect("w3 ")
        child.sendeof()
        child.expect("w19 ")
        child.expect(pexpect.EOF, timeout=10)


def test_an_answer_fills_what_the_context_has_left(smollm2_q8):
    """A message that leaves two free positions got a 1-token answer (the REPL capped answers one
    short of the context); like pyinfer-run's, the answer now runs until the context is full:
    prompt and answer fill n_ctx tokens, as llama.cpp's server (Engine.generate; the last answer
    token is drawn, not evaluated)."""
    from pyinfer import LLM

    llm = LLM(smollm2_q8, n_ctx=64, seed=0)
    words = 1
    while True:  # the longest message that leaves at least two positions
        n = len(llm.chat_tokens([{"role": "user", "content": "hello " * (words + 1)}]))
        if n > llm.n_ctx - 2:
            break
        words += 1
    text = "hello " * words
    free = llm.n_ctx - len(llm.chat_tokens([{"role": "user", "content": text}]))
    assert free >= 2
    s = ChatSession(llm, temperature=0.0, ignore_eos=True)
    stats = s.ask(text)
    assert stats.completion_tokens == free
    assert stats.finish_reason == "length"
    assert len(llm.engine.tokens) == llm.n_ctx - 1


@pytest.mark.slow
def test_reverse_prompt_ends_a_chat_answer_before_it(smollm2_q8):
    """pyinfer-chat -r WORD: the greedy answer ends just before WORD's first appearance (the
    server's stop strings), the conversation keeps what was shown, and the settings line says so."""
    from pyinfer import LLM
    from pyinfer.cli import build_parser, sampling_kwargs
    from pyinfer.repl import describe_settings

    llm = LLM(smollm2_q8, n_ctx=512, n_threads=1)
    s = ChatSession(llm, max_tokens=40, temperature=0)
    assert s.ask("Name three fruits.").stop_string is None
    answer = s.messages[-1]["content"]
    assert len(answer.split()) >= 4, answer
    word = answer.split()[3]
    args = build_parser("pyinfer-chat", chat=True).parse_args(["m.gguf", "--temp", "0", "-r", word])
    cut = ChatSession(llm, max_tokens=40, **sampling_kwargs(args, chat=False))
    shown = []
    st = cut.ask("Name three fruits.", on_text=shown.append)
    assert "".join(shown) == cut.messages[-1]["content"] == answer[:answer.find(word)]
    assert st.stop_string == word and st.finish_reason == "stop"
    assert f"halted at {word!r} (-r)" in describe_settings(cut)


def test_settings_line_says_what_is_off():
    """The start-up line printed repeat-penalty and DRY as active with a look-back of 0 tokens
    (both off then, as in llama.cpp), and top-p 0 as sampling (it is greedy)."""
    from types import SimpleNamespace

    from pyinfer.repl import describe_settings

    def line(**sp):
        return describe_settings(SimpleNamespace(sampling=sp, max_tokens=512))

    assert "no repeat penalty" in line(repeat_penalty=1.1, repeat_last_n=0)
    assert "repeat-penalty 1.10 over the last 64 tokens" in line(repeat_penalty=1.1, repeat_last_n=64)
    assert "no DRY" in line(dry_multiplier=0.8, dry_penalty_last_n=0)
    assert "DRY 0.8" in line(dry_multiplier=0.8, dry_penalty_last_n=-1)
    assert line(top_p=0.0).startswith("sampling: greedy (top-p 0)")


def test_a_piped_line_that_is_not_utf8_costs_only_itself(tiny_model):
    """Read from a pipe, stdin's text layer decoded 8 KiB blocks: one bad line took the lines
    around it (no answer to them, and the chat ended). Now each line is decoded alone."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONIOENCODING="utf-8:strict")
    r = subprocess.run([sys.executable, "-m", "pyinfer.repl", tiny_model, "-t", "1", "--temp", "0",
                        "-n", "3"], input=b"the cat\n\xff\xfe bad\nthe dog\n", capture_output=True,
                       env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert err.count("error: the message is not valid UTF-8") == 1, err
    assert err.count("[answer cut at 3 tokens") == 2, err  # both good lines were answered
    assert "prompt eval time" in err  # the session's timings at its end, as llama.cpp's main


def test_chat_reverse_prompts_take_escapes_and_control_tokens(tiny_model, monkeypatch):
    """pyinfer-chat's -r '\\n' waited for a backslash and an n (pyinfer-run's had escapes); a
    reverse prompt that is one control token halts at that token in the chat too."""
    import pyinfer.repl
    from pyinfer.cli import chat_main

    seen = {}

    def fake_repl(session, verbose=False):
        seen["s"] = session
        return 0

    monkeypatch.setattr(pyinfer.repl, "repl", fake_repl)
    assert chat_main([tiny_model, "-t", "1", "-r", "\\n", "-r", "<|im_start|>"]) == 0
    sampling = seen["s"].sampling
    assert sampling["stop"] == ["\n", "<|im_start|>"]
    assert sampling["halt_ids"] == seen["s"].llm.tokenize("<|im_start|>", add_bos=False)
    assert chat_main([tiny_model, "-t", "1", "-r", "\\n", "--no-escape"]) == 0
    assert seen["s"].sampling["stop"] == ["\\n"] and "halt_ids" not in seen["s"].sampling


def test_a_long_paste_typed_while_an_answer_streams_is_kept_whole():
    """A paste of more than 4,095 bytes during an answer came through cut to 4,095 (a line's
    limit in the terminal's canonical mode) and was sent so; raw, the terminal holds it whole."""
    with _slow_chat() as (child, pexpect):
        child.sendline("first")
        child.expect("w3 ")
        pasted = " ".join(f"p{i}" for i in range(1500))  # ~7,400 bytes
        for i in range(0, len(pasted), 1000):
            child.send(pasted[i:i + 1000])
        child.send(" END\r")
        child.expect(r"<<GOT:'(.*?)'>>", timeout=60)
        assert child.match.group(1) == pasted + " END"
        child.expect(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)


def test_crlf_piped_lines_and_an_interrupt_after_text(tiny_model, monkeypatch):
    """From the review: a piped CRLF line kept its \\r (input() drops it); an interrupt after
    some of the answer was shown dropped the shown turn from the conversation."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", "import sys; from pyinfer.repl import _input; "
                        "print(repr(_input('')), repr(_input('')))"],
                       input=b"hello\r\nworld\n", capture_output=True, env=env, timeout=60, cwd=ROOT)
    assert r.stdout.decode().strip() == "'hello' 'world'", r.stderr

    class Interrupting(FakeLLM):
        def stream_text(self, ids, max_tokens=None, should_stop=None, **kw):
            yield "shown "
            raise KeyboardInterrupt

    session = ChatSession(Interrupting())
    with pytest.raises(KeyboardInterrupt):
        session.ask("hello")
    assert [m["content"] for m in session.messages] == ["hello", "shown "]
