"""GBNF grammars (pyinfer/gbnf.py, run by llguidance) mean what llama.cpp's grammars/README.md
says: checked character by character through a matcher over a byte vocabulary, against Python's
``json`` module for a JSON grammar (RFC 8259's, written in GBNF here) and against ``re`` for
regular ones."""
from __future__ import annotations

import json
import os
import random
import re

import pytest

pytest.importorskip("llguidance")

from pyinfer.errors import PyinferError  # noqa: E402
from pyinfer.grammar import ByteVocab, Grammar  # noqa: E402


TOK = ByteVocab()  # the bytes and an end-of-text token


def accepts(grammar: str, text: str) -> bool:
    """Whether the matcher takes every byte of ``text`` and then stands at a complete sentence."""
    c = Grammar("gbnf", grammar).matcher(TOK)
    for b in text.encode():
        if not c.allowed()[b]:
            return False
        c.advance(b)
    return bool(c.accepting)


# RFC 8259's grammar (section 2-7) in GBNF
JSON_GBNF = r"""
root   ::= ws value ws
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* ws )? "}"
member ::= string ws ":" ws value
array  ::= "[" ws ( value ( ws "," ws value )* ws )? "]"
string ::= "\"" char* "\""
char   ::= [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )   # escapes
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n\r]*
"""


def _python_json(text: str) -> bool:
    def no_constants(name):
        raise ValueError(name)  # NaN / Infinity: Python's extension, not RFC 8259

    try:
        json.loads(text, parse_constant=no_constants)
        return True
    except ValueError:
        return False


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 12345678901234567890, 0.5, -1e-7, 3.25e21])
    if kind in (2, 3):
        return _random_string(rng)
    if kind in (4, 5):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice('ab"\\/\n\t\x01é😀 ') for _ in range(rng.randrange(6)))


def test_json_grammar_accepts_what_pythons_json_reads():
    """Values written by json.dumps (compact, indented, ASCII-escaped or not) are accepted; and for
    300 random short strings over JSON's characters, and 300 mutations of valid documents, the
    grammar accepts exactly what json.loads reads."""
    rng = random.Random(0)
    for _ in range(60):
        v = _random_value(rng)
        for kw in ({}, {"indent": 2}, {"ensure_ascii": False}, {"separators": (",", ":")}):
            text = json.dumps(v, **kw)
            assert accepts(JSON_GBNF, text), text
    alphabet = '{}[],:"\\0123456789-+.eEtrufalsn \n/bu'
    checked = {True: 0, False: 0}
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7)))
        want = _python_json(text)
        assert accepts(JSON_GBNF, text) == want, text
        checked[want] += 1
    for _ in range(300):
        doc = list(json.dumps(_random_value(rng)))
        i = rng.randrange(len(doc))
        op = rng.randrange(3)
        if op == 0:
            del doc[i]
        elif op == 1:
            doc.insert(i, rng.choice(alphabet))
        else:
            doc[i] = rng.choice(alphabet)
        text = "".join(doc)
        want = _python_json(text)
        assert accepts(JSON_GBNF, text) == want, text
        checked[want] += 1
    assert min(checked.values()) > 20, checked  # both answers were put to the test


@pytest.mark.parametrize("grammar,regex", [
    # each rule made only of characters stays a grammar rule: llama.cpp accepts "1230" here
    ('root ::= digits "0"\ndigits ::= [0-9]+', r"[0-9]+0"),
    ('root ::= name " is " age\nname ::= [a-zA-Z ]+\nage ::= [0-9]+', r"[a-zA-Z ]+ is [0-9]+"),
    ('root ::= "a" . "b"', r"a.b"),  # "." is any character, a newline too
    ('root ::= [^"]+', r'[^"]+'),
    ('root ::= "a"{2,3} "b"{2} "c"{1,} "d"{0} ("e" | "f")?', r"a{2,3}b{2}c{1,}(e|f)?"),
    ('root ::= ("ab" | "c")* "d"  # a comment\n', r"(ab|c)*d"),
    ('root ::= "x" |\n  "y" (\n  "z"\n  | "w" )', r"x|y(z|w)"),
    ('root ::= start\nstart ::= "a" start-2\nstart-2 ::= "b"', r"ab"),  # a rule named start
    ('root ::= "\\[\\]\\"\\\\" [\\]\\[-] "\\x41\\u00e9\\U0001F600"', '\\[\\]"\\\\[\\]\\[-]Aé😀'),
    ('root ::= [\\x20-\\U0010FFFF]+', r"[\x20-\U0010FFFF]+"),
    ('root ::= "::=" "="', r"::=="),  # "::=" in a literal is no rule
    # a literal is matched character by character too: whole-string lexemes refused "12",
    # "abc", "foobar" here (and C identifiers beginning with a keyword in llama.cpp's c.gbnf)
    ('root ::= "12"? [0-9]+', r"(12)?[0-9]+"),
    ('root ::= ("a" | "ab") "bc"', r"(a|ab)bc"),
    ('root ::= ("foo" | "foobar") "bar"', r"(foo|foobar)bar"),
    ('root ::= "ab" | "a" "bc"', r"ab|abc"),
    ('root ::= # the body may start on the next line, as in llama.cpp\'s json.gbnf\n  "a" x\n'
     'x ::=\n  "b"\n', r"ab"),
    ('root ::= "a\\x7Fb\\x01"', "a\x7fb\x01"),  # U+007F, which llguidance's Lark refuses raw
])
def test_regular_grammars_accept_what_re_matches(grammar, regex):
    """On every string of up to 4 characters over the grammar's alphabet (and a few longer ones),
    the grammar accepts what Python's re.fullmatch does (re.DOTALL: llama.cpp's "." takes a
    newline)."""
    import itertools

    pattern = re.compile(regex, re.DOTALL)
    alphabet = sorted(set(re.sub(r"\\[xuU][0-9a-fA-F]+|\\.", "", grammar)) - set("()|*+?{},")
                      | set('aB"\n1230 isé😀[]\\-x'))
    strings = ["".join(p) for n in range(5) for p in itertools.product("a0 \n", repeat=n)]
    rng = random.Random(1)
    strings += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 10))) for _ in range(400)]
    strings += ["1230", "Bob is 5", "a\nb", "aab", "aaabbcce", "ababcd", "yw", "ab", '[]"\\]Aé😀',
                "::==", "hi 😀", "abc", "abbc", "foobar", "foobarbar", "12", "123", "a\x7fb\x01",
                "a\x7fb"]
    matched = 0
    for s in strings:
        want = pattern.fullmatch(s) is not None
        matched += want
        assert accepts(grammar, s) == want, (grammar, s)
    assert matched > 0


@pytest.mark.parametrize("grammar,message", [
    ('root ::= "a" (', "line 1, column 14: a group without its closing )"),
    ('root ::= "a"\nx ::= "b" y', "line 2, column 11: undefined rule y"),
    ('x ::= "a"', "no root rule"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule root is defined twice"),
    ('root ::= "\\q"', "unknown escape \\q"),
    ('root ::= "\\u00"', "\\u needs 4 hexadecimal digits"),
    ('root ::= "\\UFFFFFFFF"', "not a Unicode character"),
    ('root ::= [z-a]', "runs backwards"),
    ('root ::= []', "an empty character class"),
    ('root ::= "a"{3,2}', "the most is less than the least"),
    ('root ::= * "a"', "* follows nothing"),
    ('root ::= <[42]>', "token references"),
    ('root ::= "a" "b', "without its closing quote"),
    ("root ::= " + "(" * 21 + '"a"' + ")" * 21, "nested more than 20 deep"),
    # no finite text completes these (llguidance's matcher failed after the model loaded)
    ('root ::= "a" root', "matches no text"),
    ('root ::= root "a"', "matches no text"),
    ('root ::= x+\nx ::= "(" x ")"', "matches no text"),
    # root ends, but a rule it reaches never does (llguidance failed on entering it)
    ('root ::= "a" | x\nx ::= "c" x', "line 1, column 16: rule x never ends"),
    ("root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(1000)) + 'r1000 ::= "b"',
     "more than 1000 rules"),
])
def test_grammar_mistakes_are_one_line_errors_with_their_place(grammar, message):
    with pytest.raises(PyinferError) as e:
        Grammar("gbnf", grammar).check()
    text = str(e.value)
    assert text.startswith("bad gbnf: ") and message in text and "\n" not in text, text


def test_lark_under_the_gbnf_name_is_still_read():
    """A grammar with no ``name ::=`` line is llguidance's Lark (as before)."""
    assert accepts('start: "a" b\nb: "c"+', "acc")
    assert not accepts('start: "a" b\nb: "c"+', "ab")


def test_json_schema_layout_and_depth():
    """A schema's own x-guidance options keep the one-line layout unless they set it; a schema
    nested past Python's recursion limit is a one-line error, not a traceback."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for s in (schema, dict(schema, **{"x-guidance": {"coerce_one_of": True}})):
        g = Grammar.json_schema(s)
        c = g.matcher(TOK)
        c.advance(ord("{"))
        assert not c.allowed()[ord("\n")]
    with pytest.raises(PyinferError, match="nested too deeply"):
        Grammar.json_schema("[" * 5000 + "]" * 5000)
    deep: dict = {"type": "array"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(PyinferError, match="nested too deeply"):
        Grammar.json_schema(deep)


def test_a_grammar_the_matcher_cannot_build_fails_the_check():
    """20,000 alternatives pass llguidance's validation but exceed its 65,525 grammar symbols
    when a matcher is built: the server queued the request and failed it in the engine."""
    g = Grammar("gbnf", "root ::= " + " | ".join(f'"w{i}"' for i in range(20000)))
    with pytest.raises(PyinferError, match="bad grammar"):
        g.check()


# ---- from a QA pass against llama.cpp's src/llama-grammar.cpp --------------------------------------
def test_a_long_chain_of_nested_rules_is_compiled_not_a_crash():
    """999 rules each a group 3 deep (within MAX_RULES and MAX_DEPTH) overflowed the stack of
    llguidance's compiler: SIGSEGV, the server gone. It now compiles on a thread with a deep
    stack. Run in a child process, so that a crash fails this test and not the run."""
    import subprocess
    import sys

    code = ("from pyinfer.grammar import Grammar\n"
            "n, d = 998, 3\n"
            "g = 'root ::= r0\\n' + ''.join(f'r{i} ::= ' + '(' * d + f'\"a\" r{i+1}' + ')' * d + '\\n'"
            " for i in range(n)) + f'r{n} ::= \"b\"\\n'\n"
            "Grammar('gbnf', g).check()\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("grammar, good, bad", [
    ('root ::= [a\\-z]+', ["a-z", "-"], ["b"]),  # \- (llama.cpp's parse_char; its generator writes it)
    ('root ::= "x\\-y"', ["x-y"], ["xy"]),
    ('root ::= ("a"{2,\n  3} # two or three\n)', ["aa", "aaa"], ["a", "aaaa"]),  # parse_space in a group
])
def test_llama_cpp_spellings(grammar, good, bad):
    for text in good:
        assert accepts(grammar, text), (grammar, text)
    for text in bad:
        assert not accepts(grammar, text), (grammar, text)


def test_a_grammar_past_llguidance_symbol_limit_says_so():
    from pyinfer.errors import PyinferError

    with pytest.raises(PyinferError, match="too large for llguidance"):
        Grammar("gbnf", 'root ::= "' + "ab" * 35000 + '"').check()
