"""What a pass that verifies drafted rows costs, as a share of a one-row pass (a dense step), measured
on a request's own passes: 1 + step + cost x rows.

A row attends to the whole context, so its price grows with the text; `auto` follows it from the
verification time of each pass against its rows. The first drafted rows cost more than later
ones (BENCHMARKS.md, "Between passes"), so a line through dense steps and drafted passes alike
prices a short draft below what it costs: drafted passes pay a step besides their rows. Passes
share the CPU with whatever else runs (another process, a page fault), so a few come out many times
slower than their rows make them: a least-squares line moves as far as they are slow, a median
barely at all. So a one-row pass's time is the median of the dense steps', and the price per row
the median of the slopes between pairs of recent drafted passes (Theil-Sen), the step what the
median line's intercept holds above a dense step; each pass's time is first clamped to a band
around the current line (the median cannot help where a single pass is the only one with another
row count).
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

import numpy as np

# Each pass weighs this much less than the next; the window holds the latest PRICE_WINDOW passes.
PRICE_DECAY = 0.95
PRICE_WINDOW = 24
# The model's price enters as two pseudo-passes on its line (no step: with 1 and PRIOR_ROWS drafted
# rows), each weighing PRICE_PRIOR_WEIGHT passes at first and decaying like a pass.
PRICE_PRIOR_WEIGHT = 2.0
PRIOR_ROWS = 4
# A pass counts as at most CLAMP times (at least 1 / CLAMP of) what the current line predicts for it.
CLAMP = 2.0
MIN_PRICE = 0.01
# The fit (a few dozen numpy calls on caches a pass has just emptied: 4-5% of a dense step if run
# after every drafted pass) reruns after every REFIT-th pass; while the window holds fewer than
# YOUNG passes, after every drafted one, so a request's first drafts learn the price at once.
REFIT = 8
YOUNG = 8


class RowPrice:
    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.cost = prior  # one more drafted row
        self.step = 0.0  # any drafted row at all
        self.one_row: float | None = None  # a one-row pass's seconds
        self.passes: deque[tuple[int, float]] = deque(maxlen=PRICE_WINDOW)  # (extra rows, seconds)
        self.prior_weight = PRICE_PRIOR_WEIGHT
        self.since_fit = 0  # passes recorded since the latest fit

    def share(self, extra_rows: int) -> float:
        """A pass of one row and `extra_rows` more (drafted, or other sequences'), in one-row passes."""
        return 1 + (self.step if extra_rows else 0.0) + self.cost * extra_rows

    def record(self, extra_rows: int, seconds: float) -> None:
        if self.one_row is None:
            self.one_row = seconds / self.share(extra_rows)
        else:
            self.prior_weight *= PRICE_DECAY
        expected = self.one_row * self.share(extra_rows)
        self.passes.append((extra_rows, min(max(seconds, expected / CLAMP), expected * CLAMP)))
        self.since_fit += 1
        if self.since_fit >= REFIT or (extra_rows and len(self.passes) < YOUNG):
            self.since_fit = 0
            self.fit()

    def fit(self) -> None:
        rows = np.array([r for r, _ in self.passes], dtype=np.float64)
        if np.all(rows == rows[0]):
            return  # one shape of pass: nothing to fit a line to, the price stays
        times = np.array([s for _, s in self.passes])
        weights = PRICE_DECAY ** np.arange(len(self.passes) - 1, -1, -1)
        dense = rows == 0
        if dense.any():
            one_row = weighted_median(times[dense], weights[dense])
        else:  # no dense step in the window: each pass read on the current line
            shares = 1 + self.step + self.cost * rows
            one_row = weighted_median(times / shares, weights)
        if one_row <= 0:
            return
        self.one_row = one_row
        drafted, drafted_times, drafted_weights = rows[~dense], times[~dense], weights[~dense]
        if len(set(drafted)) == 1:  # one drafted shape: its cost is known, not how it splits
            share = weighted_median(drafted_times, drafted_weights) / one_row - 1
            self.cost = max(MIN_PRICE, min(self.cost, share / drafted[0]))
            self.step = max(0.0, share - self.cost * drafted[0])
        elif len(drafted):
            self.cost, self.step = drafted_line(drafted, drafted_times / one_row, drafted_weights,
                                                self.prior, self.prior_weight)


def drafted_line(rows: np.ndarray, shares: np.ndarray, weights: np.ndarray, prior: float, prior_weight: float
                 ) -> tuple[float, float]:
    """(cost, step): the median line (Theil-Sen) through drafted passes' shares of a one-row pass,
    with the model's price as two pseudo-passes."""
    rows = np.append(rows, [1.0, PRIOR_ROWS])
    shares = np.append(shares, [1 + prior, 1 + prior * PRIOR_ROWS])
    weights = np.append(weights, [prior_weight] * 2)
    first, second = pairs(len(rows))
    spread = rows[second] - rows[first]
    apart = spread != 0
    slopes = (shares[second] - shares[first])[apart] / spread[apart]
    per_row = max(MIN_PRICE, weighted_median(slopes, (weights[first] * weights[second])[apart]))
    return per_row, max(0.0, weighted_median(shares - per_row * rows, weights) - 1)


@lru_cache(maxsize=None)
def pairs(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (i < j) of `count` points, as two index arrays."""
    return np.triu_indices(count, 1)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
