"""benchmarks/formats.py's comparison with fp32: greedy agreement and the table it prints."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "formats.py"
spec = importlib.util.spec_from_file_location("formats_bench", SCRIPT)
formats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(formats)


def test_greedy_agreement_counts_tokens_before_the_first_difference():
    share, same = formats.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert share == pytest.approx((2 / 4 + 1) / 2) and same == 1


def test_table_compares_each_format_with_fp32_and_llama_cpp():
    quality = {"nll": [0.0], "argmax": [[1, 2, 3, 4]], "greedy": [[1, 2]], "mmlu_correct": 3, "mmlu_total": 4}
    other = quality | {"argmax": [[1, 2, 0, 0]], "greedy": [[1, 5]]}
    timing = {"weight_mb": 100.0, "load_s": 1.0}
    results = {"none": timing | {"decode_ms": 20.0, "prefill_s": 1.0, "peak_rss_mb": 1000.0, "quality": quality},
               "int4": timing | {"decode_ms": 10.0, "prefill_s": 2.0, "peak_rss_mb": 400.0, "quality": other},
               "llama.cpp": timing | {"decode_ms": 5.0, "prefill_s": 4.0, "peak_rss_mb": 500.0, "quality": None}}
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in formats.table(results, 40.0).splitlines()[2:]}
    assert rows["int4"][4] == "0.50x" and rows["int4"][7] == "2.00x"  # decode and prefill vs llama.cpp
    assert rows["int4"][9] == "0.80x" and rows["none"][9] == "2.00x"  # peak memory vs llama.cpp
    assert rows["int4"][12] == "0.500" and rows["int4"][13] == "0.50" and rows["int4"][14] == "0/1"
    assert rows["none"][12] == "1.000" and rows["none"][14] == "1/1"
    assert rows["llama.cpp"][11].strip() == "-"
