"""`specee bench-serve`'s arithmetic and bookkeeping (no timings are asserted, none measured)."""
import math

import pytest

from specee.cli import main
from specee.eval import serve_bench
from specee.eval.serve_bench import (RequestRecord, ServeBenchConfig, format_table, overhead_summary, percentile,
                                     run_load, summarize_load)


def test_nearest_rank_percentiles():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 95) == 7.0
    assert percentile(list(range(1, 101)), 95) == 95


def test_load_summary_arithmetic():
    records = [  # client 0: 30 tokens over 0..3 s; client 1: 10 tokens over 1..2 s
        RequestRecord("dense", 2, 0, start_s=0.0, first_token_s=0.5, end_s=1.0, completion_tokens=10),
        RequestRecord("dense", 2, 0, start_s=1.0, first_token_s=0.25, end_s=3.0, completion_tokens=20),
        RequestRecord("dense", 2, 1, start_s=1.0, first_token_s=1.0, end_s=2.0, completion_tokens=10),
    ]
    s = summarize_load("dense", 2, records, wall_s=4.0)
    assert (s.requests, s.requests_per_s) == (3, 0.75)
    assert (s.ttft_p50_s, s.ttft_p95_s) == (0.5, 1.0)
    assert s.tokens_per_s_per_client == pytest.approx((30 / 3 + 10 / 1) / 2)
    assert math.isnan(summarize_load("dense", 1, [RequestRecord("dense", 1, 0, 0, None, 1, 0)], 1).ttft_p50_s)


def test_overhead_is_the_difference_of_medians_over_the_decode_time():
    o = overhead_summary(served=[1.10, 1.00, 1.30], local=[1.00, 0.90, 0.95], decode=[0.8, 0.9, 1.0])
    assert o["overhead_s"] == pytest.approx(1.10 - 0.95)
    assert o["overhead_of_decode"] == pytest.approx(0.15 / 0.9)
    assert "+16.7% of the 0.900 s decode" in format_table([], o)


def test_every_client_sends_its_requests_in_order(monkeypatch):
    sent = []

    def fake_stream(url, prompt, max_tokens, spec):
        sent.append((prompt, max_tokens, spec["spec_method"]))
        return 0.01, 7

    monkeypatch.setattr(serve_bench, "stream_chat", fake_stream)
    summary = run_load("http://127.0.0.1:9", "hybrid-tree", 3, ServeBenchConfig(requests_per_client=2, max_tokens=5))
    assert summary.requests == 6 and summary.clients == 3 and summary.mode == "hybrid-tree"
    assert {s[1:] for s in sent} == {(5, "hybrid")}
    assert {s[0] for s in sent} == set(serve_bench.PROMPTS[:4])  # clients start at different prompts
    assert summary.ttft_p95_s == 0.01


def test_bad_bench_serve_flags_exit_2(capsys):
    assert main(["bench-serve", "--modes", "dense,warp"]) == 2
    assert main(["bench-serve", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
