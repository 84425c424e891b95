"""Sampling parameters and the one place where logits become token choices."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [N, V] -> probabilities [N, V] (fp32) after temperature, top-k and top-p.

    Target and draft go through this same function, so speculative sampling compares the
    distributions the user asked for.
    """
    scores = logits.float() / max(params.temperature, 1e-5)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # also where top_p rounds to 0 in fp32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


class Sampler:
    """Turns logits into tokens for one request: argmax when greedy, else seeded sampling."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits, self.params)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] -> tokens [N]."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator).squeeze(-1)
