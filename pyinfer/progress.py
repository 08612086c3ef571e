"""Progress of long work (conversion, calibration, profiling, predictor training, perplexity).

One helper so every long step reports the same way: on a terminal, a tqdm bar redrawn in place;
when stderr is not a terminal (a log file, CI, a pipe), one plain line per ``LOG_INTERVAL_S``
seconds with the count, elapsed time and ETA, as pip does in a log, instead of either silence or
carriage-return redraws that a log shows as one endless line. Both come from tqdm.
"""
from __future__ import annotations

import os
import re
import sys

#: seconds between two lines when stderr is not a terminal (env PYINFER_PROGRESS_INTERVAL)
LOG_INTERVAL_S = 10.0


class _Lines:
    """A file for tqdm that turns its in-place redraws into whole lines (no carriage returns,
    no blank clears, no second line for the same count: tqdm redraws the last one on close)."""

    def __init__(self, f):
        self.f = f
        self.last = None  # the previous line up to its timing ("desc: pct|bar| n/total")

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        # the count without the bar, whose width follows the rate text's length (a redraw by
        # tqdm's monitor thread at the same count can draw it one character narrower)
        key = re.sub(r"\|[^|]*\|", "|", s.split(" [", 1)[0])
        if s and key != self.last:
            self.last = key
            self.f.write(s + "\n")

    def flush(self) -> None:
        self.f.flush()


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get("PYINFER_PROGRESS_INTERVAL", LOG_INTERVAL_S)))
    except ValueError:
        return LOG_INTERVAL_S


def progress_bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 enabled: bool | None = None, leave: bool = False, file=None):
    """A tqdm over ``iterable`` (or with ``total`` for ``update``) writing to ``file`` (default
    stderr).

    enabled: False -> no output; True or None -> a bar on a terminal, else a line every
    ``LOG_INTERVAL_S`` seconds plus the first and the last (``leave`` is then always on, so a log
    ends with the 100% line). Returns the tqdm object (iterate it, or ``update``/``close`` it).
    """
    from tqdm import tqdm

    f = sys.stderr if file is None else file
    if enabled is False:
        return tqdm(iterable, total=total, disable=True)
    try:
        tty = f.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=f, leave=leave,
                    dynamic_ncols=True)
    interval = _interval()
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=_Lines(f), leave=True,
                disable=False, ascii=True, ncols=80, mininterval=interval, miniters=1,
                maxinterval=max(interval, 1.0))
