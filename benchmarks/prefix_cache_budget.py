"""How much of a multi-client chat workload the prefix cache serves at each budget: the chat
scenario of `specee bench-serve` (--conversations six-turn MT-Bench conversations, eight by default,
answers of up to --max-tokens) replayed in one process turn by turn across the conversations, as that
many concurrent clients send them, once per budget. Each budget reports the share of prompt tokens taken from the
cache, the evictions, the bytes held at the end and the prefill time. The answers are the same at
every budget (the cache is lossless), so the budgets differ only in what they reuse; the JSON line at
the end says what decoded them (dense: every pass "none", nothing drafted).

    python benchmarks/prefix_cache_budget.py [--budgets 64,128,256,512,1024] [--max-tokens 128] [--model FILE.gguf]
        [--conversations 8]
"""
import argparse
import json
import time

import specee
from specee.eval.serve_scenarios import chat_scripts


def replay(engine, scripts, max_tokens: int) -> dict:
    engine.prefix_cache.clear()
    before = engine.prefix_cache.stats.evictions
    histories = [list(s.opening) for s in scripts]
    prompt = cached = drafted = 0
    prefill_s = 0.0
    method_passes = {}  # passes by the method that drafted them: what the replay decoded with
    for turn in range(max(len(s.turns) for s in scripts)):
        for history, script in zip(histories, scripts):
            history.append({"role": "user", "content": script.turns[turn]})
            result = engine.generate(history, max_tokens=max_tokens, spec_method="none")
            history.append({"role": "assistant", "content": result.text})
            prompt += result.stats.prompt_tokens
            cached += result.stats.cached_tokens
            prefill_s += result.stats.prefill_s
            drafted += result.stats.draft_tokens_proposed
            for method, passes in result.stats.method_passes.items():
                method_passes[method] = method_passes.get(method, 0) + passes
    cache = engine.prefix_cache
    return {"cached_share": cached / prompt, "prompt_tokens": prompt, "evictions": cache.stats.evictions - before,
            "held_mb": cache.bytes / 2**20, "prefill_s": prefill_s, "method_passes": method_passes, "drafted": drafted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="64,128,256,512,1024", help="comma-separated MB")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--conversations", type=int, default=8, help="conversations replayed side by side")
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    engine = specee.load(args.model)
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"{cpu}, {engine.cpu_tier} kernels, {engine.quantization} weights")
    scripts = [s.tagged(f"[budget run {i}]") for i, s in enumerate(chat_scripts(args.conversations))]
    engine.generate("Hello", max_tokens=8, spec_method="none")  # warm-up
    runs = {}
    for mb in (float(b) for b in args.budgets.split(",")):
        engine.prefix_cache.budget_bytes = int(mb * 2**20)
        began = time.perf_counter()
        r = runs[mb] = replay(engine, scripts, args.max_tokens)
        print(f"budget {mb:6.0f} MB: {r['cached_share']:5.1%} of {r['prompt_tokens']} prompt tokens cached, "
              f"{r['evictions']:5d} evictions, {r['held_mb']:6.1f} MB held, prefill {r['prefill_s']:6.1f} s "
              f"(run {time.perf_counter() - began:.0f} s)", flush=True)
    print(json.dumps({"spec_method": "none", "max_tokens": args.max_tokens, "budgets_mb": runs}))


if __name__ == "__main__":
    main()
