"""Hugging Face tokenizer files -> llama.cpp's ``tokenizer.ggml.*`` metadata (+ the verbatim JSON).

Follows the logic of llama.cpp's ``convert_hf_to_gguf.py`` (``_set_vocab_gpt2`` / ``get_vocab_base``
for byte-level BPE, ``_set_vocab_sentencepiece`` for ``tokenizer.model``) and of gguf-py's
``SpecialVocab`` for special ids, ``add_bos``/``add_eos`` and the chat template:

- ``tokenizer.model`` (SentencePiece) -> model ``llama``: pieces, scores, SentencePiece token types.
- ``tokenizer.json`` with a BPE model and a ByteLevel pre-tokenizer or decoder -> model ``gpt2``:
  tokens in id order, merges ``"a b"``, types normal (1) / control (3, special added tokens) /
  user-defined (4, other added tokens).
- Ids the tokenizer lacks up to the embedding count become ``[PAD{id}]`` of type unused (5).
- ``tokenizer.json``, when present, is also stored verbatim under ``pyinfer.tokenizer.huggingface_json``.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from pyinfer import constants as C
from pyinfer.errors import PyinferError

from . import warn
from .writer import VT, Metadata

#: Chat-turn terminators llama.cpp treats as end-of-turn (llama-vocab.cpp), in preference order.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|END_OF_TURN_TOKEN|>")
_LOOKS_SPECIAL = re.compile(r"^<\|.*\|>$")  # llama.cpp's does_token_look_special, the common form


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise PyinferError(f"cannot read {path}: {e}") from None


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _is_byte_level(tj: dict[str, Any]) -> bool:
    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(n) for n in node.get("pretokenizers", []) + node.get("decoders", []))

    return has(tj.get("pre_tokenizer")) or has(tj.get("decoder"))


def _pre_name(tj: dict[str, Any]) -> str:
    """Best-effort llama.cpp pre-tokenizer name (llama.cpp hashes tokenizer output instead)."""
    pre = tj.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds and kinds[0] == "Split":
        regex = (parts[0].get("pattern") or {}).get("Regex", "")
        if regex.startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"):
            return "llama-bpe"
    return "default"


def _gpt2_vocab(meta: Metadata, tj: dict[str, Any], n_vocab: int) -> list[str]:
    model = tj["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for tid, t in added.items():
        vocab[t["content"]] = tid
    by_id = {tid: text for text, tid in vocab.items()}
    if by_id and max(by_id) >= n_vocab:
        raise PyinferError(f"tokenizer has token id {max(by_id)} but the model has only {n_vocab} embeddings")
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(C.TOKEN_TYPE_UNUSED)
        elif i in added:
            tokens.append(text)
            special = added[i].get("special", False) or _LOOKS_SPECIAL.match(text) is not None
            types.append(C.TOKEN_TYPE_CONTROL if special else C.TOKEN_TYPE_USER_DEFINED)
        else:
            tokens.append(text)
            types.append(C.TOKEN_TYPE_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta.string(C.K_TOK_MODEL, "gpt2")
    meta.string(C.K_TOK_PRE, _pre_name(tj))
    meta.array(C.K_TOK_LIST, tokens, VT.STRING)
    meta.array(C.K_TOK_TYPE, types, VT.INT32)
    meta.array(C.K_TOK_MERGES, merges, VT.STRING)
    return tokens


def _spm_vocab(meta: Metadata, path: str, tcfg: dict[str, Any], model_dir: str, n_vocab: int) -> list[str]:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with long messages
        raise PyinferError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    n_sp = sp.vocab_size()
    if n_sp > n_vocab:
        raise PyinferError(f"tokenizer.model has {n_sp} pieces but the model has only {n_vocab} embeddings")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-1000.0] * n_vocab
    types = [C.TOKEN_TYPE_UNUSED] * n_vocab
    for i in range(n_sp):
        tokens[i], scores[i] = sp.id_to_piece(i), float(sp.get_score(i))
        if sp.is_unknown(i):
            types[i] = C.TOKEN_TYPE_UNKNOWN
        elif sp.is_control(i):
            types[i] = C.TOKEN_TYPE_CONTROL
        elif sp.is_unused(i):
            types[i] = C.TOKEN_TYPE_UNUSED
        elif sp.is_byte(i):
            types[i] = C.TOKEN_TYPE_BYTE
        else:
            types[i] = C.TOKEN_TYPE_NORMAL
    # tokens added on top of the SentencePiece model: added_tokens.json, then the richer
    # added_tokens_decoder of tokenizer_config.json (which knows which ones are special)
    extra: dict[int, tuple[str, bool]] = {}
    added_json = os.path.join(model_dir, "added_tokens.json")
    if os.path.isfile(added_json):
        for text, tid in _read_json(added_json).items():
            extra[int(tid)] = (text, False)
    for tid, t in (tcfg.get("added_tokens_decoder") or {}).items():
        extra[int(tid)] = (t["content"], bool(t.get("special", False)))
    for tid, (text, special) in sorted(extra.items()):
        if tid >= n_vocab:
            raise PyinferError(f"added token {text!r} has id {tid} but the model has only {n_vocab} embeddings")
        if tid < n_sp and tokens[tid] == text:
            continue  # the piece itself (<s>, </s>, <unk>): keep SentencePiece's type
        tokens[tid], scores[tid] = text, -1000.0
        types[tid] = C.TOKEN_TYPE_CONTROL if special else C.TOKEN_TYPE_USER_DEFINED
    meta.string(C.K_TOK_MODEL, "llama")
    meta.array(C.K_TOK_LIST, tokens, VT.STRING)
    meta.array(C.K_TOK_SCORES, scores, VT.FLOAT32)
    meta.array(C.K_TOK_TYPE, types, VT.INT32)
    meta.boolean(C.K_TOK_ADD_SPACE_PREFIX, _spm_add_dummy_prefix(path))
    for key, tid in ((C.K_TOK_BOS, sp.bos_id()), (C.K_TOK_EOS, sp.eos_id()),
                     (C.K_TOK_UNK, sp.unk_id()), (C.K_TOK_PAD, sp.pad_id())):
        if tid >= 0:
            meta.u32(key, tid)  # SentencePiece's own ids; tokenizer_config.json may override below
    return tokens


def _spm_add_dummy_prefix(path: str) -> bool:
    """normalizer_spec.add_dummy_prefix of a SentencePiece model (True when it cannot be read)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        return bool(proto.normalizer_spec.add_dummy_prefix)
    except Exception:  # protobuf missing or too new/old: SentencePiece's default
        return True


def _post_processor_adds(tj: dict[str, Any] | None) -> tuple[bool | None, bool | None, str | None, str | None]:
    """(adds a leading special, adds a trailing special, their texts) from a TemplateProcessing."""
    post = (tj or {}).get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") != "TemplateProcessing":
            continue
        single = p.get("single") or []
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
        return first is not None, last is not None, first, last
    return None, None, None, None


def _chat_templates(model_dir: str, tcfg: dict[str, Any]) -> dict[str, str]:
    """{"": default template, name: named template} from tokenizer_config.json or chat_template.*."""
    tmpl = tcfg.get("chat_template")
    if tmpl is None:
        jinja = os.path.join(model_dir, "chat_template.jinja")
        js = os.path.join(model_dir, "chat_template.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                tmpl = f.read()
        elif os.path.isfile(js):
            tmpl = _read_json(js).get("chat_template")
    if isinstance(tmpl, str):
        return {"": tmpl}
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        return {("" if t["name"] == "default" else t["name"]): t["template"] for t in tmpl}
    return {}


def hf_tokenizer_metadata(model_dir: str, n_vocab: int) -> Metadata | None:
    """Tokenizer metadata for a Hugging Face model directory, or None when it has no tokenizer.

    ``n_vocab``: the number of embedding rows; the token list is padded to it.
    Raises PyinferError when the tokenizer has more tokens than the model has embeddings.
    """
    tj_path = os.path.join(model_dir, "tokenizer.json")
    sp_path = os.path.join(model_dir, "tokenizer.model")
    tc_path = os.path.join(model_dir, "tokenizer_config.json")
    has_tj, has_sp = os.path.isfile(tj_path), os.path.isfile(sp_path)
    if not has_tj and not has_sp:
        return None
    tcfg = _read_json(tc_path) if os.path.isfile(tc_path) else {}
    if not isinstance(tcfg, dict):
        raise PyinferError(f"{tc_path} must be a JSON object, not a {type(tcfg).__name__}")
    tj_text, tj = None, None
    if has_tj:
        try:
            with open(tj_path, encoding="utf-8") as f:
                tj_text = f.read()
            tj = json.loads(tj_text)
        except (OSError, ValueError, RecursionError) as e:
            raise PyinferError(f"cannot read {tj_path}: {e}") from None
        _check_tokenizer_json(tj, tj_path)
    try:
        return _tokenizer_metadata(model_dir, n_vocab, tcfg, tj, tj_text, has_sp, sp_path)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        # a structure _check_tokenizer_json does not cover (tokenizer_config.json's fields ...)
        raise PyinferError(f"the tokenizer files in {model_dir} have an unexpected structure "
                           f"({type(e).__name__}: {e})") from None


def _check_tokenizer_json(tj: Any, path: str) -> None:
    """PyinferError unless ``tj`` has the shape the converter reads: an object whose ``model`` is an
    object; for BPE a ``vocab`` of name -> id and ``merges`` of strings or pairs; ``added_tokens``
    a list of {"id": int, "content": str}; the pre-tokenizer and decoder objects or null."""
    def bad(why: str) -> PyinferError:
        return PyinferError(f"{path}: {why}")

    if not isinstance(tj, dict):
        raise bad(f"must be a JSON object, not a {type(tj).__name__}")
    model = tj.get("model")
    if model is not None and not isinstance(model, dict):
        raise bad(f"'model' must be an object, not a {type(model).__name__}")
    for key in ("pre_tokenizer", "decoder", "post_processor"):
        if tj.get(key) is not None and not isinstance(tj[key], dict):
            raise bad(f"'{key}' must be an object or null")
    added = tj.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("id"), int) and t["id"] >= 0
            and isinstance(t.get("content"), str) for t in added):
        raise bad("'added_tokens' must be a list of {\"id\": int, \"content\": str}")
    if model and model.get("type") == "BPE":
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            raise bad("model.vocab must map token texts to non-negative ids")
        merges = model.get("merges", [])
        if not isinstance(merges, list) or not all(
                isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m))
                for m in merges):
            raise bad("model.merges must be a list of \"a b\" strings or [a, b] pairs")


def _tokenizer_metadata(model_dir: str, n_vocab: int, tcfg: dict[str, Any], tj: dict[str, Any] | None,
                        tj_text: str | None, has_sp: bool, sp_path: str) -> Metadata:
    meta = Metadata()
    kind = None
    if has_sp:
        tokens, kind = _spm_vocab(meta, sp_path, tcfg, model_dir, n_vocab), "llama"
    elif tj is not None and (tj.get("model") or {}).get("type") == "BPE" and _is_byte_level(tj):
        tokens, kind = _gpt2_vocab(meta, tj, n_vocab), "gpt2"
    else:
        # the engine loads it with tokenizers: one it cannot load fails here, not at every run
        import tokenizers

        from pyinfer.tokenizer import _tokenizers_errors

        if tj_text is not None:
            with _tokenizers_errors(os.path.join(model_dir, "tokenizer.json")):
                tokenizers.Tokenizer.from_str(tj_text)
        warn(f"tokenizer.json model {(tj.get('model') or {}).get('type')!r} is not byte-level BPE: "
             "storing tokenizer.json only")
        tokens = []
    if tj_text is not None:
        meta.string(C.K_HF_TOKENIZER_JSON, tj_text)
    # the special ids from the token texts: the stored vocabulary's, else tokenizer.json's own
    # (a SentencePiece-style tokenizer.json alone, as transformers 5 saves Llama / Mistral ones,
    # had no eos id: generation never stopped)
    _special_ids(meta, model_dir, tcfg, tj, tokens or _json_texts(tj), kind)
    for name, tmpl in _chat_templates(model_dir, tcfg).items():
        meta.string(C.K_CHAT_TEMPLATE + (f".{name}" if name else ""), tmpl)
    return meta


def _json_texts(tj: dict[str, Any] | None) -> list[str]:
    """Token texts by id from tokenizer.json (model.vocab as a text -> id map, BPE / WordPiece
    / WordLevel, or Unigram's [text, score] list, then added_tokens); ids with no text are "".
    Empty without a tokenizer.json."""
    if not tj:
        return []
    by_id: dict[int, str] = {}
    vocab = (tj.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        by_id.update((i, t) for t, i in vocab.items() if isinstance(i, int) and i >= 0)
    elif isinstance(vocab, list):
        by_id.update((i, e[0]) for i, e in enumerate(vocab)
                     if isinstance(e, (list, tuple)) and e and isinstance(e[0], str))
    by_id.update((t["id"], t["content"]) for t in tj.get("added_tokens", []))
    out = [""] * (max(by_id) + 1 if by_id else 0)
    for i, t in by_id.items():
        out[i] = t
    return out


def add_eot_id(meta: Metadata, tokens: list[str]) -> None:
    """Set ``eot_token_id`` (unless set) to a known end-of-turn token, else to the eos id."""
    if C.K_TOK_EOT in meta:
        return
    ids = {text: i for i, text in enumerate(tokens)}
    for text in _EOT_TEXTS:
        if text in ids:
            meta.u32(C.K_TOK_EOT, ids[text])
            return
    if C.K_TOK_EOS in meta:
        meta.u32(C.K_TOK_EOT, meta.get(C.K_TOK_EOS))


def _special_ids(meta: Metadata, model_dir: str, tcfg: dict[str, Any], tj: dict[str, Any] | None,
                 tokens: list[str], kind: str | None) -> None:
    """bos/eos/unk/pad/eot ids and add_bos/add_eos, as gguf-py's SpecialVocab derives them."""
    if not tokens:
        return
    ids = {text: i for i, text in enumerate(tokens)}
    # ids named in config.json / generation_config.json are the fallback for texts we cannot map
    fallback: dict[str, int] = {}
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            cfg = _read_json(path)
            for field in ("bos", "eos", "pad"):
                v = cfg.get(f"{field}_token_id")
                if isinstance(v, list):
                    v = v[0] if v else None
                if isinstance(v, int) and 0 <= v < len(tokens):
                    fallback.setdefault(field, v)
    for field, key in (("bos", C.K_TOK_BOS), ("eos", C.K_TOK_EOS), ("unk", C.K_TOK_UNK),
                       ("pad", C.K_TOK_PAD), ("sep", C.K_TOK_SEP)):
        text = _token_text(tcfg.get(f"{field}_token"))
        if text is not None and text in ids:
            meta.u32(key, ids[text])
        elif key not in meta and field in fallback:
            meta.u32(key, fallback[field])
    eos = meta.get(C.K_TOK_EOS)
    add_eot_id(meta, tokens)

    adds_first, adds_last, first, last = _post_processor_adds(tj)
    bos_text = tokens[meta.get(C.K_TOK_BOS)] if C.K_TOK_BOS in meta else None
    eos_text = tokens[eos] if eos is not None else None
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:
        add_bos = (adds_first and first == bos_text) if adds_first is not None else (kind == "llama")
    add_eos = tcfg.get("add_eos_token")
    if add_eos is None:
        add_eos = bool(adds_last and last == eos_text)
    meta.boolean(C.K_TOK_ADD_BOS, bool(add_bos))
    meta.boolean(C.K_TOK_ADD_EOS, bool(add_eos))
    if kind == "gpt2":
        meta.boolean(C.K_TOK_ADD_SPACE_PREFIX, False)
