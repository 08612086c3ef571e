"""How many of the requested kernel threads the next forward pass runs on.

OpenMP threads that wait for work either spin or sleep (``OMP_WAIT_POLICY``). A decode step
opens a few parallel regions per layer (about 150 for SmolLM2), so on an idle machine a thread
that sleeps between them pays a wake-up each time: measured on the project's 2-core box
(SmolLM2 q8_0, 2 threads, docs/benchmarks.md "Wait policy and thread governor (session 6)"),
passive waiting gave 28 tokens/s of decode and libgomp's default (spin about 300,000 times,
then sleep) 89-93; 128-token prefill 182-220 against 298-339 tokens/s. Spinning fails where
another runnable process wants one of the cores: the spinning thread holds the core its
preempted partner needs, and issue 9 measured 2 threads falling to 0.4-2.4 tokens/s on a
loaded box.

So pyinfer keeps libgomp's spinning default (``pyinfer/__init__.py``) and this governor keeps
the team within the CPUs it actually gets. Before a pass, at most every ``SAMPLE_S`` seconds,
it reads two things (``sample_machine``):

- harm: the time this process's threads spent runnable but waiting for a CPU since the last
  look (``run_delay``, 2nd field of ``/proc/self/task/*/schedstat``) over the team's thread
  time. Above ``DELAY_MAX`` the team is being preempted: it shrinks at once. Work that does
  not take our CPUs (a ``nice -n 19`` job: 3% delay measured beside two of them, 33% beside
  one normal busy loop) leaves it alone.
- room: the runnable threads of other processes (``/proc/loadavg``'s nr_running minus this
  process's threads in state R, at most the team), so ``clamp(cpus - others, 1, n_threads)``
  threads fit, cpus being the affinity mask. Lower counts are where a shrinking team goes.

It grows back when the room has lasted ``HOLD_S`` (doubled, up to ``HOLD_MAX_S``, each time a
raise is undone within ``FLAP_S``), or, where only lower-priority work fills the run queue, by
a one-thread probe every ``PROBE_S`` (doubled up to ``PROBE_MAX_S`` each time the probe is
harmed), made only where the processes at normal priority (``foreground_others``, a scan of
/proc) leave a CPU free: a spinning team beside busy loops can take seconds for one pass. A
look with no window to judge (the first pass, or the first after ``IDLE_S`` idle seconds
between passes) goes by that scan too. Where schedstat is missing the run queue count
decides alone. Kernel results do not
depend on the thread count (issue 9, tests/test_threads.py), so the tokens are the same.

Limits: processes outside this kernel's view (other VMs on the host) are not seen. The
governor is off where it has nothing to guard: one thread, passive waiting (the user's
``OMP_WAIT_POLICY=passive`` or ``GOMP_SPINCOUNT=0``), no ``/proc/loadavg`` (not Linux), or
``PYINFER_ADAPTIVE_THREADS=0``.
"""
from __future__ import annotations

import os
import time

#: seconds between two looks at the machine (a look costs 0.2-0.6 ms in gVisor, less on Linux)
SAMPLE_S = 0.05
#: fraction of the team's time spent waiting for a CPU above which the team shrinks
DELAY_MAX = 0.15
#: a look after this many idle seconds starts a new window (no verdict on the idle one)
IDLE_S = 1.0
#: seconds the free CPUs must stay free before the team grows again
HOLD_S = 0.2
#: the longest hold after repeated flapping
HOLD_MAX_S = 5.0
#: a drop this soon after a raise doubles the hold (or the probe interval)
FLAP_S = 1.0
#: first and longest interval between probes of one more thread when only the count objects
PROBE_S, PROBE_MAX_S = 0.25, 60.0


def sample_machine(team: int = 1) -> tuple[int, int | None] | None:
    """(runnable threads on this machine outside this process's kernel team, run-queue delay of
    this process's threads so far in ns, or None without schedstat), or None where /proc cannot
    say.

    Others: the kernel's nr_running (/proc/loadavg) minus this process's threads in state R, of
    which at most ``team`` (the calling thread and its spinning OpenMP workers) are the team; any
    more (a server's event loop, say) compete for the CPUs like another process's."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        ours, delay = 0, 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
                if delay is not None:
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        delay += int(f.read().split()[1])
            except FileNotFoundError:  # the thread ended while we listed, or no schedstat
                if not os.path.exists(f"/proc/self/task/{tid}"):
                    continue
                delay = None
                continue
            except (OSError, ValueError, IndexError):
                delay = None
                continue
            ours += stat[stat.rindex(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - min(ours, team)), delay


def foreground_others() -> int | None:
    """Processes other than this one that are running or runnable now at normal priority (nice
    below 10; their main thread's state in /proc/[pid]/stat), or None where /proc cannot say.
    A scan of every process (a few ms on a desktop): for the rare looks that have no run-queue
    delay to go by."""
    me, n = os.getpid(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            n += rest[0] == "R" and int(rest[16]) < 10
        except (OSError, ValueError, IndexError):  # ended while we looked, or unreadable
            continue
    return n


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
    sample are injectable for tests: clock() -> seconds, sample(team) -> as ``sample_machine``.
    """

    def __init__(self, n_threads: int, *, cpus: int | None = None, enabled: bool | None = None,
                 clock=time.monotonic, sample=sample_machine, foreground=foreground_others):
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
        self.clock, self.sample, self.foreground = clock, sample, foreground
        self.n = n_threads  # threads of the next pass
        self.hold, self.probe_every = HOLD_S, PROBE_S
        self._last_look = -1e18
        self._last_delay = None  # run_delay (ns) at the last look
        self._room_since = None  # when more threads first fitted, while they keep fitting
        self._raised_at = -1e18
        self._next_probe = None
        self._last_end = None  # when the last pass ended (``end``)

    def end(self) -> None:
        """Call when the pass ends: the time until the next ``begin`` is idle, not the pass's
        (a pass slowed by preemption must still be judged, however long it took)."""
        self._last_end = self.clock()

    def begin(self) -> int:
        """The thread count for the pass about to run (1..n_threads)."""
        if not self.enabled:
            return self.n
        now = self.clock()
        if now - self._last_look < SAMPLE_S:
            return self.n
        got = self.sample(self.n)
        if got is None:
            return self.n
        others, delay = got
        harmed = None  # unknown: no schedstat, or no window to judge
        idle = self._last_end is not None and now - self._last_end > IDLE_S
        if delay is not None and self._last_delay is not None and not idle:
            harmed = (delay - self._last_delay) / 1e9 > DELAY_MAX * self.n * (now - self._last_look)
        self._last_look, self._last_delay = now, delay
        if harmed is None and delay is not None:
            # schedstat works but there is no window yet (first pass, or after idle): the run
            # queue alone cannot tell niced work from harm, so count normal-priority processes
            fg = self.foreground()
            if fg is not None:
                self.n = min(self.n, max(1, self.cpus - fg))
            return self.n
        self._decide(max(1, min(self.n_max, self.cpus - others)), harmed, now)
        return self.n

    def _decide(self, fits: int, harmed: bool | None, now: float) -> None:
        if harmed is not False and fits < self.n:
            # preempted (or, without schedstat, the count says so): shrink at once
            self._lower(fits if harmed is None else min(fits, self.n - 1), now)
        elif harmed and self.n > 1:
            self._lower(self.n - 1, now)
        elif fits > self.n:
            self._next_probe = None
            if self._room_since is None:
                self._room_since = now
            elif now - self._room_since >= self.hold:
                self._raise(fits, now)
        else:
            self._room_since = None
            if self.n == self.n_max and now - self._raised_at > 10 * FLAP_S:  # settled: forget
                self.hold, self.probe_every = HOLD_S, PROBE_S
            if harmed is False and self.n < self.n_max:  # only the count objects: probe
                if self._next_probe is None:
                    self._next_probe = now + self.probe_every
                elif now >= self._next_probe:
                    fg = self.foreground()  # probe only where normal-priority work leaves room
                    if fg is None or self.cpus - fg > self.n:
                        self._raise(self.n + 1, now)
                    else:
                        self._next_probe = now + self.probe_every

    def _lower(self, n: int, now: float) -> None:
        if now - self._raised_at < FLAP_S:
            self.hold = min(HOLD_MAX_S, 2 * self.hold)
            self.probe_every = min(PROBE_MAX_S, 2 * self.probe_every)
        self.n, self._room_since, self._next_probe = max(1, n), None, None

    def _raise(self, n: int, now: float) -> None:
        self.n, self._room_since, self._next_probe, self._raised_at = n, None, None, now
