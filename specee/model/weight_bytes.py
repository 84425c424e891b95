"""What a pass of a `llama.Transformer` reads: the weight bytes of its layers and head as stored
(quantized matrices count their codes and scales), and the multiply-adds a row makes per byte read.
Speculation prices its drafts and the stats count bytes per token with these."""
from __future__ import annotations

from torch import nn


def matrix_bytes(linear: nn.Module, element_size: int) -> int:
    """Bytes of a linear layer's matrix: quantized linears report their own (`weight_bytes`);
    dense ones (plain or CPU-packed) hold in x out values of the model's dtype."""
    return getattr(linear, "weight_bytes", linear.in_features * linear.out_features * element_size)


def layer_matrices(model: nn.Module, layers: range) -> list[nn.Module]:
    """The four matrices of each decoder layer in `layers`."""
    return [m for i in layers for m in (model.layers[i].self_attn.qkv_proj, model.layers[i].self_attn.o_proj,
                                        model.layers[i].mlp.gate_up_proj, model.layers[i].mlp.down_proj)]


def layers_bytes(model: nn.Module, layers: range) -> int:
    """Weight bytes of the decoder layers `layers` (matrices and norms, as stored)."""
    norms = [norm for i in layers for norm in model.layers[i].norms]
    element_size = model.norm.weight.element_size()
    return (sum(matrix_bytes(m, element_size) for m in layer_matrices(model, layers))
            + sum(n.weight.numel() for n in norms) * element_size)


def head_bytes(model: nn.Module) -> int:
    """Weight bytes of the final norm and the output head, read by every pass that scores tokens."""
    element_size = model.norm.weight.element_size()
    return model.norm.weight.numel() * element_size + matrix_bytes(model.lm_head, element_size)


def weight_bytes(model: nn.Module) -> int:
    """Weight bytes one pass streams in, as stored: every matrix and norm, the full output head, and
    one embedding row (negligible, so left out)."""
    return layers_bytes(model, range(len(model.layers))) + head_bytes(model)


def multiply_adds_per_byte(model: nn.Module) -> float:
    """One row's multiply-adds over the weight bytes a pass reads (`quantize.mark_quantized`)."""
    matrices = layer_matrices(model, range(len(model.layers)))
    multiply_adds = sum(m.in_features * m.out_features for m in [*matrices, model.lm_head])
    return multiply_adds / weight_bytes(model)
