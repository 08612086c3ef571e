"""Text <-> token ids, built from the vocabulary a GGUF file embeds.

Three sources, tried in order (``Tokenizer.from_gguf``):

1. ``pyinfer.tokenizer.huggingface_json``: the source model's tokenizer.json, verbatim, loaded with
   ``tokenizers`` (exact ids of the source).
2. ``tokenizer.ggml.model == "gpt2"``: byte-level BPE rebuilt with ``tokenizers`` from tokens + merges,
   with the pre-tokenizer regexes llama.cpp uses for ``tokenizer.ggml.pre`` (``llama-vocab.cpp``,
   ``llm_tokenizer_bpe``).
3. ``tokenizer.ggml.model == "llama"``: SentencePiece rebuilt as a ``ModelProto`` from tokens, scores and
   token types. llama.cpp merges SPM pieces by score (``llm_tokenizer_spm``), which is what SentencePiece's
   BPE model does, so the proto is always written as ``model_type=BPE``.

Streaming: ``StreamDecoder`` turns ids into text one token at a time and never emits half of a multi-byte
UTF-8 character (the engine prints its output as it goes).
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Iterable

import numpy as np

from . import constants as C
from .config import read_field
from .errors import PyinferError

# llama.cpp token types (gguf.TokenType); SentencePiece uses the same numbers in ModelProto.
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn token names, tried in order when the file names no eot id.
_EOT_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
# Tokens that end generation by their text, whatever ids the file names: llama.cpp's
# end-of-generation set (llama_vocab::impl::load, special_eog_ids), so that e.g. Qwen2.5's
# <|endoftext|> and Llama 3.1's <|eom_id|> stop an answer as they do there (and in transformers,
# whose generation_config.json lists them).
_EOG_NAMES = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                        "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>", "<EOT>",
                        "_<EOT>", "<end_of_utterance>"))
# llama.cpp's FIM pad / repo / file-separator tokens, found by their text (the first of each list
# the vocabulary has) where the file names no id for them; they end generation too
_FIM_EOG_NAMES = {C.K_TOK_FIM_PAD: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
                  C.K_TOK_FIM_REP: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                    "<reponame>"),
                  C.K_TOK_FIM_SEP: ("<|file_sep|>",)}
# GGUF ids that end generation too: end of message (Llama 3.1's <|eom_id|>) and the FIM ones
_EOG_KEYS = (C.K_TOK_EOM, *_FIM_EOG_NAMES)


def _eog_ids(tokens: list[str], named, given: dict) -> frozenset[int]:
    """The end-of-generation ids: ``named`` (eos, eot; None skipped), the ids ``given`` for
    _EOG_KEYS (key -> id; one outside the vocabulary is ignored, as llama.cpp ignores it with a
    warning), each token whose text is in ``_EOG_NAMES`` and, for a FIM key not given, the first
    of its ``_FIM_EOG_NAMES`` the vocabulary has; without <|end|> where <|return|> and <|call|>
    are there too (llama.cpp's rule for gpt-oss' vocabulary, whose <|end|> ends a message). A
    text's first id (llama.cpp refuses vocabularies whose texts repeat)."""
    present = _EOG_NAMES.union(*_FIM_EOG_NAMES.values()).intersection(tokens)  # one pass
    found = set(present & _EOG_NAMES)
    for key, fim in _FIM_EOG_NAMES.items():
        first = next((n for n in fim if n in present), None)
        if key not in given and first is not None:
            found.add(first)
    if {"<|return|>", "<|call|>"} <= found:
        found.discard("<|end|>")
    ids = {i for i in named if i is not None}
    ids.update(i for i in given.values() if 0 <= i < len(tokens))
    return frozenset(ids | {tokens.index(t) for t in found})


# ---- byte-level BPE pre-tokenizer regexes ---------------------------------------------------
# Copied from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe constructor). llama.cpp applies the
# regexes one after another, each splitting the pieces the previous one produced, keeping matched and
# unmatched text as separate pieces: that is `tokenizers` Split(..., behavior="isolated") in sequence.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PUNCT_RE = r"[\p{P}\$\+<=>\^~\|`]+"
_NAIVE_WORD_RE = r" ?[^(\s|.,!?…。，、।۔،)]+"  # bloom / poro / gpt3-finnish / viking
_DEEPSEEK_LETTERS_RE = '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+'
_DEEPSEEK_PUNCT_RE = '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+'
_DEEPSEEK_CJK_RE = '[一-龥ࠀ-一가-\ud7ff]+'
_DEEPSEEK3_RE = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# For these four, llama.cpp rewrites the source's tokenizer.json regex for its own regex engine (no
# \p{Lu}, (?i:), possessive quantifiers: its comments quote the originals). `tokenizers` runs the
# originals, which is what the source model does, so they are used as the source wrote them.
_TEKKEN_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_RE = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE_RE = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
    r"|\s+(?!\S)|\s+"
)
_SEED_CODER_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")

#: the pre-tokenizer names llama.cpp runs as llama3's (its regex, merges ignored), which add BOS
#: where the file does not say (llama-vocab.cpp load())
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                "lfm2", "jina-v5-nano")

#: tokenizer.ggml.pre -> (regexes in order, ignore_merges). llama.cpp's names (llama-vocab.cpp load()).
BPE_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT_RES, False),
    "gpt-2": ((_GPT2_RE,), False),
    "gpt2": ((_GPT2_RE,), False),
    "mpt": ((_GPT2_RE,), False),
    "olmo": ((_GPT2_RE,), False),
    "jais": ((_GPT2_RE,), False),
    "smollm": ((r"\p{N}", _GPT2_RE), False),
    "starcoder": ((r"\p{N}", _GPT2_RE), False),
    "refact": ((r"\p{N}", _GPT2_RE), False),
    "command-r": ((r"\p{N}", _GPT2_RE), False),
    "codeshell": ((r"\p{N}", _GPT2_RE), False),
    "exaone": ((r"\p{N}", _GPT2_RE), False),
    "minerva-7b": ((r"\p{N}", _GPT2_RE), False),
    **{n: ((_LLAMA3_RE,), True) for n in _LLAMA3_PRES},
    "dbrx": ((_LLAMA3_RE,), False),
    "smaug-bpe": ((_LLAMA3_RE,), False),
    "qwen2": ((_QWEN2_RE,), False),
    "stablelm2": ((_QWEN2_RE,), False),
    # llama.cpp's aliases of the entries above
    **{n: ((_GPT2_RE,), False) for n in ("phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en",
                                         "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe",
                                         "trillion")},
    **{n: ((_QWEN2_RE,), False) for n in ("deepseek-r1-qwen", "megrez")},
    **{n: ((_LLAMA3_RE,), False) for n in ("glm4", "chatglm-bpe")},  # llama3's regex, merges kept
    "falcon": ((_PUNCT_RE, _GPT2_RE, r"[0-9][0-9][0-9]"), False),
    "deepseek-llm": ((r"[\r\n]", _DEEPSEEK_LETTERS_RE, _DEEPSEEK_PUNCT_RE, r"\s+$", _DEEPSEEK_CJK_RE,
                      r"\p{N}+"), False),
    "deepseek-coder": ((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK_RE, r"\p{N}"), False),
    "deepseek-v3": ((r"\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+", _DEEPSEEK3_RE), False),
    **{n: ((_NAIVE_WORD_RE,), False) for n in ("bloom", "poro-chat", "gpt3-finnish")},
    "viking": ((_NAIVE_WORD_RE, r"\p{N}"), False),
    "chameleon": ((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                   r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2_RE), False),
    "tekken": ((_TEKKEN_RE,), True),
    **{n: ((_GPT4O_RE,), False) for n in ("gpt-4o", "llama4")},
    "bailingmoe": ((_BAILINGMOE_RE,), False),
    "seed-coder": ((_SEED_CODER_RE,), False),
    # not here: "superbpe" (a zero-width lookahead split, "(?=(\d{3})+(?!\d))", whose pieces llama.cpp's
    # splitter and `tokenizers` cut differently: unverified)
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


#: str.translate table: GPT-2 printable character -> the byte value it stands for (as a code point).
_BYTE_DECODER = {ord(c): b for b, c in _bytes_to_unicode().items()}
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class NoTokenizerError(PyinferError):
    """A GGUF file without a tokenizer (a conversion of a directory that had none)."""


class Tokenizer:
    """Encode text to token ids and decode ids to text for one model.

    Build it with ``Tokenizer.from_gguf(reader)``. Encoding is thread-safe: on the Hugging Face
    / gpt2 paths ``encode(parse_special=False)`` flips ``encode_special_tokens`` on the shared
    ``tokenizers`` object, so every encode there holds one lock (the flag, flipped unguarded,
    spelled ``<|im_start|>`` out in another thread's prompt: the server tokenizes prompts while a
    JSON-schema grammar encodes; a copy of the object per mode cost 0.8 s and the vocabulary's
    memory again for SmolLM2).
    """

    def __init__(
        self,
        *,
        kind: str,
        tokens: list[str],
        token_types: np.ndarray,
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        add_bos: bool,
        add_space_prefix: bool,
        hf=None,
        sp=None,
        chat_template: str | None = None,
        eog_ids: dict | None = None,
    ):
        for what, i in (("bos", bos_id), ("eos", eos_id), ("eot", eot_id)):
            if i is not None and not 0 <= i < len(tokens):
                raise PyinferError(f"the {what} token id {i} is outside the vocabulary "
                                   f"({len(tokens)} tokens)")
        self.kind = kind  # "huggingface" | "gpt2" | "llama"
        self._tokens = tokens
        self._types = token_types  # (n_vocab,) int32, llama.cpp token types
        self._bos, self._eos, self._eot = bos_id, eos_id, eot_id
        self._stop = _eog_ids(tokens, (eos_id, eot_id), eog_ids or {})
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self._hf = hf  # tokenizers.Tokenizer (paths 1 and 2)
        self._hf_lock = threading.Lock()  # held by every encode on _hf (its special-token flag)
        self._sp = sp  # sentencepiece.SentencePieceProcessor (path 3)
        self.chat_template = chat_template
        self._byte_level = kind == "gpt2" or (kind == "huggingface" and _uses_byte_level(hf))
        self._bytes_cache: dict[int, bytes] = {}
        special = np.nonzero((token_types == TT_CONTROL) | (token_types == TT_USER_DEFINED))[0]
        self._special_ids = frozenset(int(i) for i in special)
        self._control_ids = frozenset(int(i) for i in np.nonzero(token_types == TT_CONTROL)[0])
        if sp is not None:
            self._sp_ids = {tokens[i]: int(i) for i in special}
            names = [n for n in self._sp_ids if n]
            self._sp_split = SpecialSplitter(names) if names else None
            user = [n for n in names if self._sp_ids[n] not in self._control_ids]
            self._sp_ctrl_split = SpecialSplitter(user) if user else None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Build the tokenizer a ``gguf.GGUFReader`` embeds.

        Raises PyinferError when the file has no vocabulary, an unknown ``tokenizer.ggml.model`` or an
        unknown byte-level pre-tokenizer (``tokenizer.ggml.pre``), a field of the wrong type, a
        string that is not UTF-8, a special token id outside the vocabulary or a merge that names
        a token the vocabulary lacks.
        """

        def _field(key, default=None, kind=None, item=None):
            return read_field(reader, key, default, kind=kind, item=item)

        model = _field(C.K_TOK_MODEL, kind=str)
        hf_json = _field(C.K_HF_TOKENIZER_JSON, kind=str)
        tokens = _field(C.K_TOK_LIST, kind=list, item=str)
        if tokens is None and hf_json is None:
            raise NoTokenizerError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
        types = _field(C.K_TOK_TYPE, kind=list, item=int)
        if tokens is None:
            tokens = []
        if types is not None:
            # values outside llama.cpp's types (0 = undefined) mean nothing to anyone: drop them
            types = np.asarray([t if 0 <= t <= TT_BYTE else 0 for t in types], dtype=np.int32)
        else:
            types = np.full(len(tokens), TT_NORMAL, dtype=np.int32)
        if len(types) != len(tokens):
            raise PyinferError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

        bos = _field(C.K_TOK_BOS, kind=int)
        eos = _field(C.K_TOK_EOS, kind=int)
        eot = _field(C.K_TOK_EOT, kind=int)
        eog = {k: int(i) for k, i in ((k, _field(k, kind=int)) for k in _EOG_KEYS) if i is not None}
        if eot is None:
            index = {t: i for i, t in ((int(i), tokens[i]) for i in np.nonzero(types != TT_NORMAL)[0])}
            eot = next((index[n] for n in _EOT_NAMES if n in index), None)
            if eot is None:  # some files mark these NORMAL; a miss here costs one pass over the list
                eot = next((tokens.index(n) for n in _EOT_NAMES if n in tokens), eos)
        add_bos = _field(C.K_TOK_ADD_BOS, kind=bool)
        add_space_prefix = _field(C.K_TOK_ADD_SPACE_PREFIX, kind=bool)
        pre = _field(C.K_TOK_PRE, "default", kind=str)
        if add_bos is None:  # llama.cpp's defaults (llama_vocab::impl::load)
            add_bos = model == "llama" or pre in _LLAMA3_PRES
        if add_space_prefix is None:
            add_space_prefix = model == "llama"
        common = dict(
            tokens=tokens,
            token_types=types,
            bos_id=None if bos is None else int(bos),
            eos_id=None if eos is None else int(eos),
            eot_id=None if eot is None else int(eot),
            add_bos=bool(add_bos),
            add_space_prefix=bool(add_space_prefix),
            chat_template=_field(C.K_CHAT_TEMPLATE, kind=str),
            eog_ids=eog,
        )
        if hf_json is not None:
            import tokenizers

            with _tokenizers_errors(C.K_HF_TOKENIZER_JSON):
                hf = tokenizers.Tokenizer.from_str(hf_json)
            if not tokens:
                common["tokens"], common["token_types"] = _hf_tokens_and_types(hf, hf_json)
            return cls(kind="huggingface", hf=hf, **common)
        if model == "gpt2":
            merges = _field(C.K_TOK_MERGES, kind=list, item=str)
            if merges is None:
                raise PyinferError("gpt2 tokenizer without tokenizer.ggml.merges")
            return cls(kind="gpt2", hf=_build_bpe(tokens, types, merges, pre), **common)
        if model == "llama":
            scores = _field(C.K_TOK_SCORES, kind=list, item=float)
            scores = np.zeros(len(tokens), np.float32) if scores is None else np.asarray(scores, np.float32)
            unk = _field(C.K_TOK_UNK, kind=int)
            sp = _build_spm(tokens, types, scores, unk, common["add_space_prefix"])
            return cls(kind="llama", sp=sp, **common)
        raise PyinferError(f"unsupported tokenizer model {model}")

    # ---- properties ---------------------------------------------------------------------------
    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eot_id(self) -> int | None:
        """End of turn: tokenizer.ggml.eot_token_id, else a known end-of-turn token, else eos."""
        return self._eot

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation, as llama.cpp's end-of-generation set: eos, end-of-turn, the
        file's eom / FIM ids, the tokens named in ``_EOG_NAMES`` and FIM tokens by their text
        where the file names none (``_eog_ids``)."""
        return self._stop

    def is_special(self, token_id: int) -> bool:
        """Control or user-defined token (``<|im_start|>``, ``<s>`` ...)."""
        return token_id in self._special_ids

    def is_control(self, token_id: int) -> bool:
        """A control token: one that ``skip_special`` decoding leaves out of the text."""
        return token_id in self._control_ids

    # ---- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        add_bos: prepend BOS; default from ``tokenizer.ggml.add_bos_token``.
        parse_special: match control tokens written in the text (``<|im_start|>``) as one id each, as
        llama.cpp's ``parse_special`` does; with False they are tokenized as plain text (user-defined
        tokens are matched either way, like llama.cpp).

        Raises PyinferError for a ``text`` that is not a str, or one holding lone surrogates
        (undecodable bytes kept by Python's surrogateescape, e.g. a terminal sending Latin-1):
        text that is not valid UTF-8 has no tokens.
        """
        if not isinstance(text, str):
            raise PyinferError(f"text to tokenize must be a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text[e.start:e.end]
            try:  # the bytes a surrogateescape decoder kept, else the lone surrogates themselves
                what = f"bytes {bad.encode('utf-8', 'surrogateescape')!r}"
            except UnicodeEncodeError:
                what = f"lone surrogates {ascii(bad)}"
            raise PyinferError(f"the text is not valid UTF-8 ({what})") from None
        if add_bos is None:
            add_bos = self.add_bos
        if self._sp is not None:
            ids = self._encode_spm(text, parse_special)
        else:
            with self._hf_lock:
                self._hf.encode_special_tokens = not parse_special
                try:
                    ids = self._hf.encode(text, add_special_tokens=False).ids
                finally:
                    self._hf.encode_special_tokens = False
        if add_bos and self._bos is not None:
            ids = [self._bos] + list(ids)
        return list(ids)

    def _encode_spm(self, text: str, parse_special: bool) -> list[int]:
        # llama.cpp (llama_vocab::impl::tokenize, SPM): split on special tokens first; every text
        # fragment is tokenized on its own, with the dummy-prefix space when add_space_prefix is set.
        splitter = self._sp_split if parse_special else self._sp_ctrl_split
        parts = splitter.split(text) if splitter is not None else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self._sp_ids[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``. Control tokens appear as their text unless ``skip_special``.

        Bytes that do not form valid UTF-8 become U+FFFD.
        """
        ids = [int(i) for i in ids]
        if self._sp is None:
            return self._hf.decode(ids, skip_special_tokens=skip_special)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._special_ids:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                if not (skip_special and i in self._control_ids):
                    out.append(self._tokens[i])
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def ids_holding(self, pieces: tuple[bytes, ...]) -> set[int]:
        """The ids of the tokens whose bytes (``token_to_bytes``) hold one of ``pieces``. On a
        byte-level vocabulary the pieces are looked up in the tokens' own spelling (SmolLM2's
        49,152 tokens: 37 ms, where turning every token into bytes took 153 ms;
        docs/benchmarks.md session 40)."""
        if not self._byte_level:
            return {i for i in range(len(self._tokens))
                    if any(p in self.token_to_bytes(i) for p in pieces)}
        table = _bytes_to_unicode()
        spelled = ["".join(table[c] for c in p) for p in pieces]
        out = set()
        for i, piece in enumerate(self._tokens):
            if i in self._special_ids:
                if any(p in piece.encode("utf-8") for p in pieces):
                    out.add(i)
            elif any(p in piece for p in spelled):
                out.add(i)
        return out

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (spaces restored, byte tokens as their byte).

        Special tokens give their text in UTF-8. SentencePiece's leading dummy-prefix space is kept here;
        ``decode`` and ``StreamDecoder`` remove it.
        """
        b = self._bytes_cache.get(token_id)
        if b is not None:
            return b
        if not 0 <= token_id < len(self._tokens):
            raise PyinferError(f"token id {token_id} out of range (n_vocab {len(self._tokens)})")
        piece = self._tokens[token_id]
        if token_id in self._special_ids:
            b = piece.encode("utf-8")
        elif self._byte_level:
            b = piece.translate(_BYTE_DECODER).encode("latin-1", errors="replace")
        else:
            m = _BYTE_PIECE.fullmatch(piece)
            if m is not None and self._types[token_id] == TT_BYTE:
                b = bytes([int(m.group(1), 16)])
            else:
                b = piece.replace(_SPM_SPACE, " ").encode("utf-8")
        self._bytes_cache[token_id] = b
        return b

    def token_to_piece(self, token_id: int) -> str:
        """Human-readable text of one token (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = True,
                       continuation: bool = False) -> "StreamDecoder":
        """A ``StreamDecoder``; ``continuation``: the ids continue a sequence under way (generated
        text after a prompt), see there."""
        return StreamDecoder(self, skip_special=skip_special, continuation=continuation)


def _hf_tokens_and_types(hf, hf_json: str) -> tuple[list[str], np.ndarray]:
    """Token texts and llama.cpp token types of a tokenizer.json stored without a token list (a
    SentencePiece-style tokenizer.json alone, as transformers 5 saves Llama / Mistral ones):
    added tokens marked ``special`` are CONTROL, other added tokens USER_DEFINED, and ``<0xNN>``
    pieces of a model with ``byte_fallback`` BYTE (what tokenizers' ByteFallback decoder turns into
    bytes). Without the types, byte tokens streamed as the text "<0xF0>" and control tokens were
    printed."""
    import json

    n = hf.get_vocab_size(with_added_tokens=True)
    tokens = [hf.id_to_token(i) or "" for i in range(n)]
    types = np.full(n, TT_NORMAL, dtype=np.int32)
    try:
        byte_fallback = bool((json.loads(hf_json).get("model") or {}).get("byte_fallback"))
    except (ValueError, AttributeError, RecursionError):
        byte_fallback = False
    if byte_fallback:
        for i, t in enumerate(tokens):
            if len(t) == 6 and _BYTE_PIECE.fullmatch(t):
                types[i] = TT_BYTE
    for i, added in hf.get_added_tokens_decoder().items():
        if 0 <= i < n:
            types[i] = TT_CONTROL if added.special else TT_USER_DEFINED
    return tokens, types


@contextlib.contextmanager
def _tokenizers_errors(what: str):
    """Turn what ``tokenizers`` raises on a bad vocabulary into PyinferError: a plain Exception,
    or a Rust panic (pyo3's PanicException derives from BaseException, so it is caught by name)."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - re-raised below unless it is one of the two
        if isinstance(e, PyinferError) or not (isinstance(e, Exception)
                                                or type(e).__name__ == "PanicException"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PyinferError(f"bad {what}: {msg}") from None


def _check_merges(vocab: dict[str, int], merges: list[str]) -> list[tuple[str, str]]:
    """Merge strings "A B" as pairs; PyinferError unless A, B and AB are all in the vocabulary
    (``tokenizers`` panics on a merge without a space or with a result it cannot find)."""
    pairs = []
    for i, m in enumerate(merges):
        pair = m.split(" ", 1)
        if len(pair) != 2 or not pair[0] or not pair[1]:
            raise PyinferError(f"{C.K_TOK_MERGES}[{i}] {m!r} is not two tokens separated by a space")
        for t in (pair[0], pair[1], pair[0] + pair[1]):
            if t not in vocab:
                raise PyinferError(f"{C.K_TOK_MERGES}[{i}] {m!r} names {t!r}, which is not in the "
                                   "vocabulary")
        pairs.append((pair[0], pair[1]))
    return pairs


def _uses_byte_level(hf) -> bool:
    import json

    dec = json.loads(hf.to_str()).get("decoder") or {}
    kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", [])]
    return "ByteLevel" in kinds


def _build_bpe(tokens: list[str], types: np.ndarray, merges: list[str], pre: str):
    """Byte-level BPE with llama.cpp's pre-tokenizer for ``pre`` (a `tokenizers.Tokenizer`)."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    if pre not in BPE_PRE_TOKENIZERS:
        known = ", ".join(sorted(BPE_PRE_TOKENIZERS))
        raise PyinferError(f"unknown byte-level pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {known}")
    regexes, ignore_merges = BPE_PRE_TOKENIZERS[pre]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # first id wins on a duplicate, as llama.cpp's token_to_id map
    pairs = _check_merges(vocab, merges)
    with _tokenizers_errors("byte-level BPE vocabulary"):
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
        tok = HFTokenizer(bpe)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i in np.nonzero(types == TT_CONTROL)[0]]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in np.nonzero(types == TT_USER_DEFINED)[0]]
    with _tokenizers_errors("byte-level BPE vocabulary"):
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
    return tok


class SpecialSplitter:
    """Splits text on special-token texts as ``re.split`` does over the alternation of the texts,
    longest first and in one capturing group ([text, token, text, token, ..., text]: at the
    leftmost position where one begins, the longest that does), without compiling that
    alternation: Gemma's 6,414 special tokens took Python's ``re`` 0.33 s at every load. A
    position is tried only where a token's first character stands (one character class), with
    the lengths the tokens beginning with it have, longest first. names: non-empty strings."""

    def __init__(self, names):
        self._names = frozenset(names)
        by_first: dict[str, set[int]] = {}
        for n in self._names:
            by_first.setdefault(n[0], set()).add(len(n))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in by_first.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in by_first) + "]")

    def split(self, text: str) -> list[str]:
        out, done = [], 0
        for m in self._starts.finditer(text):
            p = m.start()
            if p < done:  # inside the token just taken
                continue
            for n in self._lengths[text[p]]:
                if text[p:p + n] in self._names:
                    out += (text[done:p], text[p:p + n])
                    done = p + n
                    break
        out.append(text[done:])
        return out


def _build_spm(tokens: list[str], types: np.ndarray, scores: np.ndarray, unk_id, add_space_prefix: bool):
    """SentencePieceProcessor from llama.cpp's SPM vocabulary (tokens, scores, token types)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    if len(scores) != len(tokens):
        raise PyinferError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = bool(np.any(types == TT_BYTE))
    # SentencePiece wants exactly one UNKNOWN piece; llama.cpp's files name it by id and type.
    unk = int(unk_id) if unk_id is not None else None
    if unk is None:
        found = np.nonzero(types == TT_UNKNOWN)[0]
        unk = int(found[0]) if len(found) else None
    if unk is None:
        raise PyinferError("SentencePiece vocabulary without an unknown token")
    if not 0 <= unk < len(tokens):
        raise PyinferError(f"the unknown token id {unk} is outside the vocabulary ({len(tokens)} tokens)")
    proto.trainer_spec.unk_id = unk
    proto.trainer_spec.bos_id = -1  # BOS/EOS are added by Tokenizer.encode, not by SentencePiece
    proto.trainer_spec.eos_id = -1
    proto.trainer_spec.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = add_space_prefix
    norm.remove_extra_whitespaces = False  # llama.cpp never collapses whitespace
    norm.escape_whitespaces = True
    sp_types = types.copy()
    sp_types[(sp_types < TT_NORMAL) | (sp_types > TT_BYTE)] = TT_NORMAL
    sp_types[sp_types == TT_UNKNOWN] = TT_CONTROL  # only the one unk_id piece may be UNKNOWN
    sp_types[unk] = TT_UNKNOWN
    Piece = pb.ModelProto.SentencePiece
    proto.pieces.extend(
        Piece(piece=t, score=float(s), type=int(ty)) for t, s, ty in zip(tokens, scores.tolist(), sp_types.tolist())
    )
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
        raise PyinferError(f"bad SentencePiece vocabulary: {str(e).splitlines()[0]}") from None
    return sp


class StreamDecoder:
    """Incremental detokenizer: ``feed(id)`` returns only complete UTF-8 characters.

    A character whose bytes are split across tokens (an emoji made of byte tokens) is held back until its
    last byte arrives. ``flush()`` returns whatever is left (an incomplete tail as U+FFFD). The
    concatenated output equals ``tokenizer.decode(ids, skip_special)`` for valid UTF-8.
    Special tokens are dropped when ``skip_special`` (the default, as llama.cpp prints its output).

    ``continuation``: the ids continue a sequence already under way (a completion after its
    prompt), so the first piece keeps its leading space: SentencePiece's dummy-prefix space is
    removed only at the start of a text, and "▁the" after "Once upon a time," is " the"
    (llama.cpp's ``token_to_piece``; llama-cpp-python's ``detokenize`` with the prompt as context).
    Without it, completions of SentencePiece models lost their first space.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, continuation: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._pending = b""
        # SentencePiece's dummy-prefix space of a fragment's first piece is not part of the text.
        self._strip_space = (not continuation and tokenizer._sp is not None
                             and tokenizer.add_space_prefix)

    def feed(self, token_id: int) -> str:
        tok = self._tok
        token_id = int(token_id)
        if token_id in tok._special_ids:
            if tok._sp is not None:
                self._strip_space = tok.add_space_prefix
            if self._skip and token_id in tok._control_ids:
                return ""
            b = tok.token_to_bytes(token_id)
        else:
            b = tok.token_to_bytes(token_id)
            if self._strip_space and b:
                if b[:1] == b" ":
                    b = b[1:]
                self._strip_space = False
        buf = self._pending + b
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        out = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return out


def _complete_prefix_len(buf: bytes) -> int:
    """Length of the longest prefix of ``buf`` that does not end inside a UTF-8 sequence."""
    n = len(buf)
    # Walk back over at most 3 continuation bytes to the lead byte of the last sequence.
    i = n - 1
    while i >= 0 and n - i <= 4 and (buf[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or n - i > 4:
        return n
    lead = buf[i]
    need = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 1
    return i if n - i < need else n
