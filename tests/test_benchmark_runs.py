"""Every script in benchmarks/ run end to end on a tiny random GGUF with its smallest arguments, as
a user runs it (`python benchmarks/X.py ...`): its last line is JSON, and where it decodes, that
JSON names the method it timed and what the engine's own counters say it ran: a dense mode drafted
nothing and every pass was a dense step ("none"); a speculative mode drafted, and its own method
drafted some of its passes. Scripts that need what this machine may lack (a CUDA GPU,
llama-cpp-python) must say so and exit non-zero; where it is there, they run.
Each run starts Python and PyTorch (3 s or more on a shared 2-core machine): all are slow tests.
(tests/test_benchmark_methods.py checks the source: every generate/stream call names its method.)"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_tokenizer, write_llama_gguf

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
CUDA = torch.cuda.is_available()
LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama GGUF (Q4_K, 2 layers of 256, the tiny tokenizer, a 4096-token context for
    the chat benchmarks' long histories) and a $SPECEE_CACHE of its own sharing the built kernels."""
    from specee.model.loading import cache_root

    directory = tmp_path_factory.mktemp("benchmark-runs")
    tiny_tokenizer(directory / "tokenizer")
    model = write_llama_gguf(directory / "tiny.gguf", {"default": "Q4_K"}, directory / "tokenizer", context=4096)
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (directory / "cache").mkdir()
    (directory / "cache" / "kernels").symlink_to(kernels)
    return directory, model


def run(script: str, *args, directory: Path, ok: bool = True, timeout: float = 600, first_path: Path | None = None):
    """Runs benchmarks/`script` in a child process on one thread (`first_path`: searched for
    modules before the checkout); (return code, stdout, stderr)."""
    path = [str(first_path)] if first_path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "SPECEE_CACHE": str(directory / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if ok:
        assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.returncode, done.stdout, done.stderr


def last_json(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, "the script printed nothing"
    return json.loads(lines[-1])


def numbers(value) -> list[float]:
    """Every number in a JSON value (booleans aside)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def assert_dense(report: dict) -> None:
    """What a dense run's counters must say: every pass a dense step, nothing drafted."""
    assert report["method_passes"].get("none", 0) > 0 and set(report["method_passes"]) == {"none"}, report
    assert report["drafted"] == 0, report


def assert_speculated(report: dict, method: str) -> None:
    """What a speculative run's counters must say: it drafted, and `method` drafted some passes
    (others may be dense steps, or tokens a grammar forced)."""
    assert report["drafted"] > 0 and report["method_passes"].get(method, 0) > 0, report
    assert set(report["method_passes"]) <= {method, "none", "grammar"}, report


def test_every_benchmark_script_has_a_run_here():
    """A new script in benchmarks/ needs its run below (cluster_scaling.py's is in test_cluster.py, on
    that module's Ray cluster)."""
    covered = {"agent_loop.py", "cluster_scaling.py", "cuda_pass_cost.py", "cuda_penalties_logprobs.py", "formats.py",
               "batch_auto.py", "head_bounds.py", "kv_cache_dtype.py", "kv_cache_quality.py", "multirow_cost.py", "paired_decode.py",
               "pass_profile.py", "prefix_cache_budget.py", "prefix_cache_turns.py", "structured_output.py", "tier_rows.py"}
    assert {p.name for p in BENCHMARKS.glob("*.py")} <= covered


def test_the_checks_tell_dense_from_speculative():
    assert_dense({"method_passes": {"none": 5}, "drafted": 0})
    assert_speculated({"method_passes": {"none": 2, "grammar": 1, "hybrid": 3}, "drafted": 9}, "hybrid")
    with pytest.raises(AssertionError):
        assert_dense({"method_passes": {"none": 3, "prompt-lookup": 2}, "drafted": 4})  # `auto` timed as dense
    with pytest.raises(AssertionError):
        assert_speculated({"method_passes": {"none": 5}, "drafted": 0}, "prompt-lookup")  # never drafted
    with pytest.raises(AssertionError):
        assert_speculated({"method_passes": {"prompt-lookup": 2, "suffix": 3}, "drafted": 9}, "prompt-lookup")


# Scripts that decode: the JSON line names the method and the counters agree with it.

@pytest.mark.slow
def test_prefix_cache_turns_times_dense_first_tokens(tiny):
    directory, model = tiny
    report = last_json(run("prefix_cache_turns.py", "--model", model, "--turns", "1", "--max-tokens", "4",
                           directory=directory)[1])
    assert report["spec_method"] == "none"
    assert_dense(report)
    assert list(report["off_over_on"]) == ["1"] and 0 < report["off_over_on"]["1"] < math.inf


@pytest.mark.slow
def test_agent_loop_times_auto_against_dense_with_the_same_answers(tiny):
    """Nine loops: the ninth sends the first loop's task again, so its calls are also "seen"."""
    directory, model = tiny
    report = last_json(run("agent_loop.py", "--model", model, "--loops", "9", "--max-tokens", "4",
                           directory=directory)[1])
    assert report["spec_method"] == {"auto": "auto", "dense": "none"} and report["differ"] == 0
    dense, auto = report["modes"]["dense"], report["modes"]["auto"]
    assert_dense(dense["all"])
    assert set(auto["all"]["method_passes"]) <= {"prompt-lookup", "suffix", "ngram", "none"}
    assert auto["all"]["drafted"] > 0 and auto["seen"]["method_passes"].get("suffix", 0) > 0  # the ninth loop's own task
    calls = 9 * 5
    assert dense["all"]["calls"] == auto["all"]["calls"] == calls and dense["seen"]["calls"] == 5
    assert dense["all"]["tokens"] == auto["all"]["tokens"] > 0 and dense["all"]["cached_tokens"] > 0


@pytest.mark.slow
def test_prefix_cache_budget_replays_dense(tiny):
    directory, model = tiny
    report = last_json(run("prefix_cache_budget.py", "--model", model, "--budgets", "1", "--max-tokens", "2",
                           "--conversations", "1", directory=directory)[1])
    assert report["spec_method"] == "none" and list(report["budgets_mb"]) == ["1.0"]
    budget = report["budgets_mb"]["1.0"]
    assert_dense(budget)
    assert 0 <= budget["cached_share"] <= 1 and budget["prompt_tokens"] > 0 and budget["held_mb"] <= 1.0


@pytest.mark.slow
def test_structured_output_times_each_mode_as_named(tiny):
    """Dense with and without the schema, and prompt lookup under it (hybrid, eagle and kangaroo
    need drafter files that a random model has none of)."""
    directory, model = tiny
    report = last_json(run("structured_output.py", "--model", model, "--repeats", "1", "--prompts", "1",
                           "--max-tokens", "16", "--methods", "prompt-lookup", directory=directory)[1])
    modes = report["modes"]
    assert list(modes) == ["free dense", "json dense", "json prompt-lookup"]
    assert modes["free dense"]["spec_method"] == modes["json dense"]["spec_method"] == "none"
    assert modes["json prompt-lookup"]["spec_method"] == "prompt-lookup"
    assert_dense(modes["free dense"])
    assert_dense(modes["json dense"])
    assert_speculated(modes["json prompt-lookup"], "prompt-lookup")
    assert set(report["geomean"]) == {"json dense / free dense (tok/s)", "json prompt-lookup / json dense"}
    assert all(0 < v < math.inf for v in report["geomean"].values())


@pytest.mark.slow
def test_formats_times_dense_decoding_on_each_cache(tiny):
    directory, model = tiny
    report = last_json(run("formats.py", "--model", model, "--formats", "gguf,gguf+kv-fp16", "--rounds", "1",
                           "--no-quality", "--no-llama-cpp", directory=directory)[1])
    assert list(report["results"]) == ["gguf", "gguf+kv-fp16"]
    for system, cache in (("gguf", "float32"), ("gguf+kv-fp16", "float16")):
        result = report["results"][system]
        assert result["spec_method"] == "none" and result["kv_cache_dtype"] == cache, result
        assert_dense(result)
        assert all(result[k] > 0 and math.isfinite(result[k])
                   for k in ("decode_ms", "prefill_s", "weight_mb", "peak_rss_mb"))


@pytest.mark.slow
def test_formats_names_the_data_it_lacks_before_any_run(tiny, tmp_path):
    directory, model = tiny
    missing = tmp_path / "question.jsonl"
    code, _, stderr = run("formats.py", "--model", model, "--formats", "gguf", "--no-quality", "--no-llama-cpp",
                          "--spec-bench", str(missing), directory=directory, ok=False)
    assert code == 2 and str(missing) in stderr and "--spec-bench" in stderr, stderr
    assert "Traceback" not in stderr and "round 1" not in stderr  # said at once, no child started


@pytest.mark.slow
def test_formats_refuses_a_reference_it_does_not_run(tiny):
    directory, model = tiny
    code, _, stderr = run("formats.py", "--model", model, "--formats", "gguf", "--reference", "gguf+kv-fp16",
                          "--no-quality", "--no-llama-cpp", directory=directory, ok=False)
    assert code == 2 and "--reference gguf+kv-fp16 is not one of --formats (gguf)" in stderr, stderr
    assert "Traceback" not in stderr and "round 1" not in stderr


@pytest.mark.slow
def test_paired_decode_says_it_needs_llama_cpp_where_missing(tiny):
    directory, model = tiny
    if LLAMA_CPP:  # installed here: it must run instead (the test below), so check the run's JSON
        report = last_json(run("paired_decode.py", "--model", model, "--rounds", "1", "--tokens", "4",
                               directory=directory)[1])
        assert report["spec_method"] == "none"
        assert_dense(report)
        return
    code, _, stderr = run("paired_decode.py", "--model", model, directory=directory, ok=False)
    assert code == 1 and "needs llama-cpp-python" in stderr, stderr


FAKE_LLAMA_CPP = '''
class Llama:
    """A stand-in for llama-cpp-python's Llama: evaluates nothing, samples token 0."""
    def __init__(self, **options): pass
    def reset(self): pass
    def eval(self, tokens): pass
    def sample(self, **options): return 0
'''


@pytest.mark.slow
def test_paired_decode_times_specee_dense(tiny):
    """specee's half of the pairing, against a stand-in llama.cpp (the real one may be missing here):
    what the script reports about its own decoding does not depend on the other system."""
    directory, model = tiny
    fake = directory / "fake-llama-cpp"
    (fake / "llama_cpp").mkdir(parents=True, exist_ok=True)
    (fake / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    report = last_json(run("paired_decode.py", "--model", model, "--rounds", "2", "--tokens", "4",
                           directory=directory, first_path=fake)[1])
    assert report["spec_method"] == "none" and report["tokens"] == 4 and len(report["ratios"]) == 2
    assert_dense(report)
    assert report["method_passes"]["none"] == 3 * 4  # warm-up and two rounds, 4 dense passes each


@pytest.mark.slow
def test_cuda_penalties_logprobs(tiny):
    directory, _ = tiny
    if not CUDA:
        code, stdout, stderr = run("cuda_penalties_logprobs.py", directory=directory, ok=False)
        assert code == 1 and "needs a CUDA GPU" in stderr and not stdout, stderr
        return
    report = last_json(run("cuda_penalties_logprobs.py", directory=directory)[1])
    modes = report["modes"]
    assert_dense(modes["dense"])
    # (mode, the spec_method it asked for, the name its passes carry: a tree of drafts is "draft-tree")
    for name, method, passes in (("draft chain self:3", "draft", "draft"), ("draft tree self:3", "draft", "draft-tree"),
                                 ("prompt-lookup", "prompt-lookup", "prompt-lookup"),
                                 ("sampled draft tree self:2", "draft", "draft-tree")):
        assert modes[name]["spec_method"] == method
        assert_speculated(modes[name], passes)
    assert all(modes[name]["greedy_identical"] for name in ("draft chain self:3", "draft tree self:3", "prompt-lookup"))
    assert all(0 < v < math.inf for v in report["tokens_per_s"].values())


@pytest.mark.slow
def test_cuda_pass_cost(tiny):
    directory, _ = tiny
    if not CUDA:
        code, stdout, stderr = run("cuda_pass_cost.py", directory=directory, ok=False)
        assert code == 1 and "needs a CUDA GPU" in stderr and not stdout, stderr
        return
    report = last_json(run("cuda_pass_cost.py", "--shapes", "1b", "--dtypes", "bfloat16", "--tokens", "1,4",
                           "--repeats", "1", directory=directory)[1])
    assert report["spec_method"] == "none" and list(report["results"]) == ["1b bfloat16"]
    result = report["results"]["1b bfloat16"]
    assert list(result["pass_ms"]) == ["1", "4"]
    assert all(0 < v < math.inf for v in numbers(result))


# Scripts that time passes or kernels, not decoding: their figures are there and sane.

@pytest.mark.slow
def test_head_bounds(tiny):
    directory, model = tiny
    report = last_json(run("head_bounds.py", "--model", model, "--splits", "0,0.5", directory=directory)[1])
    assert report["vocab"] > 0 and report["hidden"] == 256 and report["states"] > 0
    assert set(report["splits"]) == {"0.0", "0.5"}
    assert report["splits"]["0.0"]["mean_surviving_share"] == 1.0  # Cauchy-Schwarz alone rules nothing out here
    assert all(0 <= v <= 1 for v in numbers(report["splits"]))


@pytest.mark.slow
def test_multirow_cost(tiny):
    directory, model = tiny
    report = last_json(run("multirow_cost.py", "--model", model, "--formats", "gguf", "--paths", "compiled",
                           "--tokens", "1,4", "--repeats", "1", "--context", "8", "--threads", "1,2",
                           directory=directory)[1])
    assert report["threads"] == [1, 2] and list(report["results"]) == ["1", "2"]
    for by_path in report["results"].values():
        (result,) = by_path.values()
        assert list(by_path) == ["gguf (compiled)"] and result["relative"]["1"] == 1.0
        assert all(0 < v < math.inf for v in numbers(result))


@pytest.mark.slow
def test_tier_rows(tiny):
    from specee.model.kernels import supported_tiers

    tiers = list(dict.fromkeys([supported_tiers()[0], "portable"]))
    directory, _ = tiny
    report = last_json(run("tier_rows.py", "--tiers", ",".join(tiers), "--rows", "1,4", "--in-features", "256",
                           "--out-features", "64", "--repeats", "1", "--threads", "1", directory=directory)[1])
    assert set(report["ms"]) == set(tiers) and all(list(report["ms"][t]) == ["1", "4"] for t in tiers)
    assert all(0 < v < math.inf for v in numbers(report["ms"]))


@pytest.mark.slow
def test_kv_cache_dtype(tiny):
    directory, model = tiny
    report = last_json(run("kv_cache_dtype.py", "--model", model, "--contexts", "8,40", "--tokens", "1,3",
                           "--repeats", "1", directory=directory)[1])
    assert [(r["context"], r["rows"]) for r in report["results"]] == [(8, 1), (8, 3), (40, 1), (40, 3)]
    for result in report["results"]:
        assert set(result["ms"]) == {"fp32", "fp16"} and all(0 < ms < math.inf for ms in result["ms"].values())
        assert result["fp16_over_fp32"] == pytest.approx(result["ms"]["fp16"] / result["ms"]["fp32"])


@pytest.mark.slow
def test_kv_cache_quality(tiny):
    directory, model = tiny
    questions = directory / "questions.jsonl"
    text = "The cache keeps every key and value of the context, and the pass reads them again. "
    prompts = [("long", text * 4), ("long", text * 4), ("short", "A few words.")]
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": category, "turns": [turn]})
                                   for i, (category, turn) in enumerate(prompts)))
    report = last_json(run("kv_cache_quality.py", "--model", model, "--length", "96", "--noise", "0.3", "--seeds", "2",
                           "--spec-bench", questions, directory=directory)[1])
    results = report["results"]
    assert results.pop("tokens") == 95  # the long category's 96 tokens score 95; the short one is left out
    assert list(results) == ["fp32", "fp16", "fp32, embeddings x (1 + 0.3 N), seed 1",
                             "fp32, embeddings x (1 + 0.3 N), seed 2"]
    assert [r["cache"] for r in results.values()] == ["float32", "float16", "float32", "float32"]
    assert results["fp32"]["top1_equal_fp32"] == 1.0 and all(1 < r["ppl"] < math.inf for r in results.values())
    assert all(r["top1_equal_fp32"] < 1 for name, r in results.items() if "seed" in name)  # the noise reached the pass


@pytest.mark.slow
def test_pass_profile(tiny):
    directory, model = tiny
    # No context: the pass is a prompt's first chunk (which once failed on an empty prefill).
    report = last_json(run("pass_profile.py", "--model", model, "--tokens", "1,4", "--threads", "1", "--context", "0",
                           "--repeats", "1", directory=directory)[1])
    assert [(row["threads"], row["tokens"]) for row in report["rows"]] == [(1, 1), (1, 4)]
    for row in report["rows"]:
        ms = row["ms"]
        assert set(ms) == {"pass", "layers", "head", "matmuls", "attention", "rest of the layers"}
        assert all(0 < ms[part] < math.inf for part in ("pass", "layers", "head", "matmuls", "attention"))
        assert ms["rest of the layers"] == pytest.approx(ms["layers"] - ms["matmuls"] - ms["attention"])
        steps = row["steps"]
        assert list(steps)[:2] == ["norm, quantize", "qkv"] and len(steps) == 10
        assert all(0 <= t["work"] <= t["longest"] and t["wait"] >= 0 for t in steps.values())
        assert 0 < sum(t["work"] + t["wait"] for t in steps.values()) < 10 * ms["layers"]
    code, _, stderr = run("pass_profile.py", "--model", model, "--context", "-1", directory=directory, ok=False)
    assert code == 2 and "--context: the cached tokens before the pass, 0 or more" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_batch_auto_times_auto_against_dense_in_a_batch_with_the_same_answers(tiny):
    directory, model = tiny
    report = last_json(run("batch_auto.py", "--model", model, "--rounds", "2", "--width", "3", "--requests", "5",
                           "--max-tokens", "6", directory=directory)[1])
    assert report["spec_method"] == {"dense": "none", "auto": "auto"} and report["differ"] == 0
    dense, auto = report["modes"]["dense"], report["modes"]["auto"]
    assert_dense(dense)
    assert set(auto["method_passes"]) <= {"prompt-lookup", "ngram", "none"}  # the suffix cache is off
    assert dense["tokens"] == auto["tokens"] > 0 and dense["passes"] >= 6  # 5 requests of up to 6 tokens, 3 at a time
    # Each mode's run is its passes and its Python between them; the modeled times are priced on one line.
    for mode in (dense, auto):
        assert 0 < mode["pass_s"] < mode["wall_s"] and mode["python_s"] == pytest.approx(mode["wall_s"] - mode["pass_s"])
    assert 0 < report["wall_ratio"] < math.inf
    # Passes of 3, 2 and 1 rows as the batch drains: a line to price them on.
    assert report["line"]["row_s"] != 0 and report["modeled_ratio"] == pytest.approx(dense["modeled_s"] / auto["modeled_s"])
