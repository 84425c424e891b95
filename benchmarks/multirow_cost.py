"""What a pass over T tokens costs relative to one, per weight format, on the default model.

Speculation verifies 2-17 tokens per pass; it pays only if such a pass costs little more than a
one-token pass. For each format, on specee's compiled CPU kernels (in each CPU tier of `--paths`
this machine runs: `avx512`, `avx2`, `portable`, ...; `compiled` is the best) and on PyTorch's own
(`eager`), this times passes over T new tokens (causal, after a prompt already in the cache, the cache
rewound after each pass; a format's paths and token counts interleaved pass by pass) and prints
the median ms per pass and the ratio to T = 1, at each thread count of `--threads`, then one JSON
line (results per thread count).

    python benchmarks/multirow_cost.py --formats none,int8,int4,gguf --paths compiled,eager
    python benchmarks/multirow_cost.py --formats int4,int8 --paths avx2,portable
    python benchmarks/multirow_cost.py --model random-1b-Q4_K_M.gguf --formats gguf --paths compiled --threads 2,16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.loader import load_parts


def interleaved_ms(models: dict, context: int, counts: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median ms of a pass over each count of new tokens after `context` cached ones, per model.
    Every (model, count) pair runs once a round, in an order that rotates: a machine whose speed
    drifts (a shared VM's moves up to 30% in a minute) moves every ratio alike."""
    ids = torch.randint(0, next(iter(models.values())).config.vocab_size, (context + max(counts),),
                        generator=torch.Generator().manual_seed(0))
    caches = {path: model.new_cache(context + max(counts)) for path, model in models.items()}
    pairs = [(path, t) for path in models for t in counts]
    times: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
    with torch.inference_mode():
        for path, model in models.items():
            model.hidden(ids[:context], torch.arange(context), caches[path])
        for round_ in range(repeats + 2):  # two warm-up rounds
            shift = round_ % len(pairs)
            for path, tokens in pairs[shift:] + pairs[:shift]:
                model, cache = models[path], caches[path]
                start = time.perf_counter()
                h = model.hidden(ids[context : context + tokens], torch.arange(context, context + tokens), cache)
                model.logits(model.norm(h))
                if round_ >= 2:
                    times[(path, tokens)].append(time.perf_counter() - start)
                cache.truncate(context)
    return {path: {t: statistics.median(times[(path, t)]) * 1e3 for t in counts} for path in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="none,int8,int4,gguf")
    parser.add_argument("--paths", default="compiled,eager", help="compiled (specee's kernels, the best CPU tier), a tier by name (avx512, avxvnni, avx2, "
                        "neon, portable), eager (PyTorch's)")
    parser.add_argument("--tokens", default="1,4,9,16")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--threads", default=str(torch.get_num_threads()), help="comma-separated thread counts")
    args = parser.parse_args()
    counts, thread_counts = [int(t) for t in args.tokens.split(",")], [int(t) for t in args.threads.split(",")]
    results: dict[int, dict] = {threads: {} for threads in thread_counts}
    for name in args.formats.split(","):  # one format's models at a time (a 1B file in fp32 is 4 GB)
        models = {path: load_parts(args.model, quantization=name, compile=path != "eager",
                                   cpu_tier=None if path in ("compiled", "eager") else path).model
                  for path in args.paths.split(",")}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for path, ms in interleaved_ms(models, args.context, counts, args.repeats).items():
                label, weight_mb = f"{name} ({path})", models[path].weight_bytes / 1e6
                results[threads][label] = {"ms": ms, "relative": {t: ms[t] / ms[counts[0]] for t in counts},
                                           "weight_mb": weight_mb}
                print(f"{threads:2d} threads  {label:20s} weights {weight_mb:6.1f} MB  "
                      + "  ".join(f"T={t}: {ms[t]:6.2f} ms ({ms[t] / ms[counts[0]]:.2f}x)" for t in counts), flush=True)
        del models
    print(json.dumps({"context": args.context, "threads": thread_counts, "results": results}))


if __name__ == "__main__":
    main()
