"""A GGUF file's weights with its own quantized blocks kept (`quantization="gguf"`), decoded with
vectorised numpy, one tensor at a time, never through an fp32 copy of the whole model (though a
file's very first load still converts it once to safetensors, for its tokenizer and config, as
every format does).

- Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m): 32 4-bit codes per block with an fp16 scale d
  (and an fp16 minimum m). They map onto int4 with zero points in groups of 32: the codes are the
  file's; the kernel wants bf16 scales and zero points, so d and m + 8d are rounded to bf16
  (relative error <= 2^-9 of each, so not the file's exact values).
- Q8_0 (w = d * q, 32 int8 per fp16 scale): the int8 kernel has one scale per output row, which
  cannot hold per-block scales, so Q8_0 is dequantized exactly and requantized per row to int8
  (error <= the row's scale / 2 on top of the file's). The exact alternatives, fp32 (4x the bytes)
  or per-block partial products, would read more or cost more than they save.
- F32, F16 and BF16 tensors (norms, and matrices a file left unquantized) are kept dense.
Any other type in a matrix is refused by name: there is no kernel for it here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .fingerprint import EMBEDDING_ROWS, fingerprint
from .gguf_convert import hf_name, open_gguf, unpermute_rows
from .loading import LoadedWeights, ModelLoadError
from .quantize import Int4Weight, Int8Weight, cat_rows, map_rows, quantize_int8

BLOCK_SIZE = 32
# Rows of a Q8_0 matrix dequantized at a time: bounds the fp32 temporary (the 49152-row
# embedding would be 113 MB at once).
Q8_0_ROWS_PER_CHUNK = 4096


def read_gguf_weights(path: Path) -> LoadedWeights:
    """The file's tensors under Hugging Face names: quantized weights where a kernel exists,
    dense tensors for the rest (no directory: the tokenizer comes from the converted copy)."""
    from gguf import GGMLQuantizationType as Type

    decoders = {Type.Q4_0: int4_from_q4, Type.Q4_1: int4_from_q4, Type.Q8_0: int8_from_q8_0}
    dense = (Type.F32, Type.F16, Type.BF16)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        raise ModelLoadError(f"--quantization gguf keeps a GGUF file's own quantized tensors, and {path} is a "
                             "Hugging Face directory: pass the .gguf file, or use --quantization int8 or int4")
    reader, config = open_gguf(path)
    state = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        if t.tensor_type not in decoders and t.tensor_type not in dense:
            raise ModelLoadError(
                f"tensor {t.name} is {t.tensor_type.name}: --quantization gguf keeps the file's own blocks and has "
                "kernels for Q4_0, Q4_1 and Q8_0 only; use --quantization int8, int4 or none for this file")
        try:
            if t.tensor_type in decoders:
                weight = decoders[t.tensor_type](np.asarray(t.data), t.tensor_type)
                weight = map_rows(weight, lambda rows, _, n=t.name: unpermute_rows(rows, n, config))
            else:
                weight = unpermute_rows(torch.from_numpy(_dense(t)), t.name, config)
        except Exception as e:  # truncated data surfaces only when a tensor is read
            raise ModelLoadError(f"cannot read tensor {t.name} of {path} ({type(e).__name__}: {e})") from None
        state[name] = weight
    return LoadedWeights(config, state, None, source_fingerprint(reader, state, config))


def source_fingerprint(reader, state: dict, config) -> str:
    """The fingerprint of the model this file dequantizes to (what `--quantization none` builds):
    its first embedding rows dequantized, and its norms (dense in the file)."""
    embedding = next(t for t in reader.tensors if hf_name(t.name) == "model.embed_tokens.weight")
    rows = torch.from_numpy(_dense_rows(embedding, EMBEDDING_ROWS))
    norms = [state["model.norm.weight"]]
    for i in range(config.num_hidden_layers):
        norms += [state[f"model.layers.{i}.input_layernorm.weight"], state[f"model.layers.{i}.post_attention_layernorm.weight"]]
    return fingerprint(config, rows, norms)


def _dense_rows(t, rows: int) -> np.ndarray:
    from gguf.quants import dequantize

    return np.array(dequantize(np.asarray(t.data)[:rows], t.tensor_type), dtype=np.float32, order="C")


def _dense(t) -> np.ndarray:
    from gguf.quants import dequantize

    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C")


def int4_from_q4(data: np.ndarray, qtype) -> Int4Weight:
    from gguf import GGMLQuantizationType as Type

    has_min = qtype == Type.Q4_1
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 20 if has_min else 18)  # [N, K / 32, bytes per block]
    d = _fp16(blocks[..., 0:2])  # [N, K / 32]
    nibbles = blocks[..., 4:] if has_min else blocks[..., 2:]  # [N, K / 32, 16]
    # Byte j of a block holds code j (low nibble) and code j + 16 (high nibble).
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, -1)  # [N, K]
    # Q4_1: d * q + m = d * (q - 8) + (m + 8 d); Q4_0 has no minimum: zero point 0.
    zeros = _fp16(blocks[..., 2:4]) + 8 * d if has_min else np.zeros_like(d)
    return Int4Weight.from_codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros), BLOCK_SIZE)


def int8_from_q8_0(data: np.ndarray, qtype=None) -> Int8Weight:
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 2 + BLOCK_SIZE)  # [N, K / 32, 34], read-only (the file's mapping)
    parts = []
    for start in range(0, rows, Q8_0_ROWS_PER_CHUNK):
        chunk = blocks[start:start + Q8_0_ROWS_PER_CHUNK]
        d = torch.from_numpy(_fp16(chunk[..., 0:2]))[..., None]  # [n, K / 32, 1]
        codes = torch.from_numpy(chunk[..., 2:].copy().view(np.int8)).float()  # [n, K / 32, 32]
        parts.append(quantize_int8((codes * d).flatten(1)))  # exact: an fp16 times an int8 fits fp32
    return cat_rows(parts)


def _fp16(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp16 values, as fp32."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)
