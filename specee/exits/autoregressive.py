"""Early exit (SpecEE) in plain autoregressive decoding: one pass per token, stopped after the
first layer whose exit policy fires and whose full-head check agrees (the full-vocabulary argmax
there is one of the candidates; that argmax is the token). Lossy: its cost is measured by the
benchmark (exit fidelity, perplexity, divergence from dense), never assumed.
"""
from __future__ import annotations

from typing import Callable, Iterator

from ..decoding.base import DecodeState
from .candidates import Candidates
from .runner import KV_MODES, ExitPass, ExitPolicy


class EarlyExit:
    """Autoregressive decoding with early exits; a recipe like Speculative (fresh drafter and
    policy per generation)."""

    lossless = False

    def __init__(self, candidates: Candidates, make_policy: Callable[[], ExitPolicy], kv: str = "exact",
                 name: str = "exit") -> None:
        if kv not in KV_MODES:
            raise ValueError(f"exit KV must be one of {', '.join(KV_MODES)}, got {kv!r}")
        self.candidates = candidates
        self.make_policy = make_policy
        self.kv = kv
        self.name = name

    def decode(self, state: DecodeState) -> Iterator[list[int]]:
        model, tokens, stats = state.model, state.tokens, state.stats
        proposer = self.candidates.make_proposer()
        proposer.reset(tokens, state.sampler)
        runner = ExitPass(model, state.cache, self.make_policy(), self.kv, stats)
        logits = state.logits
        while True:
            token = int(state.sampler.pick(logits)[0])
            tokens.append(token)
            yield [token]
            proposer.update(tokens, 0)
            candidates, drafter_prob = self.candidates.pick(proposer, tokens, model.device)
            logits, layers = runner.step(token, candidates, drafter_prob)
            stats.target_passes += 1
            stats.exit_layers.append(layers)
