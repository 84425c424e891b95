"""Build an Engine from a model path: weights, tokenizer, device placement and CPU packing."""
from __future__ import annotations

from pathlib import Path

import torch

from .engine import Engine, parse_device, parse_dtype
from .model.cpu_packing import pack_linears
from .model.loading import build_model, default_model_path, read_weights, resolve_model_dir
from .tokenizer import Tokenizer


def load_engine(model=None, dtype: str = "fp32", device: str = "cpu", threads: int | None = None) -> Engine:
    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    source = default_model_path() if model is None else Path(model).expanduser()
    directory = resolve_model_dir(source)
    weights = read_weights(directory)
    net = build_model(weights, torch_dtype, torch_device)
    if torch_device.type == "cpu":
        pack_linears(net)
    tokenizer = Tokenizer(directory, weights.config.eos_token_ids)
    return Engine(net, tokenizer, source=source)
