"""Requests wait in a bounded queue and are admitted in arrival order, up to `max_batch` at once, by
one worker thread that owns every pass of the model. The generations it runs share each pass
(`specee.batch.Batch`): a new request joins at the next round, its prompt prefilled in chunks
beside the others' decoding steps; a finished, cancelled or timed-out one leaves at once. Route
handlers never step a generation themselves: they submit a Job and read what the worker delivers."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..batch import Batch, Member
from ..engine import Event, Generation, Result
from ..grammar import GrammarError

# The characters of each running answer that /slots shows.
TEXT_TAIL = 200
# How long the idle worker waits for work before it looks at the stop flag again.
IDLE_POLL_S = 0.1

log = logging.getLogger("specee.server")


class QueueFull(Exception):
    """No room in the queue: the client should retry later."""


@dataclass
class Ended:
    """The last thing a job delivers. outcome: finished, cancelled, timeout, error, grammar (the
    request's grammar failed) or shutdown."""

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
    tokens: int = 0  # generated so far
    text: str = ""  # the answer's last TEXT_TAIL characters (for the live page's view of every stream)
    methods: dict[str, int] = field(default_factory=dict)  # passes so far by the method that drafted them

    def cancel(self) -> None:
        """Called from the handler (a client went away): the worker stops at the next step."""
        self.cancelled.set()

    def slot(self, index: int, now: float) -> dict:
        """What the live page shows of a running job."""
        started = self.first_token_at
        rate = (self.tokens - 1) / (now - started) if started and self.tokens > 1 and now > started else 0.0
        return {"slot": index, "mode": self.generation.strategy.name, "prompt_tokens": len(self.generation.prompt_ids),
                "tokens": self.tokens, "tokens_per_s": round(rate, 1), "state": "decoding" if started else "prefill",
                "methods": dict(self.methods), "text": self.text}


class Scheduler:
    def __init__(self, batch: Batch, max_queue: int, max_batch: int = 1,
                 on_step: Callable[[Event], None] = lambda event: None,
                 on_end: Callable[[Job, Ended], None] = lambda job, ended: None,
                 on_pass: Callable[[int, int], None] = lambda rows, tokens: None) -> None:
        self._batch = batch
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.max_batch = max_batch
        self._on_step = on_step  # with each engine step's event (metrics)
        self._on_end = on_end  # once per job, before its Ended is delivered (metrics)
        self._on_pass = on_pass  # after each shared pass: its rows, and the tokens the round committed
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._drain_deadline = float("inf")
        self._thread = threading.Thread(target=self._work, name="specee-scheduler", daemon=True)
        self._jobs: dict[Member, Job] = {}
        self.running = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def slots(self) -> list[dict]:
        """The running jobs, in admission order (read from any thread)."""
        now = time.monotonic()
        return [job.slot(i, now) for i, job in enumerate(list(self._jobs.values()))]

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, then let the worker exit."""
        self._stopping.set()
        self._thread.join(timeout)

    def drain(self, deadline: float) -> None:
        """Shutting down: refuse new jobs; what runs or waits may finish until `deadline`
        (time.monotonic()), then ends as "shutdown", so every stream closes properly before the
        server's grace period is over. Safe from a signal handler."""
        self._drain_deadline = deadline
        self._draining.set()

    def submit(self, job: Job) -> None:
        if self._stopping.is_set() or self._draining.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the queue is full ({self._queue.maxsize} requests wait)") from None

    def _work(self) -> None:
        while not self._stopping.is_set():
            if self._draining.is_set() and time.monotonic() > self._drain_deadline:
                break
            self._admit()
            self._drop_abandoned()
            tokens = 0
            for member, made in self._batch.advance():
                tokens += self._deliver(member, made)
            rows = self._batch.run_pass()
            self.running = len(self._jobs)
            if rows:
                self._on_pass(rows, tokens)
        self._end_everything(Ended("shutdown", message="the server is shutting down"))
        self._stopping.wait()

    def _end_everything(self, ended: Ended) -> None:
        for member in list(self._jobs):
            self._end(member, ended)
        while (job := self._take(wait=False)) is not None:
            self._on_end(job, ended)
            job.deliver(ended)
        self.running = 0

    def _admit(self) -> None:
        """Take waiting jobs, oldest first, while slots are free (waiting a moment when idle)."""
        while len(self._jobs) < self.max_batch:
            job = self._take(wait=not self._jobs)
            if job is None:
                return
            self._jobs[self._batch.add(job.generation)] = job
            self.running = len(self._jobs)

    def _take(self, wait: bool) -> Job | None:
        try:
            return self._queue.get(timeout=IDLE_POLL_S) if wait else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _drop_abandoned(self) -> None:
        """Cancelled jobs (the client went away) and those past their deadline free their slots now."""
        for member, job in list(self._jobs.items()):
            if job.cancelled.is_set():
                self._end(member, Ended("cancelled"))
            elif time.monotonic() > job.deadline:
                self._end(member, Ended("timeout", message="the request ran past the server's time limit"))

    def _deliver(self, member: Member, made: Event | Exception) -> int:
        """Hand a member's event (or failure) to its job; returns the tokens it committed."""
        job = self._jobs[member]
        if isinstance(made, GrammarError):  # the request's own grammar gave up: its client is told why
            log.info("a request's grammar failed: %s", made)
            self._end(member, Ended("grammar", message=str(made)))
            return 0
        if isinstance(made, Exception):  # a bug or a device error: fail this request, keep serving
            log.error("generation failed", exc_info=made)
            self._end(member, Ended("error", message=f"generation failed: {type(made).__name__}"))
            return 0
        self._on_step(made)
        if job.first_token_at is None and made.token_ids:
            job.first_token_at = time.monotonic()
        job.tokens += len(made.token_ids)
        job.text = (job.text + made.text)[-TEXT_TAIL:]
        if made.method is not None:
            job.methods[made.method] = job.methods.get(made.method, 0) + 1
        job.deliver(made)
        if made.finish_reason is not None:
            self._end(member, Ended("finished", job.generation.result))
        return len(made.token_ids)

    def _end(self, member: Member, ended: Ended) -> None:
        job = self._jobs.pop(member)
        if member in self._batch.members:
            self._batch.drop(member)  # frees its cache and drafting state now
        self._on_end(job, ended)
        job.deliver(ended)
