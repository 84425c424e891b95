"""`specee bench` end to end on a tiny model with the real tokenizer: records, summary, flags."""
import json

import pytest
import torch

from helpers import tiny_model
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine
from specee.eval import modes as bench_modes
from specee.eval.bench import BenchConfig, run_bench
from specee.eval.modes import REGISTRY, StrategySpec, register
from specee.eval.report import RECORD_FIELDS
from specee.exits.candidates import Candidates
from specee.sampling import SamplingParams
from specee.strategies.dense import Autoregressive
from specee.strategies.early_exit import EarlyExit


class OffByOne(Autoregressive):
    """A broken 'lossless' mode: shifts every token it emits."""

    def decode(self, state):
        for step in super().decode(state):
            yield step._replace(tokens=[(t + 1) % 1000 for t in step.tokens])


@pytest.fixture
def tiny_engine(tiny_tokenizer, tmp_path):
    model = tiny_model(seed=3, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    return Engine(model, tiny_tokenizer, source=tmp_path / "tiny")


class EveryOtherPass:
    """An exit policy for a 2-layer model: asks to exit after the first layer on every other pass."""

    def __init__(self) -> None:
        self.passes = 0

    def active(self):
        return [True]

    def fires(self, layer, features, probs, drafter_probs):
        self.passes += 1
        return torch.full((len(features),), self.passes % 2 == 0)

    def confirms(self, logits, first, drafter_probs):
        return torch.ones(len(logits), dtype=torch.bool)

    def exited(self, layer):
        pass


@pytest.fixture
def lossy_mode(tiny_tokenizer):
    """Early exit after the first of two layers on every other token: every token is a candidate,
    so each exit the policy asks for stands."""
    vocab = list(range(tiny_tokenizer.vocab_size))
    strategy = EarlyExit(Candidates(PromptLookup, vocab, len(vocab)), EveryOtherPass)
    spec = register(StrategySpec("shallow", False, lambda engine, options: strategy))
    yield spec
    del REGISTRY[spec.name]


@pytest.fixture
def broken_mode():
    spec = register(StrategySpec("broken", True, lambda engine, options: OffByOne()))
    yield spec
    del REGISTRY[spec.name]


def by_prompt_order(records, prompt_id):
    return {r["mode"]: r["run_order"] for r in records if r["prompt_id"] == prompt_id}


def write_prompts(path):
    lines = [{"question_id": i, "category": cat, "turns": [f"Question {i} about {cat}?"]}
             for i, cat in enumerate(["coding", "coding", "writing"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_records_summary_and_files(tiny_engine, broken_mode, tmp_path, capsys):
    config = BenchConfig(datasets=[str(write_prompts(tmp_path / "q.jsonl"))], num_prompts=2, max_tokens=6,
                         modes=["dense", "prompt-lookup", "broken"], out=tmp_path / "out", ignore_eos=True)
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
    # Modes rotate, yet every run is compared with dense: also where it ran before dense.
    broken = [r for r in records if r["mode"] == "broken"]
    assert all(r["matches_dense"] is False for r in broken)
    assert any(r["run_order"] < by_prompt_order(records, r["prompt_id"])["dense"] for r in broken)
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
    assert modes["prompt-lookup"]["perplexity"] is None  # lossless: dense's, not shown as its own
    assert modes["shallow"]["perplexity"] > 1
    assert modes["shallow"]["perplexity"] != pytest.approx(modes["dense"]["perplexity"], rel=1e-3)
    quality = modes["shallow"]["quality"]
    # Scored on the same tokens as dense; about half of them exited (layer 1 of 2).
    assert quality["ppl_text_dense"] == pytest.approx(modes["dense"]["perplexity"])
    assert quality["ppl_text"] == pytest.approx(modes["shallow"]["perplexity"])
    assert 0 < quality["exited_tokens"] < quality["scored_tokens"] and 0 <= quality["fidelity"] <= 1
    assert quality["ppl_continuation"] > 1 and quality["ppl_continuation_dense"] > 1


class EndsAfterThree(Autoregressive):
    """Dense decoding that emits the tokenizer's EOS as its third token; counts its runs."""

    runs = 0

    def decode(self, state):
        EndsAfterThree.runs += 1
        eos = 2  # SmolLM2's <|endoftext|>
        for i, step in enumerate(super().decode(state)):
            yield step._replace(tokens=[eos]) if i == 2 else step


@pytest.fixture
def eos_mode(tiny_tokenizer):
    assert 2 in tiny_tokenizer.eos_token_ids
    EndsAfterThree.runs = 0
    spec = register(StrategySpec("ends", True, lambda engine, options: EndsAfterThree()))
    yield spec
    del REGISTRY[spec.name]


def test_real_use_stops_at_eos_and_fixed_length_is_labelled(tiny_engine, eos_mode, tmp_path):
    prompts = str(write_prompts(tmp_path / "q.jsonl"))
    real = BenchConfig(datasets=[prompts], num_prompts=2, max_tokens=8, modes=["ends"], out=tmp_path / "a")
    summary = run_bench(tiny_engine, real, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "a" / "records.jsonl").read_text().splitlines()]
    assert [r["new_tokens"] for r in records] == [3, 3, 3]
    assert summary["stopping"].startswith("real use") and "stops at EOS" in summary["stopping"]
    # One untimed warm-up run, then one run per prompt; the warm-up is not recorded.
    assert EndsAfterThree.runs == 1 + 3
    fixed = BenchConfig(datasets=[prompts], num_prompts=2, max_tokens=8, modes=["ends"], out=tmp_path / "b",
                        ignore_eos=True)
    summary = run_bench(tiny_engine, fixed, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "b" / "records.jsonl").read_text().splitlines()]
    assert [r["new_tokens"] for r in records] == [8, 8, 8]
    assert summary["stopping"].startswith("fixed length")
    saved = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert saved["meta"]["ignore_eos"] is True and "fixed length" in (tmp_path / "b" / "summary.md").read_text()


def test_modes_rotate_from_prompt_to_prompt(tiny_engine, tmp_path):
    config = BenchConfig(datasets=[str(write_prompts(tmp_path / "q.jsonl"))], num_prompts=2, max_tokens=3,
                         modes=["dense", "prompt-lookup", "prompt-lookup-tree"], out=tmp_path / "out")
    run_bench(tiny_engine, config, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    orders = [by_prompt_order(records, pid) for pid in ("0", "1", "2")]
    assert orders[0] == {"dense": 0, "prompt-lookup": 1, "prompt-lookup-tree": 2}
    assert orders[1] == {"prompt-lookup": 0, "prompt-lookup-tree": 1, "dense": 2}
    assert orders[2] == {"prompt-lookup-tree": 0, "dense": 1, "prompt-lookup": 2}


def test_repeats_keep_each_modes_fastest_run(tiny_engine, tmp_path, monkeypatch):
    from specee.eval.modes import EngineMode

    # The warm-up's two runs, then prompt 0's rounds: (dense, prompt-lookup), (prompt-lookup, dense), (dense, ...).
    decode_times = iter([1.0, 1.0, 0.3, 0.2, 0.5, 0.1, 0.4, 0.6] + [1.0] * 100)
    real_run = EngineMode.run

    def run(self, *args, **kwargs):
        result = real_run(self, *args, **kwargs)
        result.decode_s = next(decode_times)
        return result

    monkeypatch.setattr(EngineMode, "run", run)
    config = BenchConfig(datasets=[str(write_prompts(tmp_path / "q.jsonl"))], num_prompts=1, max_tokens=3,
                         modes=["dense", "prompt-lookup"], repeats=3, out=tmp_path / "out")
    run_bench(tiny_engine, config, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    first = {r["mode"]: r["decode_s"] for r in records if r["prompt_id"] == "0"}
    assert first == {"dense": 0.1, "prompt-lookup": 0.2}  # rounds: (dense, pl), (pl, dense), (dense, pl)


def test_skip_first_takes_later_prompts_of_each_category(tiny_engine, tmp_path):
    lines = [{"question_id": i, "category": cat, "turns": [f"Question {i}?"]}
             for i, cat in enumerate(["coding", "coding", "coding", "writing", "writing"])]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = BenchConfig(datasets=[str(path)], num_prompts=5, max_tokens=2, modes=["dense"], out=tmp_path / "o",
                         skip_first=1)
    run_bench(tiny_engine, config, explicit_datasets=True)
    records = [json.loads(line) for line in (tmp_path / "o" / "records.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == ["1", "2", "4"]
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["meta"]["skip_first"] == 1


def test_a_mode_that_cannot_be_built_for_the_model_is_skipped_with_why(tiny_engine):
    def refuse(engine, options):
        raise ValueError("its table was trained for another tokenizer")

    spec = register(StrategySpec("picky", True, refuse))
    try:
        modes, skipped = bench_modes.build_modes(tiny_engine, ["dense", "picky"], SamplingParams(), threads=2)
    finally:
        del REGISTRY[spec.name]
    assert [m.name for m in modes] == ["dense"]
    assert skipped == ["picky: skipped, its table was trained for another tokenizer"]


def test_perplexity_feeds_the_models_own_device():
    """The reference text goes to the device the model lives on (a CUDA model got CPU tensors)."""
    from types import SimpleNamespace

    from specee.eval.teacher_forcing import quality

    seen = []

    class ModelOnMeta:
        device = torch.device("meta")

        def new_cache(self, length):
            return None

        def __call__(self, ids, positions, cache):
            seen.append((ids.device.type, positions.device.type))
            return torch.zeros(len(ids), 5)  # uniform over 5 tokens

    engine = SimpleNamespace(model=ModelOnMeta(), tokenizer=SimpleNamespace(encode=lambda text: [1, 2, 3]),
                             context_length=100)
    assert quality(engine, [([1, 2, 3], 1)])["ppl_dense"] == pytest.approx(5.0)
    assert seen == [("meta", "meta")]


def test_modes_take_options_for_tuning_sweeps(tiny_engine):
    assert bench_modes.parse_mode("hybrid-tree[tree_budget=6,min_copy_match=1]") == (
        "hybrid-tree", {"tree_budget": 6, "min_copy_match": 1})
    assert bench_modes.parse_mode("exit-rule[exit_rule=0.9,0.6,exit_kv=approx]") == (
        "exit-rule", {"exit_rule": "0.9,0.6", "exit_kv": "approx"})
    modes, skipped = bench_modes.build_modes(
        tiny_engine, ["prompt-lookup-tree[tree_budget=6]", "prompt-lookup-tree"], SamplingParams(), threads=2)
    assert [m.name for m in modes] == ["prompt-lookup-tree[tree_budget=6]", "prompt-lookup-tree"]
    assert [m.strategy.tree_budget for m in modes] == [6, 4] and not skipped
    with pytest.raises(ValueError, match="key=value"):
        bench_modes.parse_mode("hybrid[tree_budget]")
    _, skipped = bench_modes.build_modes(tiny_engine, ["prompt-lookup[colour=red]"], SamplingParams(), threads=2)
    assert skipped and "unknown options" in skipped[0]


def test_engine_and_hf_stop_at_the_same_end_of_sequence_unless_told_not_to(tiny_tokenizer, tmp_path, monkeypatch):
    """Real use means every system stops at the same EOS; --ignore-eos runs all to full length."""
    from helpers import specee_from_hf, tiny_hf_model

    hf_model = tiny_hf_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    hf_model.save_pretrained(tmp_path / "tiny")
    engine = Engine(specee_from_hf(hf_model), tiny_tokenizer, source=tmp_path / "tiny")
    prompt_ids, params = engine.encode("Tell me a story."), SamplingParams()
    dense = bench_modes.EngineMode(engine, REGISTRY["dense"])
    full = dense.run(prompt_ids, 12, params, ignore_eos=True).token_ids
    assert bench_modes.HFMode(engine).run(prompt_ids, 12, params, ignore_eos=True).token_ids == full
    stop = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # a token first seen mid-answer
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", [full[stop]])
    hf = bench_modes.HFMode(engine)
    assert dense.run(prompt_ids, 12, params, ignore_eos=False).token_ids == full[: stop + 1]
    assert hf.run(prompt_ids, 12, params, ignore_eos=False).token_ids == full[: stop + 1]
    assert hf.run(prompt_ids, 12, params, ignore_eos=True).token_ids == full


@pytest.mark.slow
def test_hf_baselines_load_the_default_gguf_file(default_engine):
    """Hugging Face reads the GGUF itself (it needs accelerate for that): both HF baselines build
    for the default model instead of being skipped, and agree with our dense decoding."""
    modes, skipped = bench_modes.build_modes(default_engine, ["hf", "hf-prompt-lookup"], SamplingParams(), 2)
    assert skipped == []
    prompt_ids = default_engine.encode("Name three colours.")
    dense = bench_modes.EngineMode(default_engine, REGISTRY["dense"]).run(prompt_ids, 8, SamplingParams(), True)
    assert modes[0].run(prompt_ids, 8, SamplingParams(), True).token_ids == dense.token_ids
