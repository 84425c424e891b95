"""`specee train ngram`: fit a Katz-backoff n-gram table for the n-gram, staged and `auto` drafters,
from text files, from registry datasets' or ShareGPT's prompts, or from the model's own answers to
them; and measure, on a tenth held out, how far its probabilities can be taken at their word."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..batch import run_together
from ..drafters.ngram import NgramModel
from ..engine import Engine, Generation
from ..eval.datasets import load_dataset
from .corpus import SHAREGPT_LICENCE, sharegpt_first_turns

# Every HOLD_OUT-th sequence is held out to measure the table's calibration: its right guesses over
# the probabilities it gave them, among guesses of at least CALIBRATION_FLOOR (those `auto` may draft).
HOLD_OUT = 10
CALIBRATION_FLOOR = 0.5
# Answers are generated this many prompts at a time (the progress bar's step).
GENERATE_CHUNK = 64


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


def self_generated(engine: Engine, prompts: list[str], max_tokens: int, context: int) -> list[list[int]]:
    """The model's own greedy answers (up to EOS or `max_tokens`), each after the last `context`
    tokens of its prompt in the chat template (what the table's first guess reads), generated
    together in a continuous batch."""
    dense = engine.strategy("none")
    answers = []
    for start in tqdm(range(0, len(prompts), GENERATE_CHUNK), desc="generating corpus", unit=f"{GENERATE_CHUNK} prompts",
                      file=sys.stderr):
        generations = [Generation(engine, prompt, max_tokens=max_tokens, strategy=dense, prefix_cache=False)
                       for prompt in prompts[start:start + GENERATE_CHUNK]]
        for generation, result in zip(generations, run_together(engine.model, generations)):
            answers.append(generation.prompt_ids[len(generation.prompt_ids) - context:] + result.token_ids)
    return answers


def held_out_calibration(sequences: list[list[int]], vocab_size: int, order: int) -> float | None:
    """Right guesses over their probabilities, for the guesses of at least CALIBRATION_FLOOR that a
    table trained without every HOLD_OUT-th sequence makes on those; None where it makes none."""
    held = sequences[::HOLD_OUT]
    trained = [s for i, s in enumerate(sequences) if i % HOLD_OUT]
    if not held or not trained:
        return None
    table = NgramModel.train(trained, vocab_size, order=order, progress=False)
    right = promised = 0.0
    for sequence in held:
        for t in range(order - 1, len(sequence)):
            token, prob = table.best(sequence[t - order + 1:t])
            if prob >= CALIBRATION_FLOOR:
                promised += prob
                right += token == sequence[t]
    return right / promised if promised else None


def train_ngram(
    engine: Engine, out: Path, corpus: list[str] = (), datasets: list[str] = (), generate: bool = False,
    skip_first: int = 20, limit: int | None = None, max_tokens: int = 128, order: int = 3, sharegpt: int = 0,
) -> NgramModel:
    sequences = [seq for path in corpus for seq in file_sequences(engine, Path(path))]
    prompts = dataset_prompts(list(datasets), skip_first, limit) + (sharegpt_first_turns(sharegpt) if sharegpt else [])
    if generate:
        sequences += self_generated(engine, prompts, max_tokens, order - 1)
    else:
        sequences += [engine.tokenizer.encode(text, add_special_tokens=False) for text in prompts]
    if not sequences:
        raise ValueError("nothing to train on: give --corpus FILE, --dataset NAME and/or --sharegpt N")
    model = NgramModel.train(sequences, engine.tokenizer.vocab_size, order=order)
    model.calibration = held_out_calibration(sequences, engine.tokenizer.vocab_size, order)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = sum(len(s) for s in sequences)
    info = dict(corpus=list(corpus), datasets=list(datasets), sharegpt_prompts=sharegpt, self_generated=generate,
                sequences=len(sequences), tokens=tokens, calibration=model.calibration)
    if sharegpt:
        info["sharegpt"] = SHAREGPT_LICENCE
    model.save(out, engine.tokenizer.fingerprint, info)
    calibration = "unmeasured" if model.calibration is None else f"{model.calibration:.2f}"
    print(f"n-gram table (order {order}) from {len(sequences)} sequences, {tokens} tokens, held-out calibration "
          f"{calibration} -> {out}", file=sys.stderr)
    return model
