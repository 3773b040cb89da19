"""How many CPU threads a step uses: the cores this process may run on that others leave free.

A CPU step is a few hundred parallel regions (one per op), each split evenly across torch's
threads and finished when its slowest thread is.  When another process holds one of the
cores, the thread on that core waits for a scheduler time slice in every region, and the
step slows many times over, not in proportion (benchmarks/NOTES.md, "Thread policy").  One
thread fewer then loses only that core's share.  So before each step :class:`ThreadPolicy`
sets torch's thread count to the cores that are free: it reads, every
:data:`SAMPLE_S` seconds, how busy the allowed cores were (``/proc/stat``) less what this
process used itself (``time.process_time``), and runs a core's thread only while others
left at least :data:`FREE_SHARE` of that core idle.  After more than :data:`STALE_S` seconds
between the end of a step and the start of the next, it starts again from every core.

``threads`` fixed (``EngineConfig.threads``) or batch-invariant mode (a row's sums must not
depend on the machine's load) turn the adaptation off.  The ceiling is torch's own thread
count at each step (so ``torch.set_num_threads`` keeps working) within the
process's CPU affinity (``os.sched_getaffinity``); the caller's count is restored after the
step.
"""

from __future__ import annotations

import collections
import os
import time
from contextlib import contextmanager

import torch

SAMPLE_S = 0.25  # how often the load is read: long enough for jiffies, short enough to react
# a core runs a thread of ours when others leave it at least this idle: two threads beat one
# while a competitor takes less than about half of the second core, one wins above, and a
# stricter share dropped a thread for a streaming client (benchmarks/NOTES.md, "Thread policy
# on a busy CPU")
FREE_SHARE = 0.55
# after the engine sat idle this long, what others did meanwhile says little of what they do
# beside its next steps: a benchmark client busy making the burst it is
# about to send held a core until it sent it, and the burst's first 2048-token prefill then ran
# on one thread at about half the speed (benchmarks/NOTES.md, "Thread policy").  After
# such a pause the policy starts again from every core and measures afresh.
STALE_S = 1.0


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all CPUs where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


STAT_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def stat_seconds(cpus: list[int]) -> dict[str, float] | None:
    """CPU seconds ``cpus`` spent in each of :data:`STAT_COLUMNS` since boot (``/proc/stat``;
    ``steal``: what the hypervisor ran instead of this guest); None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cpus}
    ticks = [0] * len(STAT_COLUMNS)
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            for i, value in enumerate(fields[1:1 + len(STAT_COLUMNS)]):
                ticks[i] += int(value)
    hz = os.sysconf("SC_CLK_TCK")
    return {name: t / hz for name, t in zip(STAT_COLUMNS, ticks)}


def busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent busy (not idle, not waiting on I/O, not stolen) on ``cpus`` since
    boot."""
    seconds = stat_seconds(cpus)
    if seconds is None:
        return None
    return sum(seconds[c] for c in ("user", "nice", "system", "irq", "softirq"))


class ThreadPolicy:
    """Chooses each step's thread count (see the module docstring)."""

    def __init__(self, threads: int | None = None, adaptive: bool = True):
        self.fixed = threads
        self.cpus = allowed_cpus()
        self.adaptive = adaptive and threads is None and busy_seconds(self.cpus) is not None
        self.free_cores = float(len(self.cpus))  # estimate from the last completed sample
        self._last = (time.monotonic(), busy_seconds(self.cpus) or 0.0, time.process_time())
        self._last_step_end = self._last[0]  # (monotonic; made: idle since)
        self.steps_by_threads: collections.Counter[int] = collections.Counter()

    def _sample(self) -> None:
        now = time.monotonic()
        t0, busy0, mine0 = self._last
        if now - t0 < SAMPLE_S:  # /proc/stat is read only once per sample, not every step
            return
        busy, mine = busy_seconds(self.cpus), time.process_time()
        if busy is None:
            return
        if now - self._last_step_end > STALE_S:  # the engine sat idle: every core again
            self.free_cores = float(len(self.cpus))
            self._last = (now, busy, mine)
            return
        others = max(0.0, (busy - busy0) - (mine - mine0)) / (now - t0)  # cores' worth
        self.free_cores = max(0.0, len(self.cpus) - others)
        self._last = (now, busy, mine)

    def ceiling(self) -> int:
        """The most threads a step may use now: torch's thread count, within the process's
        CPU affinity."""
        return max(1, min(torch.get_num_threads(), len(self.cpus)))

    def describe(self) -> str:
        """The policy in a phrase (``cbatch --version``, ``cbatch serve``)."""
        if self.fixed is not None:
            return f"{self.fixed} (fixed)"
        if self.adaptive:
            return f"up to {self.ceiling()}, the cores other processes leave free"
        return f"{self.ceiling()}"

    def choose(self) -> int:
        """The thread count for the next step."""
        ceiling = self.ceiling()
        if self.fixed is not None:
            return self.fixed
        if not self.adaptive:
            return ceiling
        self._sample()
        return max(1, min(ceiling, int(self.free_cores + (1 - FREE_SHARE))))

    @contextmanager
    def step(self):
        """Run the body with this step's thread count, then give the caller's back."""
        before = torch.get_num_threads()
        n = self.choose()
        self.steps_by_threads[n] += 1
        if n != before:
            torch.set_num_threads(n)
        try:
            yield n
        finally:
            self._last_step_end = time.monotonic()
            if n != before:
                torch.set_num_threads(before)
