"""What a model will need in memory, known before it loads, and what the machine has: a model that
cannot fit is refused with the numbers instead of being killed by the kernel's OOM killer.

The estimate adds the weights in the format they will run in (from the file's tensor shapes and
types alone), the KV cache of a full context, the largest tensor's decoding temporaries (a GGUF
file read into our formats) and the runtime's own (PyTorch, the tokenizer, activations)."""
from __future__ import annotations

import ctypes
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import LlamaConfig
from .errors import ModelLoadError

RUNTIME_BYTES = 400 * 2**20  # PyTorch, the kernels, the tokenizer and a pass's activations
# Bytes per weight in each format the matrices run in: int4 codes with a bf16 scale and zero point
# per 32; int8 codes with an fp32 scale and offset per group of 16 or 32 (or per row); 4-, 5- or 6-bit
# codes with an int8 pair per group under an fp16 pair per 256 (superblock scales: Q4_K, Q5_K), or
# an int8 under an fp16 (centered: Q6_K); 5- or 8-bit codes with an fp16 scale per 32 (Q5_0, Q8_0).
INT4_BYTES = 0.5 + 4 / 32
GROUPED_INT8_BYTES = {16: 1 + 8 / 16, 32: 1 + 8 / 32}
SUPERBLOCK_BYTES = {(4, 32): 0.5 + 2 / 32 + 4 / 256, (5, 32): 0.625 + 2 / 32 + 4 / 256, (6, 16): 0.75 + 2 / 16 + 4 / 256,
                    (6, 32): 0.75 + 2 / 32 + 4 / 256}
CENTERED_BYTES = 0.75 + 1 / 16 + 2 / 256
FIVE_BIT_GROUPED_BYTES = 0.625 + 2 / 32  # 5-bit codes, an fp16 scale per 32 (Q5_0)
EIGHT_BIT_CENTERED_BYTES = 1 + 2 / 32  # 8-bit codes, an fp16 scale per 32 (Q8_0)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    working: int  # decoding temporaries and the runtime

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.working


def kv_cache_bytes(config: LlamaConfig, context: int, element_bytes: int = 4) -> int:
    """A full context's keys and values, `element_bytes` each (the CPU cache: fp32, or fp16)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context * element_bytes


# Matrices fused into one at load (`loading.fuse_hf_state_dict`): superblock-scaled parts of
# different formats become 6-bit codes in the smallest group, other mixes int8 with fp32 scales in
# the smallest group (`quantize.cat_rows`).
FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def gguf_weight_bytes(path: Path, quantization: str, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weights as they will run, bytes of the largest tensor's temporaries) of a GGUF
    file in `quantization` (already resolved: gguf, int4, int8 or none)."""
    from . import gguf_blocks
    from .gguf_file import hf_name, open_gguf
    from .gguf_weights import INT8_MATRICES

    reader, config = open_gguf(path)
    dense_size = torch.tensor([], dtype=dtype).element_size()
    # fused matrix -> its parts' (count, bytes a weight, group, factored)
    matrices: dict[str, list[tuple[int, float, int, bool]]] = {}
    total, largest = 0, 0
    for t in reader.tensors:
        name = hf_name(t.name, config.model_type)
        if name is None:
            continue
        count = int(torch.tensor(t.shape).prod())
        if len(t.shape) == 1 or quantization == "none":
            total += count * (4 if len(t.shape) == 1 else dense_size)
            continue
        factored = quantization == "gguf" and t.tensor_type in gguf_blocks.FACTORED
        if quantization == "gguf" and t.tensor_type in gguf_blocks.CODE_BITS:
            bits, group = gguf_blocks.CODE_BITS[t.tensor_type], gguf_blocks.GROUP_SIZES[t.tensor_type]
            per_weight = (CENTERED_BYTES if t.tensor_type == gguf_blocks.Type.Q6_K
                          else FIVE_BIT_GROUPED_BYTES if t.tensor_type == gguf_blocks.Type.Q5_0
                          else EIGHT_BIT_CENTERED_BYTES if t.tensor_type == gguf_blocks.Type.Q8_0
                          else SUPERBLOCK_BYTES[gguf_blocks.factored_code_width(bits, group), group] if factored
                          else INT4_BYTES if bits == 4 else GROUPED_INT8_BYTES[group])
        else:  # quantized as it is read: int4 (int8 for the head and embedding, or asked for)
            group = 32 if quantization == "int4" and name not in INT8_MATRICES else 0
            per_weight = INT4_BYTES if group else 1
        parts = t.name.split(".")
        key = ".".join(parts[:2] + [FUSED.get(parts[2], parts[2])]) if parts[0] == "blk" else t.name
        matrices.setdefault(key, []).append((count, per_weight, group, factored))
        # Decoding one tensor holds its codes, per-group scales and a packed copy at once.
        largest = max(largest, 3 * count)
    for parts in matrices.values():
        if len({per_weight for _, per_weight, _, _ in parts}) > 1:  # mixed formats fuse in the smallest group
            smallest = min(group for _, _, group, _ in parts if group)
            per_weight = (SUPERBLOCK_BYTES[6, smallest] if all(factored for *_, factored in parts)
                          else GROUPED_INT8_BYTES[smallest])
            parts = [(count, per_weight, smallest, False) for count, *_ in parts]
        total += int(sum(count * per_weight for count, per_weight, _, _ in parts))
    return total, largest


def directory_weight_bytes(directory: Path, quantization: str, dtype: torch.dtype) -> tuple[int, int]:
    """The same for a Hugging Face directory, from its safetensors headers (its tensors load whole,
    then are quantized one at a time)."""
    from safetensors import safe_open

    counts = []
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            counts += [int(torch.tensor(f.get_slice(name).get_shape()).prod()) for name in f.keys()]
    per_weight = {"int4": INT4_BYTES, "int8": 1}.get(quantization, torch.tensor([], dtype=dtype).element_size())
    params = sum(counts)
    dense = params * torch.tensor([], dtype=dtype).element_size()
    return int(params * per_weight), dense if quantization in ("int4", "int8") else 0


def estimate_memory(source: Path, directory: Path, gguf: bool, quantization: str, dtype: torch.dtype,
                    config: LlamaConfig, context: int, kv_element_bytes: int = 4) -> MemoryEstimate:
    """What loading `source` (a GGUF file, else the model `directory`) in `quantization` and running a
    `context`-token generation (its cache `kv_element_bytes` an element) will need."""
    if gguf:
        weights, temporaries = gguf_weight_bytes(source, quantization, dtype)
    else:
        weights, temporaries = directory_weight_bytes(directory, quantization, dtype)
    return MemoryEstimate(weights, kv_cache_bytes(config, context, kv_element_bytes), temporaries + RUNTIME_BYTES)


def available_bytes() -> int:
    """Memory this process may still take: the machine's available memory, or less under a cgroup
    limit."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit_file = Path("/sys/fs/cgroup/memory.max")
    if limit_file.exists():
        limit = limit_file.read_text().strip()
        used_file = Path("/sys/fs/cgroup/memory.current")
        if limit != "max" and used_file.exists():
            room = int(limit) - int(used_file.read_text())
            available = room if available is None else min(available, room)
    return available if available is not None else 2**62


def check_fits(estimate: MemoryEstimate, context: int, name: str) -> None:
    available = available_bytes()
    if estimate.total > available:
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        raise ModelLoadError(
            f"{name} needs about {gib(estimate.total)} of memory (weights {gib(estimate.weights)}, KV cache for "
            f"{context} tokens {gib(estimate.kv_cache)}, working memory {gib(estimate.working)}) and this machine "
            f"has {gib(available)} available: nothing was loaded. Use a smaller --ctx-size, a smaller quantization "
            "of the model, or free some memory")


# glibc's mallopt parameter, and its ceiling for the mmap threshold (64-bit).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20


@contextmanager
def blocks_given_back():
    """While a GGUF file is decoded and packed: glibc serves blocks below its mmap threshold from its
    heap, and after the first large block is freed that threshold rises to 32 MB, so the many
    decoded tensors of tens of MB, each freed once packed, leave holes that later ones do not fit
    (a 1B file's first load peaked 1.4x higher). Blocks of 1 MB or more get their own mapping
    meanwhile, given back to the system when freed; afterwards the threshold stays at glibc's
    ceiling (where it would have risen) and the heap's free top is returned. Elsewhere, nothing."""
    libc = ctypes.CDLL(None) if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, 2**20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        libc.malloc_trim(0)
