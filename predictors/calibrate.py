"""Calibration text for the offline stage: the user's plain-text files, or text the model writes.

PowerInfer (arXiv 2312.12456, §5) profiles activations on a general corpus. No data set is needed
here: by default the model generates its own calibration text from a fixed list of diverse seed
prompts (rendered as user turns when the file has a chat template), by temperature sampling with
pyinfer's engine, seeded, so the same model and seed give the same tokens on the same machine.
Held-out evaluation text must never be passed as calibration text.
"""
from __future__ import annotations

import os

import numpy as np

from pyinfer.errors import PyinferError

#: Seed prompts: varied registers (prose, code, maths, dialogue, lists, instructions) so the
#: profile covers more than one kind of text. Changing this list changes calibration: bump
#: SELF_SOURCE when you do.
SEED_PROMPTS = (
    "Explain how photosynthesis works, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What were the main causes of the First World War?",
    "Give me a recipe for a simple vegetable soup.",
    "Solve: a train travels 180 km in 2.5 hours. What is its average speed? Show your work.",
    "Describe the water cycle to a ten-year-old.",
    "List ten tips for learning a new language.",
    "Write a polite email asking a colleague to review a report by Friday.",
    "What is the difference between a virus and a bacterium?",
    "Summarise the plot of Romeo and Juliet.",
    "How does a computer store numbers in binary? Give examples.",
    "Write a poem about autumn rain in a city.",
    "Compare renewable and fossil energy sources: pros and cons.",
    "Explain what a black hole is and how astronomers detect them.",
    "Write a dialogue between a customer and a shopkeeper about a broken umbrella.",
)
SELF_SOURCE = "self-generated:v1"
MAX_SAMPLE_TOKENS = 256  # generated tokens per seed prompt before moving to the next one


#: Most bytes read from one --calib file (a calibration takes thousands of tokens, tens of KiB
#: of text; /dev/zero or a FIFO never ends).
MAX_CALIB_FILE_BYTES = 64 << 20


def read_calib_files(paths: list[str]) -> str:
    """The text of the ``--calib`` files, joined by blank lines.

    Raises PyinferError for a missing or unreadable file, a FIFO or socket (opening one waited
    for a writer for ever), one larger than MAX_CALIB_FILE_BYTES, an empty one, or one that is
    not text (contains NUL bytes or is not valid UTF-8).
    """
    import stat

    parts = []
    for p in paths:
        try:  # (a FIFO: opening it waits for a writer for ever)
            mode = os.stat(p).st_mode
        except OSError:
            mode = 0  # (missing: the open below says so)
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise PyinferError(f"calibration file {p} is a pipe or a socket, not a text file")
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_CALIB_FILE_BYTES + 1)
        except OSError as e:
            raise PyinferError(f"cannot read calibration file {p}: {e.strerror or e}") from None
        if len(raw) > MAX_CALIB_FILE_BYTES:
            raise PyinferError(f"calibration file {p} is larger than {MAX_CALIB_FILE_BYTES >> 20} "
                               "MiB; the calibration reads only --calib-tokens tokens of it: "
                               "give an excerpt")
        if b"\0" in raw:
            raise PyinferError(f"calibration file {p} is binary (contains NUL bytes), not text")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PyinferError(f"calibration file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not text.strip():
            raise PyinferError(f"calibration file {p} is empty")
        parts.append(text)
    return "\n\n".join(parts)


def file_tokens(engine, text: str, n_tokens: int, source: str) -> list[list[int]]:
    """The first ``n_tokens`` tokens of ``text`` as one sequence (profile.py cuts it into chunks).

    Only a prefix of the text is tokenized, grown until it holds ``n_tokens`` and a margin
    (tokenization is local, so the first ``n_tokens`` are those of the whole text).
    Raises PyinferError when the text is shorter than ``n_tokens`` tokens."""
    n_chars = max(4096, 8 * n_tokens)
    while True:
        toks = engine.tokenizer.encode(text[:n_chars], add_bos=False)
        if n_chars >= len(text) or len(toks) >= n_tokens + 64:
            break
        n_chars *= 4
    if len(toks) < n_tokens:
        raise PyinferError(f"calibration text {source} is too short: {len(toks)} tokens, fewer than "
                           f"--calib-tokens {n_tokens}; give more text or lower --calib-tokens")
    return [toks[:n_tokens]]


def _prompt_tokens(engine, prompt: str) -> list[int]:
    tok = engine.tokenizer
    if tok.chat_template:
        from pyinfer.chat import render_chat

        bos = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else ""
        text = render_chat(tok.chat_template, [{"role": "user", "content": prompt}],
                           bos_token=bos, eos_token=eos)
        # the template writes BOS itself where the model wants one
        return tok.encode(text, add_bos=False)
    return tok.encode(prompt, add_bos=tok.add_bos)


def generate_tokens(engine, n_tokens: int, seed: int, max_len: int, progress: bool | None = None,
                    temperature: float = 0.8) -> list[list[int]]:
    """Sequences (prompt + sampled continuation) the model writes from ``SEED_PROMPTS``, in an
    order shuffled by ``seed``, cycling with fresh sample seeds until ``n_tokens`` tokens in all.

    engine: a dense ``pyinfer.engine.Engine``; max_len: longest sequence (<= engine.n_ctx).
    Each sample draws from ``np.random.default_rng([seed, i])`` through the engine's sampler
    (temperature ``temperature``, llama.cpp's other defaults), so runs are reproducible.
    """
    from pyinfer.progress import progress_bar
    from pyinfer.sampler import SamplingParams

    params = SamplingParams(temperature=temperature)
    order = np.random.default_rng(seed).permutation(len(SEED_PROMPTS))
    seqs: list[list[int]] = []
    total = 0
    bar = progress_bar(total=n_tokens, desc="calibration text", unit="tok", enabled=progress)
    i = 0
    try:
        while total < n_tokens:
            prompt = _prompt_tokens(engine, SEED_PROMPTS[order[i % len(order)]])[: max_len - 1]
            room = min(MAX_SAMPLE_TOKENS, max_len - len(prompt), n_tokens - total - len(prompt))
            seq = list(prompt)
            if room > 0:
                engine.reset()
                seq += list(engine.generate(
                    prompt, params, max_tokens=room,
                    seed=int(np.random.default_rng([seed, i]).integers(2**31))))
            seq = seq[: n_tokens - total]
            seqs.append(seq)
            total += len(seq)
            bar.update(len(seq))
            i += 1
    finally:  # an interrupted bar is not drawn again after the error line
        bar.close()
    engine.reset()
    return seqs


def calibration_tokens(engine, calib_files: list[str] | None, n_tokens: int, seed: int, max_len: int,
                       progress: bool | None = None, text: str | None = None) -> tuple[list[list[int]], str]:
    """(token sequences, source description) for the profiler: ``n_tokens`` tokens in all.

    With ``calib_files`` (their ``text`` already read by :func:`read_calib_files`, or read here) the
    source is ``files:<basenames>``; without, the model's own text (``SELF_SOURCE``)."""
    if calib_files:
        if text is None:
            text = read_calib_files(calib_files)
        source = "files:" + ",".join(os.path.basename(p) for p in calib_files)
        return file_tokens(engine, text, n_tokens, source), source
    return generate_tokens(engine, n_tokens, seed, max_len, progress), SELF_SOURCE
