"""A request's guard against speculating below dense decoding.

`auto`'s calibration is a request's whole history: after a long stretch of good copies it keeps
trusting a drafter for many passes once the text stops repeating. The guard reads only the latest
drafted passes: when their tokens per unit of pass cost fall clearly below a dense step's (one
token for one row), drafting rests for a number of passes that doubles with each failed probe,
then one drafted pass probes again; a probe that pays ends the rest and resets its length.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Drafted passes judged together, and the share of their cost their tokens must reach (none of
# their drafts accepted rests drafting too, however cheap the rows). Copies accepted a third of the
# time pay on average but often fail four times running: four passes held to their whole cost
# rested them, and 8 passes at 85% gained 3-5% on the tuning slice (BENCHMARKS.md, "A guard that
# tolerates a run of failed copies").
GUARD_PASSES = 8
GUARD_TOLERANCE = 0.85
# A pass shared with other generations is judged as before the tolerance, the latest 4 at their
# whole cost: in a batch, a draft's loss is every member's.
SHARED_GUARD_PASSES = 4
# Dense passes of the first rest, and the longest rest (a doubling that never stops would starve
# a request whose text becomes copyable again).
FIRST_REST = 4
LONGEST_REST = 256


class DenseGuard:
    def __init__(self) -> None:
        self.recent: deque[tuple[int, float]] = deque(maxlen=GUARD_PASSES)  # (tokens gained, tokens owed)
        self.rest_length = FIRST_REST
        self.resting = 0  # dense passes left before the next probe
        self.probing = False  # the next drafted pass is judged alone

    @property
    def open(self) -> bool:
        return self.resting == 0

    def rest(self) -> None:
        """One dense pass of the rest went by."""
        self.resting -= 1
        self.probing = self.resting == 0

    def record(self, accepted: int, cost: float, shared: bool = False) -> None:
        """A drafted pass gave accepted + 1 tokens and cost `cost` dense steps. A pass `shared` with
        other generations must pay its whole cost within a shorter window: a loss there is every
        member's."""
        if self.probing:
            self.probing = False
            if accepted + 1 >= cost:
                self.rest_length = FIRST_REST
                self.recent.clear()
            else:
                self._start_rest()
            return
        self.recent.append((accepted + 1, cost if shared else GUARD_TOLERANCE * cost))  # (tokens, tokens owed)
        window = SHARED_GUARD_PASSES if shared else GUARD_PASSES
        if len(self.recent) >= window:
            latest = list(self.recent)[-window:]
            tokens, owed = sum(t for t, _ in latest), sum(o for _, o in latest)
            if tokens < owed or tokens == window:  # below what they owe, or nothing accepted
                self._start_rest()

    def resume(self, rest_length: int) -> None:
        """Start where an earlier guard of the same drafter stands: resting, if its latest rest
        (half its next) was longer than the first, so a drafter found losing is not tried anew."""
        if rest_length > FIRST_REST:
            self.rest_length = rest_length // 2
            self._start_rest()

    def _start_rest(self) -> None:
        self.resting = self.rest_length
        self.rest_length = min(2 * self.rest_length, LONGEST_REST)
        self.recent.clear()


# A drafter whose every consultation costs (a draft model's passes) rests once its consultations
# since the last rest lost this many dense steps' worth net; good ones bank at most MAX_CREDIT.
LOSS_TO_REST = 1.0
MAX_CREDIT = 2.0


class BalanceGuard(DenseGuard):
    """The guard for a drafter that costs even when nothing it offers is drafted: it judges the
    running balance (tokens gained minus their cost, draft passes included) rather than the latest
    passes, so a cheap drafter that often offers nothing is kept for the drafts that pay, and
    a dear one rests after about a pass's worth of loss."""

    def __init__(self) -> None:
        super().__init__()
        self.balance = 0.0

    def record(self, accepted: int, cost: float, shared: bool = False) -> None:
        if self.probing:
            super().record(accepted, cost)
            self.balance = 0.0
            return
        self.balance = min(MAX_CREDIT, self.balance + accepted + 1 - cost)
        if self.balance < -LOSS_TO_REST:
            self._start_rest()
            self.balance = 0.0


@dataclass
class GuardRecord:
    """What an engine's requests learned under one guard: the rest it would take next (FIRST_REST:
    it paid lately, or was never judged). Requests share it, so a new one starts where the latest
    stands (`DenseGuard.resume`) instead of learning again what the others learned."""

    rest_length: int = FIRST_REST
