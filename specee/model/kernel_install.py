"""The CPU kernels (`kernels.cpu_kernels()`) installed on a built model as a transform: attention,
norms and MLP gates where they fit, and every layer as one kernel call where all its parts run on
them. Numbers do not change with where the kernels are installed, only which code computes them."""
from __future__ import annotations

import torch
from torch import nn

from .integer_linear import IntegerLinear
from .llama import MLP, DecoderLayer, RMSNorm, Transformer
from .thread_governor import ThreadGovernor


def with_kernels(model: Transformer, kernels) -> Transformer:
    """`model` attending through `kernels` where they fit (fp32 cache on the CPU, heads of a
    multiple of 16), its norms and gates on them where its rows fit; None: through PyTorch's."""
    fits = attends_on_kernels(model.config, model.device)
    for layer in model.layers:
        layer.self_attn.kernels = kernels if fits else None
    c = model.config
    rows_fit = model.device.type == "cpu" and c.hidden_size % 16 == 0 and c.intermediate_size % 16 == 0
    rows_on_kernels(model, kernels if rows_fit else None)
    weights = [layer_weights(layer, kernels) for layer in model.layers]
    model.fused_stack = model.thread_governor = None
    if all(w is not None for w in weights):
        model.fused_stack = (kernels, kernels.layer_stack(weights))
        if torch.get_num_threads() > 1:
            model.thread_governor = ThreadGovernor(torch.get_num_threads(), model.extra_row_cost)
    for index, layer in enumerate(model.layers):
        layer.fused = None if model.fused_stack is None else (*model.fused_stack, index)
    return model


def attends_on_kernels(config, device: torch.device) -> bool:
    """Whether a model of `config` on `device` attends through the kernels (their heads are a multiple of 16)."""
    return device.type == "cpu" and config.head_dim % 16 == 0


def rows_on_kernels(module: nn.Module, kernels) -> nn.Module:
    """`module` with its norms and MLP gates (of fp32 rows) on `kernels` (None: on PyTorch's)."""
    for part in module.modules():
        if isinstance(part, (RMSNorm, MLP)):
            part.kernels = kernels
    return module


def layer_weights(layer: DecoderLayer, kernels):
    """What the kernels' fused layers take of `layer` (`bindings.cpp`, LayerWeights), or None where a
    part does not run on `kernels`."""
    attention, mlp = layer.self_attn, layer.mlp
    head_norms = [n for n in (attention.q_norm, attention.k_norm) if n is not None]
    norms = layer.norms + head_norms
    matrices = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not (kernels is not None and all(m.kernels is kernels for m in (attention, mlp, *norms))
            and all(isinstance(m, IntegerLinear) and m.kernels is kernels for m in matrices)
            and all(n.weight.dtype == torch.float32 for n in norms)):
        return None
    qkv, o, gate_up, down = (m.as_kernel_matrix() for m in matrices)
    optional = lambda norm: None if norm is None else norm.weight  # noqa: E731
    return kernels.layer_weights(
        layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down,
        optional(attention.q_norm), optional(attention.k_norm), optional(layer.attention_output_norm),
        optional(layer.mlp_output_norm), layer.input_layernorm.eps, attention.num_heads, attention.window or 0,
        attention.rope_index, attention.scale, mlp.gelu)
