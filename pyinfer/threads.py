"""How many of the requested kernel threads the next forward pass runs on.

OpenMP threads that wait for work either spin or sleep (``OMP_WAIT_POLICY``). A decode step
opens a few parallel regions per layer (about 150 for SmolLM2), so on an idle machine a thread
that sleeps between them pays a wake-up each time: measured on the project's 2-core box
(SmolLM2 q8_0, 2 threads, docs/benchmarks.md "Wait policy (session 6)"), passive waiting gave
21-25 tokens/s of decode and libgomp's default (spin about 300,000 times, then sleep) 90-91;
128-token prefill 182-220 against 298-339 tokens/s. Spinning fails where another runnable
process wants one of the cores: the spinning thread holds the core its preempted partner
needs, and issue 9 measured 2 threads falling to 0.4-2.4 tokens/s on a loaded box.

So pyinfer keeps libgomp's spinning default (``pyinfer/__init__.py``) and this governor keeps
the team no larger than the CPUs that are free: before a pass, at most every ``SAMPLE_S``
seconds, it counts the runnable threads of the whole machine (``/proc/loadavg``, 4th field,
the kernel's nr_running) minus this process's own runnable threads (state R in
``/proc/self/task/*/stat``, at most as many as the team), and runs ``clamp(cpus - others, 1, n_threads)`` threads, where
cpus is the size of the affinity mask. It lowers the count at once and raises it only after
the room has lasted ``HOLD_S`` (doubled, up to ``HOLD_MAX_S``, each time a raise is undone
within ``FLAP_S``), so a machine whose load comes and goes does not flap. Kernel results do
not depend on the thread count (issue 9, tests/test_threads.py), so the tokens are the same.

Limits: a runnable process counts whatever its priority (work under ``nice`` also lowers the
count, though it would not have hurt); processes outside this kernel's view (other VMs on the
host) are not seen. The governor is off where it has nothing to guard: one thread, passive
waiting (the user's ``OMP_WAIT_POLICY=passive`` or ``GOMP_SPINCOUNT=0``), no ``/proc/loadavg``
(not Linux), or ``PYINFER_ADAPTIVE_THREADS=0``.
"""
from __future__ import annotations

import os
import time

#: seconds between two looks at the machine's load (a look costs 0.1-0.3 ms)
SAMPLE_S = 0.05
#: seconds the free CPUs must stay free before the team grows again
HOLD_S = 0.2
#: the longest hold after repeated flapping
HOLD_MAX_S = 5.0
#: a drop this soon after a raise doubles the hold
FLAP_S = 1.0


def runnable_others(team: int = 1) -> int | None:
    """Runnable threads on this machine now that are not this process's kernel team: the
    kernel's nr_running (/proc/loadavg) minus this process's threads in state R, of which at
    most ``team`` (the calling thread and its spinning OpenMP workers) are the team; any more (a
    server's event loop, say) compete for the CPUs like another process's. None where /proc
    cannot say."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        ours = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:  # the thread ended while we listed
                continue
            ours += stat[stat.rindex(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - min(ours, team))


def spinning_waits(environ=os.environ) -> bool:
    """True when libgomp's waiting threads spin before they sleep (its default, or the user's
    OMP_WAIT_POLICY=active / GOMP_SPINCOUNT > 0): the case the governor guards."""
    policy = environ.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy == "passive":
        return False
    spin = environ.get("GOMP_SPINCOUNT", "").strip()
    return spin not in ("0", "0k", "0M")


class ThreadGovernor:
    """Chooses the thread count of each forward pass (see the module docstring).

    n_threads: the most threads a pass may use (``-t``). cpus: CPUs this process may run on
    (default: the affinity mask). enabled: None decides as the module docstring says. clock and
    sample are injectable for tests: clock() -> seconds, sample(team) -> runnable threads
    outside the current team of ``team`` threads (``runnable_others``; None: unknown).
    """

    def __init__(self, n_threads: int, *, cpus: int | None = None, enabled: bool | None = None,
                 clock=time.monotonic, sample=runnable_others):
        self.n_max = n_threads
        if cpus is None:
            try:
                cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = os.cpu_count() or 1
        self.cpus = cpus
        if enabled is None:
            enabled = (n_threads > 1 and spinning_waits()
                       and os.environ.get("PYINFER_ADAPTIVE_THREADS", "1") != "0"
                       and sample(1) is not None)
        self.enabled = enabled
        self.clock, self.sample = clock, sample
        self.n = n_threads  # threads of the next pass
        self.hold = HOLD_S
        self._last_look = -1e18
        self._room_since = None  # when more threads first fitted, while they keep fitting
        self._raised_at = -1e18

    def begin(self) -> int:
        """The thread count for the pass about to run (1..n_threads)."""
        if self.enabled:
            now = self.clock()
            if now - self._last_look >= SAMPLE_S:
                self._last_look = now
                others = self.sample(self.n)
                if others is not None:
                    self._decide(max(1, min(self.n_max, self.cpus - others)), now)
        return self.n

    def _decide(self, fits: int, now: float) -> None:
        if fits < self.n:  # lower at once: a spinning team beside other work is the failure
            if now - self._raised_at < FLAP_S:
                self.hold = min(HOLD_MAX_S, 2 * self.hold)
            self.n, self._room_since = fits, None
        elif fits > self.n:
            if self._room_since is None:
                self._room_since = now
            elif now - self._room_since >= self.hold:
                self.n, self._room_since, self._raised_at = fits, None, now
        else:
            self._room_since = None
            if now - self._raised_at > 10 * FLAP_S:
                self.hold = HOLD_S
