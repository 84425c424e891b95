"""specee: fast LLM decoding with speculative decoding and speculative early exit."""
from __future__ import annotations

import os

# OpenMP's worker threads go to sleep after GOMP_SPINCOUNT idle spins (300,000 unless set), which
# the Python between two passes (`auto`'s drafting, a server's scheduling) outlasts; waking them
# costs every such pass more than spinning through the gap (BENCHMARKS.md, "Between passes").
# Read when torch loads its OpenMP, so set here, before; a user's own setting wins.
SPIN_COUNT = "3000000"
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

__version__ = "0.1.0"


def load(model=None, **options):
    """Load a model (GGUF file or Hugging Face directory; the default model when None) into an
    engine. The options are `specee.options.LoadOptions`' (dtype, device, threads, quantization,
    compile, cpu_tier, ctx_size, prefix_cache_mb), described there; an unknown one is a TypeError
    that lists them."""
    from .engine import load_engine
    from .options import LoadOptions, checked

    return load_engine(**checked(LoadOptions, {"model": model, **options}, "specee.load()").keywords())


def _signature():
    from .options import LoadOptions, signature

    return signature(LoadOptions)


load.__signature__ = _signature()
