"""One table per weight format on a model (the default one unless `--model`): speed, memory and
quality, next to llama.cpp.

Each format (and llama.cpp) runs in its own child process, so its peak memory is its own; the
children run round-robin for `--rounds` rounds (speed from every round, the median kept; quality
from the first). Per format:
- decode ms per token (dense, greedy, fixed length) and the weight bandwidth it achieves;
- prefill seconds of a ~1,000-token prompt (real text, the same tokens for every system);
- peak RSS after loading, decoding and prefilling;
- quality: perplexity of held-out text (Spec-Bench prompts, read as plain text, never used to
  train or tune anything), teacher-forced top-1 agreement on that text with the reference (fp32
  weights, "none", unless `--reference` names another system), greedy agreement with it (tokens
  before the first divergence from its greedy output, and outputs identical), and MMLU accuracy
  (greedy, short answers).

A format runs on specee's compiled CPU kernels, in the best CPU tier; "<format>:<tier>" in a tier
this CPU runs (avx512, avxvnni, avx2, neon, portable), "<format>:eager" on PyTorch's own kernels;
every system on an fp32 KV cache, so the formats differ only in their weights, and "<format>+kv-fp16"
on an fp16 one (`--kv-cache-dtype fp16`, what quantized weights keep by default: its cost beside
the fp32 cache's row of the same format).
`--model FILE.gguf` runs every system on that file instead (the random-weight files of
`scripts/make_random_gguf.py` have no quality to measure: `--no-quality`); a child's load time is
that of a load after the first (the first writes specee's caches, untimed).

    PYTHONPATH=. python benchmarks/formats.py --formats none,int8,int4,gguf,int4:eager --rounds 2
    PYTHONPATH=. python benchmarks/formats.py --formats int4:avx2,int4:portable,int4:eager --no-quality
    PYTHONPATH=. python benchmarks/formats.py --model random-1b-Q4_K_M.gguf --formats gguf --rounds 3 --no-quality
    PYTHONPATH=. python benchmarks/formats.py --model gemma-3-270m-q4_k_m.gguf --formats none,int8,int4,gguf
    PYTHONPATH=. python benchmarks/formats.py --formats gguf,gguf+kv-fp16 --reference gguf --rounds 1 --no-llama-cpp
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specee.eval.bench import before_divergence, judge, peak_rss_mb, read_bandwidth_gb_s
from specee.eval.datasets import DatasetMissing, load_dataset

PREFILL_TOKENS = 1000
DECODE_PROMPT = "Write a python function that returns the n-th Fibonacci number, with a docstring."
DECODE_TOKENS = 96
TEXT_TOKENS = 512  # held-out text scored per prompt
TEXT_CATEGORIES = ["summarization", "rag", "writing", "roleplay", "stem", "humanities"]
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 64
MMLU_QUESTIONS = 40
MMLU_TOKENS = 24


def held_out_texts(tokenizer, spec_bench: str) -> list[list[int]]:
    """One Spec-Bench prompt per category, as plain text (no chat template), cut to TEXT_TOKENS."""
    prompts = load_dataset(spec_bench, num_prompts=1, categories=TEXT_CATEGORIES)
    return [tokenizer.encode(p.turns[0])[:TEXT_TOKENS] for p in prompts]


def prefill_ids(tokenizer, spec_bench: str) -> list[int]:
    """~PREFILL_TOKENS tokens of real text: summarization prompts joined until long enough."""
    ids: list[int] = []
    for prompt in load_dataset(spec_bench, categories=["summarization"]):
        ids += tokenizer.encode(prompt.turns[0])
        if len(ids) >= PREFILL_TOKENS:
            return ids[:PREFILL_TOKENS]
    raise RuntimeError(f"Spec-Bench summarization holds fewer than {PREFILL_TOKENS} tokens")


def median_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


KV_FP16 = "+kv-fp16"  # a system name's suffix: the format on an fp16 KV cache


def load_arguments(system: str) -> dict:
    """`specee.load`'s options for `system`: a format, on the compiled kernels (in the tier
    "<format>:<tier>" names) or "<format>:eager" on PyTorch's own, "+kv-fp16" on an fp16 cache."""
    name, fp16 = (system[:-len(KV_FP16)], True) if system.endswith(KV_FP16) else (system, False)
    quantization, _, path = name.partition(":")
    return {"quantization": quantization, "compile": path != "eager",
            "cpu_tier": path if path not in ("", "eager") else None, "kv_cache_dtype": "fp16" if fp16 else "fp32"}


def measure_ours(system: str, inputs: dict, with_quality: bool, model: str | None) -> dict:
    import specee

    started = time.perf_counter()
    engine = specee.load(model, **load_arguments(system))
    load_s = time.perf_counter() - started
    model, long_prompt = engine.model, inputs["long_prompt"]
    # Dense decoding: one pass per token, whatever the engine's default (`auto` speculates).
    engine.generate(inputs["decode_prompt"], chat=False, max_tokens=8, ignore_eos=True, spec_method="none")  # warm-up

    def decode():
        return engine.generate(inputs["decode_prompt"], chat=False, max_tokens=DECODE_TOKENS, ignore_eos=True,
                               spec_method="none")

    def prefill():
        with torch.inference_mode():
            model.prefill(long_prompt, model.new_cache(len(long_prompt)))

    runs = [decode().stats for _ in range(3)]
    decode_s = statistics.median(stats.decode_s for stats in runs)
    # What the timed runs decoded with: passes by method ("none": dense) and draft tokens.
    method_passes = {method: sum(stats.method_passes.get(method, 0) for stats in runs)
                     for method in {m for stats in runs for m in stats.method_passes}}
    result = {"decode_ms": decode_s / (DECODE_TOKENS - 1) * 1e3, "prefill_s": median_s(prefill),
              "weight_mb": model.weight_bytes / 1e6, "peak_rss_mb": peak_rss_mb(), "load_s": load_s,
              "spec_method": "none", "method_passes": method_passes,
              "kv_cache_dtype": str(model.new_cache(1).keys.dtype).removeprefix("torch."),  # what the cache holds
              "drafted": sum(stats.draft_tokens_proposed for stats in runs)}
    if with_quality:
        result["quality"] = quality_of(engine, inputs["spec_bench"])
    return result


def quality_of(engine, spec_bench: str) -> dict:
    """What `measure_ours` reports about the outputs: per-text scores, greedy outputs, MMLU answers."""
    model, tokenizer = engine.model, engine.tokenizer
    nll, argmax = [], []
    with torch.inference_mode():
        for ids in held_out_texts(tokenizer, spec_bench):
            logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[:-1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item())
            argmax.append(logits.argmax(-1).tolist())
    greedy = [engine.generate(p.turns[0], max_tokens=GREEDY_TOKENS, spec_method="none").token_ids
              for p in load_dataset(spec_bench, num_prompts=1)[:GREEDY_PROMPTS]]
    mmlu = [bool(judge(p, engine.generate(p.turns[0], max_tokens=MMLU_TOKENS, spec_method="none").text))
            for p in load_dataset("mmlu", num_prompts=MMLU_QUESTIONS)[:MMLU_QUESTIONS]]
    return {"nll": nll, "argmax": argmax, "greedy": greedy, "mmlu_correct": sum(mmlu), "mmlu_total": len(mmlu)}


def measure_llama_cpp(inputs: dict, model: str | None) -> dict:
    from llama_cpp import Llama

    from specee.model.loading import default_model_path

    path = Path(model) if model else default_model_path()
    threads = torch.get_num_threads()
    started = time.perf_counter()
    # specee's default context, so the KV caches (and peak memory) hold the same number of tokens.
    llm = Llama(model_path=str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - started

    def decode() -> float:
        llm.reset()
        llm.eval(inputs["decode_prompt"])
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        return time.perf_counter() - start

    def prefill():
        llm.reset()
        llm.eval(inputs["long_prompt"])

    decode()  # warm-up
    decode_s = statistics.median(decode() for _ in range(3))
    return {"decode_ms": decode_s / (DECODE_TOKENS - 1) * 1e3, "prefill_s": median_s(prefill),
            "weight_mb": path.stat().st_size / 1e6, "peak_rss_mb": peak_rss_mb(), "load_s": load_s}


def child(system: str, inputs_file: str, with_quality: bool, model: str | None) -> None:
    inputs = json.loads(Path(inputs_file).read_text())
    if system == "llama.cpp":
        result = measure_llama_cpp(inputs, model)
    else:
        result = measure_ours(system, inputs, with_quality, model)
    print(json.dumps(result))


def write_inputs(path: Path, model: str | None, spec_bench: str) -> None:
    """The token ids every system runs on, tokenized once here (the children load only a model), and
    where the children's quality runs read Spec-Bench."""
    from specee.model.config import LlamaConfig
    from specee.model.loading import default_model_path, resolve_model_dir
    from specee.tokenizer import Tokenizer

    directory = resolve_model_dir(Path(model) if model else default_model_path())
    tokenizer = Tokenizer(directory, LlamaConfig.from_file(directory / "config.json").eos_token_ids)
    path.write_text(json.dumps({"long_prompt": prefill_ids(tokenizer, spec_bench),
                                "decode_prompt": tokenizer.encode_prompt(DECODE_PROMPT), "spec_bench": spec_bench}))


def run_child(system: str, inputs: Path, with_quality: bool, model: str | None) -> dict:
    command = [sys.executable, __file__, "--child", system, "--inputs", str(inputs)] + (["--quality"] if with_quality else [])
    command += ["--model", model] if model else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{system} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child_load_only(system: str, model: str) -> None:
    code = f"import specee; specee.load({model!r}, **{load_arguments(system)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """(mean share of the reference's tokens before the first difference, how many sequences are identical)."""
    shares = [before_divergence(b, a) for a, b in zip(reference, other)]
    return sum(shares) / len(shares), sum(a == b for a, b in zip(reference, other))


def table(results: dict, bandwidth: float, reference_name: str = "none") -> str:
    reference = results.get(reference_name, {}).get("quality")
    lines = ["| system | weights MB | decode ms/token | tok/s | vs llama.cpp | weights GB/s (machine "
             f"{bandwidth:.1f}) | prefill {PREFILL_TOKENS} tokens s | vs llama.cpp | peak RSS MB | vs llama.cpp | "
             f"load s | ppl | top-1 = {reference_name} | greedy before divergence | greedy identical | MMLU |",
             "|" + "---|" * 16]
    llama = results.get("llama.cpp")
    for system, r in results.items():
        q = r.get("quality")
        row = [system, f"{r['weight_mb']:.1f}", f"{r['decode_ms']:.2f}", f"{1e3 / r['decode_ms']:.1f}",
               f"{llama['decode_ms'] / r['decode_ms']:.2f}x" if llama else "-",
               f"{r['weight_mb'] / r['decode_ms']:.1f}", f"{r['prefill_s']:.2f}",
               f"{llama['prefill_s'] / r['prefill_s']:.2f}x" if llama else "-", f"{r['peak_rss_mb']:.0f}",
               f"{r['peak_rss_mb'] / llama['peak_rss_mb']:.2f}x" if llama else "-", f"{r['load_s']:.1f}"]
        if q:
            tokens = sum(len(a) for a in q["argmax"])
            row.append(f"{math.exp(sum(q['nll']) / tokens):.2f}")
            if reference:
                top1 = sum(x == y for a, b in zip(reference["argmax"], q["argmax"]) for x, y in zip(a, b)) / tokens
                share, same = agreement(reference["greedy"], q["greedy"])
                row += [f"{top1:.3f}", f"{share:.2f}", f"{same}/{len(q['greedy'])}"]
            else:
                row += ["-"] * 3
            row.append(f"{q['mmlu_correct']}/{q['mmlu_total']}")
        else:
            row += ["-"] * 5
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="none,int8,int4,gguf")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--no-quality", action="store_true", help="speed, prefill and memory only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--quality", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help="a GGUF file to run every system on (default: the default model)")
    parser.add_argument("--reference",
                        help="the system whose outputs the agreement columns compare with (default none: fp32)")
    parser.add_argument("--spec-bench", default="spec-bench",
                        help="Spec-Bench's question.jsonl (default: the copy beside the checkout)")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.inputs, args.quality, args.model)
    inputs = Path(tempfile.mkdtemp()) / "inputs.json"
    try:  # the data every run needs, before any child starts
        write_inputs(inputs, args.model, args.spec_bench)
        if not args.no_quality:
            load_dataset("mmlu", num_prompts=1)
    except (DatasetMissing, ValueError) as missing:
        parser.error(f"{missing} (--spec-bench names Spec-Bench's file; --no-quality skips MMLU)")
    systems = args.formats.split(",") + ([] if args.no_llama_cpp else ["llama.cpp"])
    if args.reference is not None and (args.reference not in systems or args.reference == "llama.cpp"):
        parser.error(f"--reference {args.reference} is not one of --formats ({args.formats})")
    if args.model:
        for system in systems[:-1] if not args.no_llama_cpp else systems:  # first loads write the caches
            run_child_load_only(system, args.model)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_index in range(args.rounds):
        for system in systems:
            with_quality = round_index == 0 and system != "llama.cpp" and not args.no_quality
            runs[system].append(run_child(system, inputs, with_quality, args.model))
            print(f"round {round_index + 1}: {system} {runs[system][-1]['decode_ms']:.2f} ms/token", file=sys.stderr)
    results = {}
    for system, rs in runs.items():
        results[system] = {key: statistics.median(r[key] for r in rs)
                           for key in ("decode_ms", "prefill_s", "weight_mb", "peak_rss_mb", "load_s")}
        results[system]["quality"] = rs[0].get("quality")
        if "spec_method" in rs[0]:  # specee's formats: what every round decoded with
            results[system] |= {"spec_method": rs[0]["spec_method"], "kv_cache_dtype": rs[0]["kv_cache_dtype"],
                                "drafted": sum(r["drafted"] for r in rs),
                                "method_passes": {m: sum(r["method_passes"].get(m, 0) for r in rs)
                                                  for m in {m for r in rs for m in r["method_passes"]}}}
    bandwidth = read_bandwidth_gb_s()
    print(table(results, bandwidth, args.reference or "none"))
    print(json.dumps({"threads": torch.get_num_threads(), "bandwidth_gb_s": bandwidth,
                      "results": {s: {k: v for k, v in r.items() if k != "quality"} for s, r in results.items()}}))


if __name__ == "__main__":
    main()
