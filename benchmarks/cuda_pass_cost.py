"""What a pass costs on a CUDA GPU at the sizes users run: random-weight Llama 3.2 / 3.1 shapes
(1B, 3B, 8B; the shapes of `scripts/make_random_gguf.py`) built straight in PyTorch on the GPU, no
file or tokenizer needed. Per shape and dtype: greedy decode tokens per second from one-row passes,
and the cost of a pass over T new rows after 200 cached tokens relative to a one-row pass (what
speculation spends to verify T - 1 drafts), then one JSON line.

    python benchmarks/cuda_pass_cost.py --shapes 1b,3b,8b --dtypes bfloat16,float32
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specee.model.config import LlamaConfig
from specee.model.llama import Transformer
from specee.model.rope import inverse_frequencies

# layers, hidden, intermediate, heads, kv heads, tied: as scripts/make_random_gguf.py's SHAPES
SHAPES = {"1b": (16, 2048, 8192, 32, 8, True), "3b": (28, 3072, 8192, 24, 8, True), "8b": (32, 4096, 14336, 32, 8, False)}
VOCAB = 128256  # Llama 3's


def random_model(shape: str, dtype: torch.dtype) -> Transformer:
    layers, hidden, intermediate, heads, kv_heads, tied = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, vocab_size=VOCAB, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=tied)
    with torch.device("cuda"):
        model = Transformer(config).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
    model.inv_freq = inverse_frequencies(config).to("cuda")  # fp32, as the loader leaves it
    return model.eval()


def synchronized(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def pass_ms(model, context: int, tokens: int, repeats: int) -> float:
    cache = model.new_cache(context + tokens)
    ids = torch.randint(0, VOCAB, (context + tokens,), device="cuda")
    positions = torch.arange(context + tokens, device="cuda")
    with torch.inference_mode():
        model.hidden(ids[:context], positions[:context], cache)

        def one_pass():
            h = model.hidden(ids[context:], positions[context:], cache)
            model.logits(model.norm(h))

        times = []
        for _ in range(repeats + 2):  # two warm-up passes
            times.append(synchronized(one_pass))
            cache.truncate(context)
    return statistics.median(times[2:]) * 1e3


def decode_tok_s(model, tokens: int) -> float:
    cache = model.new_cache(tokens + 8)
    with torch.inference_mode():
        token = torch.zeros(1, dtype=torch.long, device="cuda")

        def decode():
            nonlocal token
            for position in range(tokens):
                h = model.hidden(token, torch.tensor([position], device="cuda"), cache)
                token = model.logits(model.norm(h)).argmax(-1)

        decode()  # warm-up
        cache.truncate(0)
        return tokens / synchronized(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,3b,8b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tokens", default="1,4,9,16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"cuda_pass_cost.py needs a CUDA GPU; PyTorch {torch.__version__} sees none")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the loader does for a CUDA model
    counts = [int(t) for t in args.tokens.split(",")]
    results = {}
    for shape in args.shapes.split(","):
        for dtype_name in args.dtypes.split(","):
            model = random_model(shape, getattr(torch, dtype_name))
            ms = {t: pass_ms(model, 200, t, args.repeats) for t in counts}
            speed = decode_tok_s(model, 64)
            results[f"{shape} {dtype_name}"] = {"decode_tok_s": speed, "pass_ms": ms}
            print(f"{shape} {dtype_name:9s} decode {speed:6.1f} tok/s  "
                  + "  ".join(f"T={t}: {ms[t]:6.2f} ms ({ms[t] / ms[counts[0]]:.2f}x)" for t in counts), flush=True)
            del model
            torch.cuda.empty_cache()
    # decode_tok_s: dense greedy decoding, one pass per token (no drafts)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "spec_method": "none",
                      "results": results}))


if __name__ == "__main__":
    main()
