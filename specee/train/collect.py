"""What the trained self-drafters learn from: the target's own states over a chat corpus.

Run the target over chat conversations (its chat template, teacher forcing over prompts and
responses) and keep its last-layer states (fp16) and how often each token is its top choice.
Saved under the cache folder, so a second run (a resumed one, or another drafter's) does not
collect again.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..engine import Engine
from ..model.fingerprint import weights_fingerprint
from ..model.llama import Transformer
from ..model.loading import cache_root
from .corpus import SHAREGPT_LICENCE, benchmark_keys, is_benchmark, sharegpt_conversations, sharegpt_path
from .ngram import file_sequences


@dataclass
class Collected:
    ids: list[torch.Tensor]  # per chunk [T] token ids
    states: list[torch.Tensor]  # per chunk [T, hidden] fp16: the target's last-layer states
    top_counts: torch.Tensor  # [vocab] how often each token was the target's top choice


def corpus_sequences(engine: Engine, corpus_files: list[str], use_sharegpt: bool, limit_tokens: int,
                     chunk: int) -> tuple[list[list[int]], dict]:
    """Token chunks of at most `chunk` tokens, up to `limit_tokens` in all, and what they came from."""
    sequences = [seq for path in corpus_files for seq in file_sequences(engine, Path(path))]
    info = {"files": [str(p) for p in corpus_files]}
    if use_sharegpt:
        keys = benchmark_keys()
        budget = limit_tokens - sum(len(s) for s in sequences)
        conversations = dropped = 0
        for conversation in sharegpt_conversations(sharegpt_path()):
            if is_benchmark(conversation, keys):
                dropped += 1
                continue
            if budget <= 0:
                break
            text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
            sequences.append(engine.tokenizer.encode(text, add_special_tokens=False))
            budget -= len(sequences[-1])
            conversations += 1
        info.update(sharegpt=SHAREGPT_LICENCE, conversations=conversations, dropped_as_benchmark=dropped)
    chunks = [seq[start:start + chunk] for seq in sequences for start in range(0, len(seq), chunk)]
    chunks = [c for c in chunks if len(c) >= 2]
    kept, total = [], 0
    for c in chunks:
        if total >= limit_tokens:
            break
        kept.append(c)
        total += len(c)
    if not kept:
        raise ValueError("nothing to train on: the corpus is empty")
    info["tokens"] = total
    return kept, info


# Bumped when collected states are stored differently, so a cache of the old kind is collected anew
# (2: bf16 where fp16 overflows).
STORAGE_VERSION = 2


def collect(model: Transformer, chunks: list[list[int]]) -> Collected:
    ids_out, states_out = [], []
    top_counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    with torch.inference_mode():
        for chunk in tqdm(chunks, desc="collecting target states", unit="chunk", file=sys.stderr):
            ids = torch.tensor(chunk, device=model.device)
            h = model.hidden(ids, torch.arange(len(chunk), device=model.device), model.new_cache(len(chunk)))
            top_counts += torch.bincount(model.logits(model.norm(h)).argmax(-1).cpu(), minlength=len(top_counts))
            ids_out.append(ids.cpu())
            states_out.append(h.to("cpu", storage_dtype(h)))
    return Collected(ids_out, states_out, top_counts)


def storage_dtype(states: torch.Tensor) -> torch.dtype:
    """Half the memory of fp32 for collected states: fp16 where they fit its range (three more bits
    than bf16), bf16 where some do not (Gemma's residual stream reaches past 65,504)."""
    return torch.float16 if states.abs().max() < torch.finfo(torch.float16).max else torch.bfloat16


def choose_vocabulary(top_counts: torch.Tensor, coverage: float) -> tuple[torch.Tensor, dict]:
    """The fewest most-chosen tokens covering `coverage` of the target's top choices, and the
    coverage of a few sizes (recorded in the artifact)."""
    counts, order = top_counts.sort(descending=True)
    cumulative = counts.cumsum(0).double() / counts.sum()
    size = int((cumulative < coverage).sum()) + 1
    table = {n: float(cumulative[min(n, len(cumulative)) - 1]) for n in (1024, 2048, 4096, 8192, 16384, 32768)}
    return order[:size].clone(), {"size": size, "coverage": float(cumulative[size - 1]), "coverage_by_size": table}


def cached(name: str, key: tuple, kind: type, collect_data: Callable[[], object]):
    """The dataclass `collect_data()` makes, kept in the cache folder under a hash of `key` (all it
    depends on), so a later run with the same key reads it back instead of collecting again."""
    stored = cache_root() / f"{name}-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}.pt"
    if stored.is_file():
        return kind(**torch.load(stored, weights_only=True))
    data = collect_data()
    stored.parent.mkdir(parents=True, exist_ok=True)
    torch.save(vars(data), stored)
    return data


def target_states(engine: Engine, corpus_files: list[str], use_sharegpt: bool, tokens: int,
                  chunk: int) -> tuple[Collected, dict]:
    """The collected states (from the cache folder when this corpus was collected before) and what
    they came from, with the collection time."""
    began = time.perf_counter()
    chunks, info = corpus_sequences(engine, list(corpus_files), use_sharegpt, tokens, chunk)
    key = (weights_fingerprint(engine.model), sorted(info.items()), chunk, STORAGE_VERSION)
    data = cached("target-states", key, Collected, lambda: collect(engine.model, chunks))
    info["collect_minutes"] = round((time.perf_counter() - began) / 60, 1)
    info["model"] = str(engine.source.name) if engine.source else ""
    print(f"{info['tokens']} tokens in {len(chunks)} chunks, states ready in {info['collect_minutes']} min",
          file=sys.stderr)
    return data, info
