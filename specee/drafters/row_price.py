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
# The fit (a few hundred slopes, on caches a pass has just emptied) reruns after every REFIT-th
# pass; while the window holds fewer than YOUNG passes, after every drafted one, so a request's
# first drafts learn the price at once. It is plain Python: on lists this short numpy's calls
# cost more than the arithmetic (BENCHMARKS.md, "The row price's fit in plain Python").
REFIT = 8
YOUNG = 8
WEIGHTS = [PRICE_DECAY ** age for age in range(PRICE_WINDOW)]  # by age, the latest pass first


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
        first = self.passes[0][0]
        if all(rows == first for rows, _ in self.passes):
            return  # one shape of pass: nothing to fit a line to, the price stays
        weighted = [(rows, seconds, WEIGHTS[age]) for age, (rows, seconds) in enumerate(reversed(self.passes))]
        dense = [(seconds, weight) for rows, seconds, weight in weighted if not rows]
        if dense:
            one_row = weighted_median(dense)
        else:  # no dense step in the window: each pass read on the current line
            one_row = weighted_median([(seconds / self.share(rows), weight) for rows, seconds, weight in weighted])
        if one_row <= 0:
            return
        self.one_row = one_row
        drafted = [(rows, seconds / one_row, weight) for rows, seconds, weight in weighted if rows]
        if len({rows for rows, _, _ in drafted}) == 1:  # one drafted shape: its cost is known, not how it splits
            rows = drafted[0][0]
            share = weighted_median([(share, weight) for _, share, weight in drafted]) - 1
            self.cost = max(MIN_PRICE, min(self.cost, share / rows))
            self.step = max(0.0, share - self.cost * rows)
        elif drafted:
            self.cost, self.step = drafted_line(drafted, self.prior, self.prior_weight)


def drafted_line(drafted: list[tuple[int, float, float]], prior: float, prior_weight: float) -> tuple[float, float]:
    """(cost, step): the median line (Theil-Sen) through drafted passes' (rows, share of a one-row
    pass, weight), with the model's price as two pseudo-passes."""
    points = drafted + [(1, 1 + prior, prior_weight), (PRIOR_ROWS, 1 + prior * PRIOR_ROWS, prior_weight)]
    slopes = [((share_j - share_i) / (rows_j - rows_i), weight_i * weight_j)
              for i, (rows_i, share_i, weight_i) in enumerate(points)
              for rows_j, share_j, weight_j in points[i + 1:] if rows_j != rows_i]
    per_row = max(MIN_PRICE, weighted_median(slopes))
    return per_row, max(0.0, weighted_median([(share - per_row * rows, weight) for rows, share, weight in points]) - 1)


def weighted_median(weighted: list[tuple[float, float]]) -> float:
    """The value below which half the weight lies, of (value, weight) pairs (ties: the first given)."""
    weighted.sort(key=lambda pair: pair[0])
    half = sum(weight for _, weight in weighted) / 2
    total = 0.0
    for value, weight in weighted:
        total += weight
        if total >= half:
            return value
    return weighted[-1][0]
