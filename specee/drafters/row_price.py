"""What one more verified row costs, as a share of a one-row pass, measured on a request's own passes.

A row attends to the whole context, so its price grows with the text; `auto` follows it from the
verification time of each pass against its rows. Passes share the CPU with whatever else runs (another
process, a page fault), so a few come out many times slower than their rows make them: a
least-squares line moves as far as they are slow, a median barely at all. The price is therefore
the median of the slopes between pairs of recent passes (Theil-Sen) over the median time of a
one-row pass, each pass's time first clamped to a band around the current line (the median cannot
help where a single pass is the only one with another row count).
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

import numpy as np

# Each pass weighs this much less than the next; the window holds the latest PRICE_WINDOW passes.
PRICE_DECAY = 0.95
PRICE_WINDOW = 24
# The model's price enters as two pseudo-passes on its line (dense, and with PRIOR_ROWS extra rows),
# each weighing PRICE_PRIOR_WEIGHT passes at first and decaying like a pass.
PRICE_PRIOR_WEIGHT = 2.0
PRIOR_ROWS = 4
# A pass counts as at most CLAMP times (at least 1 / CLAMP of) what the current line predicts for it.
CLAMP = 2.0
MIN_PRICE = 0.01


class RowPrice:
    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.cost = prior
        self.one_row: float | None = None  # a one-row pass's seconds on the current line
        self.passes: deque[tuple[int, float]] = deque(maxlen=PRICE_WINDOW)  # (extra rows, seconds)
        self.prior_weight = PRICE_PRIOR_WEIGHT

    def predicted(self, extra_rows: int) -> float:
        return self.one_row * (1 + self.cost * extra_rows)

    def record(self, extra_rows: int, seconds: float) -> None:
        if self.one_row is None:
            self.one_row = seconds / (1 + self.prior * extra_rows)
        else:
            self.prior_weight *= PRICE_DECAY
        expected = self.predicted(extra_rows)
        self.passes.append((extra_rows, min(max(seconds, expected / CLAMP), expected * CLAMP)))
        rows = np.array([r for r, _ in self.passes], dtype=np.float64)
        if np.all(rows == rows[0]):
            return  # one shape of pass: nothing to fit a line to, the price stays
        times = np.array([s for _, s in self.passes])
        scale = float(np.median(times / (1 + self.cost * rows)))  # a one-row pass now, on the price's line
        rows = np.append(rows, [0.0, PRIOR_ROWS])
        times = np.append(times, [scale, scale * (1 + self.prior * PRIOR_ROWS)])
        weights = np.append(PRICE_DECAY ** np.arange(len(self.passes) - 1, -1, -1), [self.prior_weight] * 2)
        first, second = pairs(len(rows))
        spread = rows[second] - rows[first]
        apart = spread != 0
        slopes = (times[second] - times[first])[apart] / spread[apart]
        per_row = weighted_median(slopes, (weights[first] * weights[second])[apart])
        one_row = weighted_median(times - per_row * rows, weights)
        if one_row > 0:
            self.one_row = one_row
            self.cost = max(MIN_PRICE, per_row / one_row)


@lru_cache(maxsize=None)
def pairs(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (i < j) of `count` points, as two index arrays."""
    return np.triu_indices(count, 1)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
