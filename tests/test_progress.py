"""Progress of long work when stderr is not a terminal: whole lines with a count and an ETA
(pyinfer/progress.py), checked in-process and through pyinfer-convert with stderr piped."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from pyinfer.progress import progress_bar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tqdm's "desc:  40%|####      | 2/5 [00:01<00:02, 1.9tensor/s]": count, elapsed < remaining (ETA)
LINE = re.compile(r"^(?P<desc>[\w ]+): +(?P<pct>\d+)%\|[#0-9 ]*\| (?P<n>\d+)/(?P<total>\d+) "
                  r"\[\d\d:\d\d<(\d\d:\d\d|\?), ")


def test_not_a_terminal_gives_one_line_per_step(monkeypatch):
    monkeypatch.setenv("PYINFER_PROGRESS_INTERVAL", "0")
    f = io.StringIO()  # not a terminal
    for _ in progress_bar(range(5), desc="work", unit="step", file=f):
        pass
    text = f.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    counts = [int(LINE.match(ln).group("n")) for ln in lines]
    assert counts == [0, 1, 2, 3, 4, 5] and lines[-1].startswith("work: 100%")


def test_the_default_interval_keeps_a_log_short(monkeypatch):
    monkeypatch.delenv("PYINFER_PROGRESS_INTERVAL", raising=False)
    f = io.StringIO()
    bar = progress_bar(total=1000, desc="calibration text", unit="tok", file=f)
    for _ in range(100):
        bar.update(10)
    bar.close()
    lines = f.getvalue().splitlines()
    assert 2 <= len(lines) <= 3  # the first, maybe one timed, and the last (100%)
    assert LINE.match(lines[-1]).group("n") == "1000"


def test_disabled_writes_nothing():
    f = io.StringIO()
    for _ in progress_bar(range(3), desc="x", enabled=False, file=f):
        pass
    assert f.getvalue() == ""


def test_conversion_with_stderr_piped_shows_progress_lines(tmp_path):
    pytest.importorskip("torch")
    from tests._models import make_random_llama

    model_dir = make_random_llama(tmp_path / "hf", "silu", False, 2, None)
    env = dict(os.environ, PYTHONPATH=ROOT, PYINFER_PROGRESS_INTERVAL="0")
    r = subprocess.run([sys.executable, "-m", "convert.cli", model_dir, str(tmp_path / "o.gguf"),
                        "--dense", "--outtype", "q8_0"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("converting:")]
    matches = [LINE.match(ln) for ln in lines]
    assert all(matches), lines
    n = [int(m.group("n")) for m in matches]
    total = int(matches[-1].group("total"))
    assert n == list(range(total + 1)) and total > 10  # a line per tensor, then 100%
    assert "\r" not in r.stderr


def test_one_line_per_count_whatever_the_bar_width():
    """tqdm redraws a count from its monitor thread; with a longer rate text the bar is drawn
    narrower, and that redraw must not become a second line for the same count."""
    from pyinfer.progress import _Lines

    f = io.StringIO()
    lines = _Lines(f)
    lines.write("converting:  45%|####      | 9/20 [00:01<00:02, 4.5it/s]")
    lines.write("\rconverting:  45%|####     | 9/20 [00:01<00:02, 14.52it/s]")
    lines.write("converting:  50%|#####    | 10/20 [00:01<00:02, 14.52it/s]")
    assert [LINE.match(ln).group("n") for ln in f.getvalue().splitlines()] == ["9", "10"]
