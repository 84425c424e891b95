"""`specee bench`: every mode on the same prompts, interleaved prompt by prompt, with quality checks."""
from __future__ import annotations

import json
import resource
import sys
import time
import timeit
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine import Engine
from ..sampling import SamplingParams
from .datasets import DatasetMissing, Prompt, load_dataset
from .humaneval_exec import check_humaneval, extract_code
from .modes import build_modes, default_mode_names
from .quality import first_divergence, gsm8k_correct, mmlu_choice
from .teacher_forcing import TEACHER_FORCED, dense_scores, quality, scored
from .report import BenchRecord, decode_rate, format_table, machine_info, summarize, write_outputs

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
    ignore_eos: bool = False  # True: fixed-length runs; False: real use, stopping at EOS
    skip_first: int = 0  # leave out each category's first N prompts (the tuning slice skips the reported ones)
    repeats: int = 1  # runs of every mode per prompt; the fastest counts
    out: Path = Path("bench-out")
    threads: int = field(default_factory=torch.get_num_threads)
    command: str = ""

    def resolved(self) -> "BenchConfig":
        if self.suite not in SUITES:
            raise ValueError(f"unknown suite {self.suite!r} (choose from {', '.join(SUITES)})")
        suite = SUITES[self.suite]
        return replace(self, datasets=self.datasets or suite["datasets"],
                       num_prompts=self.num_prompts or suite["num_prompts"],
                       max_tokens=self.max_tokens or suite["max_tokens"],
                       modes=self.modes or default_mode_names(), out=Path(self.out))

    @property
    def stopping(self) -> str:
        if self.ignore_eos:
            return f"fixed length: EOS ignored, {self.max_tokens} tokens per prompt (--ignore-eos)"
        return f"real use: generation stops at EOS or after {self.max_tokens} tokens"


def load_prompts(config: BenchConfig, explicit: bool) -> tuple[list[tuple[str, Prompt]], list[str]]:
    """(dataset, prompt) pairs and notes for datasets that are missing. A dataset the user named
    must exist; a suite's default dataset that is not installed is skipped with a note."""
    prompts, notes = [], []
    for name in config.datasets:
        try:
            categories = _categories_for(name, config, explicit)
            loaded = load_dataset(name, num_prompts=config.num_prompts, categories=categories,
                                  skip_first=config.skip_first)
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
    """The text up to the first end-of-sequence token (fixed-length runs continue past it)."""
    eos = set(engine.tokenizer.eos_token_ids)
    end = next((i for i, t in enumerate(token_ids) if t in eos), len(token_ids))
    return engine.tokenizer.decode(token_ids[:end])


def read_bandwidth_gb_s(megabytes: int = 512) -> float:
    """The machine's memory read bandwidth, measured like our decode: bytes streamed / seconds."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    best = min(timeit.repeat(buffer.sum, number=1, repeat=5))
    return buffer.numel() * 4 / best / 1e9


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


WARM_UP_PROMPT = "Say hello in five words."  # not in any dataset: warm-up runs are never recorded
WARM_UP_TOKENS = 16


def rotated(modes: list, index: int) -> list:
    """The order modes run a prompt in: prompt i starts with mode i (mod the number of modes),
    so no mode always runs first or right after another."""
    shift = index % len(modes) if modes else 0
    return modes[shift:] + modes[:shift]


def run_prompt(engine: Engine, modes: list, index: int, dataset: str, prompt: Prompt, config: BenchConfig,
               params: SamplingParams) -> list[dict]:
    """Every mode on one prompt, in rotated order (`repeats` rounds, each rotated on, keeping each
    mode's fastest run); each is compared with dense once all have run."""
    prompt_ids = engine.encode(prompt.turns[0])
    runs = {}
    for round_ in range(config.repeats):
        for order, mode in enumerate(rotated(modes, index + round_)):
            start = time.perf_counter()
            run = mode.run(prompt_ids, config.max_tokens, params, config.ignore_eos)
            if mode.name not in runs or run.decode_s < runs[mode.name][1].decode_s:
                runs[mode.name] = (order, run, time.perf_counter() - start)
    dense_ids = runs["dense"][1].token_ids if "dense" in runs else None
    records = []
    for mode in modes:
        order, run, wall_s = runs[mode.name]
        comparable = dense_ids is not None and params.greedy and mode.name != "dense"
        records.append(asdict(BenchRecord(
            mode=mode.name, lossless=mode.lossless, prompt_id=prompt.id, category=prompt.category,
            dataset=dataset, prompt_tokens=len(prompt_ids), new_tokens=len(run.token_ids), wall_s=wall_s,
            tokens_per_s=decode_rate(len(run.token_ids), run.decode_s), run_order=order,
            matches_dense=(run.token_ids == dense_ids) if comparable else None,
            first_divergence=first_divergence(run.token_ids, dense_ids) if comparable else None,
            correct=judge(prompt, answer_text(engine, run.token_ids)),
            before_divergence=before_divergence(run.token_ids, dense_ids) if comparable else None,
            **vars(run),  # what the mode measured: tokens, times, acceptance, exits, drafting counts
        )))
    return records


def before_divergence(tokens: list[int], dense: list[int]) -> float | None:
    """The share of dense's tokens a run reproduced before it first differed (1.0: identical)."""
    if not dense:
        return None
    diverged = first_divergence(tokens, dense)
    return 1.0 if diverged is None else min(diverged, len(dense)) / len(dense)


def lossy_quality(engine: Engine, modes: list, prompts: list, records: list[dict], summary: dict) -> None:
    """Teacher-forced quality (teacher_forcing.py) of every lossy mode of ours, over the prompts'
    own text and over dense's greedy continuations; the dense figures are on the same tokens."""
    lossy = [m for m in modes if not m.lossless and isinstance(getattr(m, "strategy", None), TEACHER_FORCED)]
    for mode in modes:  # a lossless mode has dense's distribution: no perplexity of its own to show
        summary["modes"][mode.name]["perplexity"] = None
    dense = {(r["dataset"], r["prompt_id"]): r for r in records if r["mode"] == "dense" and r["new_tokens"] >= 2}
    texts, continuations = [], []
    for dataset, prompt in prompts:
        texts.append(scored(engine.tokenizer.encode(prompt.turns[0])))
        if (dataset, prompt.id) in dense:
            prompt_ids = engine.encode(prompt.turns[0])
            continuations.append(scored(prompt_ids + dense[(dataset, prompt.id)]["token_ids"], len(prompt_ids)))
    dense_text, dense_continuations = dense_scores(engine, texts), dense_scores(engine, continuations)
    for mode in tqdm(lossy, desc="quality (teacher forcing)", unit="mode", file=sys.stderr):
        on_text = quality(engine, texts, mode.strategy, dense_text)
        on_continuations = quality(engine, continuations, mode.strategy, dense_continuations)
        exited = on_text.get("exited", 0) + on_continuations.get("exited", 0)
        faithful = on_text.get("faithful", 0) + on_continuations.get("faithful", 0)
        summary["modes"][mode.name]["perplexity"] = on_text.get("ppl")
        summary["modes"][mode.name]["quality"] = {
            "fidelity": faithful / exited if exited else None, "exited_tokens": exited,
            "scored_tokens": on_text.get("tokens", 0) + on_continuations.get("tokens", 0),
            "ppl_text": on_text.get("ppl"), "ppl_text_dense": on_text.get("ppl_dense"),
            "ppl_continuation": on_continuations.get("ppl"), "ppl_continuation_dense": on_continuations.get("ppl_dense"),
        }
    if "dense" in summary["modes"]:
        summary["modes"]["dense"]["perplexity"] = quality(engine, texts, dense=dense_text).get("ppl_dense")


def run_bench(engine: Engine, config: BenchConfig, explicit_datasets: bool = False) -> dict:
    config = config.resolved()
    params = SamplingParams(temperature=config.temperature, seed=config.seed)
    prompts, notes = load_prompts(config, explicit_datasets)
    if not prompts:
        raise ValueError("no prompts to run: " + "; ".join(notes or ["the filters matched nothing"]))
    modes, skipped = build_modes(engine, config.modes, params, config.threads)
    for line in notes + skipped:
        print(line, file=sys.stderr)
    warm_up_ids = engine.encode(WARM_UP_PROMPT)
    for mode in tqdm(modes, desc="warm-up", unit="mode", file=sys.stderr):
        mode.run(warm_up_ids, WARM_UP_TOKENS, params, ignore_eos=True)  # every token exercises decoding
    records = []
    for index, (dataset, prompt) in enumerate(tqdm(prompts, desc="prompts", unit="prompt", file=sys.stderr)):
        records += run_prompt(engine, modes, index, dataset, prompt, config, params)
    summary = summarize(records, stopping=config.stopping)
    lossy_quality(engine, modes, prompts, records, summary)
    meta = machine_info() | {
        "command": config.command, "threads": config.threads, "model": str(engine.source),
        "dtype": str(engine.model.dtype).removeprefix("torch."), "quantization": engine.quantization,
        "suite": config.suite,
        "max_tokens": config.max_tokens, "temperature": config.temperature, "seed": config.seed,
        "ignore_eos": config.ignore_eos, "stopping": config.stopping, "skip_first": config.skip_first,
        "repeats": config.repeats,
        "memory_read_gb_s": read_bandwidth_gb_s(), "peak_rss_mb": peak_rss_mb(), "skipped": notes + skipped,
    }
    for stats in summary["modes"].values():
        bpt, tps = stats["bytes_per_token"], stats["tokens_per_s"]
        stats["weight_gb_s"] = bpt * tps / 1e9 if bpt and tps else None
    write_outputs(config.out, records, summary, meta)
    print(format_table(summary))
    print(f"machine: {meta['cpu']}, {config.threads} threads, memory read {meta['memory_read_gb_s']:.1f} GB/s, "
          f"process peak RSS {meta['peak_rss_mb']:.0f} MB; "
          + ", ".join(f"{m} weights {s['weight_gb_s']:.1f} GB/s" for m, s in summary["modes"].items() if s["weight_gb_s"]))
    print(json.dumps({"out": str(config.out), "meta": meta, "modes": {
        m: {k: v for k, v in s.items() if k != "categories"} for m, s in summary["modes"].items()
    }, "stopping": config.stopping, "aggregation": summary["aggregation"],
        "lossless_failures": summary["lossless_failures"]}))
    return summary
