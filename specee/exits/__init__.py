"""Speculative early exit (SpecEE): the drafter's K candidate tokens shrink the exit decision at a
layer to K numbers, so a tiny per-layer predictor (or a fixed rule) can stop a pass early.

- features.py: what a layer's state says about the candidates (3K numbers).
- predictors.py: one small MLP per layer, and the artifact that ships them for one model.
- scheduler.py: which layers' predictors run (offline ranking plus recent exits).
- policy.py: the exit decision a strategy asks for, layer by layer (learned or the rule).
- candidates.py: where a decision's K candidates come from (a drafter, filled up).
- runner.py: one target pass stopped early, the policy's protocol, the K/V of skipped layers.
- autoregressive.py, speculative.py: the strategies, exits in plain decoding and in verification.
- builder.py: exit options (CLI flags or API keywords) to one of those strategies.
"""
