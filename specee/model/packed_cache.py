"""A model built from a GGUF file, saved once in the kernels' own layout and memory-mapped on later
loads: a second load maps the packed tiles (`torch.load(mmap=True)`) instead of decoding and packing
every block again, and the pages are the file's, shared with the page cache.

The file holds each integer matrix's packed codes and scales (with its format), the dense tensors
left (norms), and the weights' fingerprint. It is keyed by what it was built from (the GGUF file's
path, size and mtime: the metadata directory it lives in; the format; PACKED_VERSION) and not by the
CPU tier: every tier reads the same tiles.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .config import LlamaConfig
from .integer_linear import IntegerLinear
from .llama import Transformer
from .quantize import QuantizedEmbedding, mark_quantized
from .rope import inverse_frequencies

PACKED_VERSION = 8  # bump when the tiles' layout or this file's contents change
EMBEDDING_MATRIX = "embed_tokens.matrix"  # an untied quantized embedding's own matrix


class DamagedCache(Exception):
    """The cache file cannot give back a whole model: it is rebuilt from the GGUF file."""


def packed_cache_path(metadata_directory: Path, quantization: str, dtype: str) -> Path:
    """Keyed by the dtype too: the norms are stored in it."""
    return metadata_directory / f"packed-v{PACKED_VERSION}-{quantization}-{dtype}.pt"


def save_packed(model: Transformer, path: Path) -> None:
    """Writes the model's packed matrices and dense tensors to `path` (atomically: a file at `path`
    is always whole). Skipped, with a note, when the disk cannot hold it."""
    matrices, tensors = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, IntegerLinear):
            matrices[name] = {"out_features": module.out_features, "bits": module.bits, "group_size": module.group_size}
            tensors[f"{name}.packed"], tensors[f"{name}.scales_zeros"] = module.packed, module.scales_zeros
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    free = shutil.disk_usage(path.parent).free
    if free < size * 1.1:
        print(f"specee: not caching the packed weights ({size / 2**30:.2f} GiB) in {path.parent}: only "
              f"{free / 2**30:.2f} GiB free; later loads will decode the file again", file=sys.stderr)
        return
    print(f"specee: caching the packed weights ({size / 2**30:.2f} GiB) in {path} (first load only)", file=sys.stderr)
    contents = {"version": PACKED_VERSION, "matrices": matrices, "tensors": tensors, "dense": model.state_dict(),
                "fingerprint": getattr(model, "source_fingerprint", None)}
    staging = None
    try:
        handle, staging = tempfile.mkstemp(dir=path.parent, prefix="partial-", suffix=".pt")  # torch.save: no leading dot
        os.close(handle)
        torch.save(contents, staging)
        os.replace(staging, path)
        remove_older_versions(path.parent)
    except (OSError, RuntimeError) as e:  # a full disk or a read-only folder: the model is loaded all the same
        print(f"specee: warning: could not cache the packed weights ({e}); later loads will decode the file "
              "again", file=sys.stderr)
    finally:
        if staging is not None:
            Path(staging).unlink(missing_ok=True)


def remove_older_versions(metadata_directory: Path) -> None:
    """Deletes the packed files of earlier PACKED_VERSIONs beside a new one: nothing reads them any
    more, and at 1-8B each is gigabytes."""
    for old in metadata_directory.glob("packed-v*-*.pt"):
        version = old.name.split("-")[1][1:]
        if version.isdigit() and int(version) != PACKED_VERSION:
            size = old.stat().st_size
            old.unlink(missing_ok=True)
            print(f"specee: removed {old.name} ({size / 2**30:.2f} GiB), packed by an earlier version",
                  file=sys.stderr)


def load_packed(path: Path, config: LlamaConfig, dtype: torch.dtype, kernels) -> Transformer:
    """The model saved at `path`, its tensors mapped from the file."""
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # torch raises assorted errors on a truncated or foreign file
        raise DamagedCache(f"{type(e).__name__}: {e}") from None
    if not isinstance(saved, dict) or saved.get("version") != PACKED_VERSION:
        raise DamagedCache("not a packed-weights file of this version")
    with torch.device("meta"):
        model = Transformer(config)
    tensors = saved["tensors"]
    try:
        for name, m in saved["matrices"].items():
            linear = IntegerLinear(tensors[f"{name}.packed"], tensors[f"{name}.scales_zeros"], m["out_features"],
                                   m["bits"], m["group_size"], kernels, tensors.get(f"{name}.bias"))
            if kernels is not None:  # tiles of another layout (a build that packed them otherwise) do not fit
                linear.as_kernel_matrix()
            if name == EMBEDDING_MATRIX:
                model.embed_tokens = QuantizedEmbedding(linear, dtype, owned=True)
            else:
                model.set_submodule(name, linear)
    except (KeyError, ValueError, AttributeError, RuntimeError) as e:
        raise DamagedCache(f"{type(e).__name__}: {e}") from None
    if EMBEDDING_MATRIX not in saved["matrices"]:  # tied: the head's rows
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    model.load_state_dict(saved["dense"], strict=False, assign=True)
    unfilled = [name for name, t in model.state_dict().items() if t.is_meta]
    if unfilled or any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise DamagedCache(f"tensors missing: {unfilled[:3]}")
    model.inv_freq = inverse_frequencies(config)
    if saved["fingerprint"] is not None:
        model.source_fingerprint = saved["fingerprint"]
    mark_quantized(model, kernels)
    return model.eval()
