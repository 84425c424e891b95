"""What trained self-drafters (the EAGLE head, the Kangaroo adapter) share: weights loaded to run
like the target, the scorer over a reduced vocabulary, and a small KV cache (their file is
artifact_header's TrainedArtifact).

Reduced vocabulary: a drafter scores only the N tokens the model emits most often (the output
head costs as much as eight of the default model's 30 layers). A token outside them is never
drafted, so verification stays exact.
"""
from __future__ import annotations

import torch
from torch import nn

from ..artifact_header import TrainedArtifact
from ..model.cache import KVCache
from ..model.cpu_packing import PackedLinear, pack_linears, packing_available
from ..model.quantize import int8_linears
from ..model.kernel_install import rows_on_kernels
from ..model.llama import Transformer

# Drafter-cache slots allocated at the start of a generation; the cache grows when it fills.
INITIAL_CACHE_SLOTS = 512


def load_trained(module: nn.Module, artifact: TrainedArtifact, target: Transformer
                 ) -> tuple[nn.Module, torch.Tensor, nn.Module, int]:
    """(`module` holding the artifact's weights and run like the target, the reduced vocabulary on
    the target's device, its scorer, the weight bytes one pass of the module and the scorer reads)."""
    module.load_state_dict({k: v.float() for k, v in artifact.weights.items()})
    module = run_like_target(module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False), target)
    vocab = artifact.vocab.to(target.device)
    # Bytes per weight as run_like_target runs the matrices (scales left out).
    element_size = 1 if target.kernels is not None else target.norm.weight.element_size()
    weights = sum(p.numel() for p in artifact.weights.values()) + vocab.numel() * target.config.hidden_size
    return module, vocab, reduced_scorer(target, vocab), weights * element_size


def reduced_scorer(target: Transformer, vocab: torch.Tensor) -> nn.Module:
    """A linear layer giving the target's (pre-softmax) logits of the tokens `vocab` only."""
    scorer = nn.Linear(target.config.hidden_size, len(vocab), bias=False, device=target.device)
    scorer.weight = nn.Parameter(target.head_rows(vocab.to(target.device)).detach().clone(), requires_grad=False)
    return run_like_target(scorer, target)


def run_like_target(module: nn.Module, target: Transformer) -> nn.Module:
    """A drafter's own linears made fast where the target runs: int8 on the CPU kernels when the
    target runs on them (read in fp32, EAGLE's head and scorer cost about 40 MB a draft step, half
    an int4 target pass), else oneDNN-packed on the CPU. Drafts change, never the output."""
    if target.kernels is not None:
        module = int8_linears(module, target.kernels)
        return rows_on_kernels(module, target.kernels)  # the head's attention keeps PyTorch's, with its masks
    if target.device.type == "cpu" and packing_available():
        return pack_linears(module, keep_weights=()) if not isinstance(module, nn.Linear) else PackedLinear(module)
    return module


def drafter_cache(model: Transformer, capacity: int = INITIAL_CACHE_SLOTS, layers: int = 1) -> KVCache:
    """A KV cache for a drafter's own layers, shaped like the target's."""
    c = model.config
    dtype = torch.float32 if model.device.type == "cpu" else model.dtype
    return KVCache(layers, c.num_key_value_heads, c.head_dim, c.max_position_embeddings, dtype, model.device,
                   capacity=min(capacity, c.max_position_embeddings))
