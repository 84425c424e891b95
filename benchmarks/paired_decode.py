"""Decode speed of specee and llama.cpp on one GGUF file, paired round by round in one process.

On a shared machine whose speed drifts from minute to minute, a ratio of two medians taken minutes
apart moves with the drift; here each round times specee and then llama.cpp back to back (which one
goes first alternates), so each round's ratio sees the same machine. Both load the file once
(llama.cpp with the same 4096-token context and thread count), decode greedily with EOS ignored
after one warm-up each, and every round prints both speeds and their ratio; the summary is the
median and geometric mean of the per-round ratios, then one JSON line.

    PYTHONPATH=. python benchmarks/paired_decode.py --model models/random-1b-Q4_K_M.gguf --rounds 10
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time

import torch

PROMPT = "The history of the printing press begins with"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per system and round")
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("paired_decode.py times llama.cpp beside specee: it needs llama-cpp-python "
                         "(pip install 'specee[llamacpp]')")

    import specee
    from llama_cpp import Llama

    engine = specee.load(args.model, quantization=args.quantization)
    threads = torch.get_num_threads()
    llm = Llama(model_path=args.model, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt_ids = engine.tokenizer.encode_prompt(PROMPT, chat=False)
    method_passes, drafted = {}, 0  # over every timed and warm-up run of ours: what it ran

    def ours() -> float:
        nonlocal drafted
        stats = engine.generate(PROMPT, chat=False, max_tokens=args.tokens + 1, ignore_eos=True,
                                spec_method="none").stats
        assert set(stats.method_passes) == {"none"}, stats.method_passes  # dense against dense
        for method, passes in stats.method_passes.items():
            method_passes[method] = method_passes.get(method, 0) + passes
        drafted += stats.draft_tokens_proposed
        return stats.decode_s / args.tokens * 1e3

    def theirs() -> float:
        llm.reset()
        llm.eval(prompt_ids)
        start = time.perf_counter()
        for _ in range(args.tokens):
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        return (time.perf_counter() - start) / args.tokens * 1e3

    ours(), theirs()  # warm-up
    ratios = []
    for round_index in range(args.rounds):
        order = (ours, theirs) if round_index % 2 == 0 else (theirs, ours)
        timed = {}
        for system in order:
            time.sleep(0.5)  # the other system's idle threads settle
            timed[system] = system()
        ratios.append(timed[theirs] / timed[ours])
        print(f"round {round_index + 1}: specee {timed[ours]:.2f} ms/token, llama.cpp {timed[theirs]:.2f} ms/token, "
              f"{ratios[-1]:.2f}x", file=sys.stderr, flush=True)
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"specee / llama.cpp decode speed: median {statistics.median(ratios):.2f}x, geometric mean {geomean:.2f}x "
          f"over {args.rounds} rounds ({engine.quantization}, {threads} threads)")
    print(json.dumps({"model": args.model, "spec_method": "none", "method_passes": method_passes, "drafted": drafted,
                      "quantization": engine.quantization, "threads": threads,
                      "tokens": args.tokens, "ratios": ratios, "median": statistics.median(ratios),
                      "geomean": geomean}))


if __name__ == "__main__":
    main()
