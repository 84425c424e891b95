"""Dense decoding: one target pass per token. The reference every other strategy matches."""
from __future__ import annotations

from typing import Iterator

import torch

from ..model.passes import PassRows
from .base import DecodeState, Step, Strategy


class Autoregressive(Strategy):
    name = "dense"

    def decode(self, state: DecodeState) -> Iterator[Step]:
        model, cache = state.model, state.cache
        logits = state.logits
        while True:
            token = int(state.sampler.pick(state.sampler.adjusted(logits, state.tokens))[0])
            state.tokens.append(token)
            yield Step([token], logits=logits, method="none")
            ids = torch.tensor([token], device=model.device)
            positions = torch.tensor([cache.length], device=model.device)
            _, logits = state.passes.run_pass(PassRows(ids, positions, cache))
            state.stats.target_passes += 1
            state.stats.record_method("none")
            state.stats.weight_bytes += model.weight_bytes
