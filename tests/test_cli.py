"""pyinfer-run as a user runs it (a subprocess): one-line ``error:`` and exit 1 for user mistakes,
and a greedy ``--chat`` answer on SmolLM2."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pyinfer_run(*args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pyinfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def assert_user_error(r: subprocess.CompletedProcess, *words: str):
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).random((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_model_file(tmp_path):
    assert_user_error(pyinfer_run(str(tmp_path / "nope.gguf"), "-p", "hi"), "not found")


def test_a_pipe_or_an_unreadable_file_as_the_model(tmp_path, runnable_gguf):
    """A FIFO as the model waited for a writer for ever (pyinfer-inspect, pyinfer-convert); a
    file the user may not read was a PermissionError traceback (checked where setpriv can drop
    root's right to read anything)."""
    import shutil

    fifo = tmp_path / "f.gguf"
    os.mkfifo(fifo)
    for module, args in (("pyinfer.info", ()), ("pyinfer.cli", ("-p", "hi")),
                         ("convert.cli", (str(tmp_path / "o.gguf"), "--dense"))):
        assert_user_error(run_module(module, str(fifo), *args, timeout=60), "pipe or a socket")
    locked = tmp_path / "locked.gguf"
    shutil.copy(runnable_gguf, locked)
    os.chmod(locked, 0)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for module, args in (("pyinfer.info", ()), ("convert.cli", (str(tmp_path / "o.gguf"), "--dense"))):
        r = subprocess.run([setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable,
                            "-m", module, str(locked), *args], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env)
        if os.geteuid() == 0 and "setpriv" in r.stderr:
            pytest.skip(f"setpriv cannot drop capabilities here: {r.stderr.strip()}")
        assert_user_error(r, "cannot read", "permission denied")


def test_context_shift_flags(runnable_gguf):
    """--context-shift: -n 40 in a context of 16 runs its 40 tokens (without it, the text stops
    at the full context and says so); --keep without --context-shift is refused."""
    args = ("-p", "the cat", "-n", "40", "-c", "16", "--temp", "0", "-t", "1", "--ignore-eos")
    r = pyinfer_run(runnable_gguf, *args)
    assert r.returncode == 0 and "the context (16 tokens) is full" in r.stderr, r.stderr
    r = pyinfer_run(runnable_gguf, *args, "--context-shift", "--keep", "1")
    assert r.returncode == 0 and "is full" not in r.stderr, r.stderr
    assert re.search(r"sampling time =.*/\s+40 runs", r.stderr), r.stderr
    assert_user_error(pyinfer_run(runnable_gguf, *args, "--keep", "2"), "--keep goes with")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a model\n")
    assert_user_error(pyinfer_run(str(p), "-p", "hi"), "not a GGUF file")


def test_truncated_gguf(tmp_path, tiny_gguf):
    data = open(tiny_gguf, "rb").read()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[:len(data) // 2])
    assert_user_error(pyinfer_run(str(p), "-p", "hi"), "truncated")


@pytest.mark.parametrize("value", ["two", "100000", "2147483648"])
def test_bad_threads(tmp_path, value):
    assert_user_error(pyinfer_run(str(tmp_path / "m.gguf"), "-p", "hi", "-t", value),
                      "-t/--threads", "must be an integer in 1..512")


# Every numeric flag is range-checked before the model is opened (pyinfer/options.py).
@pytest.mark.parametrize("flag,value,words", [
    ("-c", "9999999999999999999", "must be an integer in 0..16777216"),
    ("-c", "-1", "-c/--ctx-size"),
    ("--temp", "nan", "must be a finite number"),
    ("--temp", "inf", "--temp"),
    ("--top-k", "-2", "--top-k"),
    ("--top-p", "1.5", "must be a finite number >= 0 and <= 1"),
    ("--min-p", "-0.1", "--min-p"),
    ("--repeat-penalty", "nan", "must be a finite number > 0"),
    ("--repeat-penalty", "0", "--repeat-penalty"),
    ("-n", "-3", "-n/--n-predict"),
    ("--vram-budget", "-1", "--vram-budget"),
    ("--vram-budget", "nan", "--vram-budget"),
    ("-ngl", "-1", "-ngl/--n-gpu-layers"),
    ("-s", "-2", "-s/--seed"),
])
def test_bad_numeric_flags(tmp_path, flag, value, words):
    assert_user_error(pyinfer_run(str(tmp_path / "m.gguf"), "-p", "hi", flag, value), flag, words)


def test_bad_flags_in_the_chat_and_perplexity_too(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for module in ("pyinfer.repl", "pyinfer.perplexity"):
        r = subprocess.run([sys.executable, "-m", module, str(tmp_path / "m.gguf"), "-f", "x.txt",
                            "-t", "100000"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert_user_error(r, "-t/--threads", "must be an integer in 1..512")


def test_endless_prompt_file_is_refused_unread(tiny_gguf):
    # /dev/zero never ends: the file is read up to a bound (64 bytes per context token), then refused
    r = pyinfer_run(tiny_gguf, "-f", "/dev/zero", "-c", "4096", timeout=60)
    assert_user_error(r, "prompt file /dev/zero is larger than 262144 bytes")


def test_endless_perplexity_file_is_refused(tiny_gguf):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pyinfer.perplexity", tiny_gguf, "-f", "/dev/zero"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert_user_error(r, "text file /dev/zero is larger than 67108864 bytes")


def test_prompt_file_not_utf8(tmp_path, tiny_gguf):
    p = tmp_path / "latin1.txt"
    p.write_bytes(b"caf\xe9\n")
    assert_user_error(pyinfer_run(tiny_gguf, "-f", str(p)), "not UTF-8")


def test_no_prompt_and_no_model(tmp_path, tiny_gguf):
    assert_user_error(pyinfer_run("-p", "hi"), "no model")
    assert_user_error(pyinfer_run(str(tmp_path / "m.gguf")), "no prompt")


def test_unknown_flag():
    assert_user_error(pyinfer_run("m.gguf", "--no-such-flag"), "--no-such-flag")


def test_unreadable_prompt_file(tmp_path, tiny_gguf):
    assert_user_error(pyinfer_run(tiny_gguf, "-f", str(tmp_path / "missing.txt")), "cannot read prompt file")


@pytest.mark.slow
def test_prompt_longer_than_context(smollm2_q8):
    r = pyinfer_run(smollm2_q8, "-c", "16", "-p", "one two three four five six seven eight nine ten " * 3)
    assert_user_error(r, "longer than the context (16)")


@pytest.mark.slow
def test_reverse_prompt_halts_the_text_and_is_printed(smollm2_q8):
    """-r/--reverse-prompt (llama.cpp's): the greedy text ends at the first reverse prompt to
    appear, printed; of two, the one that completes first; an empty one is refused."""
    args = ("-p", "Here is a list of fruits: apple, banana,", "--temp", "0", "-t", "1",
            "--no-display-prompt")
    r = pyinfer_run(smollm2_q8, *args, "-n", "32")
    assert r.returncode == 0, r.stderr
    text = r.stdout[:-1]
    words = text.split()
    assert len(words) >= 6, text
    early, late = words[1], words[4]
    end = text.find(early) + len(early)
    assert text.find(late) + len(late) > end
    for flags in (("-r", early), ("-r", late, "--reverse-prompt", early)):
        r = pyinfer_run(smollm2_q8, *args, "-n", "32", *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == text[:end] + "\n", (flags, r.stdout, text)
    assert_user_error(pyinfer_run(smollm2_q8, *args, "-r", ""), "-r/--reverse-prompt")
    # --chat: the answer stops before the reverse prompt, which is left out (as in pyinfer-chat)
    chat = ("--chat", "-p", "Count from 1 to 10 separated by commas.", "--temp", "0", "-t", "1",
            "-n", "40")
    answer = pyinfer_run(smollm2_q8, *chat).stdout
    assert "5" in answer, answer
    r = pyinfer_run(smollm2_q8, *chat, "-r", "5")
    assert r.returncode == 0 and r.stdout == answer[:answer.find("5")] + "\n", (r.stdout, answer)


@pytest.mark.slow
def test_greedy_chat_answers_berlin(smollm2_q8):
    r = pyinfer_run(smollm2_q8, "--chat", "-p", "What is the capital of Germany?", "--temp", "0",
                    "-n", "24", "-c", "256", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Berlin" in r.stdout
    assert "What is the capital" not in r.stdout  # --chat does not echo the prompt
    assert "pyinfer_perf:        eval time" in r.stderr  # llama.cpp-style timing summary
    # every token drawn is counted, the end-of-turn one included (llama_perf_sampler_print)
    evals = int(re.search(r"eval time = +[\d.]+ ms / +(\d+) runs", r.stderr).group(1))
    draws = int(re.search(r"sampling time = +[\d.]+ ms / +(\d+) runs", r.stderr).group(1))
    assert draws == evals + 1, r.stderr


@pytest.mark.slow
def test_seed_is_the_requests_seed(smollm2_q8, smollm2_llm):
    """``-s 42`` samples as ``create_completion(seed=42)`` and a server request with
    ``"seed": 42`` do (llama.cpp's -s); it seeded the stream the per-call seeds are drawn from,
    so the same seed gave other text on the command line than through the API."""
    prompt = "My favourite animal is the"
    want = smollm2_llm.create_completion(prompt, max_tokens=12, temperature=1.0, seed=42,
                                         top_k=0, top_p=1.0, min_p=0.0)["choices"][0]["text"]
    r = pyinfer_run(smollm2_q8, "-p", prompt, "-n", "12", "-s", "42", "--temp", "1.0",
                    "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0", "-c", "256", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + want + "\n"


# ---- --version and -m/--model on every command (issue 13) --------------------------------------
COMMANDS = {"pyinfer-run": "pyinfer.cli", "pyinfer-chat": "pyinfer.repl", "pyinfer-serve": "pyinfer.server",
            "pyinfer-perplexity": "pyinfer.perplexity", "pyinfer-convert": "convert.cli",
            "pyinfer-inspect": "pyinfer.info"}


def run_module(module, *args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_version_on_every_command(prog):
    import tomllib

    from pyinfer import __version__

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["version"] == __version__
    assert prog in project["scripts"]  # installed as a console script
    r = run_module(COMMANDS[prog], "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{prog} {__version__} (pyinfer)"


@pytest.fixture(scope="module")
def runnable_gguf(tmp_path_factory) -> str:
    from tests._tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def test_dash_m_is_the_model(runnable_gguf, tmp_path):
    a = pyinfer_run("-m", runnable_gguf, "-p", "the", "-n", "4", "--temp", "0", "-t", "1")
    b = pyinfer_run(runnable_gguf, "-p", "the", "-n", "4", "--temp", "0", "-t", "1")
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.startswith("the")
    # llama.cpp's system_info line: the threads, then this build's SIMD paths as 0 / 1
    from pyinfer.ops import cpu

    info = [ln for ln in a.stderr.splitlines() if ln.startswith("system_info: ")]
    assert len(info) == 1 and info[0].startswith("system_info: n_threads = 1 / "), a.stderr
    assert f"AVX2 = {int(cpu.simd_enabled())}" in info[0]
    assert f"OPENMP = {int(cpu.openmp_enabled())}" in info[0]
    assert_user_error(pyinfer_run("-m", runnable_gguf, str(tmp_path / "other.gguf"), "-p", "x"),
                      "two models given")
    text = tmp_path / "t.txt"
    text.write_text("the then than in an " * 20)
    r = run_module("pyinfer.perplexity", "-m", runnable_gguf, "-f", str(text), "-c", "16", "-t", "1")
    assert r.returncode == 0 and r.stdout.startswith("perplexity: "), r.stderr
    assert_user_error(run_module("pyinfer.perplexity", "-f", str(text)), "no model given")
    assert_user_error(run_module("pyinfer.server", "--port", "1"), "no model given")


def test_gpu_flags_without_a_gpu_say_they_are_ignored(runnable_gguf):
    env = dict(os.environ, PYTHONPATH=ROOT, PYINFER_DEVICE="cpu")  # as on a machine without a GPU
    r = subprocess.run([sys.executable, "-m", "pyinfer.cli", runnable_gguf, "-p", "the", "-n", "2",
                        "--vram-budget", "4", "-ngl", "2", "-t", "1"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    notices = [ln for ln in r.stderr.splitlines() if "ignored" in ln]
    assert len(notices) == 1 and "--vram-budget, -ngl ignored" in notices[0], r.stderr


def test_closed_stdout_ends_quietly(runnable_gguf):
    """``pyinfer-run ... | head -c 20``: the reader is gone before the first byte; the run
    ends with 128 + SIGPIPE and no traceback (was BrokenPipeError's, exit 1)."""
    from pyinfer.errors import EXIT_BROKEN_PIPE

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "pyinfer.cli", runnable_gguf, "-p", "the", "-n",
                            "8", "-t", "1"], stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    finally:
        os.close(w)
    assert p.returncode == EXIT_BROKEN_PIPE and p.stderr == "", p.stderr


def test_a_full_context_is_said(runnable_gguf):
    """Generation that stops because the context is full (the tiny model's 64 tokens) says so
    on stderr; one that stops at -n does not."""
    r = pyinfer_run(runnable_gguf, "-p", "the", "-n", "500", "--ignore-eos", "-t", "1", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "the context (64 tokens) is full; raise -c, or --context-shift]" in r.stderr
    r = pyinfer_run(runnable_gguf, "-p", "the", "-n", "5", "--ignore-eos", "-t", "1", "--temp", "0",
                    "--verbose")
    assert r.returncode == 0 and "is full" not in r.stderr, r.stderr
    # --verbose adds the sparsity to the one-shot summary (the tiny file has predictors)
    assert "pyinfer_perf:     FFN sparsity = " in r.stderr, r.stderr


def test_long_prompt_shows_progress(runnable_gguf):
    """A prompt of more than one batch (engine.PROMPT_BATCH new tokens) reports its evaluation
    on stderr (lines, stderr being a pipe here): the last one at 100%."""
    from pyinfer.engine import PROMPT_BATCH

    words = " ".join(["the"] * (PROMPT_BATCH // 2 + 50))  # two tokens a word here
    r = pyinfer_run(runnable_gguf, "-p", words, "-n", "1", "-c", str(2 * PROMPT_BATCH), "-t", "1",
                    "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("prompt:")]
    assert lines and "100%" in lines[-1], r.stderr


def perplexity_run(*args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pyinfer.perplexity", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env, **kw)


def test_perplexity_context_flags(runnable_gguf, tmp_path):
    """-c 0 takes the model's default context (pyinfer-run's: the tiny model's 64 training
    tokens), a -c past the training context warns as pyinfer-run does, -c 1..7 is refused, and
    a closed stdout ends quietly with status 141 (the tool runs through errors.exit_code_of)."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat"] * 60))
    r = perplexity_run(runnable_gguf, "-f", str(text), "-c", "0", "-t", "1")
    assert r.returncode == 0 and "ctx 64," in r.stdout and "trained" not in r.stderr, r.stderr
    r = perplexity_run(runnable_gguf, "-f", str(text), "-c", "96", "-t", "1")
    assert r.returncode == 0 and "-c 96 is more than the 64 tokens" in r.stderr, r.stderr
    assert_user_error(perplexity_run(runnable_gguf, "-f", str(text), "-c", "3"), "0 or at least 8")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "pyinfer.perplexity", runnable_gguf, "-f", str(text),
                          "-t", "1", "-c", "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=env)
    p.stdout.close()
    err = p.communicate(timeout=120)[1].decode()
    assert p.returncode == 141 and "Traceback" not in err, err


def test_perplexity_in_batches_scores_what_one_forward_does(runnable_gguf, monkeypatch):
    """perplexity() evaluates a chunk in the prompt's batches (engine.prompt_batches), scoring
    each batch's positions as it comes, so that no more than a batch of logits is held: the
    result is the one-forward computation's (every position's log-probability of the next token
    over the chunk's second half, llama.cpp's method), here with batches of 5 over chunks of 24."""
    import math

    from pyinfer import engine as E
    from pyinfer.perplexity import log_softmax_at, perplexity

    eng = E.Engine(runnable_gguf, n_ctx=24, n_threads=1)
    toks = eng.tokenizer.encode(" ".join(["the cat sat on the mat"] * 30), add_bos=False)
    want_nll, want_n = 0.0, 0
    for c in range(2):
        chunk = list(toks[c * 24:(c + 1) * 24])
        if eng.tokenizer.add_bos:
            chunk[0] = eng.tokenizer.bos_id
        eng.reset()
        lp = log_softmax_at(eng.forward(chunk, 0, all_logits=True)[12:23], np.asarray(chunk[13:24]))
        want_nll -= lp.sum()
        want_n += len(lp)
    monkeypatch.setattr(E, "PROMPT_BATCH", 5)
    ppl, n, _ = perplexity(eng, toks, 24, 2, progress=False)
    assert n == want_n == 22
    assert math.isclose(ppl, math.exp(want_nll / want_n), rel_tol=1e-6)


def test_perplexity_prints_the_running_estimate_per_chunk(runnable_gguf, tmp_path):
    """pyinfer-perplexity prints llama.cpp's line of running estimates, [k]ppl of chunks 1..k
    after chunk k: each is the final estimate of a run over the first k chunks alone."""
    import re

    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat", "a dog ran"] * 40))
    final = {}
    for k in (1, 2, 3):
        r = perplexity_run(runnable_gguf, "-f", str(text), "-c", "16", "-t", "1", "--chunks", str(k))
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("[1]"))
        running = re.fullmatch(r"((\[\d+\][0-9.]+,)+)", line) and re.findall(r"\[(\d+)\]([0-9.]+),", line)
        assert [int(i) for i, _ in running] == list(range(1, k + 1)), line
        final[k] = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout).group(1)
        assert running[-1][1] == final[k]
        assert [v for _, v in running] == [final[i] for i in range(1, k + 1)]


def test_chat_template_kwargs_flag(runnable_gguf):
    """--chat-template-kwargs: a JSON object of template variables, for --chat / -i; bad JSON
    and a raw prompt are one-line errors before the model loads."""
    r = pyinfer_run(runnable_gguf, "-p", "the", "--chat", "-n", "2", "-t", "1",
                    "--chat-template-kwargs", '{"enable_thinking": false}')
    assert r.returncode == 0, r.stderr
    assert_user_error(pyinfer_run(runnable_gguf, "-p", "the", "--chat",
                                  "--chat-template-kwargs", "{oops"), "--chat-template-kwargs", "JSON")
    assert_user_error(pyinfer_run(runnable_gguf, "-p", "the", "--chat-template-kwargs", "{}"),
                      "--chat-template-kwargs needs --chat or -i")


def test_flags_that_would_do_nothing_are_refused(runnable_gguf):
    assert_user_error(pyinfer_run(runnable_gguf, "-p", "the", "--system", "be brief"),
                      "--system needs --chat or -i")
    for flag in ("--chat", "--ignore-eos", "--no-display-prompt"):
        assert_user_error(pyinfer_run(runnable_gguf, "-i", flag), flag, "not -i")
    assert_user_error(pyinfer_run(runnable_gguf, "-i", "--chat", "--ignore-eos"),
                      "--chat, --ignore-eos go with a one-shot prompt")


def test_convert_takes_the_source_as_dash_m(tmp_path):
    r = run_module("convert.cli", "-m", str(tmp_path / "nope"), str(tmp_path / "out.gguf"))
    assert_user_error(r, "nope does not exist")


def test_missing_kernels_say_how_to_build_them(runnable_gguf):
    code = ("import sys; sys.modules['pyinfer.ops._kernels'] = None  # as after `make clean`\n"
            "from pyinfer.cli import main; sys.exit(main([sys.argv[1], '-p', 'the', '-n', '1']))")
    r = subprocess.run([sys.executable, "-c", code, runnable_gguf], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert_user_error(r, "compiled kernels", "make install")
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['pyinfer.ops._kernels'] = None\n"
                        "try:\n import pyinfer.ops.cpu\nexcept ImportError as e: print('ImportError')"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.stdout.strip() == "ImportError"  # still an ImportError for code that guards the import


def test_package_imports_beside_a_folder_named_pyinfer(tmp_path):
    """The README's example in a script next to a clone named `pyinfer` (no PYTHONPATH): the installed
    package wins over the folder (Makefile: editable_mode=compat)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("pyinfer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pyinfer is not installed in this environment (make install-test installs it)")
    (tmp_path / "pyinfer").mkdir()
    (tmp_path / "pyinfer" / "README.md").write_text("a clone\n")
    (tmp_path / "example.py").write_text("import pyinfer\nfrom pyinfer import LLM\nprint(LLM.__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "LLM", r.stderr


def test_prompt_bar_after_an_interrupted_prompt(tmp_path):
    """Ctrl-C inside a long prompt (the chat REPL goes on) leaves its progress bar open; the
    next long prompt closes it and counts from 0 against its own total, and nothing stays open
    once that prompt is evaluated."""
    import io

    from pyinfer import LLM
    from pyinfer.cli import show_prompt_progress
    from pyinfer.engine import PROMPT_BATCH
    from tests._tiny_gguf import write_tiny_gguf

    eng = LLM(write_tiny_gguf(str(tmp_path / "tiny.gguf")), n_ctx=4 * PROMPT_BATCH, n_threads=1,
              device="cpu").engine
    show_prompt_progress(eng, file=io.StringIO())
    bars = eng.prompt_progress.__closure__[0].cell_contents
    forward, calls = eng.forward, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C in the second batch
            raise KeyboardInterrupt
        return forward(*a, **kw)

    eng.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        eng.eval_prompt([5 + i % 200 for i in range(3 * PROMPT_BATCH + 10)])
    eng.reset()
    assert len(bars) == 1 and bars[0].total == 3 * PROMPT_BATCH + 10  # left open
    seen = []
    eng.prompt_progress = (lambda report: lambda done, total: (
        report(done, total), seen.append((bars[0].n, bars[0].total) if bars else None)))(
        eng.prompt_progress)
    eng.eval_prompt([5 + i % 200 for i in range(PROMPT_BATCH + 40)])
    assert seen[0] == (0, PROMPT_BATCH + 40) and not bars


# ---- llama.cpp's meaning of -f, escapes, -t 0, --temp < 0, -n -2 and control-token -r ------------
@pytest.mark.parametrize("raw, out", [
    ("a\\nb", "a\nb"), ("tab\\there", "tab\there"), ("\\r\\'\\\"", "\r'\""),
    ("back\\\\n", "back\\n"),  # an escaped backslash, then a plain n
    ("\\x41\\x62", "Ab"), ("\\xe2\\x82\\xac", "\u20ac"), ("\\x4", "\\x4"), ("\\x4g", "\\x4g"),
    ("\\q", "\\q"), ("end\\", "end\\"), ("\\xff", "\ufffd"), ("plain", "plain"),
])
def test_escapes_as_llama_cpp_processes_them(raw, out):
    """common.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xNN; any other
    backslash, a short \\x and a last lone backslash stay as written."""
    from pyinfer.options import process_escapes

    assert process_escapes(raw) == out


def _prompt_tokens(stderr: str) -> int:
    return int(re.search(r"prompt eval time =.*/\s+(\d+) tokens", stderr).group(1))


def test_prompt_file_newline_and_escapes(runnable_gguf, tmp_path):
    """-f drops one trailing newline (llama.cpp's -f); -p's escapes are processed unless
    --no-escape (llama.cpp's default), so the echoed prompt holds a real newline."""
    f = tmp_path / "p.txt"
    f.write_text("the cat\n")
    common = ("-n", "1", "--temp", "0", "-t", "1")
    by_file = pyinfer_run(runnable_gguf, "-f", str(f), *common)
    by_flag = pyinfer_run(runnable_gguf, "-p", "the cat", *common)
    assert by_file.returncode == by_flag.returncode == 0, by_file.stderr
    assert _prompt_tokens(by_file.stderr) == _prompt_tokens(by_flag.stderr)
    r = pyinfer_run(runnable_gguf, "-p", "the\\ncat", *common)
    assert r.returncode == 0 and r.stdout.startswith("the\ncat"), r.stdout
    r = pyinfer_run(runnable_gguf, "-p", "the\\ncat", "--no-escape", *common)
    assert r.returncode == 0 and r.stdout.startswith("the\\ncat"), r.stdout


def test_llama_cpp_values_that_mean_a_default(runnable_gguf):
    """-t 0 / -t -1 pick the threads, --temp -1 is greedy (llama.cpp clamps it), -n -2 runs to a
    full context and never shifts it."""
    base = ("-p", "the cat", "-n", "8", "--ignore-eos")
    greedy = pyinfer_run(runnable_gguf, *base, "--temp", "0", "-t", "1")
    for extra in (("--temp", "-1", "-t", "0", "-s", "1"), ("--temp", "-0.5", "-t", "-1", "-s", "2")):
        r = pyinfer_run(runnable_gguf, *base, *extra)
        assert r.returncode == 0 and r.stdout == greedy.stdout, (extra, r.stderr)
    r = pyinfer_run(runnable_gguf, "-p", "the cat", "-n", "-2", "-c", "16", "--ignore-eos", "--temp", "0",
                    "-t", "1", "--context-shift")
    assert r.returncode == 0 and "the context (16 tokens) is full" in r.stderr, r.stderr


def test_context_shift_flags_are_refused_in_the_chat(runnable_gguf):
    """-i ignored --context-shift and --keep (the chat has no context shift)."""
    for flags in (("--context-shift",), ("--keep", "3"), ("--context-shift", "--keep", "1")):
        assert_user_error(pyinfer_run(runnable_gguf, "-i", *flags), "not -i")


def test_abbreviated_flags_are_refused(runnable_gguf):
    """argparse took --chat-template (llama.cpp's flag, not pyinfer's) as --chat-template-kwargs."""
    r = pyinfer_run(runnable_gguf, "-p", "x", "--chat", "--chat-template", "chatml")
    assert_user_error(r, "unrecognized arguments: --chat-template")
    assert_user_error(pyinfer_run(runnable_gguf, "-p", "x", "--temperature", "0"), "unrecognized")


@pytest.mark.slow
def test_a_control_token_reverse_prompt_halts_at_that_token(smollm2_q8, smollm2_llm):
    """llama.cpp's main halts at a reverse prompt that is one control token by the sampled token
    (its antiprompt_token); the text never shows such a token, so it ran to -n."""
    prompt = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
    start = smollm2_llm.tokenize("<|im_start|>", add_bos=False)
    assert len(start) == 1
    smollm2_llm.reset()
    drawn = list(smollm2_llm.generate(smollm2_llm.tokenize(prompt), max_tokens=30, temperature=0,
                                      ignore_eos=True))
    assert start[0] in drawn, drawn  # (after a turn's end the greedy model opens the next)
    k = drawn.index(start[0])
    r = pyinfer_run(smollm2_q8, "-p", prompt, "--ignore-eos", "-r", "<|im_start|>", "-n", "30",
                    "--temp", "0", "-t", "1", "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout == smollm2_llm.detokenize(drawn[:k], skip_special=True) + "\n"
    assert re.search(rf"sampling time =.*/\s+{k + 1} runs", r.stderr), r.stderr
