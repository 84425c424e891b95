"""specee: fast LLM decoding with speculative decoding and speculative early exit."""
from __future__ import annotations

__version__ = "0.1.0"


def load(model=None, dtype: str = "fp32", device: str = "cpu", threads: int | None = None,
         quantization: str = "auto", compile: bool = True, cpu_tier: str | None = None, ctx_size: int | None = None,
         prefix_cache_mb: float | None = None):
    """Load a model (GGUF file or Hugging Face directory; the default model when None).
    `quantization`: auto (int4 on the CPU, none on a GPU), none, int8, int4, or gguf (a GGUF file's
    own quantized tensors); the quantized formats run on the CPU. `compile`: on the CPU, run on
    specee's compiled kernels (built once per machine; False: PyTorch's own, slower). `cpu_tier`:
    which of their instruction-set tiers (amx, avx512, avxvnni, avx2, neon, portable; default: the best
    this CPU runs, or $SPECEE_CPU_TIER); every tier gives the same bits. `threads`: PyTorch's
    and the kernels' threads (None: as PyTorch has them; the CLI's default is the physical cores). `ctx_size`: the longest
    prompt plus answer a generation may hold (default the model's context, at most 4096).
    `prefix_cache_mb`: the prefix cache's memory (default on the CPU kernels: the model's
    K/V for 8192 tokens, at most an eighth of the available memory and 1 GiB; else 0 = off)."""
    from .engine import load_engine

    return load_engine(model, dtype=dtype, device=device, threads=threads, quantization=quantization,
                       compile=compile, cpu_tier=cpu_tier, ctx_size=ctx_size, prefix_cache_mb=prefix_cache_mb)
