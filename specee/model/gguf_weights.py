"""A GGUF file's weights, read tensor by tensor from the file's memory mapping straight into the
formats the model runs, never through an fp32 copy of the model: the peak is the loaded model plus
one tensor's temporaries.

Per `quantization`:
- "gguf" (what "auto" picks on the CPU for a file whose matrices are quantized): the file's own blocks, as
  `gguf_blocks.py` decodes them. Q4_0 and Q4_1 become int4 in groups of 32 with the file's codes;
  the int4 kernel takes bf16 scales and zero points, so d and the zero point are rounded to bf16
  (relative error <= 2^-9 of each). The K-quants (Q4_K, Q5_K, Q6_K) keep their codes in 4, 5 or 6 bits
  and their scales as the file factors them (an fp16 per superblock times an int8 per group):
  exactly the file's values in about its bytes. Q5_0, Q5_1 and Q8_0 become int8 in groups of 32
  with fp32 scales and offsets (Q5_0, whose offset is -16 times its scale, then runs as its 5-bit
  codes with one scale a group: `GroupedInt8Weight.centered_five`): exactly the file's values. F32, F16
  and BF16 matrices are quantized to the default format (int4, with an int8 output head and
  embedding) as they are read; other block types (Q2_K, Q3_K, the IQ types) are dequantized and
  quantized the same way, and said so once on stderr.
- "int4", "int8": every matrix dequantized and quantized to that format as it is read.
- "none": dense fp32 tensors.
Norms (and biases) stay dense. llama.cpp's interleaving of q and k rows is undone on whatever
rows a format keeps.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import gguf_blocks
from .errors import ModelLoadError
from .fingerprint import EMBEDDING_ROWS, fingerprint
from .gguf_file import hf_name, open_gguf, unpermute_rows
from .loading import LoadedWeights
from .quantize import (DEFAULT_INT4_GROUP_SIZE, GroupedInt8Weight, Int4Weight, SuperblockInt8Weight, map_rows,
                       quantize_int4, quantize_int8)

DENSE_TYPES = ("F32", "F16", "BF16")
# The output head and the embedding stay int8 when a format is quantized here, as quantize_model keeps them.
INT8_MATRICES = ("lm_head.weight", "model.embed_tokens.weight")


class LoadBar(tqdm):
    """A progress bar without tqdm's monitor thread, which would outlive the load (`specee serve`
    loads on a thread that must leave nothing behind)."""

    monitor_interval = 0


def read_gguf_weights(path: Path, quantization: str) -> LoadedWeights:
    """The file's tensors under Hugging Face names, in `quantization` ("gguf", "int4", "int8" or
    "none")."""
    reader, config = open_gguf(path)
    requantized: set[str] = set()
    state = {}
    tensors = [t for t in reader.tensors if hf_name(t.name, config.model_type) is not None]
    for t in LoadBar(tensors, desc=f"loading {path.name}", unit="tensor", leave=False, file=sys.stderr):
        name = hf_name(t.name, config.model_type)
        try:
            state[name] = _read_tensor(t, name, quantization, config, requantized)
            reader.release(t)
        except ModelLoadError:
            raise
        except Exception as e:  # truncated data surfaces only when a tensor is read
            raise ModelLoadError(f"cannot read tensor {t.name} of {path} ({type(e).__name__}: {e})") from None
    if requantized:
        print(f"specee: {', '.join(sorted(requantized))} blocks have no kernel: those matrices were re-quantized "
              f"to int4 (lossy; an int8 head)", file=sys.stderr)
    return LoadedWeights(config, state, None, source_fingerprint(reader, state, config), quantization,
                         norms_offset=True)  # llama.cpp's converter folds Gemma's 1 + w into its norms


def file_is_quantized(path: Path) -> bool:
    """Whether the file's matrices are stored in quantized blocks (not F32, F16 or BF16 alone)."""
    reader, config = open_gguf(path)
    return any(t.tensor_type.name not in DENSE_TYPES for t in reader.tensors
               if hf_name(t.name, config.model_type) is not None)


def _read_tensor(t, name: str, quantization: str, config, requantized: set[str]):
    kind = t.tensor_type.name
    if len(t.shape) == 1 or quantization == "none":  # norms and biases; or a dense model
        return unpermute_rows(torch.from_numpy(_dense(t)), t.name, config)
    if quantization == "gguf" and t.tensor_type in gguf_blocks.CODE_BITS:
        affine = gguf_blocks.decode(np.asarray(t.data), t.tensor_type)
        return _unpermuted(_from_affine(affine), t.name, config)
    if quantization == "gguf" and kind not in DENSE_TYPES:
        requantized.add(kind)
    dense = torch.from_numpy(_dense(t))
    int8 = quantization == "int8" or name in INT8_MATRICES
    weight = quantize_int8(dense) if int8 else quantize_int4(dense, DEFAULT_INT4_GROUP_SIZE)
    return _unpermuted(weight, t.name, config)


def _unpermuted(weight, gguf_name: str, config):
    return map_rows(weight, lambda rows, _: unpermute_rows(rows, gguf_name, config))


def _from_affine(affine: "gguf_blocks.AffineCodes"):
    codes, scales, offsets = (torch.from_numpy(a) for a in (affine.codes, affine.scales, affine.offsets))
    if affine.factors is not None:
        return SuperblockInt8Weight(codes, torch.from_numpy(affine.factors), torch.from_numpy(affine.multipliers),
                                    affine.group_size, gguf_blocks.factored_code_width(affine.bits, affine.group_size))
    if affine.bits == 4:
        # code * s + m = (code - 8) * s + (m + 8 s): int4's zero point is m + 8 s.
        return Int4Weight.from_codes(codes, scales, offsets + 8 * scales, affine.group_size)
    return GroupedInt8Weight(codes, scales, offsets, affine.group_size)


def source_fingerprint(reader, state: dict, config) -> str:
    """The fingerprint of the model this file dequantizes to (what "none" builds): its first
    embedding rows dequantized, and its norms (dense in the file)."""
    embedding = next(t for t in reader.tensors if hf_name(t.name, config.model_type) == "model.embed_tokens.weight")
    rows = torch.from_numpy(_dense(embedding, EMBEDDING_ROWS))
    norms = [state["model.norm.weight"]]
    before_mlp = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"  # HF's names
    for i in range(config.num_hidden_layers):
        norms += [state[f"model.layers.{i}.input_layernorm.weight"], state[f"model.layers.{i}.{before_mlp}.weight"]]
    return fingerprint(config, rows, norms)


def _dense(t, rows: int | None = None) -> np.ndarray:
    from gguf.quants import dequantize

    data = np.asarray(t.data) if rows is None else np.asarray(t.data)[:rows]
    return np.array(dequantize(data, t.tensor_type), dtype=np.float32, order="C")
