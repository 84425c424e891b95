"""Makes random-weight Llama-family GGUF files of realistic shapes, for speed and memory benchmarks.

The weights are random (normal, std 0.02, fixed seed), so the files are useless for quality; only
their shapes, tensor types and sizes are real. The tokenizer metadata is copied from the default
model (SmolLM2-135M-Instruct, vocab 49152), so the files tokenize and chat like it. An F16 file is
written tensor by tensor with gguf-py, then llama.cpp's own quantizer (through llama-cpp-python)
makes each quantized type from it. Nothing is downloaded.

    PYTHONPATH=. python scripts/make_random_gguf.py --shape 1b --types Q4_K_M Q6_K Q8_0 Q4_0 --out-dir DIR \
        [--rope-freqs] [--keep-f16] [--name-suffix S] [--seed N] [--threads N]

writes DIR/random-1b-Q4_K_M.gguf (DIR/random-1b-S-Q4_K_M.gguf with a suffix) and so on, skipping
files that already exist.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

VOCAB_SIZE = 49152  # the default model's tokenizer
CONTEXT_LENGTH = 4096
ROPE_FREQ_BASE = 500000.0
RMS_NORM_EPS = 1e-5
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool  # output projection shares token_embd (no `output.weight` tensor)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "tiny": Shape(2, 256, 768, 4, 2, tied=True),  # quick checks
    "1b": Shape(16, 2048, 8192, 32, 8, tied=True),  # Llama 3.2 1B
    "3b": Shape(28, 3072, 8192, 24, 8, tied=True),  # Llama 3.2 3B
    "8b": Shape(32, 4096, 14336, 32, 8, tied=False),  # Llama 3.1 8B
}

# Bits per weight, rounded up, for the disk space check: K-quant mixes keep some tensors in Q6_K,
# and every type keeps the output (or tied token_embd) in Q6_K or better.
BITS_PER_WEIGHT = {"F16": 16.0, "Q8_0": 8.5, "Q6_K": 6.6, "Q5_K_M": 6.0, "Q4_K_M": 5.2, "Q4_0": 5.0}
QUANT_TYPES = [t for t in BITS_PER_WEIGHT if t != "F16"]


def tensor_plan(shape: Shape, rope_freqs: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in llama.cpp's names; a weight is [out, in]."""
    kv_dim = shape.kv_heads * shape.head_dim
    plan = [("rope_freqs.weight", (shape.head_dim // 2,))] if rope_freqs else []
    plan.append(("token_embd.weight", (VOCAB_SIZE, shape.hidden)))
    for i in range(shape.layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.attn_k.weight", (kv_dim, shape.hidden)),
            (f"blk.{i}.attn_v.weight", (kv_dim, shape.hidden)),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden)),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden)),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate)),
        ]
    plan.append(("output_norm.weight", (shape.hidden,)))
    if not shape.tied:
        plan.append(("output.weight", (VOCAB_SIZE, shape.hidden)))
    return plan


def llama3_rope_factors(head_dim: int, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_context=8192) -> np.ndarray:
    """Llama 3.1/3.2 frequency factors, computed as llama.cpp's convert_hf_to_gguf.py does."""
    freqs = 1.0 / (ROPE_FREQ_BASE ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_f16(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """N(0, WEIGHT_STD) in F16, drawn a slab of rows at a time so no F32 copy of the whole tensor exists."""
    out = np.empty(shape, dtype=np.float16)
    rows_per_slab = max(1, (1 << 22) // shape[1])
    for start in range(0, shape[0], rows_per_slab):
        slab = rng.standard_normal((min(rows_per_slab, shape[0] - start), shape[1]), dtype=np.float32)
        out[start:start + len(slab)] = slab * WEIGHT_STD
    return out


def tensor_data(name: str, numpy_shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name == "rope_freqs.weight":
        return llama3_rope_factors(2 * numpy_shape[0])
    if len(numpy_shape) == 1:  # RMS norm weights
        return np.ones(numpy_shape, dtype=np.float32)
    return random_f16(rng, numpy_shape)


def add_metadata(writer: GGUFWriter, shape: Shape, name: str, tokenizer_gguf: Path) -> None:
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_vocab_size(VOCAB_SIZE)
    for key, field in GGUFReader(tokenizer_gguf).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)


def write_f16(path: Path, shape: Shape, name: str, rope_freqs: bool, seed: int) -> None:
    """Writes the F16 file one tensor at a time: tensor infos first, then each tensor's data."""
    from specee.model.loading import default_model_path

    plan = tensor_plan(shape, rope_freqs)
    writer = GGUFWriter(path, "llama")
    add_metadata(writer, shape, name, default_model_path())
    for tensor_name, numpy_shape in plan:
        dtype = np.float16 if len(numpy_shape) == 2 else np.float32
        writer.add_tensor_info(tensor_name, numpy_shape, np.dtype(dtype), math.prod(numpy_shape) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, numpy_shape in plan:
        writer.write_tensor_data(tensor_data(tensor_name, numpy_shape, rng))
    writer.close()


def quantize(f16_path: Path, out_path: Path, quant_type: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant_type}")
    params.nthread = threads
    llama_cpp.llama_backend_init()
    if llama_cpp.llama_model_quantize(str(f16_path).encode(), str(out_path).encode(), params) != 0:
        raise SystemExit(f"error: llama.cpp failed to quantize {f16_path} to {quant_type}")


def has_rope_freqs(path: Path) -> bool:
    return any(t.name == "rope_freqs.weight" for t in GGUFReader(path).tensors)


def check_free_space(out_dir: Path, n_params: int, types_to_make: list[str]) -> None:
    needed = sum(n_params * BITS_PER_WEIGHT[t] / 8 for t in types_to_make) + 64e6 * len(types_to_make)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise SystemExit(f"error: making {', '.join(types_to_make)} needs about {needed / 1e9:.1f} GB "
                         f"but {out_dir} has {free / 1e9:.1f} GB free")


def size_text(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:,.1f} MiB"


def timed(label: str, path: Path, make) -> None:
    """Runs make() into path.partial, renames it to path and prints path, size and time."""
    partial = path.with_name(path.name + ".partial")
    start = time.perf_counter()
    make(partial)
    partial.rename(path)
    print(f"{path}  {size_text(path)}  ({label} in {time.perf_counter() - start:.1f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument("--types", nargs="+", required=True, choices=["F16", *QUANT_TYPES])
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--rope-freqs", action="store_true",
                        help="add Llama 3.1/3.2 rope_freqs.weight factors, as llama.cpp's converter does")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file the quantized ones are made from")
    parser.add_argument("--name-suffix", default="", help="random-SHAPE-SUFFIX-TYPE.gguf, to tell variants apart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="quantizer threads")
    args = parser.parse_args()

    quant_types = [t for t in dict.fromkeys(args.types) if t != "F16"]
    if quant_types:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            parser.exit(2, 'error: quantizing needs llama-cpp-python: pip install -e ".[llamacpp]"\n')

    shape = SHAPES[args.shape]
    name = "-".join(filter(None, ["random", args.shape, args.name_suffix]))
    path_of = {t: args.out_dir / f"{name}-{t}.gguf" for t in ["F16", *quant_types]}
    for quant_type, path in path_of.items():
        if path.exists() and has_rope_freqs(path) != args.rope_freqs:
            parser.exit(2, f"error: existing {path} {'has' if not args.rope_freqs else 'lacks'} rope_freqs.weight; "
                           "use another --name-suffix or --out-dir\n")
        if path.exists() and quant_type in args.types:
            print(f"{path}  {size_text(path)}  (exists, skipped)")

    missing = [t for t in quant_types if not path_of[t].exists()]
    make_f16 = not path_of["F16"].exists() and bool(missing or "F16" in args.types)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    n_params = sum(math.prod(s) for _, s in tensor_plan(shape, args.rope_freqs))
    check_free_space(args.out_dir, n_params, missing + ["F16"] * bool(make_f16))

    if make_f16:
        timed("written", path_of["F16"], lambda p: write_f16(p, shape, name, args.rope_freqs, args.seed))
    for quant_type in missing:
        timed("quantized", path_of[quant_type], lambda p: quantize(path_of["F16"], p, quant_type, args.threads))
    if make_f16 and "F16" not in args.types and not args.keep_f16:
        path_of["F16"].unlink()
        print(f"{path_of['F16']}  removed (pass --keep-f16 to keep it)")


if __name__ == "__main__":
    main()
