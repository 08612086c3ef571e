"""A chat answer's thinking block apart from its content (pyinfer.reasoning), as llama.cpp's
server returns it with --reasoning-format deepseek / auto: the block's text, trimmed, as
reasoning_content; the rest, its leading whitespace trimmed, as content; an answer without a
block left as written. The expectations are llama.cpp's documented results (its server's
``reasoning_content``), e.g. "<think>I'm\\nthinking</think>Hello, world!\\nWhat's up?" ->
("I'm\\nthinking", "Hello, world!\\nWhat's up?")."""
import random

import pytest

from pyinfer.reasoning import ReasoningSplitter, opens_thinking, split_reasoning

CASES = {
    "<think>I'm\nthinking</think>Hello, world!\nWhat's up?": ("I'm\nthinking", "Hello, world!\nWhat's up?"),
    "<think>\nhmm, Berlin\n</think>\n\nBerlin.": ("hmm, Berlin", "Berlin."),
    "Berlin.": ("", "Berlin."),
    "  Berlin.": ("", "  Berlin."),  # no block: as written
    "<think></think>\n\nhi": ("", "hi"),  # Qwen3 with enable_thinking false writes an empty one
    "<thinking>x": ("", "<thinking>x"),
    "<thi": ("", "<thi"),
    "\n<think>a  b\n\nc</think>d": ("a  b\n\nc", "d"),
    "<think>\nunfinished  ": ("unfinished", ""),  # cut by max_tokens: all reasoning
    # llama.cpp trims ASCII whitespace only (std::isspace over UTF-8 bytes): an ideographic or
    # no-break space the model wrote stays
    "<think>\u3000\u601d\u8003\u3000\n</think>\n\u00a0\u7b54": ("\u3000\u601d\u8003\u3000", "\u00a0\u7b54"),
    "\u3000<think>x</think>y": ("", "\u3000<think>x</think>y"),
}


@pytest.mark.parametrize("text", list(CASES))
def test_split_as_llama_cpp_whole_and_streamed(text):
    """The whole answer and every way of cutting it into pieces give the same parts, and every
    character is accounted for (consumed: what logprobs align with)."""
    assert split_reasoning(text) == CASES[text]
    for seed in range(40):
        rng = random.Random(seed)
        sp, parts, i = ReasoningSplitter(), [], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            parts += sp.feed(text[i:j])
            i = j
            assert sp.consumed <= i
        parts += sp.flush()
        got = ("".join(t for k, t in parts if k == "reasoning"),
               "".join(t for k, t in parts if k == "content"))
        assert got == CASES[text], (parts, seed)
        assert sp.consumed == len(text) and all(t for _, t in parts)


def test_reasoning_streams_before_the_block_closes():
    """The reasoning is given out as it comes, holding back only a possible tag or the
    whitespace a tag may follow."""
    sp = ReasoningSplitter()
    assert sp.feed("<think>") == []
    assert sp.feed("\nOne, ") == [("reasoning", "One,")]
    assert sp.feed("two </th") == [("reasoning", " two")]
    assert sp.feed("ink>\n\nThree.") == [("content", "Three.")]


@pytest.mark.parametrize("start,want", [("<think>a", ("a  b", "c")), ("", ("", "  b</think>c")),
                                        (None, ("a  b", "c"))])
def test_long_whitespace_runs(start, want):
    """Whitespace one character at a time (a looping small model) is held without rescanning
    (it took quadratic time) and comes out as the one-piece split gives it."""
    sp = ReasoningSplitter(in_thinking=start is None)
    text = (start or "") + ("a" if start is None else "") + " " * 20000 + "b</think>c"
    parts = sp.feed(text[:len(text) - 20010])
    for ch in text[len(text) - 20010:]:
        parts += sp.feed(ch)
    parts += sp.flush()
    got = ("".join(t for k, t in parts if k == "reasoning"),
           "".join(t for k, t in parts if k == "content"))
    assert got == split_reasoning(text, start is None)
    assert got[0].replace(" " * 20000, "  ") == want[0]
    assert got[1].replace(" " * 20000, "  ") == want[1]
    assert sp.consumed == len(text)


def test_a_block_the_prompt_opened():
    """DeepSeek-R1's template ends the generation prompt with "<think>\\n": the answer holds
    only the closing tag."""
    assert opens_thinking("<|Assistant|><think>\n") and not opens_thinking("<|Assistant|>")
    assert split_reasoning("thought\n</think>\n\nanswer", in_thinking=True) == ("thought", "answer")
    assert split_reasoning("still thinking", in_thinking=True) == ("still thinking", "")
