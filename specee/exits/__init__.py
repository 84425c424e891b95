"""Speculative early exit (SpecEE): the drafter's K candidate tokens shrink the exit decision at a
layer to K numbers, so a tiny per-layer predictor (or a fixed rule) can stop a pass early. From the
bottom up: candidates, features -> predictors, scheduler -> policy -> runner (one pass stopped
early) -> the strategies (autoregressive, speculative), which builder makes from exit options."""
from . import policy  # noqa: F401  (registers the built-in exit kinds)
