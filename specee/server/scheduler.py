"""Requests wait in a bounded queue, served in arrival order by one worker thread that owns the
engine's step loop. Route handlers never step a generation themselves: they submit a Job and
read what the worker delivers, so batching several generations into one pass can be added here
alone (ACTIVE_SLOTS > 1, then one batched step instead of a step per job)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..engine import Event, Generation, Result

# Generations stepped in one round. The engine runs one request at a time today.
ACTIVE_SLOTS = 1
# How long the idle worker waits for work before it looks at the stop flag again.
IDLE_POLL_S = 0.1

log = logging.getLogger("specee.server")


class QueueFull(Exception):
    """No room in the queue: the client should retry later."""


@dataclass
class Ended:
    """The last thing a job delivers. outcome: finished, cancelled, timeout, error or shutdown."""

    outcome: str
    result: Result | None = None
    message: str = ""


@dataclass
class Job:
    generation: Generation
    deadline: float  # time.monotonic() after which the request is given up
    deliver: Callable[[Event | Ended], None]  # thread-safe; called from the worker thread
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Called from the handler (a client went away): the worker stops at the next step."""
        self.cancelled.set()


@dataclass
class Running:
    job: Job
    steps: Iterator[Event]


class Scheduler:
    def __init__(self, max_queue: int, on_step: Callable[[Event], None] = lambda event: None,
                 on_end: Callable[[Job, Ended], None] = lambda job, ended: None) -> None:
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._on_step = on_step  # with each engine step's event (metrics)
        self._on_end = on_end  # once per job, before its Ended is delivered (metrics)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="specee-scheduler", daemon=True)
        self.running = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, then let the worker exit."""
        self._stopping.set()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the queue is full ({self._queue.maxsize} requests wait)") from None

    def _work(self) -> None:
        active: list[Running] = []
        while not self._stopping.is_set():
            while len(active) < ACTIVE_SLOTS:
                job = self._take(wait=not active)
                if job is None:
                    break
                active.append(Running(job, iter(job.generation)))
            self.running = len(active)
            for run in list(active):
                if not self._step(run):
                    active.remove(run)
            self.running = len(active)
        for run in active:
            self._end(run, Ended("shutdown", message="the server is shutting down"))
        while (job := self._take(wait=False)) is not None:
            self._end(Running(job, iter(job.generation)), Ended("shutdown", message="the server is shutting down"))
        self.running = 0

    def _take(self, wait: bool) -> Job | None:
        try:
            return self._queue.get(timeout=IDLE_POLL_S) if wait else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _step(self, run: Running) -> bool:
        """Advance one job by one engine step; False once it has ended."""
        job = run.job
        if job.cancelled.is_set():
            return self._end(run, Ended("cancelled"))
        if time.monotonic() > job.deadline:
            return self._end(run, Ended("timeout", message="the request ran past the server's time limit"))
        try:
            event = next(run.steps)
        except Exception as e:  # a bug or a device error: fail this request, keep serving
            log.exception("generation failed")
            return self._end(run, Ended("error", message=f"generation failed: {type(e).__name__}"))
        self._on_step(event)
        if job.first_token_at is None and event.token_ids:
            job.first_token_at = time.monotonic()
        job.deliver(event)
        if event.finish_reason is None:
            return True
        next(run.steps, None)  # the generation files its result after its last event
        return self._end(run, Ended("finished", job.generation.result))

    def _end(self, run: Running, ended: Ended) -> bool:
        run.steps.close()  # frees the generation's cache and drafting state now
        self._on_end(run.job, ended)
        run.job.deliver(ended)
        return False
