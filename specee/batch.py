"""Generations that share the target's passes: continuous batching.

Each member generation runs in a greenlet of its own on the caller's thread. When its strategy
asks for a full pass of the target (`DecodeState.run_pass`: a prefill chunk, a dense step, the
verification of a chain or a tree), the greenlet parks those rows and hands control back. Once
every member is parked, or has finished a step that needed no such pass, one pass over the
weights serves them all (`Transformer.run_passes`) and each member resumes with its own states
and logits. Strategies, drafters and verification stay as they are and never see each other;
drafters with passes of their own and early exits run those alone, in turn.

All work stays on the one thread that calls `advance` and `run_pass`: PyTorch's OpenMP thread
pool belongs to a thread, and a second pool on few cores throttles every parallel region.
"""
from __future__ import annotations

import torch
from greenlet import GreenletExit, greenlet

from .engine import Event, Generation
from .model.llama import PassRows, Transformer

# `specee serve`'s defaults: generations sharing a pass, and prompt tokens a pass takes from a
# new one (BENCHMARKS.md, "Continuous batching").
DEFAULT_MAX_BATCH = 8
DEFAULT_PREFILL_CHUNK = 128
# A member that needs no shared pass (early exits run their own) makes at most this many steps a
# round, so the others are not kept waiting.
STEPS_PER_ROUND = 2


class Member:
    """One generation in a batch: its rows parked for the next pass, or the output it resumes with."""

    def __init__(self, generation: Generation, prefill_chunk: int | None, home: greenlet) -> None:
        self.generation = generation
        self.prefill_chunk = prefill_chunk
        self.parked: PassRows | None = None
        self.reply: tuple[torch.Tensor, torch.Tensor] | Exception | None = None
        self._greenlet = greenlet(self._run, home)

    def _run(self) -> None:
        events = self.generation.events(self._run_pass, self.prefill_chunk)
        try:
            for event in events:
                self._greenlet.parent.switch(event)
        finally:  # closed where it stands when dropped between steps
            events.close()

    def _run_pass(self, rows: PassRows) -> tuple[torch.Tensor, torch.Tensor]:
        return self._greenlet.parent.switch(rows)  # resumed with this member's share of the pass

    def resume(self) -> Event | PassRows | None:
        """Run until the next event or parked pass (None: the generation has ended)."""
        reply, self.reply = self.reply, None
        if isinstance(reply, Exception):
            return self._greenlet.throw(reply)
        return self._greenlet.switch() if reply is None else self._greenlet.switch(reply)

    @property
    def ended(self) -> bool:
        return self._greenlet.dead

    def close(self) -> None:
        """Stop the generation where it is: its cache and drafting state are freed."""
        if self._greenlet:  # started and not dead
            self._greenlet.throw(GreenletExit)


class Batch:
    """Members advance in rounds: `advance` runs each until it parks or ends a step and returns the
    events they made; `run_pass` then runs every parked member's rows in one pass."""

    def __init__(self, model: Transformer, prefill_chunk: int | None = None) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.members: list[Member] = []
        self.last_pass_rows = 0

    def add(self, generation: Generation) -> Member:
        member = Member(generation, self.prefill_chunk, greenlet.getcurrent())
        self.members.append(member)
        return member

    def drop(self, member: Member) -> None:
        """Remove a member now (cancelled, timed out), closing its generation."""
        with torch.inference_mode():
            member.close()
        self.members.remove(member)

    def advance(self) -> list[tuple[Member, Event | Exception]]:
        """Resume every member not parked. Returns the events made, in order, and the exception of a
        member whose generation failed; ended and failed members leave the batch."""
        made = []
        # Held around every resume: members enter and leave inference mode inside their steps, and
        # guards that interleave must all restore the same state.
        with torch.inference_mode():
            for member in [m for m in self.members if m.parked is None]:
                try:
                    self._advance(member, made)
                except Exception as error:  # the generation failed: the others go on
                    made.append((member, error))
                if member.ended:
                    self.members.remove(member)
        return made

    def _advance(self, member: Member, made: list) -> None:
        for _ in range(STEPS_PER_ROUND):
            out = member.resume()
            if not isinstance(out, Event):
                member.parked = out
                return
            made.append((member, out))
            if out.finish_reason is not None:
                member.resume()  # the generation files its result after its last event
                return

    def run_pass(self) -> int:
        """One pass over the rows of every parked member; returns how many rows it ran."""
        parked = [m for m in self.members if m.parked is not None]
        parts = [m.parked for m in parked]
        for member in parked:
            member.parked = None
        if parked:
            try:
                with torch.inference_mode():
                    outputs = self.model.run_passes(parts)
            except Exception as error:  # a bug or a device error: each member fails with it
                outputs = [error] * len(parked)
            for member, output in zip(parked, outputs):
                member.reply = output
        self.last_pass_rows = sum(len(part.ids) for part in parts)
        return self.last_pass_rows
