"""Generations that share the target's passes: continuous batching.

Each member generation runs in a greenlet of its own on the caller's thread. When its strategy
asks for a pass of the target (`DecodeState.passes`: a prefill chunk, a dense step, the
verification of a chain or a tree), the greenlet parks those rows and hands control back. Once
every member is parked, or has finished a step that needed no such pass, one pass over the
weights serves them all and each member resumes with its own states and logits. A member whose
pass runs layer by layer (early exits decide between layers) parks its rows before each layer and
joins the shared pass there; the pass goes on to the deepest layer any member needs. Strategies,
drafters and verification stay as they are and never see each other; drafters with passes of
their own run those alone, in turn.

All work stays on the one thread that calls `advance` and `run_pass`: PyTorch's OpenMP thread
pool belongs to a thread, and a second pool on few cores throttles every parallel region.
"""
from __future__ import annotations

import torch
from greenlet import GreenletExit, greenlet

from .engine import Event, Generation, Result
from .model.llama import Transformer
from .model.passes import (
    LayerRows,
    PassRows,
    Segment,
    begin_passes,
    end_passes,
    run_passes,
)
from .model.rope import RopeAngles

# `specee serve`'s defaults: generations sharing a pass, and prompt tokens a pass takes from a
# new one (BENCHMARKS.md, "Continuous batching").
DEFAULT_MAX_BATCH = 8
DEFAULT_PREFILL_CHUNK = 128
# A member that needs no shared pass makes at most this many steps a round, so the others are not
# kept waiting.
STEPS_PER_ROUND = 2


class Member:
    """One generation in a batch: the rows it parked for the next pass (or layer), or the output it
    resumes with. It is the generation's `Passes`."""

    def __init__(self, batch: "Batch", generation: Generation, prefill_chunk: int | None, home: greenlet) -> None:
        self.batch = batch
        self.generation = generation
        self.prefill_chunk = prefill_chunk
        self.parked: PassRows | LayerRows | None = None
        self.reply: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | Exception | None = None
        self.rows = 0  # the rows it ran in the batch's last pass
        self.step_rows = 1  # ... and in its latest step (a prefill chunk's is the one row of the step after)
        self._greenlet = greenlet(self._run, home)

    def _run(self) -> None:
        while not self.generation.ready:  # a follower waits a round at a time for its leader's prefill
            self._greenlet.parent.switch(None)
        events = self.generation.events(self, self.prefill_chunk)
        try:
            for event in events:
                self._greenlet.parent.switch(event)
        finally:  # closed where it stands when dropped between steps
            events.close()

    def run_pass(self, part: PassRows) -> tuple[torch.Tensor, torch.Tensor]:
        return self._greenlet.parent.switch(part)  # resumed with this member's share of the pass

    def run_layer(self, rows: LayerRows) -> torch.Tensor:
        return self._greenlet.parent.switch(rows)  # resumed with this member's rows after the layer

    def sharing(self) -> tuple[int, int]:
        return len(self.batch.members) - 1, max(0, self.batch.last_rows - self.rows)

    def sharing_next(self) -> tuple[int, int]:
        """The others' rows in the next pass: those already parked for it, the rest as many as in
        their latest step. A pass that carried a new member's prompt is no guide: pricing drafts
        against it had every member draft as if the next pass were as large."""
        others = [member for member in self.batch.members if member is not self]
        return len(others), sum(member.coming_rows() for member in others)

    def coming_rows(self) -> int:
        # (`shape[0]`, not `len`: every member asks about every other one each step, and a tensor's
        # `len` is Python-level in PyTorch, twice the cost)
        if isinstance(self.parked, PassRows):
            return self.parked.ids.shape[0]
        if isinstance(self.parked, LayerRows):
            return self.parked.h.shape[0]
        return self.step_rows

    def resume(self) -> Event | PassRows | LayerRows | None:
        """Run until the next event or parked rows (None: the generation has ended)."""
        reply, self.reply = self.reply, None
        if isinstance(reply, Exception):
            return self._greenlet.throw(reply)
        return self._greenlet.switch() if reply is None else self._greenlet.switch(reply)

    @property
    def ended(self) -> bool:
        return self._greenlet.dead

    def close(self) -> None:
        """Stop the generation where it is: its cache and drafting state are freed."""
        share = self.generation.share
        if share is not None and self.generation.leads and not share.settled:
            share.abandoned = True  # its followers prefill alone
        if self._greenlet:  # started and not dead
            self._greenlet.throw(GreenletExit)


class Batch:
    """Members advance in rounds: `advance` runs each until it parks or ends a step and returns the
    events they made; `run_pass` then runs every parked member's rows in one pass."""

    def __init__(self, model: Transformer, prefill_chunk: int | None = None) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.members: list[Member] = []
        self.last_rows = 0  # rows of the last pass
        self._made: list[tuple[Member, Event | Exception]] = []  # made while a pass ran, told next round

    def add(self, generation: Generation) -> Member:
        member = Member(self, generation, self.prefill_chunk, greenlet.getcurrent())
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
        made, self._made = self._made, []
        # Held around every resume: members enter and leave inference mode inside their steps, and
        # guards that interleave must all restore the same state.
        with torch.inference_mode():
            for member in [m for m in self.members if m.parked is None]:
                self._advance(member, made, STEPS_PER_ROUND)
        return made

    def _advance(self, member: Member, made: list, steps: int) -> None:
        """Resume `member` until it parks, ends or has made `steps` events."""
        try:
            for _ in range(steps):
                out = member.resume()
                if not isinstance(out, Event):
                    member.parked = out
                    break
                made.append((member, out))
                if out.finish_reason is not None:
                    member.resume()  # the generation files its result after its last event
                    break
        except Exception as error:  # the generation failed: the others go on
            made.append((member, error))
        if member.ended:
            self.members.remove(member)

    def run_pass(self) -> int:
        """One pass over the rows of every parked member; returns how many rows it ran."""
        whole = [m for m in self.members if isinstance(m.parked, PassRows)]
        layered = [m for m in self.members if isinstance(m.parked, LayerRows)]
        parts = [m.parked for m in whole]
        for member in self.members:
            member.rows = len(member.parked.ids) if member in whole else 0
        for member, part in zip(whole, parts):  # a part scoring only its last rows is a prefill chunk
            member.step_rows = member.rows if part.logits_from == 0 else 1
        for member in whole:
            member.parked = None
        rows = sum(len(part.ids) for part in parts)
        try:
            with torch.inference_mode():
                if layered:
                    h, brought = self._run_layered(parts, layered)
                    rows += brought
                    outputs = end_passes(self.model, parts, h) if parts else []
                else:
                    outputs = run_passes(self.model, parts) if parts else []
            self.last_rows = rows
        except Exception as error:  # a bug or a device error: each member fails with it
            outputs = [error] * len(whole)
            for member in [m for m in layered if isinstance(m.parked, LayerRows)]:
                member.parked, member.reply = None, error
        for member, output in zip(whole, outputs):
            member.reply = output
        return rows

    def _run_layered(self, parts: list[PassRows], layered: list[Member]) -> tuple[torch.Tensor | None, int]:
        """The pass layer by layer: the whole passes' rows run every layer; before each, the members
        parked at that layer join with theirs and, after it, decide (they exit, or park for the
        next layer). Returns the whole passes' last states and the rows the layered members brought."""
        h, angles, segments = begin_passes(self.model, parts) if parts else (None, None, [])
        whole_rows = [len(h)] if parts else []
        brought: dict[Member, int] = {}
        for i in range(len(self.model.layers)):
            joining = [m for m in layered if isinstance(m.parked, LayerRows) and m.parked.layer == i]
            if not joining and not parts:
                if not any(isinstance(m.parked, LayerRows) and m.parked.layer > i for m in layered):
                    break
                continue
            rows = [m.parked for m in joining]
            inputs = ([(h, angles)] if parts else []) + [(r.h, r.angles) for r in rows]
            rotations = RopeAngles(torch.cat([a.cos for _, a in inputs]), torch.cat([a.sin for _, a in inputs]))
            out = self.model.layers[i](torch.cat([x for x, _ in inputs]), rotations,
                                       segments + [Segment(r.cache, r.bias, len(r.h)) for r in rows])
            pieces = out.split(whole_rows + [len(r.h) for r in rows])
            if parts:
                h, pieces = pieces[0], pieces[1:]
            for member, piece in zip(joining, pieces):
                brought[member] = max(brought.get(member, 0), len(piece))
                member.parked, member.reply = None, piece
                self._advance(member, self._made, 1)  # parks for the next layer, or ends its pass
        return h, sum(brought.values())


def run_together(model: Transformer, generations: list[Generation], width: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, batch: Batch | None = None) -> list[Result]:
    """Run `generations` in one continuous batch of at most `width` at a time (a new one joins as
    one ends), as `specee serve` would; returns their results in order. Offline work on many
    prompts (a training corpus of the model's own answers) goes several times faster than one
    generation at a time, with the same tokens. `batch`: an empty one to run them in (a benchmark's,
    which times its passes); default a new one of `model` with `prefill_chunk`."""
    batch = batch or Batch(model, prefill_chunk)
    waiting = list(reversed(generations))
    while waiting or batch.members:
        while waiting and len(batch.members) < width:
            batch.add(waiting.pop())
        for _, made in batch.advance():
            if isinstance(made, Exception):
                raise made
        batch.run_pass()
    return [generation.result for generation in generations]
