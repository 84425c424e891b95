"""What the benchmark runs: our engine's strategies and the outside baselines, behind one interface:
a `name`, whether it is `lossless` (promises the dense output token for token) and `run`."""
from __future__ import annotations

import copy
import functools
import importlib.util
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..drafters.registry import METHODS
from ..engine import Engine
from ..sampling import SamplingParams
from ..strategies.base import Strategy

LLAMA_CPP_INSTALL = "pip install 'specee[llamacpp]' (builds llama.cpp from source, ~15 minutes on 2 cores)"


@dataclass(frozen=True)
class StrategySpec:
    """A named decoding mode: a strategy with fixed options. `specee bench` runs every registered
    one, so a new mode needs no benchmark code."""

    name: str
    lossless: bool
    build: Callable[[Engine, dict], Strategy]  # (engine, options over the mode's own) -> a ready strategy


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    REGISTRY[spec.name] = spec
    return spec


def engine_mode(name: str, **defaults) -> StrategySpec:
    """`engine.strategy` with these options; exits are lossy by nature."""
    return register(StrategySpec(name, "exit" not in defaults,
                                 lambda engine, options: engine.strategy(**(defaults | options))))


engine_mode("dense", spec_method="none")  # one target pass per token
for _method in METHODS.values():  # the modes each drafter module declares (drafters/registry.py)
    for _name, _options in _method.bench.items():
        engine_mode(_name, spec_method=_method.name, **_options)
# Early exit by the bundled per-layer predictors on prompt-lookup/trigram candidates; the skipped
# layers' KV exact (caught up by the next pass) unless approx (computed from the exit state).
engine_mode("exit-specee", exit="specee")
engine_mode("exit-specee-approx", exit="specee", exit_kv="approx")
# The draft-token rule: top token >= 0.99 or draft token >= 0.9, from 7/8 of the depth.
engine_mode("exit-rule", exit="rule")
# Speculation whose verification passes exit early (trees: hyper-tokens; Kangaroo: above its layers).
engine_mode("hybrid+exit-specee", exit="specee", spec_method="hybrid")
engine_mode("hybrid+exit-rule", exit="rule", spec_method="hybrid")
engine_mode("hybrid-tree+exit-specee", exit="specee", spec_method="hybrid", tree="auto")
engine_mode("eagle-copy+exit-specee", exit="specee", spec_method="eagle-copy")
engine_mode("kangaroo+exit-specee", exit="specee", spec_method="kangaroo")


@dataclass
class Run:
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    accept_lengths: list[int] = field(default_factory=list)
    exit_layers: list[int] = field(default_factory=list)
    bytes_per_token: float | None = None
    avg_layers: float | None = None
    drafting: dict | None = None  # see drafting_counts
    exiting: dict | None = None  # see exit_counts


class EngineMode:
    """One registered decoding strategy of our engine, with options over its defaults."""

    def __init__(self, engine: Engine, spec: StrategySpec, options: dict | None = None, name: str | None = None) -> None:
        self.engine = engine
        self.name = name or spec.name
        self.lossless = spec.lossless
        self.strategy = spec.build(engine, options or {})

    def run(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, ignore_eos: bool) -> Run:
        # Every mode answers the same prompts: a run must not draft from another run's answer.
        self.engine.suffix_cache.clear()
        result = self.engine.generate(
            prompt_ids, max_tokens=max_tokens, ignore_eos=ignore_eos, strategy=self.strategy,
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        )
        s = result.stats
        return Run(
            result.token_ids, s.prefill_s, s.decode_s, list(s.accept_lengths), list(s.exit_layers),
            s.bytes_per_token, s.avg_forward_layers, drafting_counts(s), exit_counts(s),
        )


def drafting_counts(s) -> dict | None:
    """What the drafter tables pool over prompts (CTAR, drafting share, draft cost); None for dense."""
    if not s.draft_nodes:
        return None
    return {"position_proposed": list(s.position_proposed), "position_accepted": list(s.position_accepted),
            "draft_s": s.draft_s, "verify_s": s.verify_s, "draft_nodes": s.draft_nodes, "passes": s.target_passes}


def exit_counts(s) -> dict | None:
    """What the early-exit table pools over prompts (predictors, full-head checks); None without exits."""
    if not s.exit_layers:
        return None
    return {"passes": len(s.exit_layers), "predictors_run": s.predictors_run, "exit_checks": s.exit_checks,
            "exit_checks_agreed": s.exit_checks_agreed, "predictor_s": s.predictor_s, "decode_s": s.decode_s}


def parse_mode(text: str) -> tuple[str, dict]:
    """"hybrid-tree[tree_budget=6,tree_width=3]" -> ("hybrid-tree", {"tree_budget": 6, "tree_width": 3}):
    a registered mode with speculative options changed, for tuning sweeps. A comma not followed by
    key= belongs to the value ("exit-rule[exit_rule=0.9,0.6]")."""
    name, _, rest = text.partition("[")
    if not rest:
        return text, {}
    if not rest.endswith("]"):
        raise ValueError(f"mode {text!r}: write options as name[key=value,key=value]")
    options = {}
    for item in filter(None, re.split(r",(?=\s*\w+\s*=)", rest[:-1])):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"mode {text!r}: option {item!r} needs key=value")
        options[key.strip()] = _number_or_text(value.strip())
    return name, options


def _number_or_text(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


class HFMode:
    """Hugging Face `generate` on the same weights, dtype and device; optionally its prompt lookup."""

    def __init__(self, engine: Engine, prompt_lookup_tokens: int | None = None) -> None:
        self.name = "hf" if prompt_lookup_tokens is None else "hf-prompt-lookup"
        self.lossless = False  # a baseline: compared with dense, never judged
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.engine = engine
        self.model = hf_model(engine.source, engine.model.dtype, engine.model.device)
        self.weight_bytes = dense_weight_bytes(self.model)

    def _generate(self, ids: torch.Tensor, max_tokens: int, params: SamplingParams, ignore_eos: bool) -> list[int]:
        config = copy.deepcopy(self.model.generation_config)
        # The same end-of-sequence tokens as our engine; none runs the full length (an empty list:
        # generate fills None from the model's own generation config).
        config.eos_token_id = [] if ignore_eos else list(self.engine.tokenizer.eos_token_ids)
        options = dict(max_new_tokens=max_tokens, pad_token_id=0, do_sample=not params.greedy)
        if not params.greedy:
            options.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
            torch.manual_seed(params.seed or 0)
        if self.prompt_lookup_tokens:
            options["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        with torch.inference_mode():
            return self.model.generate(ids, generation_config=config, **options)[0, ids.shape[1]:].tolist()

    def run(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, ignore_eos: bool) -> Run:
        ids = torch.tensor([prompt_ids], device=self.model.device)
        start = time.perf_counter()
        self._generate(ids, 1, params, ignore_eos)  # prefill alone, to split it from decoding
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        tokens = self._generate(ids, max_tokens, params, ignore_eos)
        total_s = time.perf_counter() - start
        bytes_per_token = None if self.prompt_lookup_tokens else self.weight_bytes
        return Run(tokens, prefill_s, max(total_s - prefill_s, 1e-9), bytes_per_token=bytes_per_token)


@functools.cache  # loaded once, shared by the greedy and prompt-lookup modes
def hf_model(source: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    if source.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    else:  # HF reads the GGUF with its own loader: an independent check of ours
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    return model.to(device).eval()


def dense_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one pass of a dense HF model reads: every parameter but the embedding table
    (one row per token), and the output head even when it is the embedding (tied)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)  # tied: listed once
    return total + (head.numel() * head.element_size() if head is embedding else 0)


class LlamaCppMode:
    """llama.cpp (through llama-cpp-python) on the same GGUF file, same threads, greedy."""

    name = "llama.cpp"
    lossless = False

    def __init__(self, engine: Engine, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(engine.source), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        # llama.cpp reads the quantized weights as they are stored in the file.
        self.bytes_per_token = float(engine.source.stat().st_size)
        self.eos = engine.tokenizer.eos_token_ids

    def run(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, ignore_eos: bool) -> Run:
        eos = set() if ignore_eos else set(self.eos)
        tokens: list[int] = []
        start = time.perf_counter()
        prefill_s = 0.0
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if not tokens:
                prefill_s = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) >= max_tokens or token in eos:  # the EOS is kept, as our engine keeps it
                break
        total_s = time.perf_counter() - start
        return Run(tokens, prefill_s, max(total_s - prefill_s, 1e-9), bytes_per_token=self.bytes_per_token)


class Skip(Exception):
    """A baseline that cannot run here; the message says why and how to get it."""


def _llama_cpp(engine: Engine, params: SamplingParams, threads: int) -> LlamaCppMode:
    if importlib.util.find_spec("llama_cpp") is None:
        raise Skip(f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}")
    if engine.source.is_dir():
        raise Skip("it needs a GGUF model file (--model FILE.gguf)")
    if not params.greedy:
        raise Skip("the baseline runs greedy only")
    return LlamaCppMode(engine, threads)


BASELINES = {
    "hf": lambda engine, params, threads: HFMode(engine),
    "hf-prompt-lookup": lambda engine, params, threads: HFMode(engine, prompt_lookup_tokens=10),
    "llama.cpp": _llama_cpp,
}


def default_mode_names() -> list[str]:
    return list(REGISTRY) + list(BASELINES)


def build_modes(engine: Engine, names: list[str], params: SamplingParams, threads: int) -> tuple[list, list[str]]:
    """The modes to run, and one line for each that is skipped: a baseline that is not installed
    (with how to get it), or a mode that cannot be built for this model (with why). A registered
    mode may carry options: "hybrid-tree[tree_budget=6]"."""
    parsed = [parse_mode(name) for name in names]
    for base, options in parsed:
        if base not in REGISTRY and (base not in BASELINES or options):
            raise ValueError(f"unknown mode {base!r} (choose from {', '.join(default_mode_names())}; "
                             "options go on registered modes only)")
    modes, skipped = [], []
    for name, (base, options) in zip(names, parsed):
        try:
            if base in REGISTRY:
                modes.append(EngineMode(engine, REGISTRY[base], options, name))
            else:
                modes.append(BASELINES[base](engine, params, threads))
        except (Skip, ValueError) as reason:
            skipped.append(f"{name}: skipped, {reason}")
    return modes, skipped
