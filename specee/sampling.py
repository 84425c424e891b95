"""Sampling parameters and the one place where logits become token choices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: -2..2
MAX_LOGIT_BIAS = 100.0  # and for a logit bias: -100..100
MAX_TOP_LOGPROBS = 20  # OpenAI's most alternatives per token


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's: logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), counting
    # the tokens generated so far (not the prompt's, as vLLM counts), and logit[t] += logit_bias[t].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias takes token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether the logits depend on more than the model: penalties or a bias."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


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


class RowConstraint(Protocol):
    """A grammar over the output (grammar.Constraint): what it allows after the committed output
    and each row's draft path, and the tokens it forces."""

    def advance(self, output: list[int]) -> None: ...

    def masks(self, paths: list[list[int]]) -> torch.Tensor: ...  # [rows, vocab] bool

    def forced(self) -> list[int]: ...

    def admissible(self, draft): ...  # the draft less the nodes it refuses


class Sampler:
    """Turns logits into tokens for one request: argmax when greedy, else seeded sampling. The
    target's logits first go through `adjusted` (the request's penalties, bias and grammar), with the
    tokens before each row: `prompt_length` of them are the prompt's."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", prompt_length: int = 0,
                 constraint: RowConstraint | None = None) -> None:
        self.params = params
        self.prompt_length = prompt_length
        self.constraint = constraint  # the request's grammar, if it has one
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def adjusts(self) -> bool:
        """Whether `adjusted` changes the logits: penalties, a bias or a grammar."""
        return self.params.adjusts or self.constraint is not None

    def forced(self, tokens: list[int]) -> list[int]:
        """The tokens the request's grammar forces after `tokens` (none without a grammar)."""
        if self.constraint is None:
            return []
        self.constraint.advance(tokens[self.prompt_length:])
        return self.constraint.forced()

    def admissible(self, tokens: list[int], draft):
        """The draft less the nodes the grammar refuses after `tokens`, where dropping them is exact:
        greedy verification, or drafts verified as deterministic picks (not i.i.d. samples), and not
        drafts whose shallow layers already ran in the cache (Kangaroo's)."""
        if self.constraint is None or draft.shallow is not None or (draft.sampled and not self.greedy):
            return draft
        self.constraint.advance(tokens[self.prompt_length:])
        return self.constraint.admissible(draft)

    def adjusted(self, logits: torch.Tensor, tokens: list[int], paths: list[list[int]] | None = None) -> torch.Tensor:
        """The logits [N, V] of rows that follow `tokens` (prompt and output so far), row i after
        `paths[i]` more tokens (its draft path; default none), with the request's penalties and
        bias applied, and the tokens its grammar refuses there at -inf. Unchanged when the request
        has none of them."""
        params = self.params
        if not self.adjusts:
            return logits
        rows, vocab = logits.shape
        adjusted = logits.float().clone() if params.adjusts else logits.float()
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(tokens[self.prompt_length:], dtype=torch.long)
            counts = torch.bincount(output, minlength=vocab)[:vocab].float().expand(rows, vocab).clone()
            for row, path in enumerate(paths or ()):
                if path:
                    counts[row].index_add_(0, torch.tensor(path), torch.ones(len(path)))
            counts = counts.to(adjusted.device)
            adjusted -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        for token, bias in params.logit_bias:
            adjusted[:, token] += bias
        if self.constraint is not None:
            self.constraint.advance(tokens[self.prompt_length:])
            allowed = self.constraint.masks(paths or [[]] * rows).to(adjusted.device)
            adjusted = torch.where(allowed, adjusted, float("-inf"))
        return adjusted

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return processed_probs(logits, self.params)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] -> tokens [N]."""
        if self.greedy:
            return argmax(logits)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator).squeeze(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: each row's first maximum, as `logits.argmax(-1)`; on the CPU through numpy,
    whose reduction over a vocabulary takes a fraction of torch's (a share of a small model's pass)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)
