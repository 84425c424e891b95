"""Speculative early exit (SpecEE), the policy's parts: the drafter's K candidate tokens shrink the
exit decision at a layer to K numbers, so a tiny per-layer predictor (or a fixed rule) can stop a
pass early. From the bottom up: candidates, features -> predictors, scheduler -> policy, each kind
registered by name (registry). The passes that stop early are strategies' (specee.strategies)."""
from . import policy  # noqa: F401  (registers the built-in exit kinds)
