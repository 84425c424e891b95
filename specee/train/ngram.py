"""`specee train ngram`: fit a Katz-backoff n-gram table for the n-gram and staged drafters,
from text files, from registry datasets, or from the model's own answers to dataset prompts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..drafters.ngram import NgramModel
from ..engine import Engine
from ..eval.datasets import load_dataset


def file_sequences(engine: Engine, path: Path) -> list[list[int]]:
    """A Spec-Bench style .jsonl gives its turns; any other file is plain text, one document per
    blank-line-separated block."""
    if not path.is_file():
        raise ValueError(f"corpus file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        texts = [turn for line in path.read_text().splitlines() if line.strip() for turn in json.loads(line)["turns"]]
    else:
        texts = [block for block in path.read_text().split("\n\n") if block.strip()]
    return [engine.tokenizer.encode(text, add_special_tokens=False) for text in texts]


def dataset_prompts(names: list[str], skip_first: int, limit: int | None) -> list[str]:
    """Prompt texts, leaving out the first `skip_first` of each category of each dataset (what
    the benchmark reports on), then at most `limit` per category."""
    return [p.turns[0] for name in names for p in load_dataset(name, num_prompts=limit, skip_first=skip_first)]


def self_generated(engine: Engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The model's own greedy conversations: prompt (chat template) + answer up to EOS."""
    sequences = []
    for prompt in tqdm(prompts, desc="generating corpus", unit="prompt", file=sys.stderr):
        ids = engine.encode(prompt)
        result = engine.generate(ids, max_tokens=max_tokens, spec_method="prompt-lookup")
        sequences.append(ids + result.token_ids)
    return sequences


def train_ngram(
    engine: Engine, out: Path, corpus: list[str] = (), datasets: list[str] = (), generate: bool = False,
    skip_first: int = 20, limit: int | None = None, max_tokens: int = 128, order: int = 3,
) -> NgramModel:
    sequences = [seq for path in corpus for seq in file_sequences(engine, Path(path))]
    prompts = dataset_prompts(list(datasets), skip_first, limit)
    if generate:
        sequences += self_generated(engine, prompts, max_tokens)
    else:
        sequences += [engine.tokenizer.encode(text, add_special_tokens=False) for text in prompts]
    if not sequences:
        raise ValueError("nothing to train on: give --corpus FILE and/or --dataset NAME")
    model = NgramModel.train(sequences, engine.tokenizer.vocab_size, order=order)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = sum(len(s) for s in sequences)
    info = dict(corpus=list(corpus), datasets=list(datasets), self_generated=generate, sequences=len(sequences),
                tokens=tokens)
    model.save(out, engine.tokenizer.fingerprint, info)
    print(f"n-gram table (order {order}) from {len(sequences)} sequences, {tokens} tokens -> {out}", file=sys.stderr)
    return model
