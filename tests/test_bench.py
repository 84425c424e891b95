"""`specee bench` end to end on a tiny model with the real tokenizer: records, summary, flags."""
import json

import pytest
import torch

from helpers import tiny_model
from specee.decoding.autoregressive import Autoregressive
from specee.decoding.registry import REGISTRY, StrategySpec, register
from specee.engine import Engine
from specee.eval import modes as bench_modes
from specee.eval.bench import BenchConfig, run_bench
from specee.eval.report import RECORD_FIELDS
from specee.model.loading import default_model_path
from specee.sampling import SamplingParams


class OffByOne(Autoregressive):
    """A broken 'lossless' mode: shifts every token it emits."""

    def decode(self, state):
        for new in super().decode(state):
            yield [(t + 1) % 1000 for t in new]


@pytest.fixture
def tiny_engine(default_engine):
    model = tiny_model(seed=3, vocab_size=default_engine.config.vocab_size, num_hidden_layers=2)
    return Engine(model, default_engine.tokenizer, source=default_model_path())


class ShallowLossy(Autoregressive):
    """A lossy mode for the test: decodes densely but scores text with the first layer only."""

    def reference_logits(self, model, ids):
        cache = model.new_cache(len(ids))
        h = model.hidden(torch.tensor(ids), torch.arange(len(ids)), cache, layers=range(1))
        return model.logits(model.norm(h))


@pytest.fixture
def lossy_mode():
    spec = register(StrategySpec("shallow", False, lambda engine, options: ShallowLossy(), "test only"))
    yield spec
    del REGISTRY[spec.name]


@pytest.fixture
def broken_mode():
    spec = register(StrategySpec("broken", True, lambda engine, options: OffByOne(), "test only"))
    yield spec
    del REGISTRY[spec.name]


def write_prompts(path):
    lines = [{"question_id": i, "category": cat, "turns": [f"Question {i} about {cat}?"]}
             for i, cat in enumerate(["coding", "coding", "writing"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_records_summary_and_files(tiny_engine, broken_mode, tmp_path, capsys):
    config = BenchConfig(datasets=[str(write_prompts(tmp_path / "q.jsonl"))], num_prompts=2, max_tokens=6,
                         modes=["dense", "prompt-lookup", "broken"], out=tmp_path / "out")
    summary = run_bench(tiny_engine, config, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 3
    for record in records:
        assert set(RECORD_FIELDS) <= set(record)
        assert record["new_tokens"] == 6 and record["decode_s"] > 0
    by_mode = {r["mode"]: r for r in records if r["prompt_id"] == "0"}
    assert by_mode["prompt-lookup"]["matches_dense"] is True
    assert by_mode["prompt-lookup"]["accept_lengths"]  # speculative modes report their passes
    assert by_mode["broken"]["matches_dense"] is False and by_mode["broken"]["first_divergence"] == 0
    # the lossless mode that is not lossless is flagged, loudly
    assert {f["mode"] for f in summary["lossless_failures"]} == {"broken"}
    out = capsys.readouterr().out
    assert "LOSSLESS FAILURE: mode broken" in out
    last = json.loads(out.strip().splitlines()[-1])  # the last stdout line is one JSON summary
    assert set(last["modes"]) == {"dense", "prompt-lookup", "broken"}
    assert summary["modes"]["dense"]["speedup_vs_dense"] == pytest.approx(1.0)
    assert summary["modes"]["prompt-lookup"]["lossless_ok"] is True
    assert set(summary["modes"]["dense"]["categories"]) == {"coding", "writing"}
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["meta"]["memory_read_gb_s"] > 0 and saved["meta"]["command"] == ""
    for name in ("summary.md", "speedup_by_category.png", "acceptance_lengths.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_missing_baseline_is_skipped_with_how_to_install(tiny_engine, monkeypatch):
    real_find_spec = bench_modes.importlib.util.find_spec
    monkeypatch.setattr(bench_modes.importlib.util, "find_spec",
                        lambda name: None if name == "llama_cpp" else real_find_spec(name))
    modes, skipped = bench_modes.build_modes(tiny_engine, ["dense", "llama.cpp"], SamplingParams(), threads=2)
    assert [m.name for m in modes] == ["dense"]
    assert len(skipped) == 1 and skipped[0].startswith("llama.cpp: skipped")
    assert "pip install" in skipped[0]


def test_unknown_mode_is_a_clear_error(tiny_engine):
    with pytest.raises(ValueError, match="unknown mode 'warp-drive'"):
        bench_modes.build_modes(tiny_engine, ["warp-drive"], SamplingParams(), threads=2)


def test_lossy_modes_report_their_own_perplexity(tiny_engine, lossy_mode, tmp_path):
    config = BenchConfig(datasets=[str(write_prompts(tmp_path / "q.jsonl"))], num_prompts=1, max_tokens=4,
                         modes=["dense", "prompt-lookup", "shallow"], out=tmp_path / "out")
    modes = run_bench(tiny_engine, config, explicit_datasets=True)["modes"]
    assert modes["dense"]["perplexity"] > 1
    assert modes["prompt-lookup"]["perplexity"] == modes["dense"]["perplexity"]  # lossless: the same model
    assert modes["shallow"]["perplexity"] > 1
    assert modes["shallow"]["perplexity"] != pytest.approx(modes["dense"]["perplexity"], rel=1e-3)
