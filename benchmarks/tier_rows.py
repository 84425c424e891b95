"""What a pass over T rows costs against a one-row pass, per CPU tier, on one int4 linear layer.

Speculation verifies several rows a pass: the AMX tier multiplies up to 16 rows of a block at once on
its tiles, where the AVX-512 tier spends vpdpbusd instructions per row. This times the CPU kernels'
`integer_linear` (a 1B model's MLP shape by default: 2048 inputs, 8192 outputs, int4 in groups of 32)
over T rows in each tier named, the tiers taking turns so that other work on the cores hits them
alike, and prints the median ms per pass and its ratio to T = 1 (and the fastest pass, which
other work on shared cores disturbs least), then one JSON line.

    python benchmarks/tier_rows.py --tiers amx,avx512 --rows 1,4,9,16 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.model.kernels import load_tier
from specee.model.quantize import quantize_int4, quantized_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="amx,avx512")
    parser.add_argument("--rows", default="1,4,9,16")
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tiers, counts = args.tiers.split(","), [int(t) for t in args.rows.split(",")]
    weight = quantize_int4(torch.randn(args.out_features, args.in_features) * 0.02, 32)
    layers = {tier: quantized_linear(weight, kernels=load_tier(tier)) for tier in tiers}
    inputs = {t: torch.randn(t, args.in_features) for t in counts}
    times = {(tier, t): [] for tier in tiers for t in counts}
    with torch.inference_mode():
        for round_ in range(args.repeats + 5):  # five warm-up rounds
            for t in counts:
                for tier in tiers:
                    start = time.perf_counter()
                    layers[tier](inputs[t])
                    if round_ >= 5:
                        times[tier, t].append(time.perf_counter() - start)
        for t in counts:  # the tiers' bits are the same (kernels.h): a benchmark of a wrong kernel is no benchmark
            outputs = [layers[tier](inputs[t]) for tier in tiers]
            assert all(torch.equal(outputs[0], out) for out in outputs[1:]), f"the tiers differ at T={t}"
    ms = {tier: {t: statistics.median(times[tier, t]) * 1e3 for t in counts} for tier in tiers}
    fastest = {tier: {t: min(times[tier, t]) * 1e3 for t in counts} for tier in tiers}
    for tier in tiers:
        print(f"{tier:8s} median " + "  ".join(f"T={t}: {ms[tier][t]:6.3f} ms ({ms[tier][t] / ms[tier][counts[0]]:.2f}x)"
                                               for t in counts), flush=True)
        print(f"{tier:8s} fastest " + "  ".join(
            f"T={t}: {fastest[tier][t]:6.3f} ms ({fastest[tier][t] / fastest[tier][counts[0]]:.2f}x)" for t in counts))
    print(json.dumps({"in_features": args.in_features, "out_features": args.out_features, "threads": args.threads,
                      "ms": ms, "relative": {tier: {t: ms[tier][t] / ms[tier][counts[0]] for t in counts}
                                             for tier in tiers},
                      "fastest_ms": fastest}))


if __name__ == "__main__":
    main()
