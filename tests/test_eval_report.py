import json
import math
from dataclasses import asdict

import pytest

from specee.eval.report import (
    RECORD_FIELDS,
    BenchRecord,
    decode_rate,
    format_table,
    machine_info,
    summarize,
    write_outputs,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_FIELDS = {"prompts", "skipped", "excluded", "new_tokens", "decode_s", "tokens_per_s", "speedup_vs_dense",
                  "speedup_vs_dense_min", "speedup_vs_dense_max", "speedup_vs_hf", "mean_accept_length",
                  "avg_layers", "bytes_per_token", "accuracy", "accuracy_n", "lossless_ok"}


def record(mode, prompt_id, category, decode_s, new_tokens=20, **extra):
    fields = dict(mode=mode, lossless=mode != "early-exit", prompt_id=prompt_id, category=category, dataset="toy",
                  prompt_tokens=10, new_tokens=new_tokens, prefill_s=0.1, decode_s=decode_s, wall_s=decode_s + 0.1,
                  tokens_per_s=decode_rate(new_tokens, decode_s), token_ids=list(range(new_tokens)),
                  matches_dense=True, first_divergence=None)
    fields.update(extra)
    return asdict(BenchRecord(**fields))


def toy_records():
    """Two categories x two prompts; spec is 2x dense on 'qa' and 4x on 'code', hf is half dense."""
    records = []
    for category, spec_speed in (("qa", 2.0), ("code", 4.0)):
        for n in range(2):
            pid = f"{category}-{n}"
            records.append(record("hf", pid, category, 2.0, bytes_per_token=2e9))
            records.append(record("dense", pid, category, 1.0, avg_layers=16.0, bytes_per_token=1e9, correct=n == 0))
            records.append(record("spec", pid, category, 1.0 / spec_speed, accept_lengths=[1, 3, 4, 2], correct=n == 0))
            records.append(record("early-exit", pid, category, 0.5 if n == 0 else 1.5, new_tokens=20 if n == 0 else 60,
                                  avg_layers=12.0 if n == 0 else 8.0, exit_layers=[8, 12, 16, 12],
                                  matches_dense=None, correct=False, before_divergence=0.25 if n == 0 else 0.75,
                                  exiting={"passes": 4, "predictors_run": 8 + 4 * n, "exit_checks": 4,
                                           "exit_checks_agreed": 3 - 2 * n, "predictor_s": 0.05,
                                           "decode_s": 0.5 if n == 0 else 1.5}))
    return records


def test_record_has_the_documented_fields():
    expected = {"mode", "lossless", "prompt_id", "category", "dataset", "prompt_tokens", "new_tokens", "prefill_s",
                "decode_s", "wall_s", "tokens_per_s", "run_order", "accept_lengths", "exit_layers", "avg_layers",
                "bytes_per_token", "token_ids", "matches_dense", "first_divergence", "correct", "skipped", "drafting",
                "exiting", "before_divergence"}
    assert set(RECORD_FIELDS) == expected
    assert set(record("dense", "p", "qa", 1.0)) == expected


def test_early_exit_stats_pool_over_prompts():
    summary = summarize(toy_records())
    early = summary["modes"]["early-exit"]
    # Per category: prompt 0 ran 8 predictors and 3 of 4 checks agreed, prompt 1 ran 12 and 1 of 4.
    assert early["predictors_per_token"] == pytest.approx(20 / 8)
    assert early["check_agreement"] == pytest.approx(4 / 8)
    assert early["predictor_share"] == pytest.approx(0.1 / 2.0)
    assert early["before_divergence"] == pytest.approx(0.5)
    assert summary["modes"]["dense"]["predictors_per_token"] is None
    table = format_table(summary)
    assert "early exit (pooled over prompts" in table and "predictors/token" in table


def test_summary_metrics():
    summary = summarize(toy_records())
    assert list(summary["modes"]) == ["hf", "dense", "spec", "early-exit"]
    assert summary["categories"] == ["qa", "code"]
    for stats in summary["modes"].values():
        assert SUMMARY_FIELDS | {"lossless", "categories"} <= set(stats)
    spec, dense, early = summary["modes"]["spec"], summary["modes"]["dense"], summary["modes"]["early-exit"]
    assert spec["categories"]["qa"]["speedup_vs_dense"] == pytest.approx(2.0)
    assert spec["categories"]["code"]["speedup_vs_dense"] == pytest.approx(4.0)
    # overall: the geometric mean over categories, whatever their token counts
    assert spec["speedup_vs_dense"] == pytest.approx(math.sqrt(2.0 * 4.0))
    assert spec["speedup_vs_hf"] == pytest.approx(math.sqrt(4.0 * 8.0))
    assert (spec["speedup_vs_dense_min"], spec["speedup_vs_dense_max"]) == (pytest.approx(2.0), pytest.approx(4.0))
    assert dense["speedup_vs_dense"] == pytest.approx(1.0)
    assert spec["mean_accept_length"] == pytest.approx(2.5)
    assert dense["mean_accept_length"] is None
    # tok/s: (n - 1) / decode seconds per prompt, geometric means per category, then over categories
    assert spec["categories"]["qa"]["tokens_per_s"] == pytest.approx(19 / 0.5)
    assert spec["tokens_per_s"] == pytest.approx(math.sqrt((19 / 0.5) * (19 / 0.25)))
    # per prompt, then geometric mean: 2x on the 20-token prompt, (59 / 1.5) / 19 on the 60-token one
    assert early["categories"]["qa"]["speedup_vs_dense"] == pytest.approx(math.sqrt(2.0 * 59 / 1.5 / 19))
    assert early["speedup_vs_dense_max"] == pytest.approx(59 / 1.5 / 19)
    # per-token layers: (12 * 20 + 8 * 60) / 80 per category
    assert early["avg_layers"] == pytest.approx((12 * 20 + 8 * 60) / 80)
    assert dense["bytes_per_token"] == pytest.approx(1e9)
    assert (dense["accuracy"], dense["accuracy_n"]) == (0.5, 4)
    assert early["accuracy"] == 0.0
    assert summary["modes"]["hf"]["accuracy"] is None
    assert dense["lossless_ok"] is True and early["lossless_ok"] is None and not early["lossless"]
    assert summary["lossless_failures"] == []
    assert "geometric mean" in summary["aggregation"]
    assert "LOSSLESS FAILURE" not in format_table(summary)


def test_prompts_without_a_decode_rate_are_excluded_and_counted():
    """One generated token (EOS at once) has no decode rate: out of the ratio, counted."""
    records = toy_records() + [record("dense", "qa-7", "qa", 0.0, new_tokens=1),
                               record("spec", "qa-7", "qa", 0.0, new_tokens=1)]
    assert decode_rate(1, 0.0) is None and decode_rate(2, 0.5) == 2.0
    spec = summarize(records)["modes"]["spec"]
    assert spec["categories"]["qa"]["excluded"] == 1 and spec["excluded"] == 1
    assert spec["categories"]["qa"]["speedup_vs_dense"] == pytest.approx(2.0)


def test_tables_say_how_the_run_stopped_and_how_numbers_were_aggregated():
    summary = summarize(toy_records(), stopping="real use: generation stops at EOS or after 64 tokens")
    lines = format_table(summary).splitlines()
    assert lines[0] == "real use: generation stops at EOS or after 64 tokens"
    assert lines[1].startswith("aggregation: per prompt")
    overall = next(line for line in lines if line.startswith("overall"))
    assert "2.83x" in overall  # spec's geometric mean over categories


def test_a_category_name_two_datasets_share_is_split_by_dataset():
    records = toy_records()
    for r in records:
        if r["category"] == "code" and r["prompt_id"].endswith("1"):
            r["dataset"] = "humaneval"  # same category name, another data set
    summary = summarize(records)
    assert summary["categories"] == ["qa", "toy/code", "humaneval/code"]
    spec = summary["modes"]["spec"]["categories"]
    assert spec["toy/code"]["prompts"] == spec["humaneval/code"]["prompts"] == 1
    assert spec["humaneval/code"]["speedup_vs_dense"] == pytest.approx(4.0)


def test_skipped_prompts_are_counted_and_left_out_of_speedup():
    records = toy_records() + [record("spec", "qa-2", "qa", 100.0, skipped="out of memory")]
    records.append(record("dense", "qa-3", "qa", 100.0))  # no spec run to pair with
    spec = summarize(records)["modes"]["spec"]
    assert (spec["prompts"], spec["skipped"]) == (4, 1)
    assert spec["speedup_vs_dense"] == pytest.approx(math.sqrt(8.0))


def test_lossless_failure_is_loud():
    records = toy_records()
    records.append(record("spec", "qa-9", "qa", 0.5, matches_dense=False, first_divergence=7))
    records.append(record("dense", "qa-9", "qa", 1.0))
    summary = summarize(records)
    assert summary["lossless_failures"] == [
        {"mode": "spec", "dataset": "toy", "prompt_id": "qa-9", "category": "qa", "first_divergence": 7}
    ]
    assert summary["modes"]["spec"]["lossless_ok"] is False
    assert summary["modes"]["spec"]["categories"]["code"]["lossless_ok"] is True
    failure_lines = [line for line in format_table(summary).splitlines() if line.startswith("LOSSLESS FAILURE")]
    assert len(failure_lines) == 1 and "spec" in failure_lines[0] and "qa-9" in failure_lines[0]


def test_lossy_mode_differences_are_not_failures():
    records = toy_records() + [record("early-exit", "qa-9", "qa", 0.5, matches_dense=False, first_divergence=3)]
    assert summarize(records)["lossless_failures"] == []


def test_missing_record_field_is_a_clear_error():
    bad = record("dense", "p", "qa", 1.0)
    del bad["decode_s"]
    with pytest.raises(ValueError, match="decode_s"):
        summarize([bad])


def test_format_table_rows_and_category_speedups():
    table = format_table(summarize(toy_records()))
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("mode "))
    assert header.split()[:4] == ["mode", "lossless", "prompts", "excluded"]
    spec_row = next(line for line in lines if line.startswith("spec "))
    assert "2.83x" in spec_row and "2.00-4.00x" in spec_row  # overall speedup vs dense, per-prompt range
    qa_row = next(line for line in lines if line.startswith("qa "))
    assert qa_row.split()[:4] == ["qa", "0.50x", "(0.50-0.50x)", "1.00x"]


def test_write_outputs_creates_every_file(tmp_path):
    records = toy_records()
    summary = summarize(records)
    meta = {"command": "specee bench --toy", "machine": {"cpu": "test"}}
    written = write_outputs(tmp_path / "out", records, summary, meta)
    names = {p.name for p in written}
    assert names == {"records.jsonl", "summary.json", "summary.md", "speedup_by_category.png",
                     "accuracy_vs_speedup.png", "exit_layers.png", "acceptance_lengths.png"}
    out = tmp_path / "out"
    lines = (out / "records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    stored = json.loads((out / "summary.json").read_text())
    assert stored["meta"] == meta and stored["modes"]["spec"]["speedup_vs_dense"] == pytest.approx(math.sqrt(8.0))
    markdown = (out / "summary.md").read_text()
    assert "| spec |" in markdown and "specee bench --toy" in markdown
    for name in names:
        if name.endswith(".png"):
            data = (out / name).read_bytes()
            assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_plots_without_data_are_left_out(tmp_path):
    records = [record("dense", "p", "qa", 1.0), record("spec", "p", "qa", 0.5)]
    written = write_outputs(tmp_path, records, summarize(records), {"command": "x"})
    assert {p.name for p in written} == {"records.jsonl", "summary.json", "summary.md", "speedup_by_category.png"}
    assert not (tmp_path / "exit_layers.png").exists()


def test_machine_info():
    info = machine_info()
    assert set(info) == {"cpu", "logical_cores", "torch_threads", "platform", "python", "torch", "specee"}
    assert info["logical_cores"] >= 1 and info["torch_threads"] >= 1
    assert info["cpu"] and info["python"].count(".") == 2


def test_drafter_statistics_pool_prompts():
    """CTAR(w) = passes whose first w drafts were all accepted / passes that drafted w; drafting
    share and draft cost pool time over prompts."""
    counts = [
        dict(position_proposed=[4, 4, 2], position_accepted=[3, 1, 0], draft_s=0.2, verify_s=0.8, draft_nodes=10,
             passes=4),
        dict(position_proposed=[2, 2], position_accepted=[2, 2], draft_s=0.1, verify_s=0.4, draft_nodes=6, passes=2),
    ]
    records = [record("dense", f"p{i}", "qa", 1.0) for i in range(2)]
    records += [record("spec", f"p{i}", "qa", 1.0, drafting=c) for i, c in enumerate(counts)]
    spec = summarize(records)["modes"]["spec"]
    assert spec["ctar"][:3] == [5 / 6, 3 / 6, 0 / 2] and spec["ctar"][3] is None
    assert spec["drafting_share"] == pytest.approx(0.3 / 2.0)
    assert spec["draft_cost"] == pytest.approx((0.3 / 16) / (1.2 / 6))
    assert "CTAR1" in format_table(summarize(records)) and summarize(records)["modes"]["dense"]["ctar"] is None
