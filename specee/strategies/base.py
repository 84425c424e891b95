"""What every decoding strategy receives and yields."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from ..model.cache import KVCache
from ..model.llama import Transformer
from ..model.passes import Passes
from ..sampling import Sampler
from ..stats import GenerationStats


@dataclass
class DecodeState:
    """Everything a strategy needs after prefill. `tokens` holds prompt + output so far and
    grows as the strategy yields; `logits` are the target's logits after the last prompt token."""

    model: Transformer
    cache: KVCache
    tokens: list[int]
    logits: torch.Tensor  # [1, vocab]
    sampler: Sampler
    stats: GenerationStats
    hidden: torch.Tensor | None = None  # [prompt, hidden] the last layer's states (before the final norm)
    # [prompt, hidden] the states after the strategy's `shallow_layers` first layers, when it has them
    shallow: torch.Tensor | None = None
    # Runs the target's passes (`run_pass`, and `run_layer` for a pass run layer by layer): the
    # model itself, at once, or a server batch's member, sharing them with the other generations.
    passes: Passes | None = None
    # The last layer's states of the committed positions, in order, where the strategy has them
    # (a feature drafter's: the prompt's, then each pass's accepted rows), for the prefix cache.
    final_states: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.passes = self.passes or self.model


class Step(NamedTuple):
    """What a strategy commits at once: accepted draft tokens (none for dense decoding), then
    exactly one token the target chose itself."""

    tokens: list[int]
    drafted: int = 0  # how many leading tokens were drafts
    exit_layer: int | None = None  # the layers the pass behind these tokens ran, when it stopped early
    # The model's logits the tokens were chosen from: token i from row rows[i] of `logits`
    # (rows None: row i), for the log-probabilities a request may ask for.
    logits: torch.Tensor | None = None
    rows: list[int] | None = None
    # The method that drafted the pass behind these tokens ("none": nothing was drafted); None for
    # tokens no pass of a drafting loop made (the first, from the prompt's pass).
    method: str | None = None


class Strategy:
    """A decoding strategy: yields Steps until closed. A recipe that holds no generation's state,
    so one strategy serves any number of generations. What it can do is declared here, with the
    defaults of dense decoding; the engine and the server read these, never probe for others."""

    name: str = "strategy"
    # Greedy output token-identical to dense decoding, sampling distributed like it: its K/V and
    # text may be kept for later requests.
    lossless: bool = True
    # False where tokens are chosen at a partial depth among a few candidates (early exits): the
    # request's penalties, logit bias, grammar and log-probabilities, all over the full
    # vocabulary, then do not apply.
    full_logits: bool = True
    greedy_only: bool = False  # acceptance compares argmaxes: temperature 0 only
    # Whether its drafter reads the prompt's last-layer states (DecodeState.hidden): cached prompt
    # blocks must then hold them.
    reads_features: bool = False
    # The target's first layers its drafter runs itself (Kangaroo): prefill then hands it the
    # prompt's states after them (DecodeState.shallow). None: no drafter shares the target's layers.
    shallow_layers: int | None = None

    def decode(self, state: DecodeState) -> Iterator[Step]:
        raise NotImplementedError
