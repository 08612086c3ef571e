"""English text for the tests' tokenizers, and the one gate on system corpora.

The tests train tokenizers (a 1000-piece SentencePiece BPE among them), which needs a few thousand
lines of varied English. Nothing the test command installs ships such text, so the suite makes its
own: ``english_sentences`` builds simple sentences from the word list in
tests/fixtures/english-words.txt (written for this repository). It draws only from
``random.Random(seed).random()``, the one part of the ``random`` module whose output Python promises
to keep across versions, so the text is the same everywhere.

Debian's ``fortunes`` and ``jargon-text`` packages are used only as extra text when installed, and
setting ``PYINFER_NO_SYSTEM_CORPORA=1`` hides them so that a machine that has them can run the
suite as a fresh one would.
"""
from __future__ import annotations

import bisect
import itertools
import os
import random
from functools import lru_cache

WORDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "english-words.txt")
FORTUNES_DIR = "/usr/share/games/fortunes"
JARGON_DIR = "/usr/share/doc/jargon-text"
SYSTEM_CORPORA = (FORTUNES_DIR, JARGON_DIR)
NO_SYSTEM_CORPORA_ENV = "PYINFER_NO_SYSTEM_CORPORA"


def system_corpora_hidden() -> bool:
    """True when $PYINFER_NO_SYSTEM_CORPORA is set to anything but "" or "0"."""
    return os.environ.get(NO_SYSTEM_CORPORA_ENV, "") not in ("", "0")


def system_corpus_dir(path: str) -> str | None:
    """``path`` (one of SYSTEM_CORPORA) if it is installed and not hidden, else None."""
    assert path in SYSTEM_CORPORA, path
    return path if not system_corpora_hidden() and os.path.isdir(path) else None


def fortune_lines(max_files: int = 8) -> list[str]:
    """Non-blank lines of the first ``max_files`` fortune files; [] when absent or hidden."""
    root = system_corpus_dir(FORTUNES_DIR)
    if root is None:
        return []
    lines: list[str] = []
    for name in sorted(os.listdir(root))[:max_files]:
        path = os.path.join(root, name)
        if "." in name or not os.path.isfile(path):  # skip the .dat indexes and .u8 copies
            continue
        with open(path, encoding="utf-8", errors="ignore") as f:
            lines += [s for s in f.read().splitlines() if s.strip()]
    return lines


@lru_cache(maxsize=1)
def _word_lists() -> dict[str, list[str]]:
    """The [section] -> words table of tests/fixtures/english-words.txt."""
    lists: dict[str, list[str]] = {}
    section: list[str] = []  # words before any [section] header are ignored
    with open(WORDS_FILE, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("["):
                section = lists.setdefault(line.strip("[]"), [])
            elif line and not line.startswith("#"):
                section += line.split()
    return lists


class _Sentences:
    """Sentence maker over the word lists; early words of a list come up more often (Zipf-like)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.words = _word_lists()
        self.cum = {k: list(itertools.accumulate(1 / (i + 1) for i in range(len(v)))) for k, v in self.words.items()}

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def number(self, lo: int, hi: int) -> int:
        return lo + int(self.rng.random() * (hi - lo + 1))

    def word(self, kind: str) -> str:
        cum = self.cum[kind]
        return self.words[kind][bisect.bisect(cum, self.rng.random() * cum[-1])]

    def noun_phrase(self) -> str:
        det, noun = self.word("det"), (self.word("adj") + " " if self.chance(0.5) else "") + self.word("noun")
        if det == "a" and noun[0] in "aeiou":
            det = "an"
        return f"{det} {noun}"

    def subject(self) -> str:
        r = self.rng.random()
        return self.word("person") if r < 0.25 else self.word("pron") if r < 0.45 else self.noun_phrase()

    def place(self) -> str:
        where = self.word("place") if self.chance(0.3) else self.noun_phrase()
        return f"{self.word('prep')} {where}"

    def clause(self) -> str:
        subject, r = self.subject(), self.rng.random()
        if r < 0.5:
            obj = self.word("person") if self.chance(0.2) else self.noun_phrase()
            words = [subject, self.word("verb"), obj]
        elif r < 0.8:
            words = [subject, self.word("verb_i")] + ([self.word("adv")] if self.chance(0.5) else [])
        else:
            return f"{self.noun_phrase()} {self.word('be')} {self.word('adj')}"
        return " ".join(words + ([self.place()] if self.chance(0.5) else []))

    def sentence(self) -> str:
        r = self.rng.random()
        if r < 0.45:
            s = self.clause() + ("!" if self.chance(0.1) else ".")
        elif r < 0.65:
            s = f"{self.clause()}, {self.word('conj')} {self.clause()}."
        elif r < 0.72:
            s = f"who {self.word('verb')} {self.noun_phrase()}?"
        elif r < 0.78:
            s = f"{'was' if self.chance(0.7) else 'is'} {self.noun_phrase()} {self.word('adj')}?"
        elif r < 0.86:
            s = f'{self.word("person")} said, "{_capitalize(self.clause())}."'
        elif r < 0.90:
            s = f'"It\'s {self.word("adj")}," said {self.word("person")}.'
        elif r < 0.95:
            s = f"in {self.number(1500, 1999)}, {self.clause()}."
        else:
            s = f"{self.clause()} for {self.number(2, 400)} {self.word('unit')}."
        return _capitalize(s)


def _capitalize(s: str) -> str:
    """Upper-case the first letter only (str.capitalize would lower-case the names)."""
    return s[:1].upper() + s[1:]


def english_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` English-like sentences, the same for the same (n, seed) on every machine and Python."""
    maker = _Sentences(seed)
    return [maker.sentence() for _ in range(n)]
