"""What an fp16 KV cache costs in quality: perplexity of held-out text, and top-1 predictions equal to
the fp32 cache's, on an fp32 cache, an fp16 one (`--kv-cache-dtype fp16`) and, as the yardstick of
a change that costs nothing, the fp32 cache with the embeddings multiplied by 1 + `--noise` x N(0, 1)
(one run per seed, `--seeds`).

On specee's compiled kernels each layer's activations are rounded to int8 before its matrix
products, so any change to the numbers, however small, redraws some of those roundings and the
predictions that hang on them: the yardstick says how much of the fp16 cache's difference is that,
not the halves.

The text: each Spec-Bench category's prompts, read as plain text (no chat template), joined to
`--length` tokens, each scored in one pass on a fresh cache.

    python benchmarks/kv_cache_quality.py --length 2048
    python benchmarks/kv_cache_quality.py --model gemma-3-270m-q4_k_m.gguf --length 2048
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from specee.eval.datasets import DatasetMissing, load_dataset
from specee.loader import KV_CACHE_DTYPES, load_parts

SHORTEST = 64  # a category with fewer tokens than this is left out


def held_out_texts(tokenizer, spec_bench: str, length: int) -> list[list[int]]:
    """Per category, its prompts' tokens joined until `length`."""
    texts: dict[str, list[int]] = {}
    for prompt in load_dataset(spec_bench):
        ids = texts.setdefault(prompt.category, [])
        if len(ids) < length:
            ids += tokenizer.encode(prompt.turns[0])
    return [ids[:length] for ids in texts.values() if len(ids) >= SHORTEST]


def scored(model, ids: list[int], noise: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(each next token's negative log-likelihood, each position's top-1 prediction) in one pass."""
    hook = None
    if noise:
        generator = torch.Generator().manual_seed(seed)
        hook = model.embed_tokens.register_forward_hook(
            lambda module, inputs, out: out * (1 + noise * torch.randn(out.shape, generator=generator)))
    try:
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[:-1].float()
    finally:
        if hook is not None:
            hook.remove()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none"), logits.argmax(-1)


def measure(model, texts: list[list[int]], noise: float, seeds: int) -> dict:
    """Per run: its cache's element, perplexity, and the share of top-1 predictions equal to the fp32 cache's."""
    runs = {"fp32": ("fp32", 0.0, 0), "fp16": ("fp16", 0.0, 0)}
    runs |= {f"fp32, embeddings x (1 + {noise:g} N), seed {s}": ("fp32", noise, s) for s in range(1, seeds + 1)}
    outputs, held = {}, {}  # held: the element each run's cache held
    for name, (cache, scale, seed) in runs.items():
        model.kv_cache_dtype = KV_CACHE_DTYPES[cache]
        outputs[name] = [scored(model, ids, scale, seed) for ids in texts]
        held[name] = str(model.new_cache(1).keys.dtype).removeprefix("torch.")
    model.kv_cache_dtype = KV_CACHE_DTYPES["fp32"]
    tokens = sum(len(ids) - 1 for ids in texts)
    reference = [top for _, top in outputs["fp32"]]
    return {name: {"cache": held[name], "ppl": math.exp(sum(nll.sum().item() for nll, _ in out) / tokens),
                   "top1_equal_fp32": sum(int((top == ref).sum()) for (_, top), ref in zip(out, reference)) / tokens}
            for name, out in outputs.items()} | {"tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--length", type=int, default=2048, help="tokens of text per Spec-Bench category")
    parser.add_argument("--noise", type=float, default=1e-6, help="the yardstick's relative change to the embeddings")
    parser.add_argument("--seeds", type=int, default=2, help="yardstick runs")
    parser.add_argument("--spec-bench", default="spec-bench",
                        help="Spec-Bench's question.jsonl (default: the copy beside the checkout)")
    args = parser.parse_args()
    parts = load_parts(args.model, quantization=args.quantization)
    if not parts.model.uses_kernels:
        raise SystemExit("the fp16 KV cache runs on specee's compiled CPU kernels, and this load has none")
    try:
        texts = held_out_texts(parts.tokenizer, args.spec_bench, args.length)
    except (DatasetMissing, ValueError) as missing:
        parser.error(f"{missing} (--spec-bench names Spec-Bench's file)")
    if not texts:
        parser.error(f"no category of {args.spec_bench} holds {SHORTEST} tokens")
    results = measure(parts.model, texts, args.noise, args.seeds)
    print(f"{results['tokens']} tokens in {len(texts)} texts")
    for name, r in results.items():
        if name != "tokens":
            print(f"{name:44s} ppl {r['ppl']:9.4f}  top-1 equal to the fp32 cache's {r['top1_equal_fp32']:.3f}")
    print(json.dumps({"tier": parts.model.kernels.tier, "results": results}))


if __name__ == "__main__":
    main()
