"""`auto`'s draft model: a user's `--draft-model` (a smaller model, or the target's first L layers),
consulted where the free drafters offer nothing worth a row.

Unlike a copy or a table lookup, a draft costs a pass of the draft model per token, paid whether or
not the chain is taken. So each node must pay for its row and its draft pass, and the draft
passes' price is measured as the row's is: their seconds over a one-row target pass's (a seeded
sampled request keeps the bytes' ratio, so its answer never depends on timing). A guard of its
own (dense_guard.py's BalanceGuard) stops consulting the model once its consultations lost about a
dense step's worth (tokens gained minus their cost, draft passes included): a draft model that
cannot pay on this text is dropped within a few passes, and probed again later. Where that guard
stands is the engine's, shared by its requests (`GuardRecord`): after a few requests that found
the draft model losing, the next start resting too, and one whose probe pays opens it for the
next. The draft model reads only the prompt's last CONTEXT_WINDOW tokens, then everything after
them: its cache must first take in every token it has not seen, and a long prompt taken in whole
cost more than a short answer's drafts could win back (BENCHMARKS.md, "auto with a draft model");
drafts are verified, so a shorter context costs acceptance, never the answer.
"""
from __future__ import annotations

import time
from collections import deque
from statistics import median

from ..artifact_store import ArtifactLoader, register_artifact
from .dense_guard import BalanceGuard, GuardRecord
from .draft_model import DraftModel

# Draft passes whose seconds give the draft's price (the latest ones: the context grows).
TIMED_PASSES = 16
CONTEXT_WINDOW = 128


class ModelOffer:
    def __init__(self, draft: DraftModel, bytes_share: float, record: GuardRecord | None = None) -> None:
        self.draft = draft
        self.bytes_share = bytes_share  # a draft pass's weight bytes over a target pass's
        self.record = record or GuardRecord()
        self.seconds: deque[float] = deque(maxlen=TIMED_PASSES)
        self.guard = BalanceGuard()
        self.shared = True  # reads and writes the record
        self.start = 0  # the first token the draft model reads

    def reset(self, prompt: list[int], shared: bool = True) -> None:
        """A new request; `shared` False (a seeded sample, whose answer must not depend on other
        requests) starts its guard afresh and leaves the record alone."""
        self.start = max(0, len(prompt) - CONTEXT_WINDOW)
        self.draft.reset(prompt[self.start:], None)  # greedy drafts: verification treats them as one-hot
        self.seconds.clear()
        self.guard = BalanceGuard()
        self.shared = shared
        if shared:
            self.guard.resume(self.record.rest_length)

    @property
    def open(self) -> bool:
        """Whether to consult the draft model this pass (else a pass of its rest goes by)."""
        if self.guard.open:
            return True
        self.guard.rest()
        return False

    def judge(self, accepted: int, cost: float) -> None:
        """A consultation gave accepted + 1 tokens for `cost` dense steps (draft passes included)."""
        self.guard.record(accepted, cost)
        if self.shared:
            self.record.rest_length = self.guard.rest_length

    def price(self, one_row_seconds: float | None, measured: bool) -> float:
        """A draft pass's cost as a share of a one-row target pass."""
        if not measured or not one_row_seconds or not self.seconds:
            return self.bytes_share
        return median(self.seconds) / one_row_seconds

    def chain(self, context: list[int], limit: int, factor: float, floor: float) -> tuple[list[int], list[float], list[float], int]:
        """The draft model's greedy chain, node by node while its calibrated reach (its top
        probabilities times `factor`) stays at least `floor`: (tokens, reach, estimated reach,
        draft passes run)."""
        tokens: list[int] = []
        reach, estimated = [], []
        passes = 0
        seen = context[self.start:]
        while len(tokens) < limit:
            began = time.perf_counter()
            probs = self.draft.logits_after(seen + tokens)[0].float().softmax(-1)
            self.seconds.append(time.perf_counter() - began)
            passes += 1
            prob, token = probs.max(0)
            calibrated = (reach[-1] if reach else 1.0) * min(1.0, float(prob) * factor)
            if calibrated < floor:
                break
            tokens.append(int(token))
            reach.append(calibrated)
            estimated.append((estimated[-1] if estimated else 1.0) * float(prob))
        return tokens, reach, estimated, passes

    def take_bytes_read(self) -> int:
        return self.draft.take_bytes_read()


register_artifact(ArtifactLoader("draft-record", lambda spec, store: GuardRecord(),
                                 "auto's record of a draft model needs --draft-model"))
