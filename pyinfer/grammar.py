"""Constrained sampling: JSON schemas, GBNF/Lark grammars and regular expressions through llguidance.

llguidance (the library llama.cpp itself links for ``--json-schema`` and ``--grammar`` with
``LLAMA_LLGUIDANCE``) compiles a grammar against the model's vocabulary and, before every token,
gives the set of tokens that keep the output inside the grammar. The sampler draws only from that
set (``pyinfer.sampler.distribution``'s ``allowed`` mask); once the grammar is complete, only the
end-of-text token is allowed, so generation stops there.

``Grammar`` is what a request asks for (a kind and its text); ``Grammar.matcher(tokenizer)`` makes
a fresh ``Constraint`` for one generation. The per-tokenizer ``LLTokenizer`` is built once and
cached (building it walks the whole vocabulary). Install with ``pip install -e '.[structured]'``
in the checkout.
"""
from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass

import numpy as np

from pyinfer.errors import PyinferError

KINDS = ("json_schema", "json_object", "gbnf", "lark", "regex")
#: The grammar of ``response_format: {"type": "json_object"}``: any JSON object (OpenAI's meaning).
ANY_OBJECT_SCHEMA = {"type": "object"}
#: llguidance's JSON layout options (its docs/json_schema.md, "Whitespace handling"): JSON on one
#: line as Python's json.dumps writes it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise PyinferError("structured output needs llguidance: pip install -e '.[structured]' "
                           "in the pyinfer checkout") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text.

    kind: "json_schema" (``text`` is the schema as JSON), "json_object" (any JSON object),
    "gbnf" (llama.cpp's GBNF, or Lark: llguidance reads both), "lark", or "regex".
    """

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PyinferError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        """From a schema given as a dict or as JSON text. Raises PyinferError for text that is not
        a JSON object."""
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise PyinferError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise PyinferError("a JSON schema must be a JSON object")
            return cls("json_schema", json.dumps(schema))
        except RecursionError:
            raise PyinferError("the JSON schema is nested too deeply") from None

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (converted once: the last few are cached).
        Raises PyinferError when it does not parse (pyinfer.gbnf.GbnfError for GBNF)."""
        return _converted(self.kind, self.text)

    def check(self, tokenizer=None) -> None:
        """Raise PyinferError unless the grammar converts and llguidance accepts it (an
        unsatisfiable schema, an unknown ``$ref`` ...), as ``matcher`` would; with ``tokenizer``
        it is also checked against the vocabulary. Cheap after the first call (cached)."""
        grammar = self.llguidance_grammar()
        llg = _llguidance()
        err = (on_deep_stack(llg.LLMatcher.validate_grammar, grammar) if tokenizer is None
               else on_deep_stack(llg.LLMatcher.validate_grammar, grammar, lltokenizer(tokenizer)))
        if err:
            raise PyinferError(f"bad grammar: {_why(err)}")
        _builds(grammar)

    def matcher(self, tokenizer) -> "Constraint":
        """A fresh ``Constraint`` for one generation with ``tokenizer`` (pyinfer.tokenizer.Tokenizer).
        Raises PyinferError when the grammar is invalid."""
        return Constraint(lltokenizer(tokenizer), self.llguidance_grammar(), tokenizer.n_vocab)


def with_layout(schema: dict) -> dict:
    """``schema`` with JSON_LAYOUT in its ``x-guidance`` (its own options there win)."""
    own = schema.get("x-guidance")
    return dict(schema, **{"x-guidance": dict(JSON_LAYOUT, **(own if isinstance(own, dict) else {}))})


@functools.lru_cache(maxsize=8)
def _converted(kind: str, text: str) -> str:
    """``Grammar.llguidance_grammar``'s work: a request's grammar is checked by the server, then
    used by the API and the matcher; converting it three times tripled a slow conversion."""
    llg = _llguidance()
    if kind == "gbnf":
        from pyinfer import gbnf

        if gbnf.looks_like_gbnf(text):  # (else Lark under the "gbnf" name: llguidance's own)
            try:
                return llg.grammar_from("lark", gbnf.to_lark(text))
            except gbnf.GbnfError as e:
                raise PyinferError(f"bad gbnf: {e}") from None
            except (ValueError, RuntimeError, TypeError) as e:
                raise PyinferError(f"bad gbnf: {_first_line(e)}") from None
    try:
        if kind in ("json_object", "json_schema"):
            schema = ANY_OBJECT_SCHEMA if kind == "json_object" else json.loads(text)
            # one line, one space after ':' and ',' (a small model given free whitespace can emit
            # newlines until the token limit), unless the schema's own x-guidance says otherwise
            schema = with_layout(schema)
            return llg.grammar_from("json_schema", json.dumps(schema))
        return llg.grammar_from(kind, text)
    except (ValueError, RuntimeError, TypeError) as e:
        raise PyinferError(f"bad {kind.replace('_', ' ')}: {_first_line(e)}") from None
    except RecursionError:
        raise PyinferError(f"bad {kind.replace('_', ' ')}: nested too deeply") from None


@functools.lru_cache(maxsize=8)
def _builds(grammar: str) -> None:
    """Raise PyinferError unless a matcher builds: what only building one finds (llguidance's
    limit of 65,525 grammar symbols: a GBNF of 20,000 alternatives passed and failed in the
    engine), over the 257-token vocabulary of the bytes (milliseconds for a real grammar; once
    per grammar text, as the conversion: the server checks every request's)."""
    Constraint(lltokenizer(_BYTE_VOCAB), grammar, _BYTE_VOCAB.n_vocab)


#: Stack of the thread llguidance compiles grammars on: its compiler recurses along chains of
#: rules and groups, and overflowed a thread's 8 MiB (SIGSEGV, the process gone) on a GBNF of
#: 999 rules each a group 3 deep; this takes ~30x that (the memory is only reserved).
DEEP_STACK_BYTES = 256 << 20
_stack_lock = threading.Lock()


def on_deep_stack(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run on a thread with DEEP_STACK_BYTES of stack (its result, or
    what it raised). A grammar compile needs it (about 0.1 ms a call)."""
    box: list = []

    def run():
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box.append((False, e))

    with _stack_lock:  # (stack_size is a process-wide setting for threads made after it)
        old = threading.stack_size(DEEP_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="pyinfer-grammar")
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _why(err: str) -> str:
    """llguidance's error text as one line, its internal limits said in words."""
    if "symbols.len() < u16::MAX" in err:  # (an assertion, not a message)
        return ("too large for llguidance: more than about 65,500 grammar symbols (each "
                "character of a literal is one)")
    return _first_line(Exception(err))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class ByteVocab:
    """The 256 bytes and an end-of-text token (id 256): a vocabulary to build a matcher with
    before the model's tokenizer is at hand (Grammar.check), or to feed a grammar text byte by
    byte (tests/test_gbnf.py)."""

    n_vocab = 257
    eos_id = 256
    bos_id = None
    stop_ids = frozenset({256})

    def is_special(self, i):
        return i == 256

    def token_to_bytes(self, i):
        return b"" if i == 256 else bytes([i])

    def encode(self, text, add_bos=False, parse_special=False):
        return list(text.encode())


_BYTE_VOCAB = ByteVocab()


class _VocabView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: the bytes of every token (control
    tokens prefixed with 0xFF, as llguidance's own llama.cpp adapter marks them), BOS/EOS ids and a
    tokenize function."""

    def __init__(self, tok):
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [(b"\xff" if tok.is_special(i) else b"") + tok.token_to_bytes(i)
                       for i in range(tok.n_vocab)]
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_special(i)]
        self._tok = tok

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False)


def lltokenizer(tok):
    """llguidance's LLTokenizer for ``tok``, built once per Tokenizer object (walks the vocabulary)."""
    cached = getattr(tok, "_lltokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    eos = sorted(tok.stop_ids) or None
    llt = llg.LLTokenizer(llg.TokenizerWrapper(_VocabView(tok)), n_vocab=tok.n_vocab, eos_token=eos)
    tok._lltokenizer = llt
    return llt


class Constraint:
    """One generation's grammar state: ``allowed()`` before each token, ``advance(tok)`` after.

    Args:
        llt: llguidance.LLTokenizer of the model's vocabulary.
        grammar: llguidance grammar text (``Grammar.llguidance_grammar``).
        n_vocab: the model's vocabulary size (the logits' length).
    Raises PyinferError when llguidance rejects the grammar.
    """

    def __init__(self, llt, grammar: str, n_vocab: int):
        llg = _llguidance()
        self._m = on_deep_stack(llg.LLMatcher, llt, grammar, log_level=0)
        if self._m.is_error():
            raise PyinferError(f"bad grammar: {_why(self._m.get_error())}")
        self.n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """(n_vocab,) bool: the tokens that keep the text inside the grammar. Raises PyinferError
        when the matcher has failed."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise PyinferError("grammar matcher failed: "
                               f"{_first_line(Exception(self._m.get_error()))}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[:self.n_vocab].astype(bool)

    def advance(self, token: int) -> None:
        """Feed the sampled ``token`` (one ``allowed()`` permitted). Raises PyinferError otherwise."""
        if not self._m.consume_token(int(token)) or self._m.is_error():
            raise PyinferError("grammar matcher failed: "
                               f"{_first_line(Exception(self._m.get_error()))}")

    @property
    def done(self) -> bool:
        """True when the grammar is complete and admits nothing more than the end of text."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar."""
        return self._m.is_accepting()
