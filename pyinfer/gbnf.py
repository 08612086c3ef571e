"""llama.cpp's GBNF grammars, parsed here and written as llguidance's Lark with the same meaning.

GBNF (llama.cpp ``grammars/README.md``; its parser ``src/llama-grammar.cpp``) is a context-free
grammar over characters: ``name ::= alternatives`` rules, ``root`` the start; "literals" and
[character classes] (``^`` negates; ``a-z`` ranges) with the escapes ``\\n \\r \\t \\\\ \\" \\[
\\] \\- \\xHH \\uHHHH \\UHHHHHHHH``; ``.`` any character (a newline too); rule names ([A-Za-z0-9-]);
groups ``( )``; ``* + ?`` and ``{m} {m,} {m,n}`` after an item; ``#`` comments to the end of the
line. A rule ends at a newline except right after ``::=`` or ``|`` and inside parentheses.

llguidance reads GBNF too, through its own conversion, which turns every rule made only of
characters into one lexer token: a token that matches as much text as it can, so
``root ::= digits "0"``, ``digits ::= [0-9]+`` refused "1230" (llama.cpp accepts it) and
``name ::= [a-zA-Z ]+`` ate the " is " of ``name " is " age``; it also read ``.`` without the
newline, ``\\u00e9`` as ``\\ue9``, a rule named ``start`` as Lark. Here every GBNF rule stays a
grammar rule (llguidance's Earley parser decides where one ends, as llama.cpp's matcher does)
and every lexeme is one character (a literal is a sequence of them: a whole-string lexeme is
matched greedily too), so a repetition of a class repeats single characters.

``to_lark(text)`` returns the Lark text; ``GbnfError`` (a PyinferError) gives the line and
column of the first mistake.
"""
from __future__ import annotations

import json
import re

from pyinfer.errors import PyinferError

#: Most items (literals, classes, references, groups) a grammar may have.
MAX_ITEMS = 100_000
#: Most rules, and deepest nesting of groups: llguidance's compiler recurses along a chain of
#: rules (each naming the next) and crashed the process (SIGSEGV) at 3,000 on this machine;
#: real grammars have tens of rules (llama.cpp's json.gbnf 9).
MAX_RULES = 1000
#: llguidance's Lark refuses groups nested deeper than about 28.
MAX_DEPTH = 20
#: Largest count of a {m,n} repetition.
MAX_REPEAT = 10_000
_NAME = re.compile(r"[A-Za-z0-9-]+")
_RULE_START = re.compile(r"(?m)^[ \t]*[A-Za-z0-9-]+[ \t]*::=")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class GbnfError(PyinferError):
    """A GBNF grammar that does not parse; the message names the line and column."""


def looks_like_gbnf(text: str) -> bool:
    """True when some line starts a GBNF rule (``name ::=``); llguidance's Lark otherwise."""
    return _RULE_START.search(text) is not None


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.rules: dict[str, str] = {}  # GBNF name -> Lark body
        self.order: list[str] = []
        self.refs: dict[str, int] = {}  # name -> position of a first reference
        self.items = 0
        self.depth = 0
        # name -> what it takes for the rule to end: True, ("ref", name), ("any" | "all", [...])
        self.forms: dict = {}

    # positions and errors
    def error(self, pos: int, what: str) -> GbnfError:
        line = self.s.count("\n", 0, pos) + 1
        col = pos - (self.s.rfind("\n", 0, pos) + 1) + 1
        return GbnfError(f"GBNF line {line}, column {col}: {what}")

    def space(self, pos: int, newline_ok: bool) -> int:
        s = self.s
        while pos < len(s):
            c = s[pos]
            if c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            elif c == "#":
                while pos < len(s) and s[pos] not in "\r\n":
                    pos += 1
            else:
                break
        return pos

    def char(self, pos: int) -> tuple[str, int]:
        """One character of a literal or class at pos (an escape or a code point)."""
        s = self.s
        if s[pos] != "\\":
            return s[pos], pos + 1
        if pos + 1 >= len(s):
            raise self.error(pos, "an escape at the end of the grammar")
        e = s[pos + 1]
        if e in _SIMPLE:
            return _SIMPLE[e], pos + 2
        if e in _HEX_DIGITS:
            n = _HEX_DIGITS[e]
            digits = s[pos + 2:pos + 2 + n]
            if len(digits) != n or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.error(pos, f"\\{e} needs {n} hexadecimal digits")
            cp = int(digits, 16)
            if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
                raise self.error(pos, f"\\{e}{digits} is not a Unicode character")
            return chr(cp), pos + 2 + n
        raise self.error(pos, f"unknown escape \\{e}")

    def count(self, n: int, pos: int) -> None:
        self.items += n
        if self.items > MAX_ITEMS:
            raise self.error(pos, f"the grammar expands to more than {MAX_ITEMS} items")

    # grammar
    def parse(self) -> str:
        s = self.s
        pos = self.space(0, True)
        while pos < len(s):
            m = _NAME.match(s, pos)
            if not m:
                raise self.error(pos, "expected a rule name")
            name = m.group()
            pos = self.space(m.end(), False)
            if not s.startswith("::=", pos):
                raise self.error(pos, f"expected ::= after {name}")
            if name in self.rules:
                raise self.error(m.start(), f"rule {name} is defined twice")
            self.rules[name] = ""  # (a rule may name itself)
            self.order.append(name)
            if len(self.order) > MAX_RULES:
                raise self.error(m.start(), f"more than {MAX_RULES} rules; write the grammar "
                                 "with fewer")
            # (llama.cpp's parse_rule: newlines and comments may follow "::=")
            body, form, pos = self.alternatives(self.space(pos + 3, True), nested=False)
            self.rules[name] = body
            self.forms[name] = form
            if pos < len(s) and s[pos] not in "\r\n":
                raise self.error(pos, f"unexpected {s[pos]!r}")
            pos = self.space(pos, True)
        if "root" not in self.rules:
            raise GbnfError("the GBNF grammar has no root rule")
        for name, at in self.refs.items():
            if name not in self.rules:
                raise self.error(at, f"undefined rule {name}")
        ends = self._rules_that_end()
        if "root" not in ends:
            raise GbnfError("the GBNF grammar matches no text: root never ends (no alternative "
                            "of it, or of a rule it needs, finishes without the rule itself, "
                            "as in root ::= \"a\" root)")
        for name in self._reachable():  # (llguidance's matcher fails on entering one)
            if name not in ends:
                raise self.error(self.refs[name], f"rule {name} never ends (each alternative "
                                 "needs the rule itself again)")
        lark_names = {name: "start" if name == "root" else f"r{i}_{name.lower().replace('-', '_')}"
                      for i, name in enumerate(self.order)}

        def lark_name(m):
            return lark_names[m.group(1)]

        out = ["%llguidance {}", ""]
        for name in self.order:
            body = re.sub(r"\x00([A-Za-z0-9-]+)\x00", lark_name, self.rules[name])
            out.append(f"{lark_names[name]}: {body}")
        return "\n".join(out) + "\n"

    def _reachable(self) -> list:
        """The rules root can reach, in the order of their definition."""
        seen, todo = {"root"}, ["root"]
        while todo:
            for name in re.findall(r"\x00([A-Za-z0-9-]+)\x00", self.rules[todo.pop()]):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return [n for n in self.order if n in seen]

    def _rules_that_end(self) -> set:
        """The rules that derive some finite text (the least fixed point over self.forms)."""
        done: set = set()

        def ends(form) -> bool:
            if form is True:
                return True
            if form[0] == "ref":
                return form[1] in done
            return (any if form[0] == "any" else all)(ends(f) for f in form[1])

        grew = True
        while grew:
            grew = False
            for name in self.order:
                if name not in done and ends(self.forms[name]):
                    done.add(name)
                    grew = True
        return done

    def alternatives(self, pos: int, nested: bool) -> tuple[str, tuple, int]:
        alts, forms = [], []
        while True:
            seq, form, pos = self.sequence(pos, nested)
            alts.append(seq)
            forms.append(form)
            if pos < len(self.s) and self.s[pos] == "|":
                pos = self.space(pos + 1, True)
                continue
            return " | ".join(alts), ("any", forms), pos

    def sequence(self, pos: int, nested: bool) -> tuple[str, tuple, int]:
        s = self.s
        items: list[str] = []
        forms: list = []  # per item, what it takes to end (self.forms)
        while pos < len(s):
            c = s[pos]
            start = pos
            if c == '"':
                pos += 1
                text = []
                while pos < len(s) and s[pos] != '"':
                    ch, pos = self.char(pos)
                    text.append(ch)
                if pos >= len(s):
                    raise self.error(start, "a literal without its closing quote")
                pos += 1
                items.append(_literal(text))
                forms.append(True)
            elif c == "[":
                pos += 1
                negate = pos < len(s) and s[pos] == "^"
                pos += negate
                parts = []
                while pos < len(s) and s[pos] != "]":
                    lo, pos = self.char(pos)
                    hi = lo
                    if pos + 1 < len(s) and s[pos] == "-" and s[pos + 1] != "]":
                        hi, pos = self.char(pos + 1)
                        if ord(hi) < ord(lo):
                            raise self.error(start, "a character range that runs backwards")
                    one = f"\\x{{{ord(lo):x}}}"
                    parts.append(one if hi == lo else f"{one}-\\x{{{ord(hi):x}}}")
                if pos >= len(s):
                    raise self.error(start, "a character class without its closing ]")
                pos += 1
                if not parts:
                    raise self.error(start, "an empty character class")
                items.append(f"/[{'^' if negate else ''}{''.join(parts)}]/")
                forms.append(True)
            elif c == ".":
                pos += 1
                items.append("/(?s:.)/")
                forms.append(True)
            elif c == "(":
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    raise self.error(pos, f"groups nested more than {MAX_DEPTH} deep")
                body, form, pos = self.alternatives(self.space(pos + 1, True), nested=True)
                self.depth -= 1
                if pos >= len(s) or s[pos] != ")":
                    raise self.error(start, "a group without its closing )")
                pos += 1
                items.append(f"({body})")
                forms.append(form)
            elif m := _NAME.match(s, pos):
                name = m.group()
                after = self.space(m.end(), False)
                if s.startswith("::=", after):  # the next rule (nested: a missing ")")
                    if nested:
                        raise self.error(start, "a group without its closing )")
                    break
                self.refs.setdefault(name, pos)
                pos = m.end()
                items.append(f"\x00{name}\x00")
                forms.append(("ref", name))
            elif c in "*+?":
                if not items:
                    raise self.error(pos, f"{c} follows nothing")
                items[-1] = f"{_operand(items[-1])}{c}"
                if c != "+":  # (zero times ends)
                    forms[-1] = True
                pos += 1
            elif c == "{":
                if not items:
                    raise self.error(pos, "{ follows nothing")
                items[-1], zero, pos = self.repeat(items[-1], pos, nested)
                if zero:
                    forms[-1] = True
            elif c == "<":
                raise self.error(pos, "token references (<[id]>, <token>) are not supported")
            else:
                break
            self.count(1, start)
            pos = self.space(pos, nested)
        if pos < len(s) and s[pos] in "\r\n" and nested:
            pos = self.space(pos, True)
        return (" ".join(items) if items else '""'), ("all", forms), pos

    def repeat(self, item: str, pos: int, nested: bool) -> tuple[str, bool, int]:
        """x{m}, x{m,}, x{m,n} as Lark's repetitions of the same spelling; the bool: m == 0.
        Spaces and comments may stand around the numbers (newlines too inside parentheses),
        as llama.cpp's ``parse_space(pos, is_nested)`` skips them."""
        s, start = self.s, pos

        def number(at):
            end = at
            while end < len(s) and s[end] in "0123456789":  # (ASCII digits only, as llama.cpp)
                end += 1
            return (int(s[at:end]) if end > at else None), end

        at = self.space(pos + 1, nested)
        lo, at = number(at)
        at = self.space(at, nested)
        comma = at < len(s) and s[at] == ","
        hi = lo
        if comma:
            hi, at = number(self.space(at + 1, nested))
            at = self.space(at, nested)
        if lo is None or at >= len(s) or s[at] != "}":
            raise self.error(start, "expected {m}, {m,} or {m,n}")
        end = at + 1
        pos = start
        if hi is not None and hi < lo:
            raise self.error(pos, f"{{{lo},{hi}}}: the most is less than the least")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(pos, f"a repetition of more than {MAX_REPEAT}")
        if hi == 0:
            return '""', True, end
        bound = f"{{{lo}}}" if hi == lo else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"
        return f"{_operand(item)}{bound}", lo == 0, end


def _literal(chars: list) -> str:
    """A GBNF literal as Lark items of one character each: llguidance matches each Lark string
    as one lexeme, as long as it can, so ("a" | "ab") "bc" written with whole strings refused
    "abc", which llama.cpp's character-by-character matcher accepts. Printable characters as
    strings, others (controls, U+007F, which llguidance's Lark refuses raw) as \\x{..}."""
    if not chars:
        return '""'
    parts = [json.dumps(c, ensure_ascii=False) if c.isprintable() else f"/\\x{{{ord(c):x}}}/"
             for c in chars]
    return parts[0] if len(parts) == 1 else f"({' '.join(parts)})"


def _operand(item: str) -> str:
    """``item`` ready for a repetition operator: wrapped when it ends in one already."""
    return f"({item})" if item.endswith(("*", "+", "?", "}")) else item


def to_lark(text: str) -> str:
    """The llguidance Lark grammar of GBNF ``text``. Raises GbnfError (line and column) for a
    grammar llama.cpp would not parse either, or one that expands past MAX_ITEMS items."""
    return _Parser(text).parse()
