"""DRY ("don't repeat yourself") against a NumPy reference written from its published definition.

The definition (p-e-w, text-generation-webui PR #5677; llama.cpp's --dry-* options): a token t
that would extend a repetition gets n = the longest n such that the last n tokens of the history,
followed by t, already occurred in the history; matching never crosses a sequence breaker and a
breaker is never penalised. When n >= allowed_length its logit loses
``multiplier * base ** (n - allowed_length)``. The reference below searches every n-gram
occurrence directly (cubic time); pyinfer.sampler uses a Z-function (linear time).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyinfer.sampler import SamplingParams, apply_dry, distribution, dry_match_lengths


def reference_lengths(history, breakers, n_vocab):
    """(n_vocab,) int: DRY's match length of every token, by searching all earlier occurrences."""
    h = np.asarray(history, dtype=np.int64)
    L = h.shape[0]
    out = np.zeros(n_vocab, dtype=np.int64)
    for t in range(n_vocab):
        if t in breakers:
            continue
        for n in range(1, L):
            suffix = h[L - n:]
            if any(int(x) in breakers for x in suffix):
                break
            # an earlier occurrence of suffix + [t]: suffix at e-n..e-1 and t at e, with e <= L-1
            if any(h[e] == t and np.array_equal(h[e - n:e], suffix) for e in range(n, L)):
                out[t] = n
    return out


def reference_dry(logits, history, params, breakers):
    z = np.array(logits, dtype=np.float32)
    if params.dry_penalty_last_n > 0:
        history = history[-params.dry_penalty_last_n:]
    if params.dry_multiplier == 0 or params.dry_penalty_last_n == 0:
        return z
    n = reference_lengths(history, breakers, z.shape[0])
    hit = n >= params.dry_allowed_length
    z[hit] -= (params.dry_multiplier * params.dry_base ** (n[hit] - params.dry_allowed_length)).astype(np.float32)
    return z


def test_a_repeated_phrase_is_penalised_by_its_length():
    a, b, c, d, x = range(5)
    hist = [a, b, c, d, x, a, b, c]  # "a b c" again: d would make it "a b c d" a second time
    assert dry_match_lengths(hist) == {d: 3}  # only d ever followed the last token c
    p = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    z = apply_dry(np.zeros(8, np.float32), hist, p)
    np.testing.assert_allclose(z, [0, 0, 0, -0.8 * 1.75, 0, 0, 0, 0], rtol=1e-6)
    # greedy decoding would continue the loop; with DRY it does not
    logits = np.array([0, 0, 0, 2.0, 0, 1.5, 0, 0], np.float32)
    assert distribution(logits, SamplingParams(temperature=0))[0][0] == d
    assert distribution(logits, SamplingParams(temperature=0, dry_multiplier=0.8), history=hist)[0][0] == 5


def test_breakers_stop_the_match():
    a, b, c, d, brk = range(5)
    hist = [a, b, brk, c, d, a, b, brk, c]
    assert dry_match_lengths(hist, frozenset({brk})) == {d: 1}  # not 4: the match stops at brk
    assert dry_match_lengths(hist + [brk], frozenset({brk})) == {}  # last token is a breaker
    assert dry_match_lengths([a, brk, a], frozenset({brk})) == {}  # a breaker is never penalised


def test_off_by_default_and_window():
    hist = [1, 2, 3, 1, 2, 3, 1, 2]
    z0 = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(apply_dry(z0.copy(), hist, SamplingParams()), z0)
    np.testing.assert_array_equal(
        apply_dry(z0.copy(), hist, SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=0)), z0)
    # a window of 3 tokens "3 1 2" holds no earlier occurrence of anything
    np.testing.assert_array_equal(
        apply_dry(z0.copy(), hist, SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=3)), z0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_reference_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    n_vocab = int(rng.integers(2, 6))
    L = int(rng.integers(2, 48))
    hist = [int(t) for t in rng.integers(0, n_vocab, L)]
    breakers = frozenset(int(t) for t in rng.choice(n_vocab, int(rng.integers(0, 2)), replace=False))
    params = SamplingParams(dry_multiplier=float(rng.uniform(0.1, 2)), dry_base=float(rng.uniform(1, 3)),
                            dry_allowed_length=int(rng.integers(1, 5)),
                            dry_penalty_last_n=int(rng.choice([-1, 0, 5, 20])))
    logits = rng.standard_normal(n_vocab).astype(np.float32) * 3
    want = reference_dry(logits, hist, params, breakers)
    got = apply_dry(logits.copy(), hist, params, breakers)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    full = {t: int(n) for t, n in enumerate(reference_lengths(hist, breakers, n_vocab)) if n}
    assert dry_match_lengths(hist, breakers) == full


def test_a_long_loop_stays_finite_and_fast():
    import time

    hist = [7] * 4000  # the worst case of a naive search: every position matches
    p = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    t0 = time.perf_counter()
    z = apply_dry(np.zeros(10, np.float32), hist, p)
    assert time.perf_counter() - t0 < 1.0
    assert np.isfinite(z).all() and z[7] < -1e30 and (np.delete(z, 7) == 0).all()


def test_bad_values_are_refused():
    for kw in (dict(dry_multiplier=-1), dict(dry_base=0.5), dict(dry_allowed_length=0),
               dict(dry_penalty_last_n=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# ---------------------------------------------------------------- the real model
def _repeated_ngrams(ids, n=6) -> float:
    """Fraction of the n-grams of ``ids`` that occurred before in it (0: no repetition)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / max(1, len(grams))


@pytest.mark.slow
def test_chat_default_breaks_smollm2_loops():
    """SmolLM2-135M's greedy answers loop on some prompts ("A gentle lover, a gentle lover," over
    and over: 94% of the 6-grams of 200 tokens repeat; the planet list restarts as
    "Pseudo-Pseudo-System": 64%); the chat's DRY default (0.8) breaks those loops. Which prompts
    loop hangs on rounding (the greedy path changes with the kernels), so three prompts are run: at
    least one must loop without DRY; with it every looping answer must repeat less, at least one
    must stop looping (under 30%), and the mean repetition must halve. A list that restarts line by
    line stays partly repeated by design: "\\n" is one of DRY's sequence breakers (llama.cpp's
    default), so no penalised match spans a line (measured with session 7's kernels: the moon
    70% -> 21%, the sea 82% -> 13%, the planets 64% -> 50%, its header now varied:
    "Pseudo-Planets", "Pseudo-Planetary"). The llama.cpp file runs as it is."""
    from pyinfer import LLM
    from pyinfer.cli import CHAT_DRY_MULTIPLIER
    from tests._paths import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not found (see tests/_paths.py)")
    llm = LLM(path, n_ctx=512, n_threads=2)
    plain, dry = [], []
    for prompt in ("Write a poem about the moon.", "List the planets of the solar system.",
                   "Write a poem about the sea."):
        ids = llm.chat_tokens([{"role": "user", "content": prompt}])
        plain.append(_repeated_ngrams(list(llm.generate(ids, max_tokens=200, temperature=0))))
        dry.append(_repeated_ngrams(list(llm.generate(ids, max_tokens=200, temperature=0,
                                                      dry_multiplier=CHAT_DRY_MULTIPLIER))))
    assert max(plain) > 0.6, plain
    assert all(d < p - 0.1 for p, d in zip(plain, dry) if p > 0.6), (plain, dry)
    assert min(d for p, d in zip(plain, dry) if p > 0.6) < 0.3, (plain, dry)
    assert np.mean(dry) < 0.5 * np.mean(plain), (plain, dry)


# ---------------------------------------------------------------- through the engine and server
def _repeated_pairs(ids, breakers, start=0):
    """Adjacent pairs (a, b) of ``ids`` that end at index >= ``start`` + 1 and occurred earlier,
    with neither a nor b a breaker."""
    out = []
    for j in range(max(start, 1), len(ids)):
        a, b = ids[j - 1], ids[j]
        if a in breakers or b in breakers:
            continue
        if any(ids[i - 1] == a and ids[i] == b for i in range(1, j)):
            out.append((a, b))
    return out


def test_engine_passes_the_history_and_breakers(tmp_path):
    """With allowed length 1 and a huge multiplier, greedy decoding never makes a pair of tokens
    that occurred before (prompt included) unless a breaker stands in it; without DRY the tiny
    model does."""
    from pyinfer import LLM
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "tiny.gguf")), n_ctx=64, n_threads=1)
    prompt = llm.tokenize("the cat and the dog and the")
    breakers = llm.engine.dry_breakers()
    assert llm.tokenize("\n")[-1] in breakers and llm.tokenize("a")[-1] not in breakers
    plain = list(llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True))
    dry = list(llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True,
                            dry_multiplier=1e4, dry_allowed_length=1))
    assert _repeated_pairs(prompt + plain, breakers, len(prompt))  # the test can fail
    assert _repeated_pairs(prompt + dry, breakers, len(prompt)) == []


def test_server_fields():
    from pyinfer.server import BadRequest, sampling_options

    opts = sampling_options({"dry_multiplier": 0.8, "dry_penalty_last_n": 64}, 16)
    assert (opts["dry_multiplier"], opts["dry_base"], opts["dry_allowed_length"],
            opts["dry_penalty_last_n"]) == (0.8, 1.75, 2, 64)
    assert sampling_options({}, 16)["dry_multiplier"] == 0.0  # llama.cpp's server: off
    with pytest.raises(BadRequest, match="dry_base"):
        sampling_options({"dry_base": 0.5}, 16)


def test_a_tiny_multiplier_is_a_tiny_penalty():
    """3e38 / 1e-300 overflowed to inf and int(inf) raised OverflowError (a traceback from
    pyinfer-run --dry-multiplier 1e-300): the cap is now computed in logs."""
    hist = [1, 2, 1, 2, 1, 2, 1]
    for mult in (1e-300, 5e-324):
        z = apply_dry(np.zeros(8, np.float32), hist, SamplingParams(dry_multiplier=mult))
        assert np.all(np.isfinite(z)) and z[2] <= 0 and z[2] > -1e-30
    # a long repeat with a large base: base ** e itself overflowed a float; capped at 3e38
    long = [1, 2] * 100 + [1]
    for mult, base in ((1e-300, 1000.0), (1e6, 1e6)):
        z = apply_dry(np.zeros(8, np.float32), long, SamplingParams(dry_multiplier=mult, dry_base=base))
        assert np.isfinite(z[2]) and z[2] == np.float32(-3e38)
    # and the formula where nothing overflows: multiplier * base ** (n - allowed)
    z = apply_dry(np.zeros(8, np.float32), hist, SamplingParams(dry_multiplier=0.5, dry_base=2.0,
                                                                dry_allowed_length=2))
    n = dry_match_lengths(hist)[2]
    assert z[2] == pytest.approx(-0.5 * 2.0 ** (n - 2), rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_match_lengths_equal_the_reference(seed):
    """cpu.dry_match (C) against dry_match_lengths (the Python reference, tested above against
    hand-worked cases): the same lengths for every token, on histories with repeats, breakers
    and a breaker at the end."""
    from pyinfer.sampler import _match_lengths

    rng = np.random.default_rng(seed)
    n_vocab = 50
    for L in (0, 1, 2, 5, 40, 600):
        phrase = list(rng.integers(0, 12, 7))
        h = []
        while len(h) < L:  # repeated phrases with noise: long matches
            h += phrase if rng.random() < 0.6 else list(rng.integers(0, n_vocab, 3))
        h = h[:L]
        for breakers in (frozenset(), frozenset({3, 5}), frozenset({int(h[-1])}) if h else frozenset()):
            want = dry_match_lengths(h, breakers)
            got = dict(_match_lengths(h, breakers, n_vocab))
            assert got == want, (L, breakers)
            again = dict(_match_lengths(h, breakers, n_vocab))  # (its scratch is left all zero)
            assert again == want


def test_breakers_found_in_the_tokens_spelling_are_those_of_their_bytes(tmp_path):
    """Tokenizer.ids_holding searches a byte-level vocabulary's own spelling (~4x faster than
    turning every token into bytes, the first DRY step's cost in the chat): the same ids."""
    from pyinfer import LLM
    from pyinfer.engine import DRY_BREAKERS
    from tests._tiny_gguf import write_tiny_gguf

    tk = LLM(write_tiny_gguf(str(tmp_path / "t.gguf")), n_ctx=32, n_threads=1, device="cpu").tokenizer
    assert tk._byte_level
    for pieces in (DRY_BREAKERS, (b"th", b"\xc3"), (b"<|im",)):
        want = {i for i in range(tk.n_vocab) if any(p in tk.token_to_bytes(i) for p in pieces)}
        assert tk.ids_holding(pieces) == want and want, pieces
