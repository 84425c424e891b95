"""Time to first token of a conversation's later turns with the prefix cache on and off, in one
process on the default model and format: each turn resends the history (the model's own answers)
plus a new user message. For each turn both settings run, alternating which goes first, after a
warm-up; the cache-off run opts out per request, so both see the same engine.

    python benchmarks/prefix_cache_turns.py [--turns 6] [--model FILE.gguf]
"""
import argparse
import json
import math
import statistics
import time

import specee

OPENINGS = [
    "Explain how a bicycle gear system works.",
    "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?",
]
FOLLOW_UPS = ["Tell me more.", "Give an example.", "Summarise that in two sentences.", "Why does that matter?",
              "What would you add?", "Any caveats?", "Explain it to a child."]


def ran(totals: dict, stats) -> None:
    """Adds a generation's passes by method and its draft tokens to `totals`: what the run decoded with."""
    for method, passes in stats.method_passes.items():
        totals["method_passes"][method] = totals["method_passes"].get(method, 0) + passes
    totals["drafted"] += stats.draft_tokens_proposed


def first_token_s(engine, messages, cache: bool, totals: dict):
    began = time.perf_counter()
    stream = engine.stream(messages, max_tokens=1, prefix_cache=cache, spec_method="none")
    for _ in stream:
        pass
    seconds = time.perf_counter() - began
    ran(totals, stream.result.stats)
    return seconds, stream.result.stats.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=120, help="most tokens of each answer the history keeps")
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    engine = specee.load(args.model)
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"{cpu}, {engine.cpu_tier} kernels, {engine.quantization} weights, "
          f"budget {engine.prefix_cache.budget_bytes / 2**20:.0f} MB")
    ratios = {turn: [] for turn in range(1, args.turns + 1)}
    totals = {"method_passes": {}, "drafted": 0}
    for opening in OPENINGS:
        engine.prefix_cache.clear()
        messages = [{"role": "user", "content": opening}]
        first_token_s(engine, messages, True, totals)  # warm-up
        for turn in range(1, args.turns + 1):
            order = (False, True) if turn % 2 else (True, False)
            timed = {cache: first_token_s(engine, messages, cache, totals) for cache in order}
            (off, _), (on, cached) = timed[False], timed[True]
            prompt = len(engine.encode(messages))
            ratios[turn].append(off / on)
            print(f"turn {turn}: {prompt:5d} prompt tokens, {cached:5d} cached: off {off * 1000:6.1f} ms, "
                  f"on {on * 1000:6.1f} ms, {off / on:5.2f}x", flush=True)
            answer = engine.generate(messages, max_tokens=args.max_tokens, spec_method="none")
            ran(totals, answer.stats)
            messages = messages + [{"role": "assistant", "content": answer.text},
                                   {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    means = {}
    for turn, values in ratios.items():
        means[turn] = math.exp(statistics.fmean(math.log(v) for v in values))
        print(f"turn {turn}: time to first token, cache off / on, geometric mean over {len(values)}: {means[turn]:.2f}x")
    print(json.dumps({"spec_method": "none", **totals, "off_over_on": means}))


if __name__ == "__main__":
    main()
