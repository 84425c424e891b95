"""Load a model's parts from a path: weights on a device in a dtype (CPU-packed or quantized), and
its tokenizer.
The engine is assembled from these parts; so are draft models."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .model.cpu_packing import pack_linears
from .model.kernel_install import attends_on_kernels, with_kernels
from .model.kernels import cpu_kernels
from .model.llama import Transformer
from .model.errors import ModelLoadError
from .model.memory import blocks_given_back, check_fits, estimate_memory
from .model.loading import build_model, default_model_path, is_gguf_file, read_config, read_weights, resolve_model_dir
from .model.quantize import automatic_quantization, check_quantization, quantize_model
from .tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KV_CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
KV_CACHE_CHOICES = ("auto", *KV_CACHE_DTYPES)
DEFAULT_CONTEXT = 4096  # llama.cpp's default context too
DEVICES = ("cpu", "cuda")


@dataclass
class ModelParts:
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # the GGUF file or model directory they were loaded from
    quantization: str = "none"  # none, int8, int4 or gguf
    context_length: int = 4096  # the longest prompt plus answer a generation may hold


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
               quantization: str = "auto", compile: bool = True, cpu_tier: str | None = None,
               ctx_size: int | None = None, kv_cache_dtype: str = "auto") -> ModelParts:
    """`quantization`: auto (on the CPU kernels a GGUF file's own blocks, else int4:
    `automatic_quantization`; none off the CPU), none, int8, int4 (quantize the loaded weights), or
    gguf (keep a GGUF file's own quantized tensors);
    the quantized formats run on the CPU. `compile`: on the CPU, run on the compiled kernels
    (`model/kernels/`, built once per machine) where they can be had, in `cpu_tier` (default: the
    best this CPU runs, or $SPECEE_CPU_TIER); False: PyTorch's own. `ctx_size`: the context a
    generation may fill (default the model's, at most DEFAULT_CONTEXT); on the CPU, a model whose
    weights and full KV cache will not fit in the memory available is refused before it loads.
    `kv_cache_dtype`: fp32, fp16 (the compiled CPU kernels only), or auto (`kv_cache_element`)."""
    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    if ctx_size is not None and (not isinstance(ctx_size, int) or ctx_size <= 0):
        raise ValueError(f"ctx_size must be a positive integer, got {ctx_size}")
    check_quantization(quantization, torch_device)
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        if threads != torch.get_num_threads():  # setting it anew leaves a thread behind on the caller
            torch.set_num_threads(threads)
    source = default_model_path() if model is None else Path(model).expanduser()
    directory = resolve_model_dir(source)  # refuses what is neither a GGUF file nor a model directory
    gguf = is_gguf_file(source)
    if quantization == "gguf" and not gguf:
        raise ModelLoadError(f"--quantization gguf keeps a GGUF file's own quantized tensors, and {source} is a "
                             "Hugging Face directory: pass the .gguf file, or use --quantization int8 or int4")
    config = read_config(directory)
    kernels = cpu_kernels(cpu_tier) if compile and torch_device.type == "cpu" else None
    if quantization == "auto":
        quantization = automatic_quantization(config, torch_device)
        if gguf and quantization != "none" and kernels is not None:
            from .model.gguf_weights import file_is_quantized

            # The file's own blocks: off the kernels grouped int8 would run dense, so int4 stays.
            quantization = "gguf" if file_is_quantized(source) else quantization
    kernels_attend = kernels is not None and attends_on_kernels(config, torch_device)
    kv_dtype = kv_cache_element(kv_cache_dtype, kernels_attend, quantization)
    context = context_length(config, ctx_size)
    if torch_device.type == "cpu":
        check_fits(estimate_memory(source, directory, gguf, quantization, torch_dtype, config, context,
                                   kv_dtype.itemsize), context, source.name)
    if torch_device.type == "cuda":
        # cuDNN's attention plans each new key length anew (4.5 ms of CPU a call in bf16 on an
        # H100), and every decoding step brings a new one; flash and efficient attention do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if gguf:
        net = _gguf_model(source, directory, config, quantization, torch_dtype, torch_device, kernels)
    else:
        net = build_model(read_weights(directory), torch_dtype, torch_device, kernels)
        if quantization in ("int8", "int4"):
            quantize_model(net, quantization, kernels=kernels)
    if torch_device.type == "cpu":
        pack_linears(net)  # the dense matrices left, if any
    net = with_kernels(net, kernels)
    net.kv_cache_dtype = kv_dtype
    return ModelParts(net, Tokenizer(directory, config.eos_token_ids), source, quantization, context)


def kv_cache_element(name: str, kernels_attend: bool, quantization: str) -> torch.dtype:
    """The CPU cache's element: fp32, or fp16 where attention runs on the compiled kernels (the
    only attention here that reads halves). auto: fp16 where quantized weights attend on the
    kernels, as llama.cpp's default cache (its measured cost in quality is nil: BENCHMARKS.md, "What
    an fp16 KV cache costs in quality"; half the bytes a step reads at long contexts), else fp32, so
    a model in fp32 weights keeps the Hugging Face reference's answers."""
    if name not in KV_CACHE_CHOICES:
        raise ValueError(f"unknown KV cache dtype {name!r} (choose from {', '.join(KV_CACHE_CHOICES)})")
    if name == "auto":
        return torch.float16 if kernels_attend and quantization != "none" else torch.float32
    if name == "fp16" and not kernels_attend:
        raise ValueError("--kv-cache-dtype fp16 runs on specee's compiled CPU kernels, and this load has none "
                         "(--no-compile, a GPU, no C++ compiler, or heads not a multiple of 16): use fp32")
    return KV_CACHE_DTYPES[name]


def context_length(config, ctx_size: int | None) -> int:
    if ctx_size is None:
        return min(config.max_position_embeddings, DEFAULT_CONTEXT)
    if ctx_size > config.max_position_embeddings:
        raise ValueError(f"ctx_size {ctx_size} is longer than the model's context ({config.max_position_embeddings})")
    return ctx_size


def _gguf_model(source: Path, directory: Path, config, quantization: str, dtype: torch.dtype, device: torch.device,
                kernels) -> Transformer:
    """A GGUF file's model, read tensor by tensor into `quantization`; on the CPU kernels, the packed
    result is cached beside the file's metadata and mapped from there on later loads."""
    from .model.gguf_weights import read_gguf_weights  # needs the gguf package
    from .model.packed_cache import DamagedCache, load_packed, packed_cache_path, save_packed

    cache = packed_cache_path(directory, quantization, dtype_name(dtype)) if kernels is not None and quantization != "none" else None
    if cache is not None and cache.exists():
        try:
            return load_packed(cache, config, dtype, kernels)
        except DamagedCache as e:
            print(f"specee: warning: the packed-weights cache {cache} is damaged ({e}); rebuilding it", file=sys.stderr)
            cache.unlink(missing_ok=True)
    with blocks_given_back():
        net = build_model(read_gguf_weights(source, quantization), dtype, device, kernels)
        if cache is not None:
            save_packed(net, cache)
    return net
