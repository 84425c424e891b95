"""What a trained weight-level artifact (an adapter, a draft head, exit predictors) is tied to:
the model's shape and its weights, independent of dtype, device and CPU packing."""
from __future__ import annotations

import hashlib

import torch

from .llama import Transformer

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
EMBEDDING_ROWS = 256  # a sample of the embedding: enough to tell checkpoints apart


def weights_fingerprint(model: Transformer) -> str:
    """A hash of the shape, each layer's norms before attention and before the MLP, the final norm
    and the first embedding rows (as stored: Gemma's scaling left out). Values are
    rounded to bf16 first, so an fp32 model and the same model loaded in bf16 agree. A quantized
    model answers with the fingerprint of the weights it was quantized from (`source_fingerprint`):
    what was trained for those weights runs on it too."""
    source = getattr(model, "source_fingerprint", None)
    if source is not None:
        return source
    rows = torch.arange(min(EMBEDDING_ROWS, model.config.vocab_size), device=model.device)
    norms = [model.norm.weight]
    for layer in model.layers:
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return fingerprint(model.config, model.embed_tokens(rows), norms)


def fingerprint(config, embedding_rows: torch.Tensor, norms: list[torch.Tensor]) -> str:
    """The fingerprint of weights given by pieces: the first EMBEDDING_ROWS embedding rows, then the
    final norm's weight and each layer's two norm weights, in order."""
    digest = hashlib.sha256(repr([getattr(config, name) for name in SHAPE_FIELDS]).encode())
    for tensor in [embedding_rows, *norms]:
        rounded = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(rounded.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
