"""Where an agent loop's time goes, `auto` against dense, in one process: the `agent` scenario of
`specee bench-serve` (a ~1,000-token system prompt, a task, then observations, each call resending
the loop so far; loops past the eighth send an earlier loop's task again) through `engine.generate`,
greedy, stopping at EOS or --max-tokens. Each mode has an engine of its own (its own prefix and
suffix caches, as a server of its own would) and the modes take each call in turn, the first
alternating. Per mode: the whole time, prefill and decode, tokens and passes, for every call and
for the calls of a task sent again ("seen"); and how many answers differ between the modes
(lossless: none).

    python benchmarks/agent_loop.py [--loops 20] [--max-tokens 64] [--model FILE.gguf]
"""
import argparse
import json
import time

import specee
from specee.eval.bench import rotated
from specee.eval.serve_scenarios import agent_scripts

MODES = {"auto": "auto", "dense": "none"}


def new_totals() -> dict:
    return {"calls": 0, "wall_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "tokens": 0, "passes": 0,
            "prompt_tokens": 0, "cached_tokens": 0, "method_passes": {}, "drafted": 0}


def add(totals: dict, wall_s: float, stats) -> None:
    totals["calls"] += 1
    totals["wall_s"] += wall_s
    totals["prefill_s"] += stats.prefill_s
    totals["decode_s"] += stats.decode_s
    totals["tokens"] += stats.generated_tokens
    totals["passes"] += stats.target_passes
    totals["prompt_tokens"] += stats.prompt_tokens
    totals["cached_tokens"] += stats.cached_tokens
    totals["drafted"] += stats.draft_tokens_proposed
    for method, passes in stats.method_passes.items():
        totals["method_passes"][method] = totals["method_passes"].get(method, 0) + passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    engines = {mode: specee.load(args.model) for mode in MODES}
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"{cpu}, {engines['dense'].cpu_tier} kernels, {engines['dense'].quantization} weights, {args.loops} loops")
    for mode, method in MODES.items():  # a warm-up, then each engine starts with empty caches
        engines[mode].generate([{"role": "user", "content": "Say hello."}], max_tokens=8, spec_method=method)
        engines[mode].suffix_cache.clear()
        engines[mode].prefix_cache.clear()
    totals = {mode: {"all": new_totals(), "seen": new_totals()} for mode in MODES}
    differ = 0
    calls = 0
    for script in agent_scripts(args.loops):
        histories = {mode: list(script.opening) for mode in MODES}
        for turn in script.turns:
            answers = {}
            # The first mode changes from call to call: a call right after the other engine's runs on
            # caches that engine filled.
            for mode in rotated(list(MODES), calls):
                method = MODES[mode]
                messages = histories[mode] + [{"role": "user", "content": turn}]
                began = time.perf_counter()
                result = engines[mode].generate(messages, max_tokens=args.max_tokens, spec_method=method)
                wall_s = time.perf_counter() - began
                for part in ("all", "seen") if script.seen else ("all",):
                    add(totals[mode][part], wall_s, result.stats)
                histories[mode] = messages + [{"role": "assistant", "content": result.text}]
                answers[mode] = result.token_ids
            differ += answers["auto"] != answers["dense"]
            calls += 1
    for part in ("all", "seen"):
        dense, auto = totals["dense"][part], totals["auto"][part]
        if not dense["calls"]:
            continue
        for mode, t in totals.items():
            t = t[part]
            print(f"{part:>4} {mode:>5}: {t['calls']} calls, {t['wall_s']:.2f} s (prefill {t['prefill_s']:.2f} s, "
                  f"decode {t['decode_s']:.2f} s), {t['tokens']} tokens in {t['passes']} passes")
        print(f"{part:>4}: auto / dense, whole {dense['wall_s'] / auto['wall_s']:.2f}x, "
              f"decode {dense['decode_s'] / auto['decode_s']:.2f}x")
    print(f"answers that differ between the modes: {differ}")
    print(json.dumps({"spec_method": MODES, "loops": args.loops, "differ": differ, "modes": totals}))


if __name__ == "__main__":
    main()
