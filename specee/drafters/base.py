"""The proposer interface: a drafter guesses tokens, the target verifies them.

One proposer object serves one generation: strategies build a fresh one per request, so its
state (indexes, caches, statistics) is never shared between requests.
"""
from __future__ import annotations

import torch

from ..model.cache import KVCache
from ..sampling import Sampler
from ..verification.draft import Draft


class Proposer:
    """Anything that drafts: prompt lookup, n-gram tables, draft models, staged drafters.

    `propose` is required; the other methods have no-op defaults. A proposer that can rank
    several guesses per position sets `drafts_trees` and implements `candidates`."""

    drafts_trees: bool = False
    # A proposer that reads the target's last-layer hidden states sets this and implements observe.
    wants_features: bool = False
    bytes_read: int = 0  # weight bytes read since the last take_bytes_read; a drafter running weights adds to it

    def reset(self, prompt: list[int], sampler: Sampler | None) -> None:
        """Start a generation after `prompt` with this request's sampler."""

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """Draft at most `max_tokens` nodes continuing `context` (every token so far)."""
        raise NotImplementedError

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """At most k guesses for the token after `context`, (token id, probability), best first."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only")

    def observe(self, features: torch.Tensor) -> None:
        """The target's last-layer hidden states ([n, hidden]) of the next n committed positions:
        first the whole prompt, then after each pass the root and the accepted tokens."""

    def watch(self, passes, stats) -> None:
        """Before the first draft: what runs the generation's passes (`sharing()` says what the other
        generations of a batch put in them) and its GenerationStats, for a policy that sizes drafts by
        what a row costs now and reports its choices (`auto`)."""

    def share_target(self, cache: KVCache, prompt_states: torch.Tensor) -> None:
        """For a self-drafter that runs the target's first layers (the strategy's `shallow_layers`):
        the target's cache, which it extends for those layers as it drafts, and the prompt's states
        after them. Verification then runs only the layers above (Draft.shallow)."""
        raise NotImplementedError(f"{type(self).__name__} does not share the target's layers")

    def update(self, context: list[int], num_accepted: int) -> None:
        """Told after verification: `context` now ends with the accepted tokens."""

    def take_bytes_read(self) -> int:
        """Weight bytes the proposer read since the last call (for bytes per token)."""
        taken, self.bytes_read = self.bytes_read, 0
        return taken
