"""pyinfer-perplexity --kl-divergence-base / --kl-divergence (pyinfer/kld.py): the figures against
PyTorch's KL divergence of the two engines' own logits, a model against itself, and the errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._corpus import english_sentences
from tests.test_cli import ROOT, assert_user_error, perplexity_run


def _figure(out: str, label: str) -> float:
    m = re.search(re.escape(label) + r"\s*:\s*(-?[0-9.]+)", out)
    assert m, (label, out)
    return float(m.group(1))


@pytest.fixture(scope="module")
def runnable_gguf(tmp_path_factory) -> str:
    from tests._tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kld") / "text.txt"
    path.write_text(" ".join(english_sentences(400, seed=3)))
    return str(path)


@pytest.fixture(scope="module")
def smollm2_q4_0(tmp_path_factory):
    """SmolLM2 converted to q4_0 (dense): another model of the same vocabulary as smollm2_q8."""
    from convert.cli import convert
    from tests._paths import smollm2_gguf_path

    src = smollm2_gguf_path()
    if src is None:
        pytest.skip("SmolLM2 GGUF not found")
    out = str(tmp_path_factory.mktemp("kld") / "smollm2-q4_0.gguf")
    convert(src, out, "q4_0", progress=False)
    return out


@pytest.mark.slow
def test_kl_divergence_of_q4_0_from_q8_0_is_torchs(smollm2_q8, smollm2_q4_0, text_file, tmp_path):
    """SmolLM2 at q4_0 against its q8_0 file as the base (llama.cpp's use: a quantization's
    cost), 2 chunks of 64: mean and largest KLD, perplexity ratio, Δp and same-top-token rate
    equal the figures computed here from the two engines' logits with torch.nn.functional.kl_div
    (the base's log-probabilities are stored in 0.0005-nat steps: agreement to 1e-4)."""
    torch = pytest.importorskip("torch")
    from pyinfer.engine import Engine
    from pyinfer.perplexity import chunk_tokens, text_tokens

    base = str(tmp_path / "base.kld")
    r = perplexity_run(smollm2_q8, "-f", text_file, "-c", "64", "--chunks", "2", "-t", "1",
                       "--kl-divergence-base", base)
    assert r.returncode == 0 and os.path.isfile(base), r.stderr
    r = perplexity_run(smollm2_q4_0, "-t", "1", "--kl-divergence-base", base, "--kl-divergence")
    assert r.returncode == 0, r.stderr
    assert "over 62 tokens" in r.stdout, r.stdout

    klds, nll_q, nll_p, dps, same = [], [], [], [], []
    q8 = Engine(smollm2_q8, n_ctx=64, n_threads=1)
    q4 = Engine(smollm2_q4_0, n_ctx=64, n_threads=1)
    with open(text_file) as f:
        chunks = chunk_tokens(q8, text_tokens(q8, f.read()), 64, 2)
    for chunk in chunks:
        logits = []
        for eng in (q8, q4):
            eng.reset()
            logits.append(torch.log_softmax(torch.from_numpy(
                eng.forward([int(t) for t in chunk], 0, all_logits=True)[32:63]).double(), -1))
        lp, lq = logits
        t = torch.from_numpy(chunk[33:64])
        klds.append(torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1))
        nll_p.append(-lp[torch.arange(31), t])
        nll_q.append(-lq[torch.arange(31), t])
        dps.append(lq[torch.arange(31), t].exp() - lp[torch.arange(31), t].exp())
        same.append(lq.argmax(-1) == lp.argmax(-1))
    kld = torch.cat(klds)
    assert kld.mean() > 1e-3  # q4_0 is another function: the test can tell
    assert _figure(r.stdout, "Mean    KLD") == pytest.approx(float(kld.mean()), abs=1e-4)
    assert _figure(r.stdout, "Maximum KLD") == pytest.approx(float(kld.max()), abs=2e-4)
    ratio = float((torch.cat(nll_q).mean() - torch.cat(nll_p).mean()).exp())
    assert _figure(r.stdout, "Mean PPL(Q)/PPL(base)") == pytest.approx(ratio, abs=2e-6)
    assert _figure(r.stdout, "Mean PPL(base)") == pytest.approx(
        float(torch.cat(nll_p).mean().exp()), rel=2e-6)
    assert _figure(r.stdout, "Mean    Δp") == pytest.approx(100 * float(torch.cat(dps).mean()),
                                                          abs=1e-3)
    assert _figure(r.stdout, "Same top p") == pytest.approx(
        100 * float(torch.cat(same).double().mean()), abs=1e-3)


def test_a_model_against_itself(runnable_gguf, tmp_path):
    """The same file and flags as its own base: KL divergence 0, ratio 1, same top token always;
    the base holds the tokens, so the comparison needs no -f."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat", "a dog ran"] * 40))
    base = str(tmp_path / "b.kld")
    r = perplexity_run(runnable_gguf, "-f", str(text), "-c", "16", "--chunks", "3", "-t", "1",
                       "--kl-divergence-base", base)
    assert r.returncode == 0 and "saved the log-probabilities of 21 positions" in r.stdout, r.stderr
    r = perplexity_run(runnable_gguf, "-t", "1", "--kl-divergence-base", base, "--kl-divergence")
    assert r.returncode == 0, r.stderr
    assert _figure(r.stdout, "Mean    KLD") < 1e-6
    assert _figure(r.stdout, "Mean PPL(Q)/PPL(base)") == pytest.approx(1.0, abs=1e-6)
    assert _figure(r.stdout, "Same top p") == 100.0
    assert "over 21 tokens" in r.stdout
    r = perplexity_run(runnable_gguf, "-t", "1", "--kl-divergence-base", base, "--kl-divergence",
                       "--chunks", "1")
    assert r.returncode == 0 and "over 7 tokens" in r.stdout, r.stderr


@pytest.mark.slow
def test_kl_divergence_errors(runnable_gguf, smollm2_q8, tmp_path):
    """Each mistake is one line and status 1; no base file is left by a run that fails."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat"] * 40))
    base = str(tmp_path / "b.kld")
    assert_user_error(perplexity_run(runnable_gguf, "--kl-divergence"), "--kl-divergence-base FILE")
    assert_user_error(perplexity_run(runnable_gguf), "no text given")
    assert_user_error(perplexity_run(runnable_gguf, "-f", str(text), "--kl-divergence-base",
                                     str(tmp_path / "no" / "b.kld")), "does not exist")
    assert_user_error(perplexity_run(runnable_gguf, "-f", str(text), "--kl-divergence-base",
                                     str(tmp_path)), "not a regular file")
    assert_user_error(perplexity_run(runnable_gguf, "--kl-divergence-base", str(text),
                                     "--kl-divergence"), "not a pyinfer KL-divergence base file")
    assert_user_error(perplexity_run(runnable_gguf, "--kl-divergence-base", str(tmp_path / "none"),
                                     "--kl-divergence"), "cannot read")
    r = perplexity_run(runnable_gguf, "-f", str(text), "-c", "16", "--chunks", "2", "-t", "1",
                       "--kl-divergence-base", base)
    assert r.returncode == 0, r.stderr
    assert_user_error(perplexity_run(runnable_gguf, "-f", str(text), "--kl-divergence-base", base,
                                     "--kl-divergence"), "-f is not used")
    assert_user_error(perplexity_run(runnable_gguf, "-c", "32", "--kl-divergence-base", base,
                                     "--kl-divergence"), "chunks of 16 tokens")
    assert_user_error(perplexity_run(smollm2_q8, "--kl-divergence-base", base, "--kl-divergence"),
                      "vocabulary")
    # the base file never replaces an input (the model, the text)
    for victim in (runnable_gguf, str(text)):
        before = open(victim, "rb").read()
        assert_user_error(perplexity_run(runnable_gguf, "-f", str(text), "-c", "16",
                                         "--kl-divergence-base", victim), "would overwrite")
        assert open(victim, "rb").read() == before
    # a token id outside the vocabulary (the header's n_vocab) is a damaged file
    import json
    import struct

    raw = open(base, "rb").read()
    (n,) = struct.unpack("<I", raw[12:16])
    header = json.loads(raw[16:16 + n])
    bad_tok = tmp_path / "tok.kld"
    bad_tok.write_bytes(raw[:16 + n] + struct.pack("<i", header["n_vocab"]) + raw[20 + n:])
    assert_user_error(perplexity_run(runnable_gguf, "--kl-divergence-base", str(bad_tok),
                                     "--kl-divergence"), "outside the vocabulary")
    cut = tmp_path / "cut.kld"
    cut.write_bytes(open(base, "rb").read()[:-10])
    assert_user_error(perplexity_run(runnable_gguf, "--kl-divergence-base", str(cut),
                                     "--kl-divergence"), "unfinished")
    # a text shorter than one chunk fails before anything is written
    short = tmp_path / "s.txt"
    short.write_text("the cat")
    assert_user_error(perplexity_run(runnable_gguf, "-f", str(short), "-c", "16",
                                     "--kl-divergence-base", str(tmp_path / "c.kld")),
                      "fewer than one chunk")
    assert sorted(os.listdir(tmp_path)) == ["b.kld", "cut.kld", "s.txt", "t.txt", "tok.kld"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_an_interrupted_base_run_leaves_no_file(runnable_gguf, tmp_path, sig):
    """SIGINT during the scoring: exit 130 (errors.exit_code_of), and neither the base file nor
    its temporary file is left in the directory; `kill` and a closed terminal too (they ended
    the process with the temporary file left), exit 128 + the signal's number."""
    import signal
    import time

    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat", "a dog ran"] * 4000))
    env = dict(os.environ, PYTHONPATH=ROOT)
    # (SIGINT as a terminal sends it: a background job's inherited "ignore" set back)
    p = subprocess.Popen([sys.executable, "-m", "pyinfer.perplexity", runnable_gguf, "-f", str(text),
                          "-c", "16", "-t", "1", "--kl-divergence-base", str(tmp_path / "b.kld")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not any(n.startswith(".b.kld.") for n in os.listdir(tmp_path)) and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    p.send_signal(getattr(signal, sig))
    err = p.communicate(timeout=60)[1].decode()
    want = 130 if sig == "SIGINT" else 128 + getattr(signal, sig)
    assert p.returncode == want and "Traceback" not in err, (p.returncode, err)
    assert sorted(os.listdir(tmp_path)) == ["t.txt"]
