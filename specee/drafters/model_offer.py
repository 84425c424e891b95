"""`auto`'s draft model: a user's `--draft-model` (a smaller model, or the target's first L layers),
consulted where the free drafters offer nothing worth a row.

Unlike a copy or a table lookup, a draft costs a pass of the draft model per token, paid whether or
not the chain is taken. So each node must pay for its row and its draft pass, and the draft
passes' price is measured as the row's is: their seconds over a one-row target pass's (a seeded
sampled request keeps the bytes' ratio, so its answer never depends on timing). A guard of its
own (dense_guard.py) stops consulting the model while its latest consultations gave fewer tokens
than they cost, draft passes included: a draft model that cannot pay on this text is dropped
within a few passes, and probed again later.
"""
from __future__ import annotations

import time
from collections import deque
from statistics import median

from .dense_guard import DenseGuard
from .draft_model import DraftModel

# Draft passes whose seconds give the draft's price (the latest ones: the context grows).
TIMED_PASSES = 16


class ModelOffer:
    def __init__(self, draft: DraftModel, bytes_share: float) -> None:
        self.draft = draft
        self.bytes_share = bytes_share  # a draft pass's weight bytes over a target pass's
        self.seconds: deque[float] = deque(maxlen=TIMED_PASSES)
        self.guard = DenseGuard()

    def reset(self, prompt: list[int]) -> None:
        self.draft.reset(prompt, None)  # greedy drafts: verification treats them as one-hot
        self.seconds.clear()
        self.guard = DenseGuard()

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
        while len(tokens) < limit:
            began = time.perf_counter()
            probs = self.draft.logits_after(context + tokens)[0].float().softmax(-1)
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
