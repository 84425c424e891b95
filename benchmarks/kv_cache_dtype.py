"""A pass over T rows after C tokens of context on an fp32 KV cache against the same pass on an fp16
one (`--kv-cache-dtype fp16`), on specee's compiled CPU kernels at this process's threads.

For each context the prompt is prefilled into one cache of each kind; then, for each row count, the
pass (layers and head, its keys and values written, then forgotten) runs on each cache in turn,
the order alternating, after a warm-up; the median of each is reported, and their ratio. A pass of
1 row is a dense decoding step; of a few rows, a speculative verification; of many, a prefill chunk.

    python benchmarks/kv_cache_dtype.py --contexts 50,1250,3000 --tokens 1,4,8,16,56
    python benchmarks/kv_cache_dtype.py --model random-1b-Q4_K_M.gguf --contexts 1000,4000
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.loader import KV_CACHE_DTYPES, load_parts

WARM_UP = 2


def timed_pass(model, ids: torch.Tensor, positions: torch.Tensor, cache) -> float:
    """Seconds of one pass over `ids` after what `cache` holds, which it then forgets."""
    filled = cache.length
    start = time.perf_counter()
    model.logits(model.norm(model.hidden(ids, positions, cache)))
    seconds = time.perf_counter() - start
    cache.truncate(filled)
    return seconds


def compare(model, context: int, rows: list[int], repeats: int) -> list[dict]:
    """ms of a pass of each row count after `context` tokens, on each kind of cache."""
    ids = torch.randint(0, model.config.vocab_size, (context + max(rows),), generator=torch.Generator().manual_seed(0))
    caches = {}
    with torch.inference_mode():
        for name, dtype in KV_CACHE_DTYPES.items():
            model.kv_cache_dtype = dtype
            caches[name] = model.new_cache(context + max(rows))
            model.hidden(ids[:context], torch.arange(context), caches[name])
        results = []
        for count in rows:
            new, positions = ids[context:context + count], torch.arange(context, context + count)
            times = {name: [] for name in caches}
            for repeat in range(repeats + WARM_UP):
                for name in (list(caches) if repeat % 2 else list(caches)[::-1]):
                    seconds = timed_pass(model, new, positions, caches[name])
                    if repeat >= WARM_UP:
                        times[name].append(seconds)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            results.append({"context": context, "rows": count, "ms": ms, "fp16_over_fp32": ms["fp16"] / ms["fp32"]})
    model.kv_cache_dtype = KV_CACHE_DTYPES["fp32"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--cpu-tier", help="a tier by name (amx, avx512, avx2, ...); default: the best")
    parser.add_argument("--contexts", default="50,1250,3000", help="comma-separated tokens of context")
    parser.add_argument("--tokens", default="1,4,8,16,56", help="comma-separated rows a pass")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    model = load_parts(args.model, quantization=args.quantization, cpu_tier=args.cpu_tier).model
    if not model.uses_kernels:
        raise SystemExit("the fp16 KV cache runs on specee's compiled CPU kernels, and this load has none")
    rows = [int(t) for t in args.tokens.split(",")]
    results = []
    print(f"{'context':>8} {'rows':>5} {'fp32 ms':>9} {'fp16 ms':>9} {'fp16/fp32':>10}")
    for context in (int(c) for c in args.contexts.split(",")):
        for result in compare(model, context, rows, args.repeats):
            results.append(result)
            print(f"{context:8d} {result['rows']:5d} {result['ms']['fp32']:9.2f} {result['ms']['fp16']:9.2f} "
                  f"{result['fp16_over_fp32']:10.3f}", flush=True)
    print(json.dumps({"tier": model.kernels.tier, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
