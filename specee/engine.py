"""The Engine: owns the model, tokenizer and KV cache; runs prefill and a strategy's step loop."""
from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .decoding.autoregressive import Autoregressive
from .decoding.base import DecodeState, Strategy
from .model.cache import KVCache
from .model.llama import Transformer
from .sampling import Sampler, SamplingParams
from .stats import GenerationStats
from .text_stream import TextStream
from .tokenizer import Messages, Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
GENERATION_OPTIONS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "chat", "strategy"}
# Cache slots beyond prompt + max_tokens, so a verification pass may write draft tokens past the end.
CACHE_SLACK = 128


@dataclass
class Event:
    """One step of a stream: the tokens it committed and the text they made final."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last event: "stop" (EOS or stop string) or "length"


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    stats: GenerationStats = field(repr=False)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict() | {"prefill_s": self.stats.prefill_s, "decode_s": self.stats.decode_s},
        }


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available")
    return torch.device(name)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, source: Path | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.source = source  # the GGUF file or model directory it was loaded from
        self._cache: KVCache | None = None
        self._strategies: dict[str, Strategy] = {}

    @property
    def config(self):
        return self.model.config

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the model for trained artifacts: architecture and tokenizer (what a token-level
        table depends on), independent of dtype and device."""
        config = {k: v for k, v in self.config.to_dict().items() if k not in ("extra", "torch_dtype", "dtype")}
        blob = json.dumps([config, sorted(self.tokenizer.vocab.items())], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    def encode(self, prompt: str | Messages, chat: bool = True) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, chat=chat)

    def generate(self, prompt: str | Messages, **options) -> Result:
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Messages | list[int], spec_method: str | None = None, **options) -> "Generation":
        """Options: max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, chat, and either a
        ready `strategy` or speculative decoding settings: spec_method (none, prompt-lookup, ngram,
        draft, staged) with any of num_draft_tokens, tree ("auto" or rank paths "0;1;0,0"),
        tree_budget, tree_width, draft_model (a path or "self:L"), ngram_model,
        confidence_threshold, adaptive."""
        spec = {k: options.pop(k) for k in list(options) if k not in GENERATION_OPTIONS}
        spec = {k: v for k, v in spec.items() if v is not None}
        if spec_method not in (None, "none"):
            options["strategy"] = self.strategy(spec_method, **spec)
        elif spec:
            raise ValueError(f"options {sorted(spec)} need a spec_method (or are unknown)")
        return Generation(self, prompt, **options)

    def strategy(self, spec_method: str | None = None, **spec_options) -> Strategy:
        """The decoding strategy for these options, built once and reused (draft models and
        n-gram tables are loaded only the first time)."""
        if spec_method in (None, "none"):
            return Autoregressive()
        from .decoding.spec_builder import build_speculative

        options = {k: v for k, v in spec_options.items() if v is not None}
        key = json.dumps([spec_method, options], sort_keys=True)
        if key not in self._strategies:
            self._strategies[key] = build_speculative(self, {"method": spec_method, **options})
        return self._strategies[key]

    def cache_for(self, length: int) -> KVCache:
        """A reset cache with room for `length` positions (reused across requests)."""
        if self._cache is None or self._cache.max_len < length:
            self._cache = self.model.new_cache(length)
        self._cache.reset()
        return self._cache

    def prefill(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run the prompt through the model; returns the logits after its last token [1, vocab]."""
        device = self.model.device
        h = self.model.hidden(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), cache)
        return self.model.logits(self.model.norm(h[-1:]))


class Generation:
    """A running request: iterate for Events; `.result` is filled when iteration ends."""

    def __init__(
        self,
        engine: Engine,
        prompt: str | Messages | list[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] | str = (),
        ignore_eos: bool = False,
        chat: bool = True,
        strategy: Strategy | None = None,
    ) -> None:
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
        self.engine = engine
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            self.prompt_ids = list(prompt)
        else:
            self.prompt_ids = engine.encode(prompt, chat=chat)
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(self.prompt_ids) >= engine.context_length:
            raise ValueError(
                f"the prompt has {len(self.prompt_ids)} tokens but the model's context is "
                f"{engine.context_length}: shorten it"
            )
        self.max_tokens = min(max_tokens, engine.context_length - len(self.prompt_ids))
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        self.eos = set() if ignore_eos else set(engine.tokenizer.eos_token_ids)
        self.strategy = strategy or Autoregressive()
        self.result: Result | None = None

    def __iter__(self) -> Iterator[Event]:
        engine, model = self.engine, self.engine.model
        stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        text = TextStream(engine.tokenizer, self.stop)
        output: list[int] = []
        finish = "length"
        with torch.inference_mode():
            cache = engine.cache_for(len(self.prompt_ids) + self.max_tokens + CACHE_SLACK)
            start = time.perf_counter()
            logits = engine.prefill(self.prompt_ids, cache)
            stats.weight_bytes += model.weight_bytes
            stats.prefill_s = time.perf_counter() - start
            state = DecodeState(model, cache, list(self.prompt_ids), logits, Sampler(self.params, model.device), stats)
            steps = self.strategy.decode(state)
            start = time.perf_counter()
            try:
                for new in steps:
                    new, finish = self._cut(new, len(output))
                    output.extend(new)
                    delta = text.add(new)
                    if text.stopped:
                        finish = "stop"
                    if finish != "continue":
                        break
                    yield Event(new, delta)
            finally:
                steps.close()
                stats.decode_s = time.perf_counter() - start
        stats.generated_tokens = len(output)
        yield Event(new, delta + text.finish(), finish)
        self.result = Result(text.text, output, len(self.prompt_ids), len(output), finish, stats)

    def _cut(self, new: list[int], produced: int) -> tuple[list[int], str]:
        """Keep the tokens up to an EOS or the token limit; say whether generation goes on."""
        for i, token in enumerate(new):
            if token in self.eos:
                return new[: i + 1], "stop"
            if produced + i + 1 >= self.max_tokens:
                return new[: i + 1], "length"
        return new, "continue"
