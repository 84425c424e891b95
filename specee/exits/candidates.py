"""Where an exit decision's K candidate tokens come from: a drafter's top K guesses for the next
token, filled up with `fallback` tokens (the model's most common) when it has fewer."""
from __future__ import annotations

from typing import Callable

import torch

from ..drafters.base import Proposer


class Candidates:
    def __init__(self, make_proposer: Callable[[], Proposer], fallback: list[int], k: int = 4) -> None:
        if k < 1:
            raise ValueError(f"exit candidates must be >= 1, got {k}")
        if len(set(fallback)) < k:
            raise ValueError(f"{k} candidates need at least {k} distinct fallback tokens")
        self.make_proposer = make_proposer
        self.fallback = list(fallback)
        self.k = k

    def pick(self, proposer: Proposer, context: list[int], device, leading: list[int] = ()) -> tuple[torch.Tensor, float]:
        """(the K candidate ids for the token after `context`, the drafter's probability of the
        first). `leading`: tokens that come first whatever the drafter says (the draft tokens being
        verified after this position), at most K of them."""
        guesses = proposer.candidates(context, self.k)
        ids = [token for token, _ in guesses]
        if leading:
            probability = next((prob for token, prob in guesses if token == leading[0]), 0.0)
            ids = list(dict.fromkeys([*leading, *ids]))[: self.k]
            guesses = [(leading[0], probability)]
        for token in self.fallback:
            if len(ids) >= self.k:
                break
            if token not in ids:
                ids.append(token)
        return torch.tensor(ids, device=device), guesses[0][1] if guesses else 0.0

    def table(self, ids: list[int], device) -> torch.Tensor:
        """[T, K]: the candidates for the token after each position of `ids` (teacher forcing)."""
        proposer = self.make_proposer()
        proposer.reset(ids[:1], None)
        rows = []
        for t in range(len(ids)):
            if t:
                proposer.update(ids[: t + 1], 0)
            rows.append(self.pick(proposer, ids[: t + 1], device)[0])
        return torch.stack(rows)
