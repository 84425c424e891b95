"""What a pass over T tokens costs relative to one, per weight format, on the default model.

Speculation verifies 2-17 tokens per pass; it pays only if such a pass costs little more than a
one-token pass. For each format, on specee's compiled CPU kernels (in each CPU tier of `--paths`
this machine runs: `avx512`, `avx2`, `portable`, ...; `compiled` is the best) and on PyTorch's own
(`eager`), this times passes over T new tokens (causal, after a prompt already in the cache, the cache
rewound after each pass) and prints ms per pass and the ratio to T = 1, then one JSON line.

    python benchmarks/multirow_cost.py --formats none,int8,int4,gguf --paths compiled,eager
    python benchmarks/multirow_cost.py --formats int4,int8 --paths avx2,portable
    python benchmarks/multirow_cost.py --model random-1b-Q4_K_M.gguf --formats gguf --paths compiled
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.loader import load_parts


def pass_ms(model, context: int, tokens: int, repeats: int) -> float:
    """Median ms of a pass over `tokens` new tokens after `context` cached ones."""
    cache = model.new_cache(context + tokens)
    ids = torch.randint(0, model.config.vocab_size, (context + tokens,), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        model.hidden(ids[:context], torch.arange(context), cache)
        for _ in range(repeats + 2):  # two warm-up passes
            start = time.perf_counter()
            h = model.hidden(ids[context:], torch.arange(context, context + tokens), cache)
            model.logits(model.norm(h))
            times.append(time.perf_counter() - start)
            cache.truncate(context)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="none,int8,int4,gguf")
    parser.add_argument("--paths", default="compiled,eager", help="compiled (specee's kernels, the best CPU tier), a tier by name (avx512, avxvnni, avx2, "
                        "neon, portable), eager (PyTorch's)")
    parser.add_argument("--tokens", default="1,4,9,16")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    args = parser.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    results = {}
    for name in args.formats.split(","):
        for path in args.paths.split(","):
            tier = None if path in ("compiled", "eager") else path
            model = load_parts(args.model, quantization=name, compile=path != "eager", cpu_tier=tier).model
            ms = {t: pass_ms(model, args.context, t, args.repeats) for t in counts}
            label = f"{name} ({path})"
            results[label] = {"ms": ms, "relative": {t: ms[t] / ms[counts[0]] for t in counts},
                              "weight_mb": model.weight_bytes / 1e6}
            print(f"{label:20s} weights {model.weight_bytes / 1e6:6.1f} MB  "
                  + "  ".join(f"T={t}: {ms[t]:6.2f} ms ({ms[t] / ms[counts[0]]:.2f}x)" for t in counts), flush=True)
            del model
    print(json.dumps({"context": args.context, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
