"""`specee bench`: every mode on the same prompts, interleaved prompt by prompt, with quality checks."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine import Engine
from ..sampling import SamplingParams
from .datasets import DatasetMissing, Prompt, load_dataset
from .humaneval_exec import check_humaneval, extract_code
from .modes import build_modes, default_mode_names
from .quality import first_divergence, gsm8k_correct, mmlu_choice
from .report import BenchRecord, format_table, machine_info, summarize, write_outputs

SUITES = {
    # A few prompts of every kind, for development: a few minutes here.
    "quick": dict(datasets=["spec-bench", "humaneval"], num_prompts=1, max_tokens=64,
                  categories=["summarization", "translation", "math_reasoning", "writing"]),
    # Every category of every dataset, sized for a 2-core machine (about an hour here, most of it
    # in the slow baselines); raise --num-prompts where there is time.
    "full": dict(datasets=["spec-bench", "humaneval", "gsm8k", "mmlu"], num_prompts=3, max_tokens=128,
                 categories=None),
}


@dataclass
class BenchConfig:
    suite: str = "quick"
    datasets: list[str] | None = None  # None: the suite's
    num_prompts: int | None = None  # per category; None: the suite's
    categories: list[str] | None = None
    max_tokens: int | None = None
    modes: list[str] | None = None  # None: every registered mode and every baseline
    temperature: float = 0.0
    seed: int = 0
    out: Path = Path("bench-out")
    threads: int = field(default_factory=torch.get_num_threads)
    command: str = ""

    def resolved(self) -> "BenchConfig":
        if self.suite not in SUITES:
            raise ValueError(f"unknown suite {self.suite!r} (choose from {', '.join(SUITES)})")
        suite = SUITES[self.suite]
        return BenchConfig(
            suite=self.suite,
            datasets=self.datasets or suite["datasets"],
            num_prompts=self.num_prompts or suite["num_prompts"],
            categories=self.categories,
            max_tokens=self.max_tokens or suite["max_tokens"],
            modes=self.modes or default_mode_names(),
            temperature=self.temperature, seed=self.seed, out=Path(self.out), threads=self.threads,
            command=self.command,
        )


def load_prompts(config: BenchConfig, explicit: bool) -> tuple[list[tuple[str, Prompt]], list[str]]:
    """(dataset, prompt) pairs and notes for datasets that are missing. A dataset the user named
    must exist; a suite's default dataset that is not installed is skipped with a note."""
    prompts, notes = [], []
    for name in config.datasets:
        try:
            categories = _categories_for(name, config, explicit)
            loaded = load_dataset(name, num_prompts=config.num_prompts, categories=categories)
        except DatasetMissing as missing:
            if explicit:
                raise
            notes.append(f"dataset {name}: skipped, {missing}")
            continue
        prompts += [(Path(name).stem if name.endswith(".jsonl") else name, p) for p in loaded]
    return prompts, notes


def _categories_for(name: str, config: BenchConfig, explicit: bool) -> list[str] | None:
    """--categories filter every dataset; without it, a dataset the user named runs whole, and
    the suite's own pick of Spec-Bench categories applies only to the suite's datasets."""
    if config.categories is not None:
        return config.categories
    return SUITES[config.suite]["categories"] if name == "spec-bench" and not explicit else None


def judge(prompt: Prompt, text: str) -> bool | None:
    """Task accuracy of one answer, where the dataset has a reference."""
    ref = prompt.reference
    if "test" in ref and "entry_point" in ref:
        return check_humaneval(ref, extract_code(text, ref["prompt"])).passed
    if "choices" in ref:
        return mmlu_choice(text) == ref["answer"]
    if "answer" in ref:
        return gsm8k_correct(text, ref["answer"])
    return None


def answer_text(engine: Engine, token_ids: list[int]) -> str:
    """The text up to the first end-of-sequence token (runs continue past it for timing)."""
    eos = set(engine.tokenizer.eos_token_ids)
    end = next((i for i, t in enumerate(token_ids) if t in eos), len(token_ids))
    return engine.tokenizer.decode(token_ids[:end])


def perplexity(engine: Engine, texts: list[str], strategy=None) -> float | None:
    """Perplexity of reference texts under the target model, or under a lossy strategy's own
    logits (its `reference_logits(model, ids) -> [T, vocab]`); None for modes that have none."""
    if strategy is None:
        model = engine.model

        def logits_of(ids):
            return model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    elif hasattr(strategy, "reference_logits"):
        def logits_of(ids):
            return strategy.reference_logits(engine.model, ids)
    else:
        return None
    total_nll, count = 0.0, 0
    with torch.inference_mode():
        for text in texts:
            ids = engine.tokenizer.encode(text)[: engine.context_length]
            if len(ids) < 2:
                continue
            logits = logits_of(ids)  # [T, vocab]
            nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="sum")
            total_nll, count = total_nll + nll.item(), count + len(ids) - 1
    return math.exp(total_nll / count) if count else None


def read_bandwidth_gb_s(megabytes: int = 512) -> float:
    """The machine's memory read bandwidth, measured like our decode: bytes streamed / seconds."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    best = min(_timed(buffer.sum) for _ in range(5))
    return buffer.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(engine: Engine, config: BenchConfig, explicit_datasets: bool = False) -> dict:
    config = config.resolved()
    params = SamplingParams(temperature=config.temperature, seed=config.seed)
    prompts, notes = load_prompts(config, explicit_datasets)
    if not prompts:
        raise ValueError("no prompts to run: " + "; ".join(notes or ["the filters matched nothing"]))
    modes, skipped = build_modes(engine, config.modes, params, config.threads)
    for line in notes + skipped:
        print(line, file=sys.stderr)
    records = []
    for dataset, prompt in tqdm(prompts, desc="prompts", unit="prompt", file=sys.stderr):
        prompt_ids = engine.encode(prompt.turns[0])
        dense_ids = None
        for mode in modes:
            start = time.perf_counter()
            run = mode.run(prompt_ids, config.max_tokens, params)
            wall_s = time.perf_counter() - start
            if mode.name == "dense":
                dense_ids = run.token_ids
            comparable = dense_ids is not None and params.greedy and mode.name != "dense"
            records.append(asdict(BenchRecord(
                mode=mode.name, lossless=mode.lossless, prompt_id=prompt.id, category=prompt.category,
                dataset=dataset, prompt_tokens=len(prompt_ids), new_tokens=len(run.token_ids),
                prefill_s=run.prefill_s, decode_s=run.decode_s, wall_s=wall_s,
                tokens_per_s=(len(run.token_ids) - 1) / run.decode_s if run.decode_s > 0 else 0.0,
                accept_lengths=run.accept_lengths, exit_layers=run.exit_layers, avg_layers=run.avg_layers,
                bytes_per_token=run.bytes_per_token, peak_rss_mb=peak_rss_mb(), token_ids=run.token_ids,
                matches_dense=(run.token_ids == dense_ids) if comparable else None,
                first_divergence=first_divergence(run.token_ids, dense_ids) if comparable else None,
                correct=judge(prompt, answer_text(engine, run.token_ids)),
            )))
    summary = summarize(records)
    texts = [p.turns[0] for _, p in prompts]
    dense_ppl = perplexity(engine, texts)
    for mode in modes:
        # Lossless modes produce the dense model's distribution, so they share its perplexity.
        strategy = getattr(mode, "strategy", None)
        lossy = strategy is not None and not mode.lossless
        summary["modes"][mode.name]["perplexity"] = perplexity(engine, texts, strategy) if lossy else (
            dense_ppl if mode.lossless else None)
    meta = machine_info() | {
        "command": config.command, "threads": config.threads, "model": str(engine.source),
        "dtype": str(engine.model.dtype).removeprefix("torch."), "suite": config.suite,
        "max_tokens": config.max_tokens, "temperature": config.temperature, "seed": config.seed,
        "memory_read_gb_s": read_bandwidth_gb_s(), "skipped": notes + skipped,
    }
    for stats in summary["modes"].values():
        bpt, tps = stats["bytes_per_token"], stats["tokens_per_s"]
        stats["weight_gb_s"] = bpt * tps / 1e9 if bpt and tps else None
    write_outputs(config.out, records, summary, meta)
    print(format_table(summary))
    print(f"machine: {meta['cpu']}, {config.threads} threads, memory read {meta['memory_read_gb_s']:.1f} GB/s; "
          + ", ".join(f"{m} weights {s['weight_gb_s']:.1f} GB/s" for m, s in summary["modes"].items() if s["weight_gb_s"]))
    print(json.dumps({"out": str(config.out), "meta": meta, "modes": {
        m: {k: v for k, v in s.items() if k != "categories"} for m, s in summary["modes"].items()
    }, "lossless_failures": summary["lossless_failures"]}))
    return summary
