"""How many threads a pass runs on: all the loaded ones, or one fewer at a time while other work
holds cores.

A pass splits its work evenly over its threads and meets at barriers between steps, so a thread
that shares its core with another busy process holds every barrier up: on two cores with a
CPU-bound process on one, two threads decoded about half as fast as one (BENCHMARKS.md, "Threads
that give way to a busy core"). The governor times each step (a pass and the work since the
last) and, now and then, runs a few passes on another thread count (probes): one fewer, or, below
the loaded count, all of them again. It keeps a count that was clearly faster, set on the passes'
thread for the work between passes too (a torch call there on the loaded count would wake the
idle OpenMP threads to spin on the free cores). Probes come rarely on a machine where they keep losing
(their interval doubles), and at once when passes slow down well past their settled time.
Every thread count gives the same bits (each tile and each attention item is one thread's work),
so the choice changes speed only.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager, nullcontext
from statistics import median

import torch

# A probe: this many passes on the other count, against the latest BASELINE_PASSES on the current
# one. Its first pass is left out of the verdict: right after the switch a thread may still sit on
# the busy core. A probe ends after EARLY_PASSES where each of them took HOPELESS times those
# passes' median (one thread of two on a quiet machine takes 1.85x: half the probe's cost saved).
PROBE_PASSES = 4
EARLY_PASSES = 2
HOPELESS = 1.3
BASELINE_PASSES = 8
# The other count must be this much faster to be kept (the machine's own noise is smaller).
MARGIN = 0.1
# Passes before the first probe; a losing probe doubles the wait, up to LONGEST_WAIT.
FIRST_WAIT = 64
LONGEST_WAIT = 8192
# Passes this many times slower than the settled ones (the first after a decision) probe at once,
# at most every TRIGGER_GAP passes.
SLOWDOWN = 1.5
TRIGGER_GAP = 64
# Passes of more rows (prefill chunks) are not timed: their time says little of a decoding step's.
MOST_ROWS = 32


class ThreadGovernor:
    def __init__(self, most: int, row_cost: float) -> None:
        self.most = most  # the loaded thread count
        self.row_cost = row_cost  # a row's share of a one-row pass, to set passes of other sizes side by side
        self.count = most  # the count passes run on, outside a probe
        self.trying: int | None = None  # the count a probe runs on
        self.recent: deque[float] = deque(maxlen=BASELINE_PASSES)  # the latest steps on `count`, in one-row passes
        self.probe: list[float] = []
        self.settled: float | None = None  # the median step after the latest decision
        self.wait = FIRST_WAIT
        self.until_probe = FIRST_WAIT
        self.since_trigger = 0
        self.probe_up = True  # below `most`, probes alternate between all threads and one fewer
        self.applied = most  # the count the governor last set on the passes' thread
        self.last_end: float | None = None  # when the latest timed pass ended

    @property
    def running(self) -> int:
        """The count the next pass runs on."""
        return self.trying or self.count

    def record(self, rows: int, seconds: float) -> None:
        """A step (a pass of `rows` rows and the work since the last) took `seconds` on `running` threads."""
        if rows > MOST_ROWS:
            return
        cost = seconds / (1 + self.row_cost * (rows - 1))  # in one-row passes
        if self.trying is not None:
            self.probe.append(cost)
            hopeless = len(self.probe) == EARLY_PASSES and min(self.probe) >= HOPELESS * median(self.recent)
            if len(self.probe) >= PROBE_PASSES or hopeless:
                self._decide()
            return
        self.recent.append(cost)
        self.until_probe -= 1
        self.since_trigger += 1
        if len(self.recent) < BASELINE_PASSES:
            return
        if self.settled is None:
            self.settled = median(self.recent)
        slowed = self.since_trigger >= TRIGGER_GAP and median(self.recent) > SLOWDOWN * self.settled
        if (self.until_probe <= 0 or slowed) and self._other() is not None:
            self.since_trigger = 0
            self.trying, self.probe = self._other(), []

    def _other(self) -> int | None:
        """The count the next probe tries: one fewer at all threads; below, all of them or one fewer in turn."""
        if self.count == self.most:
            return self.most - 1 if self.most > 1 else None
        if self.probe_up or self.count == 1:
            return self.most
        return self.count - 1

    def _decide(self) -> None:
        tried, self.trying = self.trying, None
        if self.count < self.most:
            self.probe_up = not self.probe_up
        if median(self.probe[1:]) < (1 - MARGIN) * median(self.recent):
            self.count, self.wait = tried, FIRST_WAIT
            self.probe_up = True
        else:
            self.wait = min(2 * self.wait, LONGEST_WAIT)
        self.until_probe = self.wait
        self.recent.clear()
        self.settled = None

    @contextmanager
    def timed(self, rows: int):
        """Run a pass of `rows` rows on `running` threads and time it with the work since the last
        pass ended (a step's whole cost; a pause longer than the pass, such as no request to run,
        is left out). The count stays set after the pass, so the work between passes runs on it
        too. Where the calling thread runs a count the governor did not set (its caller's own), the
        pass runs on it, untimed."""
        current = torch.get_num_threads()
        if current not in (self.most, self.applied):
            yield
            return
        threads = self.running
        if current != threads:
            torch.set_num_threads(threads)
            self.applied = threads
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        between = start - self.last_end if self.last_end is not None else 0.0
        self.last_end = end
        self.record(rows, end - start + (between if between <= end - start else 0.0))


def governed(governor: ThreadGovernor | None, rows: int):
    """`governor.timed(rows)`, or nothing where passes have no governor."""
    return nullcontext() if governor is None else governor.timed(rows)
