"""Where a pass over T rows spends its time, on specee's compiled CPU kernels, at this process's threads.

A pass is the decoder layers (one `decoder_layers` call: matmuls, attention and the row-wise steps
between them, the threads meeting at barriers) and the head. This times the whole pass, then each
part alone on the same rows and threads: every layer's four matmuls (`integer_linear`, activation
quantization included), one layer's attention over the cached keys, and the head. What the layers
take beyond their matmuls and attention is the row-wise steps, the barriers and the call itself.
Inside the layers' call, each step of a layer is timed on every thread (`Kernels.time_steps`):
"steps" gives per step, summed over the layers, the threads' mean and longest time at work and
their mean wait at the barrier after it (the wait is the other threads' work, or the barrier's own
cost), which holds at any thread count.

    python benchmarks/pass_profile.py --model random-1b-Q4_K_M.gguf --tokens 1,16 --threads 2,16
    python benchmarks/pass_profile.py --cpu-tier avx512    (default: the best tier this CPU runs)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.loader import load_parts


def median_ms(work, repeats: int) -> float:
    """Median ms of `work()` over `repeats` calls after two warm-up calls."""
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def matrices(layer) -> list:
    """A decoder layer's four quantized matrices (IntegerLinear), in the order a pass runs them."""
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def profile(model, tokens: int, context: int, repeats: int) -> dict:
    """ms of a pass over `tokens` rows after `context` cached ones, and of its parts."""
    config = model.config
    cache = model.new_cache(context + tokens)
    ids = torch.randint(0, config.vocab_size, (context + tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        if context:  # a pass after no context at all is a prompt's first chunk
            model.hidden(ids[:context], torch.arange(context), cache)
        positions = torch.arange(context, context + tokens)

        def layers():
            h = model.hidden(ids[context:], positions, cache)
            cache.truncate(context)
            return h

        h = layers()
        normed = model.norm(h)
        steps = step_times(model.kernels, layers, repeats)
        result = {"pass": median_ms(lambda: (model.logits(model.norm(layers()))), repeats),
                  "layers": median_ms(layers, repeats),
                  "head": median_ms(lambda: model.logits(normed), repeats)}
        kernels = model.kernels
        matmul = 0.0
        for layer in model.layers:
            for m in matrices(layer):
                x = torch.randn(tokens, m.in_features)
                matmul += median_ms(lambda: kernels.integer_linear(x, m.packed, m.scales_zeros, m.out_features,
                                                                   m.bits, m.group_size), repeats)
        result["matmuls"] = matmul
        heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q = torch.randn(tokens, heads, hd)
        keys, values = torch.randn(kv, context + tokens, hd), torch.randn(kv, context + tokens, hd)
        visible = torch.arange(context + 1, context + tokens + 1)
        one = median_ms(lambda: kernels.attention(q, keys, values, visible, torch.empty(0, dtype=torch.uint8), 0,
                                                  context + tokens, 0, hd ** -0.5), repeats)
        result["attention"] = one * len(model.layers)
        result["rest of the layers"] = result["layers"] - result["matmuls"] - result["attention"]
    return result, steps


def step_times(kernels, layers, repeats: int) -> dict:
    """ms per call of each step of the layers' call, summed over layers: threads' mean and longest
    work, and their mean wait after it."""
    layers(), layers()  # (warm-up)
    kernels.time_steps(True)
    for _ in range(repeats):
        layers()
    seconds, calls = kernels.step_seconds()
    kernels.time_steps(False)
    if calls == 0:
        raise SystemExit("the layers did not run as one kernel call: nothing to time step by step")
    ms = seconds * 1e3 / calls
    return {name: {"work": ms[:, i, 0].mean().item(), "longest": ms[:, i, 0].max().item(),
                   "wait": ms[:, i, 1].mean().item()} for i, name in enumerate(kernels.layer_steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--cpu-tier", help="a tier by name (amx, avx512, avx2, ...); default: the best")
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--threads", default=str(torch.get_num_threads()), help="comma-separated thread counts")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.context < 0:
        parser.error("--context: the cached tokens before the pass, 0 or more")
    model = load_parts(args.model, quantization=args.quantization, compile=True, cpu_tier=args.cpu_tier).model
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for tokens in (int(t) for t in args.tokens.split(",")):
            ms, steps = profile(model, tokens, args.context, args.repeats)
            rows.append({"threads": threads, "tokens": tokens, "tier": model.kernels.tier, "ms": ms, "steps": steps})
            print(f"threads {threads:2d} T={tokens:2d} " + "  ".join(f"{k} {v:7.2f}" for k, v in ms.items()), flush=True)
            print("    steps (work mean/longest, wait): " + "  ".join(
                f"{name} {t['work']:.2f}/{t['longest']:.2f}, {t['wait']:.2f}" for name, t in steps.items()), flush=True)
    print(json.dumps({"context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
