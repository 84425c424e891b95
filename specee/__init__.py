"""specee: fast LLM decoding with speculative decoding and speculative early exit."""
from __future__ import annotations

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
