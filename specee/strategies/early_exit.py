"""Early exit (SpecEE) in plain autoregressive decoding: one pass per token, stopped after the
first layer whose exit policy fires and whose full-head check agrees (the full-vocabulary argmax
there is one of the candidates; that argmax is the token). Each pass is a verification pass over
no draft, so plain and speculative decoding settle an exit by one rule. Lossy: its cost is
measured by the benchmark (exit fidelity, perplexity, divergence from dense), never assumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from ..exits.candidates import Candidates
from ..exits.policy import ExitPolicy
from ..verification.draft import Draft
from ..verification.tree import TreeLayout
from .base import DecodeState, Step, Strategy
from .exit_pass import ExitPass
from .speculative_exit import ExitVerifier


@dataclass(eq=False)
class EarlyExit(Strategy):
    """Autoregressive decoding with early exits; a recipe like Speculative (fresh drafter and
    policy per generation)."""

    candidates: Candidates
    make_policy: Callable[[], ExitPolicy]
    kv: str = "exact"
    name: str = "exit"
    lossless = False
    full_logits = False
    speculative = None  # no drafter: each pass verifies an empty draft

    def decode(self, state: DecodeState) -> Iterator[Step]:
        tokens, stats = state.tokens, state.stats
        runner = ExitPass(state.model, state.cache, self.make_policy(), self.kv, stats, passes=state.passes)
        verifier = ExitVerifier(self.candidates, runner, tokens, state.sampler)
        no_draft = Draft.empty()
        layout = TreeLayout.of(no_draft)
        logits, exit_layer = state.logits, None  # the prompt's pass ran every layer
        while True:
            token = int(state.sampler.pick(logits)[0])
            tokens.append(token)
            yield Step([token], exit_layer=exit_layer)
            verifier.update(tokens, 0)
            verified = verifier.verify(tokens, no_draft, layout)
            logits, exit_layer = verified.logits, verified.exit_layer
            stats.target_passes += 1
