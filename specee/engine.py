"""The Engine: owns the model, tokenizer and shared drafting artifacts; every generation gets its
own KV cache and its own drafting state, so generations never disturb each other."""
from __future__ import annotations

import copy
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from .artifact_store import ArtifactStore
from .drafters.suffix_cache import DEFAULT_BUDGET_TOKENS, SuffixCache
from .grammar import Grammar, GrammarCompiler
from .loader import load_parts
from .model.cache import KVCache, SpareBuffers
from .model.llama import Transformer
from .model.memory import kv_cache_bytes
from .model.passes import Passes, PassRows
from .prefix_cache import PrefixCache, available_memory, default_budget_bytes
from .sampling import MAX_TOP_LOGPROBS, Sampler, SamplingParams
from .stats import GenerationStats
from .strategies.base import DecodeState, Step, Strategy
from .strategies.builder import build_strategy
from .strategies.config import MAX_DRAFT_NODES, SpecConfig
from .text_stream import TextStream
from .tokenizer import Messages, Tokenizer

GENERATION_OPTIONS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "chat", "strategy",
                      "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar", "prefix_cache",
                      "prompt_logprobs", "stop_check"}
# Cache slots beyond prompt + max_tokens, so a verification pass may write draft tokens past the end.
CACHE_SLACK = MAX_DRAFT_NODES + 1
# Output slots a generation's cache starts with; it grows (doubling) when a long answer needs more.
INITIAL_OUTPUT_SLOTS = 512
# Prompt rows scored at once for prompt log-probabilities: [rows, vocab] floats stay ~100 MB.
PROMPT_LOGPROB_ROWS = 512


@dataclass
class Event:
    """One step of a stream: the tokens it committed and the text they made final."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last event: "stop" (EOS or stop string) or "length"
    # How many leading token_ids were accepted draft tokens; the rest came from the target itself.
    drafted: int = 0
    # Early exit: the layers run by the pass that made these tokens when it stopped early; None
    # when it ran them all.
    exit_layer: int | None = None
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them
    method: str | None = None  # the method that drafted the pass behind these tokens (Step.method)
    # On a stream's first event, when asked for: the prompt's tokens after its first (prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (its logits before temperature, penalties and
    filters, as vLLM reports by default), and the `top` likeliest tokens of that distribution."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    stats: GenerationStats = field(repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    prompt_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # tokens after the first

    def to_dict(self) -> dict:
        names = ("text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason")
        stats = self.stats.to_dict() | {"prefill_s": self.stats.prefill_s, "decode_s": self.stats.decode_s}
        return {name: getattr(self, name) for name in names} | {"stats": stats}


class PrefillState(NamedTuple):
    """A prompt's prefill: its cache, the logits after it, and the states a drafter reads."""

    cache: KVCache
    logits: torch.Tensor
    hidden: torch.Tensor | None
    shallow: torch.Tensor | None


class SharedPrefill:
    """One prompt pass for several generations of one request (n > 1): the first publishes a copy
    of its prefill, each of the others takes one (the last takes the published copy itself)."""

    def __init__(self, followers: int) -> None:
        self.left = followers
        self.state: PrefillState | None = None
        self.abandoned = False  # the first ended before its prefill: the others prefill alone

    @property
    def settled(self) -> bool:
        return self.state is not None or self.abandoned

    def take(self) -> PrefillState | None:
        state = self.state
        if state is None:
            return None
        self.left -= 1
        if self.left == 0:
            self.state = None
            return state
        return state._replace(cache=state.cache.copy())


def load_engine(model=None, dtype: str = "fp32", device: str = "cpu", threads: int | None = None,
                quantization: str = "auto", compile: bool = True, cpu_tier: str | None = None,
                ctx_size: int | None = None, prefix_cache_mb: float | None = None,
                suffix_cache_tokens: int | None = None, kv_cache_dtype: str = "auto") -> "Engine":
    parts = load_parts(model, dtype=dtype, device=device, threads=threads, quantization=quantization,
                       compile=compile, cpu_tier=cpu_tier, ctx_size=ctx_size, kv_cache_dtype=kv_cache_dtype)
    return Engine(parts.model, parts.tokenizer, source=parts.source, quantization=parts.quantization,
                  context_length=parts.context_length, prefix_cache_mb=prefix_cache_mb,
                  suffix_cache_tokens=suffix_cache_tokens)


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, source: Path | None = None,
                 quantization: str = "none", context_length: int | None = None,
                 prefix_cache_mb: float | None = None, suffix_cache_tokens: int | None = None) -> None:
        self.model = model
        self.loaded_threads = torch.get_num_threads()
        self.tokenizer = tokenizer
        self.source = source  # the GGUF file or model directory it was loaded from
        self.quantization = quantization  # how the matrices are stored: none, int8, int4 or gguf
        # The longest prompt plus answer a generation may hold (the KV cache grows up to it).
        self.context_length = context_length or model.config.max_position_embeddings
        # Earlier generations' prompts and answers, which `auto` drafts from (0 tokens: none kept).
        self.suffix_cache = SuffixCache(DEFAULT_BUDGET_TOKENS if suffix_cache_tokens is None else suffix_cache_tokens)
        self.artifacts = ArtifactStore(model, tokenizer, self.suffix_cache)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)
        # Earlier generations' K/V for prompts that begin the same way, within a budget that follows
        # the model and the machine unless one is asked for. Off by default where the kernels are
        # not batch-invariant (CUDA): a reused prefix would not be bit-identical there.
        if prefix_cache_mb is not None:
            budget = int(prefix_cache_mb * 2**20)
        else:
            element = model.kv_cache_dtype.itemsize
            budget = default_budget_bytes(kv_cache_bytes(model.config, 1, element), available_memory()) if model.uses_kernels else 0
        self.prefix_cache = PrefixCache(budget)
        # Finished generations' K/V buffers, which the next ones write into: at most what the memory
        # check at load counted for one full-context cache.
        self.spare_buffers = SpareBuffers(kv_cache_bytes(model.config, self.context_length, model.kv_cache_dtype.itemsize))

    @property
    def pass_threads(self) -> int:
        """The threads the model's passes run on now: the loaded count, or fewer while another
        process holds a core (model/thread_governor.py)."""
        governor = self.model.thread_governor
        return governor.running if governor is not None else self.loaded_threads

    @property
    def cpu_tier(self) -> str | None:
        """The CPU tier specee's kernels run in (avx512, avx2, ...), or None on PyTorch's kernels."""
        return self.model.kernels.tier if self.model.uses_kernels else None

    @property
    def config(self):
        return self.model.config

    def encode(self, prompt: str | Messages, chat: bool = True) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, chat=chat)

    def generate(self, prompt: str | Messages, **options) -> Result:
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Messages | list[int], config: SpecConfig | str | None = None,
               **options) -> "Generation":
        """Options: max_tokens (0: the prompt alone), temperature, top_k, top_p, seed, stop, ignore_eos, chat,
        presence_penalty, frequency_penalty, logit_bias ({token id: bias}), logprobs, prompt_logprobs (the
        alternatives for each prompt token: its log-probabilities are reported), grammar (a Grammar), stop_check
        (makes a test of each token's text that ends the answer: Generation's), and either a
        ready `strategy` or a decoding configuration: a SpecConfig, or its keywords (spec_method,
        tree, ..., exit, exit_kv, ...; strategies/config.py declares them all). Without any, the
        default method (`auto`); spec_method="none" decodes densely."""
        spec = {k: v for k in list(options) if k not in GENERATION_OPTIONS and (v := options.pop(k)) is not None}
        if config is not None or spec:
            options["strategy"] = self.strategy(config, **spec)
        return Generation(self, prompt, **options)

    @functools.cached_property
    def default_strategy(self) -> Strategy:
        """What a generation runs when it names no decoding options (`DEFAULT_METHOD`)."""
        return self.strategy(SpecConfig())

    def strategy(self, config: SpecConfig | str | None = None, **keywords) -> Strategy:
        """The decoding strategy for a configuration, given whole or as keywords (a method name
        first stands for spec_method). Tables, draft models and predictors load once per engine;
        the strategy holds no per-request state, so it may be reused and shared."""
        if not isinstance(config, SpecConfig):
            config = SpecConfig.from_keywords({"spec_method": config, **keywords} if config else keywords)
        elif keywords:
            config = config.merged(keywords)
        return build_strategy(config, self.artifacts)

    def new_cache(self, prompt_tokens: int, max_tokens: int) -> KVCache:
        """A cache for one generation: room for all it may write, allocated as it goes. Its first
        allocation is rounded up to a power of two (within the context), so that the buffers it
        leaves behind hold the next call of a conversation or an agent's loop, whose prompt is this
        one's and a little more."""
        limit = prompt_tokens + max_tokens + CACHE_SLACK
        needed = prompt_tokens + min(max_tokens, INITIAL_OUTPUT_SLOTS) + CACHE_SLACK
        rounded = min(1 << (needed - 1).bit_length(), max(needed, self.context_length + CACHE_SLACK))
        return self.model.new_cache(limit, capacity=rounded, spares=self.spare_buffers)


class Generation:
    """A running request: iterate for Events; `.result` is filled when iteration ends."""

    def __init__(self, engine: Engine, prompt: str | Messages | list[int], max_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: list[str] | tuple[str, ...] | str = (), ignore_eos: bool = False, chat: bool = True,
                 strategy: Strategy | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
                 grammar: Grammar | None = None, prefix_cache: bool = True, prompt_logprobs: int | None = None,
                 stop_check: Callable[[], Callable[[str], bool]] | None = None) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens}")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} (the alternatives per token) must be in 0..{MAX_TOP_LOGPROBS}, got {value}")
        self.logprobs = logprobs  # None: none; k: each token's, and the k likeliest tokens'
        self.prompt_logprobs = prompt_logprobs  # the same for the prompt's tokens
        self.engine = engine
        vocab = engine.model.config.vocab_size
        if any(not 0 <= token < vocab for token in logit_bias or {}):
            raise ValueError(f"logit_bias names a token outside the vocabulary (ids 0..{vocab - 1})")
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                     logit_bias=tuple(sorted((logit_bias or {}).items())))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            self.prompt_ids = list(prompt)
        else:
            self.prompt_ids = engine.encode(prompt, chat=chat)
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(self.prompt_ids) > engine.context_length - (max_tokens > 0):  # max_tokens 0 scores a full context
            raise ValueError(
                f"the prompt has {len(self.prompt_ids)} tokens but the context is {engine.context_length} "
                "(--ctx-size): shorten it"
            )
        self.max_tokens = min(max_tokens, engine.context_length - len(self.prompt_ids))
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        self.eos = set() if ignore_eos else set(engine.tokenizer.eos_token_ids)
        self.strategy = strategy or engine.default_strategy
        if self.strategy.greedy_only and temperature > 0:
            raise ValueError(f"{self.strategy.name} runs greedy only: use temperature 0")
        if not self.strategy.full_logits:
            if self.params.adjusts:
                raise ValueError(f"{self.strategy.name} does not apply presence or frequency penalties or a logit bias")
            if logprobs is not None or prompt_logprobs is not None:
                raise ValueError(f"{self.strategy.name} chooses among a few candidates: it has no log-probabilities")
            if grammar is not None:
                raise ValueError(f"{self.strategy.name} chooses among a few candidates: it cannot follow a grammar")
        if grammar is not None and ignore_eos:
            raise ValueError("a grammar ends the answer when it is complete: drop ignore_eos")
        self.grammar = grammar
        # Makes, for each answer (n > 1 choices share this), a test of each token's text that says
        # when the answer is complete beyond EOS and stop strings (the server's tool calls).
        self.stop_check = stop_check
        # Reuse and keep prefixes. Prompt log-probabilities need every prompt row's states, which
        # a reused prefix skips: such a request prefills its whole prompt, as a fresh one would.
        self.prefix_cache = prefix_cache and engine.prefix_cache.enabled and prompt_logprobs is None
        if grammar is not None:
            engine.grammars.check(grammar)
        self.result: Result | None = None
        self.share: SharedPrefill | None = None  # n > 1: the prefill this generation shares
        self.leads = True  # it runs the shared prefill (else it takes it)

    def followers(self, count: int) -> list["Generation"]:
        """`count` more generations of this request that start from its prefill (n > 1), so one
        prompt pass serves them all. With a seed, follower i samples with seed + i + 1."""
        self.share = SharedPrefill(count)
        twins = []
        for i in range(count):
            twin = copy.copy(self)
            seed = None if self.params.seed is None else self.params.seed + i + 1
            twin.params = dataclasses.replace(self.params, seed=seed)
            twin.leads = False
            twins.append(twin)
        return twins

    @property
    def ready(self) -> bool:
        """False while this follower's leader has not prefilled, or while another generation
        prefills the blocks this prompt would take from the prefix cache (a batch holds it back)."""
        if self.prefix_cache and self.engine.prefix_cache.awaits(self.prompt_ids):
            return False
        return self.share is None or self.leads or self.share.settled

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self, passes: Passes | None = None, prefill_chunk: int | None = None) -> Iterator[Event]:
        """The stream of Events. `passes` runs the target's passes (default: the model, at once; a
        server batch shares them between generations); `prefill_chunk` caps the prompt tokens one
        pass takes (default: the whole prompt at once)."""
        engine, model = self.engine, self.engine.model
        passes = passes or model
        stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        text = TextStream(engine.tokenizer, self.stop)
        done = self.stop_check() if self.stop_check is not None else None
        output: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if self.logprobs is not None else None
        finish, new, delta, drafted, exit_layer, new_logprobs, method = "length", [], "", 0, None, None, None
        # Inference mode is entered per step, never held across a yield: interleaved generations
        # would otherwise unwind each other's mode.
        start = time.perf_counter()
        shared = self.share.take() if self.share is not None and not self.leads else None
        if shared is not None:
            cache, logits, hidden, shallow = shared
        else:
            try:
                with torch.inference_mode():
                    cache = engine.new_cache(len(self.prompt_ids), self.max_tokens)
                    logits, hidden, shallow = self._prefill(cache, passes, prefill_chunk, stats)
                    if self.share is not None and self.leads:
                        self.share.state = PrefillState(cache.copy(), logits, hidden, shallow)
            finally:
                if self.share is not None and self.leads and self.share.state is None:
                    self.share.abandoned = True
        prompt_entries = None
        if self.prompt_logprobs is not None:
            with torch.inference_mode():
                prompt_entries = prompt_token_logprobs(model, hidden, self.prompt_ids, self.prompt_logprobs)
        stats.prefill_s = time.perf_counter() - start
        if self.max_tokens == 0:  # the prompt alone: its prefill, its log-probabilities
            engine.spare_buffers.give(cache)
            yield Event([], "", "length", logprobs=None if logprobs is None else [], prompt_logprobs=prompt_entries)
            self.result = Result("", [], len(self.prompt_ids), 0, "length", stats, logprobs, prompt_entries)
            return
        unsent_prompt = prompt_entries  # they go with the first event
        constraint = engine.grammars.constraint(self.grammar) if self.grammar is not None else None
        sampler = Sampler(self.params, model.device, len(self.prompt_ids), constraint)
        state = DecodeState(model, cache, list(self.prompt_ids), logits, sampler, stats,
                            hidden, shallow, passes)
        steps = self.strategy.decode(state)
        start = time.perf_counter()
        try:
            while True:
                with torch.inference_mode():
                    step = next(steps, None)
                if step is None:  # a strategy that ends by itself ends the generation
                    new, delta, drafted, new_logprobs = [], "", 0, None if logprobs is None else []
                    break
                new, delta, finish = self._commit(step.tokens, output, text, done)
                drafted, exit_layer = min(len(new), step.drafted), step.exit_layer  # cut short: fewer drafts
                stats.draft_tokens_accepted -= step.drafted - drafted  # count only what reached the user
                method = step.method
                if logprobs is not None:
                    new_logprobs = token_logprobs(step, len(new), self.logprobs)
                    logprobs += new_logprobs
                if finish != "continue":
                    break
                stats.decode_s = time.perf_counter() - start
                yield Event(new, delta, drafted=drafted, exit_layer=exit_layer, logprobs=new_logprobs, method=method,
                            prompt_logprobs=unsent_prompt)
                unsent_prompt = None
                start = time.perf_counter() - stats.decode_s  # time spent by the consumer is not decoding
        finally:
            steps.close()
            stats.decode_s = time.perf_counter() - start
            self._keep(state, output)
        stats.generated_tokens = len(output)
        # Ended, not abandoned (a closed or failed generation never gets here): nothing reads the
        # cache any more, and the next generation may write into its buffers.
        engine.spare_buffers.give(cache)
        yield Event(new, delta + text.finish(), finish, drafted, exit_layer, new_logprobs, method, unsent_prompt)
        self.result = Result(text.text, output, len(self.prompt_ids), len(output), finish, stats, logprobs,
                             prompt_entries)

    def _keep(self, state: DecodeState, output: list[int]) -> None:
        """What later requests reuse of this one, however it ended: its K/V blocks for the prefix
        cache, its text for the suffix cache; lossless strategies only (lossy K/V is never shared)."""
        if not self.strategy.lossless:
            return
        if self.prefix_cache:
            layers = self.engine.model.config.num_hidden_layers
            with torch.inference_mode():
                final = {layers: torch.cat(state.final_states)} if state.final_states else None
                self.engine.prefix_cache.store(state.tokens, state.cache, final)
        self.engine.suffix_cache.add(self.prompt_ids + output)  # the model's own text, to draft from

    def _prefill(self, cache: KVCache, passes: Passes, chunk: int | None, stats: GenerationStats):
        """Run the prompt: (logits after its last token [1, vocab], the last layer's states of every
        prompt token, the states after the drafter's shared layers or None)."""
        layers = self.engine.model.config.num_hidden_layers
        shallow_layers = self.strategy.shallow_layers
        # The states the strategy reads besides K/V, which cached blocks must then hold.
        depth = shallow_layers or (layers if self.strategy.reads_features else None)
        first, cached_states = 0, None
        if self.prefix_cache:  # the blocks of an earlier prompt that begins the same way
            blocks = self.engine.prefix_cache.lookup(self.prompt_ids, depth)
            if blocks:
                cached_states = self.engine.prefix_cache.restore(blocks, cache, depth)
                first = stats.cached_tokens = cache.length
        claimed = self.engine.prefix_cache.claim(self.prompt_ids) if self.prefix_cache else []
        try:
            return self._run_prompt(cache, passes, chunk, stats, first, cached_states)
        finally:  # stored, failed or cancelled: nobody waits for these blocks any more
            self.engine.prefix_cache.release(claimed)

    def _run_prompt(self, cache: KVCache, passes: Passes, chunk: int | None, stats: GenerationStats, first: int,
                    cached_states: torch.Tensor | None):
        """Prefill the prompt from position `first` (the cache holds those before it, and
        `cached_states` their states where the strategy reads some), then store its blocks."""
        model, layers = self.engine.model, self.engine.model.config.num_hidden_layers
        shallow_layers = self.strategy.shallow_layers
        if shallow_layers:  # a drafter sharing the first layers takes their states on the way
            stats.weight_bytes += model.weight_bytes
            logits, hidden, shallow = model.prefill(self.prompt_ids[first:], cache, shallow_layers, start=first)
            if first:
                hidden, shallow = None, torch.cat((cached_states, shallow))  # no strategy here reads `hidden`
            if self.prefix_cache:
                self.engine.prefix_cache.store(self.prompt_ids, cache, {shallow_layers: shallow} | (
                    {layers: hidden} if hidden is not None else {}))
            return logits, hidden, shallow
        ids = torch.tensor(self.prompt_ids, device=model.device)
        chunk = chunk or len(ids)
        states = []
        for start in range(first, len(ids), chunk):
            piece = ids[start : start + chunk]
            last = start + chunk >= len(ids)
            positions = torch.arange(start, start + len(piece), device=model.device)
            hidden, logits = passes.run_pass(PassRows(piece, positions, cache, logits_from=len(piece) - (1 if last else 0)))
            states.append(hidden)
            stats.weight_bytes += model.weight_bytes
        if first and cached_states is None:
            hidden = None  # the cached part's states are unknown (the strategy does not read them)
        else:
            hidden = torch.cat(([cached_states] if first else []) + states)
        if self.prefix_cache:  # shareable from now on, by requests arriving while this one decodes
            self.engine.prefix_cache.store(self.prompt_ids, cache, {layers: hidden} if hidden is not None else None)
        return logits, hidden, None

    def _commit(self, step: list[int], output: list[int], text: TextStream,
                done: Callable[[str], bool] | None = None) -> tuple[list[int], str, str]:
        """Commit a step's tokens one by one, exactly as dense decoding would: stop after an EOS,
        after the token that completes a stop string or `done`'s end, or at the token limit,
        whatever the step brought after it. Returns (tokens kept, their final text, "stop"/"length"/"continue")."""
        kept: list[int] = []
        delta = ""
        for token in step:
            kept.append(token)
            output.append(token)
            piece = text.add([token])
            delta += piece
            if token in self.eos or text.stopped or done is not None and done(piece):
                return kept, delta, "stop"
            if len(output) >= self.max_tokens:
                return kept, delta, "length"
        return kept, delta, "continue"


def prompt_token_logprobs(model: Transformer, states: torch.Tensor, prompt_ids: list[int], top: int
                          ) -> list[TokenLogprob]:
    """Each prompt token after the first with its log-probability given the tokens before it (the
    prompt row before it, scored from the last layer's `states` [prompt, hidden] as a full prefill
    scores it) and the `top` likeliest tokens of that row."""
    entries = []
    for start in range(0, len(prompt_ids) - 1, PROMPT_LOGPROB_ROWS):
        rows = states[start : start + PROMPT_LOGPROB_ROWS]  # [rows, hidden]
        logprobs = torch.log_softmax(model.logits(model.norm(rows)).float(), dim=-1)  # [rows, vocab]
        following = prompt_ids[start + 1 : start + 1 + len(rows)]  # the token each row predicts
        chosen = logprobs[torch.arange(len(following)), torch.tensor(following)].tolist()
        best = logprobs[: len(following)].topk(top, dim=-1) if top else None
        entries += [TokenLogprob(token, value, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best
                                 else []) for i, (token, value) in enumerate(zip(following, chosen))]
    return entries


def token_logprobs(step: Step, count: int, top: int) -> list[TokenLogprob]:
    """The first `count` tokens of a step, each with its log-probability in the row of the pass
    that chose it and the `top` likeliest tokens of that row."""
    rows = (step.rows or list(range(len(step.tokens))))[:count]
    with torch.inference_mode():
        logprobs = torch.log_softmax(step.logits[rows].float(), dim=-1)
        chosen = logprobs[torch.arange(count), torch.tensor(step.tokens[:count])].tolist()
        best = logprobs.topk(top, dim=-1) if top else None
    return [TokenLogprob(token, value, list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best else [])
            for i, (token, value) in enumerate(zip(step.tokens[:count], chosen))]
