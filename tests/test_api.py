"""pyinfer.LLM: OpenAI-shaped results, streaming, stop strings, usage, KV-cache reuse.

Fast tests drive the text layer (stop strings, finish reasons, chunk shapes) over a scripted engine;
slow tests run the converted SmolLM2 at temperature 0.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyinfer.api import LLM, GenerationStats, stop_holdback
from pyinfer.engine import Timings
from pyinfer.errors import PyinferError


# ---- a scripted engine: token i decodes to PIECES[i] --------------------------------------------
class _Decoder:
    def __init__(self, pieces):
        self.pieces = pieces

    def feed(self, i):
        return self.pieces[i]

    def flush(self):
        return ""


class _Tokenizer:
    def __init__(self, pieces):
        self.pieces = pieces
        self.bos_id = self.eos_id = None
        self.chat_template = None
        self.n_vocab = len(pieces)

    def stream_decoder(self, skip_special=True, continuation=False):
        return _Decoder(self.pieces)

    def decode(self, ids, skip_special=False):
        return "".join(self.pieces[i] for i in ids)


class _Engine:
    """Yields ``script`` (token ids) after any prompt, as Engine.generate does (stop id not yielded)."""

    def __init__(self, script, n_ctx=64):
        self.script = script
        self.n_ctx = n_ctx
        self.tokens = []
        self.timings = Timings()

    def generate(self, prompt, params, *, max_tokens=-1, seed=None, ignore_eos=False, stop_ids=None):
        self.tokens = list(prompt)
        self.timings.prompt_n += len(prompt)
        self.finish_reason = None
        for n, t in enumerate(self.script):
            yield t
            self.tokens.append(t)
            if n + 1 == max_tokens or len(self.tokens) >= self.n_ctx:
                self.finish_reason = "length"
                return
        self.finish_reason = "stop"  # the script's end: a stop id


def scripted(pieces, n_ctx=64) -> LLM:
    llm = LLM.__new__(LLM)
    llm._engine = _Engine(list(range(len(pieces))), n_ctx)
    llm.tokenizer = _Tokenizer(pieces)
    llm.model_name = "scripted"
    llm.model_path = "scripted.gguf"
    llm.verbose = False
    llm._rng = np.random.default_rng(0)
    llm.last_stats = GenerationStats()
    llm.bos_token = llm.eos_token = ""
    llm.chat_template = None
    llm.chat_template_kwargs = {}
    return llm


def _thinking_llm(pieces, prompt_piece):
    """A scripted LLM answering ``pieces`` to a chat whose prompt decodes to prompt_piece."""
    llm = scripted(pieces + [prompt_piece])
    llm._engine.script = list(range(len(pieces)))
    llm.chat_tokens = lambda messages, template_kwargs=None: [len(pieces)]
    return llm


def test_reasoning_content_as_llama_cpp_server():
    """reasoning_format "auto" / "deepseek": the <think> block goes to reasoning_content, whole
    and streamed alike (the parts of the stream add up to the same); "none": as written; a block
    the prompt opened (DeepSeek-R1's template) ends at the answer's </think>."""
    msgs = [{"role": "user", "content": "capital of Germany?"}]
    pieces = ["<think>", "\nThe capital", " is Berlin.\n", "</thi", "nk>\n\n", "Berlin", "."]
    for fmt in ("auto", "deepseek"):
        out = _thinking_llm(pieces, "Q").create_chat_completion(msgs, reasoning_format=fmt)
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "Berlin.",
                                                "reasoning_content": "The capital is Berlin."}
        chunks = list(_thinking_llm(pieces, "Q").create_chat_completion(
            msgs, reasoning_format=fmt, stream=True))
        deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The capital is Berlin."
        assert "".join(d.get("content", "") for d in deltas) == "Berlin."
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)
    out = _thinking_llm(pieces, "Q").create_chat_completion(msgs)  # the API's default: none
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "".join(pieces)}
    forced = _thinking_llm(["Hmm.", "\n</think>\n\n", "Berlin."], "<think>\n")
    msg = forced.create_chat_completion(msgs, reasoning_format="auto")["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "Berlin.")
    with pytest.raises(PyinferError, match="reasoning_format must be one of"):
        _thinking_llm(pieces, "Q").create_chat_completion(msgs, reasoning_format="think")


def test_chat_template_kwargs_defaults_and_per_call():
    """LLM.chat_template_kwargs (the CLIs' --chat-template-kwargs) reach every rendering; a
    call's own chat_template_kwargs win over them; bad ones are PyinferErrors."""
    llm = scripted(["a", "b"])
    llm.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}")
    msgs = [{"role": "user", "content": "q"}]
    assert llm.render_chat(msgs) == "q"
    llm.chat_template_kwargs = {"enable_thinking": False}
    assert llm.render_chat(msgs) == "q[no think]"
    assert llm.render_chat(msgs, template_kwargs={"enable_thinking": True}) == "q"
    with pytest.raises(PyinferError, match="set by the renderer itself"):
        llm.render_chat(msgs, template_kwargs={"bos_token": "x"})
    llm.chat_template_kwargs = {"messages": 1}  # set by hand: checked too
    with pytest.raises(PyinferError, match="LLM.chat_template_kwargs: 'messages'"):
        llm.render_chat(msgs)


def test_stop_holdback():
    assert stop_holdback("Hello <|e", ["<|end|>"]) == 6
    assert stop_holdback("Hello", ["<|end|>"]) == 5
    assert stop_holdback("ab", ["b!", "ab?"]) == 0  # the earliest start that could still match wins
    assert stop_holdback("", ["x"]) == 0


def test_stop_string_split_across_tokens_is_never_emitted():
    llm = scripted(["The end", "<|", "end", "|>", " more"])
    chunks = list(llm.stream_text([0], stop=["<|end|>"]))
    assert chunks == ["The end"]
    assert llm.last_stats.finish_reason == "stop"
    assert llm.last_stats.completion_tokens == 4


def test_held_back_text_is_released_when_it_is_not_a_stop():
    llm = scripted(["a", "<", "b", "c"])
    chunks = list(llm.stream_text([0], stop="<|end|>"))
    assert chunks == ["a", "<b", "c"]  # "<" waited for the next token, then went out
    assert llm.last_stats.finish_reason == "stop"  # the script ran out, as at an end-of-text id


def test_earliest_stop_wins_and_text_is_cut_before_it():
    llm = scripted(["Hel", "lo", " wor", "ld!"])
    out = llm.create_completion([0], max_tokens=10, stop=["world", "o w"])
    assert out["choices"][0]["text"] == "Hell"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


def test_length_finish_and_stream_chunk_shapes():
    llm = scripted(["a", "b", "c", "d"])
    out = llm.create_completion([5, 6], max_tokens=2)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == "ab" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    chunks = list(llm.create_completion([5, 6], max_tokens=2, stream=True))
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert len({c["id"] for c in chunks}) == 1


def test_should_stop_interrupts():
    llm = scripted(list("abcdef"))
    seen = []
    for piece in llm.stream_text([0], should_stop=lambda: len(seen) >= 2):
        seen.append(piece)
    assert "".join(seen) == "ab"
    assert llm.last_stats.interrupted and llm.last_stats.finish_reason == "stop"


def test_prompt_must_fit():
    llm = scripted(["a"], n_ctx=4)
    with pytest.raises(PyinferError, match=r"4 tokens, as long as the context \(4\), which leaves "
                                           "no room for an answer"):
        llm.create_completion([1, 2, 3, 4])
    with pytest.raises(PyinferError, match=r"5 tokens, longer than the context \(4\)"):
        llm.create_completion([1, 2, 3, 4, 5])
    with pytest.raises(PyinferError, match="empty prompt"):
        llm.create_completion([])


def test_bad_sampling_parameters_raise_before_streaming():
    llm = scripted(["a"])
    with pytest.raises(PyinferError, match="top_p must be a finite number >= 0 and <= 1"):
        llm.create_completion([0], top_p=1.5, stream=True)


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_k=-2), "top_k must be an integer in 0.."),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(min_p=1.5), "min_p must be a finite number >= 0 and <= 1"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(repeat_penalty=0.0), "repeat_penalty must be a finite number > 0"),
    (dict(repeat_penalty=float("nan")), "repeat_penalty must be a finite number > 0"),
    (dict(max_tokens=-2), "max_tokens must be an integer in -1.."),
    (dict(max_tokens=10**20), "max_tokens must be an integer in -1.."),
    (dict(seed=-2), "seed must be an integer in 0..18446744073709551615 (or -1)"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(stop=3), "stop must be a string or a list of strings"),
])
def test_bad_request_values_are_pyinfer_errors(kw, message):
    llm = scripted(["a"])
    for create in (lambda: llm.create_completion([0], **kw),
                   lambda: llm.create_chat_completion([{"role": "user", "content": "x"}], **kw)):
        with pytest.raises(PyinferError) as e:
            create()
        assert message in str(e.value)


def test_top_p_zero_is_greedy_and_seed_minus_one_is_random():
    llm = scripted(["a", "b"])
    assert llm._params(0.8, 40, 0.0, 0.05, 1.0).temperature == 0.0
    assert llm.create_completion([0], seed=-1, max_tokens=2)["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("kw,message", [
    (dict(n_threads=0), "n_threads must be an integer in 1..512, got 0"),
    (dict(n_threads=100000), "n_threads must be an integer in 1..512, got 100000"),
    (dict(n_threads=2**31), "n_threads must be an integer in 1..512"),
    (dict(n_ctx=-1), "n_ctx must be an integer in 0..16777216, got -1"),
    (dict(n_ctx=9999999999999999999), "n_ctx must be an integer in 0..16777216"),
    (dict(vram_budget=-1.0), "vram_budget must be a finite number > 0"),
    (dict(vram_budget=float("nan")), "vram_budget must be a finite number > 0"),
    (dict(n_gpu_layers=-1), "n_gpu_layers must be an integer in 0.."),
    (dict(seed=-5), "seed must be an integer"),
    (dict(cache_type="q8"), "cache_type 'q8': expected one of auto, f16, f32"),
])
def test_constructor_errors(tmp_path, kw, message):
    # the values are refused before the file is even opened
    with pytest.raises(PyinferError) as e:
        LLM(str(tmp_path / "none.gguf"), **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("kw", [dict(vram_budget=1.0), dict(n_gpu_layers=2),
                                dict(reset_gpu_index=True), dict(disable_gpu_index=True)])
def test_gpu_options_on_the_cpu_name_the_api_arguments(smollm2_q8, kw):
    """The message named only the command-line flags (--vram-budget, -ngl) to API callers; the
    GPU split's flags were accepted silently with device cpu (README: an error). It names the
    option given, in both spellings."""
    (name,) = kw
    with pytest.raises(PyinferError, match=rf"^\S+ \({name}=\): for a GPU device") as e:
        LLM(smollm2_q8, device="cpu", **kw)
    assert "\n" not in str(e.value)


def test_decode_rate_counts_decode_runs(tmp_path):
    """``tokens_per_second`` is llama.cpp's eval rate: decode passes over their time. The first
    generated token comes from the prompt's logits, so an answer of one token ran no decode pass
    (the rate is 0.0, not 1 token over no time) and one of five ran four."""
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "tiny.gguf")), n_threads=1, device="cpu")
    ids = llm.tokenize("the")
    for n, runs in ((1, 0), (5, 4)):
        before = llm.engine.timings.eval_n
        list(llm.stream_text(ids, max_tokens=n, ignore_eos=True, temperature=0))
        s = llm.last_stats
        assert s.completion_tokens == n and s.eval_runs == runs
        assert llm.engine.timings.eval_n - before == runs
        assert s.tokens_per_second == (pytest.approx(1e3 * runs / s.eval_ms) if runs else 0.0)


def test_warmup_leaves_no_trace_but_its_load_time(smollm2_q8):
    """Engine.warmup (llama.cpp's warm-up pass, what the CLIs run at load) leaves an empty cache
    and zeroed counters: the next prompt and decode steps give the bits of an engine that never
    warmed up, and only load_ms grew."""
    ids = [1, 504, 3458, 282, 4649, 314, 253, 2]
    runs = {}
    for warm in (False, True):
        eng = LLM(smollm2_q8, n_ctx=64, n_threads=2, device="cpu").engine
        load_ms = eng.timings.load_ms
        if warm:
            eng.warmup()
            t = eng.timings
            assert not eng.tokens and t.load_ms > load_ms
            assert (t.prompt_n, t.eval_n, t.passes, eng.model.ffn.stats.total) == (0, 0, 0, 0)
        first = eng.eval_prompt(ids[:5]).copy()
        runs[warm] = [first] + [eng.eval_token(i).copy() for i in ids[5:]]
        assert eng.timings.prompt_n == 5 and eng.timings.eval_n == 3
    for a, b in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(a, b)


def test_warmup_with_special_ids_past_the_embedding(tmp_path):
    """A llama.cpp file's tokenizer may list more tokens than token_embd has rows, its eos among
    them: the warm-up feeds token 0 there (an IndexError at load before) and leaves the engine
    clean."""
    from tests._tiny_gguf import write_tiny_gguf

    eng = LLM(write_tiny_gguf(str(tmp_path / "tiny.gguf")), n_threads=1, device="cpu").engine
    eng.tokenizer._eos = eng.cfg.n_vocab + 5
    eng.tokenizer._bos = None
    eng.warmup()
    assert not eng.tokens and eng.timings.passes == 0


def test_prompt_progress_starts_before_the_first_batch(tmp_path):
    """A long prompt reports (0, n) before its first batch, then after each batch: a progress
    bar's clock (and so its tokens/s) includes the first batch (it read 7x fast without)."""
    from pyinfer.engine import PROMPT_BATCH
    from tests._tiny_gguf import write_tiny_gguf

    eng = LLM(write_tiny_gguf(str(tmp_path / "tiny.gguf")), n_ctx=2 * PROMPT_BATCH + 64,
              n_threads=1, device="cpu").engine
    calls = []
    eng.prompt_progress = lambda done, total: calls.append((done, total))
    n = PROMPT_BATCH + 40
    eng.eval_prompt([i % eng.cfg.n_vocab for i in range(n)])
    assert calls == [(0, n), (PROMPT_BATCH, n), (n, n)]
    calls.clear()
    eng.eval_prompt(list(range(10)))  # a short prompt reports nothing
    assert calls == []


def test_constructor_missing_file(tmp_path):
    with pytest.raises(PyinferError, match="not found"):
        LLM(str(tmp_path / "none.gguf"), device="cpu")


def test_lazy_import():
    import pyinfer

    assert pyinfer.LLM is LLM
    with pytest.raises(AttributeError):
        pyinfer.NoSuchThing  # noqa: B018


# ---- the real model -----------------------------------------------------------------------------
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]


def fresh(llm):
    """Empty the KV cache so every compared run evaluates its prompt the same way: a prompt evaluated
    as one batch and one whose last token is evaluated alone round differently (logits differ by up
    to ~0.3 on SmolLM2 q8_0), which can flip a near-tie under greedy decoding."""
    llm.reset()
    return llm


@pytest.mark.slow
def test_a_prompt_gets_the_same_logits_whatever_the_cache_holds(smollm2_llm):
    """Engine.eval_prompt evaluates at least a prompt's last two tokens, never a batch of one: a
    prompt the cache already holds (a repeated request), one that extends the cache by a token,
    and a fresh one get the same last-token logits bit for bit, so one greedy request asked twice
    of one LLM gives the same text (a lone last token went through the decode kernels, whose
    logits on SmolLM2 q8_0 differ by up to ~1, and the second answer differed)."""
    from pyinfer.engine import prompt_batches

    llm, eng = smollm2_llm, smollm2_llm.engine
    ids = llm.tokenize("The capital of France is")
    eng.reset()
    want = eng.eval_prompt(ids).copy()
    eng.eval_token(int(np.argmax(want)))
    np.testing.assert_array_equal(eng.eval_prompt(ids), want)  # whole prompt cached
    eng.reset()
    eng.eval_prompt(ids[:-1])
    np.testing.assert_array_equal(eng.eval_prompt(ids), want)  # one token more than cached
    # the decode step alone rounds otherwise: what the repeated prompt used to get
    eng.reset()
    eng.eval_prompt(ids[:-1])
    assert not np.array_equal(eng.eval_token(ids[-1]), want)
    a = fresh(llm).create_completion("The capital of France is", max_tokens=16, temperature=0)
    b = llm.create_completion("The capital of France is", max_tokens=16, temperature=0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert llm.last_stats.prompt_evaluated == 2
    assert prompt_batches(513) == [(0, 511), (511, 513)] and prompt_batches(1) == [(0, 1)]


@pytest.mark.slow
def test_generated_rows_are_evaluated_again_when_a_prompt_holds_them(smollm2_llm):
    """A chat's next turn holds the answer the decode kernels wrote into the cache: reusing those
    rows gave other logits than a fresh evaluation (up to ~0.8 on SmolLM2), so turn 2 after turn
    1 answered other text than the same messages sent to a fresh LLM. Only rows a batched
    forward wrote are reused now; a one-token prompt's row (a decode step) neither."""
    llm, eng = smollm2_llm, smollm2_llm.engine
    ids = llm.tokenize("Once upon a time, in a land far away, there lived a")
    eng.reset()
    logits = eng.eval_prompt(ids)
    for _ in range(12):  # a greedy answer, through the decode kernels
        logits = eng.eval_token(int(np.argmax(logits)))
    turn2 = eng.tokens + llm.tokenize(" The end. Tell me more:")
    got = eng.eval_prompt(turn2).copy()
    eng.reset()
    want = eng.eval_prompt(turn2).copy()
    np.testing.assert_array_equal(got, want)
    eng.reset()
    eng.eval_prompt(turn2[:1])  # a one-token prompt: a decode step
    np.testing.assert_array_equal(eng.eval_prompt(turn2), want)
    msgs = [{"role": "user", "content": "Write a short story about a fox."}]
    llm.reset()
    r1 = llm.create_chat_completion(msgs, temperature=0, max_tokens=24)["choices"][0]["message"]
    msgs2 = msgs + [r1, {"role": "user", "content": "Now make it sadder."}]
    a = llm.create_chat_completion(msgs2, temperature=0, max_tokens=24)["choices"][0]["message"]
    assert 0 < llm.last_stats.prompt_evaluated < llm.last_stats.prompt_tokens  # the prefix reused
    b = fresh(llm).create_chat_completion(msgs2, temperature=0, max_tokens=24)
    assert a["content"] == b["choices"][0]["message"]["content"]
    # the chat REPL reuses its answers' rows for latency, only while it answers: the API keeps
    # the exact rule after a ChatSession has run on the same LLM
    from pyinfer.repl import ChatSession

    llm.reset()
    chat = ChatSession(llm, max_tokens=12, temperature=0)
    chat.ask("Hi!")
    chat.ask("Tell me a joke.")
    assert not eng.reuse_decoded_rows
    turn = eng.tokens + llm.tokenize(" More:")
    got = eng.eval_prompt(turn).copy()
    eng.reset()
    np.testing.assert_array_equal(got, eng.eval_prompt(turn))


@pytest.mark.slow
def test_an_end_of_turn_at_the_last_position_is_a_stop(smollm2_q8, smollm2_llm):
    """The end-of-turn token drawn from the context's last position ended the answer by itself,
    but finish_reason was worked out afterwards from a full cache: "length" (and pyinfer-run /
    the REPL said the context was full). The engine now says why a generation ended."""
    msgs = [{"role": "user", "content": "Hi"}]
    n_prompt = len(smollm2_llm.chat_tokens(msgs))
    free = smollm2_llm.create_chat_completion(msgs, temperature=0, max_tokens=64)
    assert free["choices"][0]["finish_reason"] == "stop"
    k = free["usage"]["completion_tokens"]
    assert k < 64
    # a context of P + k + 1 holds the answer and draws the end of turn from its last row; one
    # of P + k ends the same answer at the context's end (prompt + answer <= n_ctx, as
    # llama.cpp's server: it gave P + k + 1 tokens in all, one more than the context)
    for n_ctx, reason in ((n_prompt + k + 1, "stop"), (n_prompt + k, "length")):
        out = LLM(smollm2_q8, n_ctx=n_ctx).create_chat_completion(msgs, temperature=0)
        assert out["choices"][0]["message"] == free["choices"][0]["message"]
        assert out["choices"][0]["finish_reason"] == reason, n_ctx
        assert out["usage"]["total_tokens"] <= n_ctx


@pytest.mark.slow
def test_a_stream_interrupted_by_another_call_says_so(smollm2_llm):
    """Two streams read side by side on one LLM shared one KV cache and both went on with wrong
    text; a stream resumed after another call now raises PyinferError, and the call that took
    the cache gives what it gives alone."""
    from pyinfer.errors import PyinferError

    llm = smollm2_llm
    want = fresh(llm).create_completion("My favourite fruit is", max_tokens=8, temperature=0)
    a = fresh(llm).create_completion("The capital of France is", max_tokens=8, temperature=0,
                                     stream=True)
    next(a)
    next(a)
    b = llm.create_completion("My favourite fruit is", max_tokens=8, temperature=0, stream=True)
    assert "".join(c["choices"][0]["text"] for c in b) == want["choices"][0]["text"]
    with pytest.raises(PyinferError, match="interrupted"):
        for _ in a:
            pass


@pytest.mark.slow
def test_logprobs_end_where_a_stop_string_cuts_the_text(smollm2_llm):
    """The tokens of a stop string cut from the text get no log-probabilities (llama.cpp's server
    trims them; OpenAI's logprobs cover the returned text): the tokens join to the text, in a
    completion, a stream and a chat (there a prefix of it: the token " Berlin" straddles the
    cut and goes with the stop string); an empty stop string stops nothing (it ended every answer
    at once, empty)."""
    llm = smollm2_llm
    prompt = "The capital of France is"
    full = fresh(llm).create_completion(prompt, max_tokens=12, temperature=0, logprobs=1)
    text = full["choices"][0]["text"]
    assert "".join(full["choices"][0]["logprobs"]["tokens"]) == text and "." in text
    for stop in (["."], [" of"], "\n"):
        out = fresh(llm).create_completion(prompt, max_tokens=12, temperature=0, logprobs=1, stop=stop)
        c = out["choices"][0]
        assert c["finish_reason"] == "stop" and text.startswith(c["text"]) and c["text"] != text
        assert "".join(c["logprobs"]["tokens"]) == c["text"], (stop, c)
        chunks = list(fresh(llm).create_completion(prompt, max_tokens=12, temperature=0, logprobs=1,
                                                   stop=stop, stream=True))
        assert "".join(t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]) == c["text"]
    chat = fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24, logprobs=True,
                                             stop=["Berlin"])
    msg = chat["choices"][0]["message"]["content"]  # "... is ": the stop cut " Berlin" in two
    joined = "".join(t["token"] for t in chat["choices"][0]["logprobs"]["content"])
    assert msg.startswith(joined) and msg[len(joined):] == " " and "Berlin" not in joined
    for empty in ("", [""]):
        out = fresh(llm).create_completion(prompt, max_tokens=12, temperature=0, stop=empty)
        assert out["choices"][0]["text"] == text and out["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_streamed_logprobs_leave_out_a_token_the_stop_string_cuts(smollm2_llm):
    """A stream handed out each token's logprobs as soon as the token came, also a token whose
    text was still held back as a possible stop string; when the stop matched, the stream had
    sent it and the non-streamed answer had not. Stop strings that begin inside a token."""
    llm = smollm2_llm
    prompt = "Once upon a time"
    full = fresh(llm).create_completion(prompt, max_tokens=24, temperature=0, logprobs=1)
    text, lp = full["choices"][0]["text"], full["choices"][0]["logprobs"]
    ends = lp["text_offset"][1:] + [len(text)]
    cases = 0
    for k in range(1, len(lp["tokens"]) - 1):
        start, end = lp["text_offset"][k], ends[k]
        stop = text[start + 1:ends[k + 1]]
        if end - start < 2 or text.find(stop) != start + 1:
            continue
        cases += 1
        for chat in (False, True):
            if chat:
                msgs = [{"role": "user", "content": prompt}]
                a = fresh(llm).create_chat_completion(msgs, max_tokens=24, temperature=0,
                                                      logprobs=True, stop=stop)
                b = list(fresh(llm).create_chat_completion(msgs, max_tokens=24, temperature=0,
                                                           logprobs=True, stop=stop, stream=True))
                want = [e["token"] for e in a["choices"][0]["logprobs"]["content"]]
                got = [e["token"] for c in b for e in (c["choices"][0]["logprobs"] or {}).get(
                    "content", [])]
            else:
                a = fresh(llm).create_completion(prompt, max_tokens=24, temperature=0, logprobs=1,
                                                 stop=stop)
                b = list(fresh(llm).create_completion(prompt, max_tokens=24, temperature=0,
                                                      logprobs=1, stop=stop, stream=True))
                want = a["choices"][0]["logprobs"]["tokens"]
                got = [t for c in b for t in c["choices"][0]["logprobs"]["tokens"]]
                assert want == lp["tokens"][:k]  # the straddling token went with the stop
            assert got == want, (stop, chat)
        if cases == 2:
            break
    assert cases == 2


@pytest.mark.slow
def test_logprobs_of_tokens_that_split_a_character(smollm2_llm):
    """Japanese text comes one byte token at a time (each kana split in two tokens). Every such
    token showed as U+FFFD, so its ``text_offset`` counted one character per token and pointed
    past the text. Now a split token shows as OpenAI's ``bytes:\\xNN`` form, its bytes are the
    tokenizer's, and each offset is where the token's text begins in the answer, streamed or
    not, including an answer that ends inside a character (its tail shows as U+FFFD)."""
    llm = smollm2_llm
    out = fresh(llm).create_completion("日本の首都は", max_tokens=12, temperature=0, logprobs=2)
    c = out["choices"][0]
    text, lp = c["text"], c["logprobs"]
    split = [t for t in lp["tokens"] if t.startswith("bytes:")]
    assert split, lp["tokens"]  # the case under test: some token is part of a character
    raw = b""
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        if tok.startswith("bytes:"):
            b = bytes(int(h, 16) for h in tok[len("bytes:"):].split("\\x")[1:])
            with pytest.raises(UnicodeDecodeError):
                b.decode("utf-8")
        else:
            b = tok.encode("utf-8")
            assert text[off:].startswith(tok)
        assert text[:off] == raw.decode("utf-8", errors="ignore")[:off]
        assert 0 <= off <= len(text)
        raw += b
    assert raw.decode("utf-8", errors="replace") == text  # the bytes make the answer
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chunks = list(fresh(llm).create_completion("日本の首都は", max_tokens=12, temperature=0,
                                               logprobs=2, stream=True))
    streamed = [ch["choices"][0]["logprobs"] for ch in chunks]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    chat = fresh(llm).create_chat_completion([{"role": "user", "content": "日本語で挨拶して"}],
                                             temperature=0, max_tokens=12, logprobs=True)
    content = chat["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in content)
    assert joined.decode("utf-8", errors="replace") == chat["choices"][0]["message"]["content"]
    assert all(e["token"].startswith("bytes:") or e["token"] == bytes(e["bytes"]).decode("utf-8")
               for e in content)


def test_arguments_of_the_wrong_type_raise_pyinfer_error(smollm2_llm, tmp_path):
    """Token ids that are not integers, text that is not a str or not valid UTF-8, and a model
    path that is not a path raise PyinferError (they raised TypeError, ValueError or
    OverflowError); bytes prompts are UTF-8 text, as tokenize reads them (they were taken as
    token ids)."""
    from pyinfer import LLM
    from pyinfer.errors import PyinferError

    llm = smollm2_llm
    for call in (lambda: llm.create_completion(None), lambda: llm.create_completion(["a"]),
                 lambda: llm.create_completion([1.5]), lambda: llm.tokenize(None),
                 lambda: llm.tokenize(5), lambda: llm.tokenize("a\ud800b"),
                 lambda: llm.create_completion("a\ud800b"), lambda: llm.detokenize([-1]),
                 lambda: llm.detokenize(["a"]), lambda: llm.detokenize([10 ** 6]),
                 lambda: list(llm.generate(llm.tokenize("hi"), stop_ids=5)),
                 lambda: llm.create_embedding(["a", 5]), lambda: LLM(None)):
        with pytest.raises(PyinferError):
            call()
    a = fresh(llm).create_completion(b"The capital of France is", max_tokens=4, temperature=0)
    b = fresh(llm).create_completion("The capital of France is", max_tokens=4, temperature=0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"] == b["usage"]


def test_chat_content_parts_and_no_messages(smollm2_llm):
    """OpenAI's content parts (a list of text parts) render as their texts joined by newlines,
    as llama.cpp joins them (they were a template TypeError, then glued with nothing between);
    no messages at all, or messages of another type, are refused (OpenAI does)."""
    from pyinfer.errors import PyinferError

    llm = smollm2_llm
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of Germany?"}]}]
    plain = [{"role": "user", "content": "What is the capital\nof Germany?"}]
    assert llm.chat_tokens(parts) == llm.chat_tokens(plain)
    assert llm.chat_tokens(tuple(plain)) == llm.chat_tokens(plain)
    for bad in ([], (), None, "hi", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]):
        with pytest.raises(PyinferError):
            llm.create_chat_completion(bad, max_tokens=2)
    with pytest.raises(PyinferError, match="should_stop"):  # before any token, not a TypeError after
        llm.create_chat_completion(plain, max_tokens=2, should_stop=True)
    with pytest.raises(PyinferError, match="should_stop"):
        llm.create_completion("Hi", max_tokens=2, should_stop=1)


def test_chat_continues_a_last_assistant_message(smollm2_llm):
    """A chat ending with an assistant message is continued from its text (llama.cpp's server,
    prefill_assistant): for a user turn and the assistant's start, with SmolLM2's template, the
    prompt is transformers' apply_chat_template(continue_final_message=True) (a chat of the
    assistant's message alone differs: transformers renders the template's default system turn,
    llama.cpp and pyinfer render the empty chat before the text), and the answer holds only what
    follows. Parts of the continued message join with nothing between (llama.cpp appends them);
    its text is not split into reasoning."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    from pyinfer.errors import PyinferError

    llm = smollm2_llm
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    hf.chat_template = llm.chat_template
    chat = [{"role": "user", "content": "What is the capital of Germany?"},
            {"role": "assistant", "content": "The capital of Germany is"}]
    text = hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text.endswith("assistant\nThe capital of Germany is")
    assert llm.chat_tokens(chat) == llm.tokenize(text, special=True)
    out = llm.create_chat_completion(chat, max_tokens=3, temperature=0)
    answer = out["choices"][0]["message"]["content"]
    assert "Berlin" in answer and not answer.startswith("The capital")
    with pytest.raises(PyinferError, match="two assistant"):
        llm.chat_tokens(chat + [{"role": "assistant", "content": "x"}])
    parts = [chat[0], {"role": "assistant", "content": [{"type": "text", "text": "The capital "},
                                                        {"type": "text", "text": "of Germany is"}]}]
    assert llm.chat_tokens(parts) == llm.chat_tokens(chat)
    think = [chat[0], {"role": "assistant", "content": "<think>\n"}]
    out = llm.create_chat_completion(think, max_tokens=4, temperature=0, reasoning_format="auto")
    assert "reasoning_content" not in out["choices"][0]["message"]


def test_close_and_the_with_block(smollm2_q8):
    """LLM.close() (llama-cpp-python's Llama has one) releases the engine; later calls raise
    PyinferError; ``with LLM(...)`` closes at the end."""
    import weakref

    from pyinfer import LLM
    from pyinfer.errors import PyinferError

    with LLM(smollm2_q8, n_ctx=64) as llm:
        assert llm.create_completion("Hi", max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
        eng = weakref.ref(llm.engine)
    assert eng() is None  # nothing else held it
    with pytest.raises(PyinferError, match="closed"):
        llm.create_completion("Hi", max_tokens=2)
    llm.close()


@pytest.mark.slow
def test_stream_and_non_stream_agree_token_for_token(smollm2_llm):
    llm = smollm2_llm
    prompt = "The three primary colors are"
    ids = llm.tokenize(prompt)
    toks = list(fresh(llm).generate(ids, max_tokens=12, temperature=0))
    full = fresh(llm).create_completion(prompt, max_tokens=12, temperature=0)
    streamed = list(fresh(llm).create_completion(prompt, max_tokens=12, temperature=0, stream=True))
    text = full["choices"][0]["text"]
    assert text == llm.detokenize(toks, skip_special=True)
    assert "".join(c["choices"][0]["text"] for c in streamed) == text
    assert streamed[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "length"
    assert full["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                             "total_tokens": len(ids) + 12}
    # The same text re-tokenizes to the tokens generated (greedy output is canonical here).
    assert llm.tokenize(text, add_bos=False) == toks


@pytest.mark.slow
def test_chat_completion_stream_agrees_and_stops_at_end_of_turn(smollm2_llm):
    llm = smollm2_llm
    full = fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24)
    msg = full["choices"][0]["message"]
    assert full["object"] == "chat.completion" and msg["role"] == "assistant"
    assert "Berlin" in msg["content"]
    assert full["choices"][0]["finish_reason"] == "stop"  # ended at <|im_end|>, before 24 tokens
    assert full["usage"]["prompt_tokens"] == len(llm.chat_tokens(GERMANY))
    assert full["usage"]["completion_tokens"] < 24
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + full["usage"]["completion_tokens"]
    chunks = list(fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24, stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.slow
def test_stop_strings_on_the_model(smollm2_llm):
    llm = smollm2_llm
    full = fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24)["choices"][0]["message"]["content"]
    assert "Berlin" in full
    want = full[:full.index("Berlin")]
    out = fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24, stop=["Berlin"])
    assert out["choices"][0]["message"]["content"] == want
    assert out["choices"][0]["finish_reason"] == "stop"
    chunks = list(fresh(llm).create_chat_completion(GERMANY, temperature=0, max_tokens=24, stop="Berl",
                                             stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


@pytest.mark.slow
def test_next_turn_reuses_the_previous_prompt(smollm2_llm):
    llm = smollm2_llm
    first = llm.create_chat_completion(GERMANY, temperature=0, max_tokens=24)
    answer = first["choices"][0]["message"]
    cached = list(llm.engine.tokens)
    messages = GERMANY + [answer, {"role": "user", "content": "And of France?"}]
    ids = llm.chat_tokens(messages)
    common = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
    n_first = len(llm.chat_tokens(GERMANY))
    assert common > n_first  # the first answer is part of the common prefix
    llm.create_chat_completion(messages, temperature=0, max_tokens=4)
    assert llm.last_stats.prompt_tokens == len(ids)
    # the first prompt's rows are reused; the answer's (written by the decode kernels, which
    # round otherwise) are evaluated again, batched, with the new message
    assert llm.last_stats.prompt_evaluated == len(ids) - n_first


def test_ignore_eos_reports_the_models_logprobs(smollm2_llm):
    """With ignore_eos the end-of-generation tokens are never drawn, but the log-probabilities
    are the model's (llama.cpp's server reads them before its ignore_eos bias): the same as a
    plain greedy run's token for token, and where that run ended, its end-of-turn token is the
    most likely alternative (they came from the banned logits, renormalised without it)."""
    llm = smollm2_llm
    chat = [{"role": "user", "content": "What is 2+2?"}]
    a = llm.create_chat_completion(chat, temperature=0, max_tokens=48, logprobs=True, top_logprobs=2)
    assert a["choices"][0]["finish_reason"] == "stop"
    la = a["choices"][0]["logprobs"]["content"]
    n = len(la)
    b = llm.create_chat_completion(chat, temperature=0, max_tokens=n + 1, logprobs=True,
                                   top_logprobs=2, ignore_eos=True)
    lb = b["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in lb[:n]] == [e["logprob"] for e in la]
    assert [e["top_logprobs"] for e in lb[:n]] == [e["top_logprobs"] for e in la]
    eot = llm.tokenizer.decode([llm.tokenizer.eot_id if getattr(llm.tokenizer, "eot_id", None)
                                is not None else llm.tokenizer.eos_id], skip_special=False)
    assert lb[n]["top_logprobs"][0]["token"] == eot
    assert lb[n]["token"] != eot


def test_a_prompt_that_fills_the_context_gets_no_answer(smollm2_q8):
    """Engine.generate with a prompt of exactly n_ctx tokens (the API refuses it, the engine
    takes it) drew one token past the context: prompt + answer is at most n_ctx."""
    from pyinfer.engine import Engine
    from pyinfer.sampler import SamplingParams

    eng = Engine(smollm2_q8, n_ctx=16, n_threads=1)
    ids = eng.tokenizer.encode("one two three four five six seven eight nine ten " * 3)
    for p in (15, 16):
        eng.reset()
        out = list(eng.generate(ids[:p], SamplingParams(temperature=0), ignore_eos=True))
        assert len(out) == 16 - p and eng.finish_reason == "length"


@pytest.mark.parametrize("keep", [0, 3, -1])
def test_context_shift_keeps_llama_cpps_window_and_goes_on(keep, tmp_path):
    """context_shift (llama.cpp's --context-shift --keep N): each time the context fills, the
    first n_keep tokens (BOS added to N; -1: the whole prompt) stay, the oldest half of the
    rest goes (n_discard = (n_past - n_keep) // 2, llama.cpp's main), and the answer goes on to
    max_tokens; the logits after a shift are a fresh engine's over the kept tokens."""
    from pyinfer.engine import Engine
    from pyinfer.sampler import SamplingParams
    from tests._tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    eng = Engine(path, n_ctx=16, n_threads=1, device="cpu")
    fresh = Engine(path, n_ctx=16, n_threads=1, device="cpu")
    prompt = eng.tokenizer.encode("the cat sat", add_bos=True)
    bos = int(eng.tokenizer.add_bos and prompt[0] == eng.tokenizer.bos_id)
    n_keep = len(prompt) if keep < 0 else min(keep + bos, len(prompt))
    windows = []
    real = eng.eval_prompt

    def spy(tokens):
        logits = real(tokens)
        windows.append((list(tokens), np.array(logits)))
        return logits

    eng.eval_prompt = spy
    out = list(eng.generate(prompt, SamplingParams(temperature=0), max_tokens=40, ignore_eos=True,
                            context_shift=keep))
    assert len(out) == 40 and eng.finish_reason == "length"
    # replay llama.cpp's rule over the text the engine produced (the last token is never
    # evaluated: max_tokens ends the answer first)
    text, want = list(prompt), []
    for tok in out[:-1]:
        if len(text) + 1 >= 16:
            n_discard = (len(text) - n_keep) // 2
            text = text[:n_keep] + text[n_keep + n_discard:]
            want.append(text + [tok])
        text.append(tok)
    assert windows[0][0] == prompt  # (the prompt's own evaluation)
    assert [w for w, _ in windows[1:]] == want and len(want) >= 3
    for window, logits in windows[1:]:
        fresh.reset()
        np.testing.assert_allclose(logits, fresh.eval_prompt(window), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyinfer import LLM
    from tests._tiny_gguf import write_tiny_gguf

    return LLM(write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "t.gguf")), n_ctx=64,
               n_threads=1, seed=0, device="cpu")


def test_a_stream_ends_with_its_own_finish_reason_and_usage(tiny):
    """A stream's last chunk reported whatever call ran last on the LLM (it read last_stats):
    a stream whose tokens were all drawn, finished after another call, says "length"."""
    pytest.importorskip("llguidance")
    # (a regex of ASCII letters: one token, one piece of text, on the tiny byte-level model)
    kw = dict(max_tokens=4, temperature=0, ignore_eos=True, grammar="start: /[a-z]{8}/")
    a = tiny.create_completion("the", stream=True, **kw)
    pieces = [next(a) for _ in range(4)]
    tiny.create_completion("th", max_tokens=1, temperature=0, stop=["a", "e", "t", " "])
    rest = list(a)
    assert [c["choices"][0]["finish_reason"] for c in pieces + rest][-1] == "length"
    msgs = [{"role": "user", "content": "the"}]
    c = tiny.create_chat_completion(msgs, stream=True, **kw)
    [next(c) for _ in range(5)]  # the role, then 4 pieces
    tiny.create_completion("th", max_tokens=1, temperature=0)
    assert list(c)[-1]["choices"][0]["finish_reason"] == "length"


def test_closing_the_llm_ends_an_open_stream(tmp_path):
    """A stream resumed after close() went on generating, then raised from its finally block (and
    printed "Exception ignored" when collected unfinished); tokenize still worked."""
    import gc

    from pyinfer import LLM
    from pyinfer.errors import PyinferError
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "t.gguf")), n_ctx=64, n_threads=1, device="cpu")
    s = llm.create_completion("the", max_tokens=20, temperature=0, ignore_eos=True, stream=True)
    next(s)
    llm.close()
    with pytest.raises(PyinferError, match="closed"):
        next(s)
    for call in (lambda: llm.tokenize("x"), lambda: llm.render_chat([{"role": "user", "content": "x"}])):
        with pytest.raises(PyinferError, match="closed"):
            call()
    llm2 = LLM(write_tiny_gguf(str(tmp_path / "u.gguf")), n_ctx=64, n_threads=1, device="cpu")
    left = llm2.create_completion("the", max_tokens=20, temperature=0, ignore_eos=True, stream=True)
    next(left)
    llm2.close()
    hook_calls = []
    import sys

    old, sys.unraisablehook = sys.unraisablehook, hook_calls.append
    try:
        del left
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert hook_calls == []


@pytest.mark.parametrize("kw, message", [
    (dict(stream="no"), "stream must be true or false"), (dict(ignore_eos="false"), "ignore_eos must be"),
    (dict(stream=1), "stream must be"),
])
def test_flags_of_the_wrong_type_are_refused(tiny, kw, message):
    from pyinfer.errors import PyinferError

    for call in (lambda: tiny.create_completion("the", max_tokens=2, **kw),
                 lambda: tiny.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=2, **kw)):
        with pytest.raises(PyinferError, match=message):
            call()


@pytest.mark.parametrize("shift", [1.5, "2", True])
def test_context_shift_of_the_wrong_type_is_refused_up_front(tiny, shift):
    """(a float failed with a TypeError from a slice, and only once the context filled)"""
    from pyinfer.errors import PyinferError

    with pytest.raises(PyinferError, match="context_shift must be an integer"):
        next(tiny.generate(tiny.tokenize("the"), max_tokens=2, context_shift=shift))


def test_a_second_thread_gets_an_error_not_a_garbled_answer(tmp_path):
    """Two threads sharing one LLM ran their forward passes over one cache at once and got
    silently wrong text; a forward pass that finds another one running is a PyinferError."""
    import threading

    from pyinfer import LLM
    from pyinfer.errors import PyinferError
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "t.gguf")), n_ctx=64, n_threads=1, device="cpu")
    want = llm.create_completion("the", max_tokens=4, temperature=0, ignore_eos=True)
    model = llm.engine.model
    inside, release = threading.Event(), threading.Event()
    real = model.forward

    def slow_forward(*a, **kw):
        inside.set()
        release.wait(30)
        return real(*a, **kw)

    model.forward = slow_forward
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", llm.create_completion(
        "the", max_tokens=4, temperature=0, ignore_eos=True)))
    t.start()
    assert inside.wait(30)
    model.forward = real  # (the other thread's pass is the slow one)
    with pytest.raises(PyinferError, match="busy in another thread"):
        llm.create_completion("then", max_tokens=2, temperature=0)
    with pytest.raises(PyinferError, match="busy in another thread"):
        llm.create_embedding("the")
    release.set()
    t.join(30)
    assert out["a"]["choices"][0]["text"] == want["choices"][0]["text"]


def test_numpy_numbers_are_numbers(tiny):
    """np.int64 max_tokens / seed and np.float32 temperature were refused as of the wrong type
    (NumPy integers were already taken as token ids); NumPy's bool stays refused."""
    import numpy as np

    from pyinfer.errors import PyinferError

    a = tiny.create_completion("the", max_tokens=np.int64(3), seed=np.int64(7),
                               temperature=np.float32(0.5), ignore_eos=True)
    b = tiny.create_completion("the", max_tokens=3, seed=7, temperature=0.5, ignore_eos=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]
    with pytest.raises(PyinferError, match="max_tokens"):
        tiny.create_completion("the", max_tokens=np.bool_(True))


def test_an_empty_prompt_is_the_start_of_a_document(tiny):
    """llama-cpp-python evaluates [BOS] for prompt "" (OpenAI's default prompt is the document's
    start); pyinfer refused it as an empty prompt."""
    a = tiny.create_completion("", max_tokens=3, temperature=0, ignore_eos=True)
    b = tiny.create_completion([tiny.tokenizer.bos_id], max_tokens=3, temperature=0, ignore_eos=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["prompt_tokens"] == 1
