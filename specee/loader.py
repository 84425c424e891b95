"""Load a model's parts from a path: weights on a device in a dtype (CPU-packed or quantized), and
its tokenizer.
The engine is assembled from these parts; so are draft models."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .model.cpu_packing import pack_linears
from .model.kernels import cpu_kernels
from .model.llama import Transformer
from .model.loading import build_model, default_model_path, read_weights, resolve_model_dir
from .model.quantize import automatic_quantization, check_quantization, quantize_model
from .tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")


@dataclass
class ModelParts:
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # the GGUF file or model directory they were loaded from
    quantization: str = "none"  # none, int8, int4 or gguf


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, known in DTYPES.items() if known == dtype)


def parse_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available")
    return torch.device(name)


def load_parts(model=None, dtype: str = "fp32", device: str = "cpu", threads: int | None = None,
               quantization: str = "auto", compile: bool = True, cpu_tier: str | None = None) -> ModelParts:
    """`quantization`: auto (int4 on the CPU, none elsewhere: `automatic_quantization`), none,
    int8, int4 (quantize the loaded weights), or gguf (keep a GGUF file's own quantized tensors);
    the quantized formats run on the CPU. `compile`: on the CPU, run on the compiled kernels
    (`model/kernels/`, built once per machine) where they can be had, in `cpu_tier` (default: the
    best this CPU runs, or $SPECEE_CPU_TIER); False: PyTorch's own."""
    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    check_quantization(quantization, torch_device)
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    source = default_model_path() if model is None else Path(model).expanduser()
    if quantization == "gguf":
        from .model.gguf_quantized import read_gguf_weights  # needs the gguf package

        weights = read_gguf_weights(source)  # refuses unsupported blocks before any conversion
        directory = resolve_model_dir(source)
    else:
        directory = resolve_model_dir(source)
        weights = read_weights(directory)
    config = weights.config
    if quantization == "auto":
        quantization = automatic_quantization(config, torch_device)
    if torch_device.type == "cuda":
        # cuDNN's attention plans each new key length anew (4.5 ms of CPU a call in bf16 on an
        # H100), and every decoding step brings a new one; flash and efficient attention do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    kernels = cpu_kernels(cpu_tier) if compile and torch_device.type == "cpu" else None
    net = build_model(weights, torch_dtype, torch_device, kernels)
    if quantization in ("int8", "int4"):
        quantize_model(net, quantization, kernels=kernels)
    if torch_device.type == "cpu":
        pack_linears(net)  # the dense matrices left, if any
    net.use_kernels(kernels)
    return ModelParts(net, Tokenizer(directory, config.eos_token_ids), source, quantization)
