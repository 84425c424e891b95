"""Every command's model flags (`LoadOptions`, declared in specee/options.py), checked before the
model loads, and the load itself with its one line on stderr."""
from __future__ import annotations

import argparse
import sys
import time

from ..options import LoadOptions, add_flags, from_namespace
from .common import UsageError

# Trained artifacts are made on the dense weights (what the bundled ones were trained on, and what
# gradients flow through); they run in every format, matched by the dense weights' fingerprint.
TRAINING_QUANTIZATION = "none"


def add_model_options(p: argparse.ArgumentParser, default_quantization: str = "auto") -> None:
    add_flags(p, LoadOptions, {"quantization": default_quantization})


def validate_model_options(args) -> None:
    from ..loader import parse_device, parse_dtype
    from ..model.kernels import requested_tier, supported_tiers
    from ..model.quantize import check_quantization

    try:
        parse_dtype(args.dtype)
        check_quantization(args.quantization, parse_device(args.device))
        tier = requested_tier(args.cpu_tier)
        if tier not in supported_tiers():
            raise ValueError(f"CPU tier {tier} cannot run on this CPU (it runs {', '.join(supported_tiers())})")
    except ValueError as e:
        raise UsageError(str(e)) from None


def load(args):
    """The engine the model flags ask for, on the physical cores unless --threads says otherwise."""
    from .. import load as load_engine
    from ..model.cores import physical_cores

    started = time.perf_counter()
    chosen = args.threads is not None
    args.threads = args.threads or physical_cores()
    engine = load_engine(**from_namespace(LoadOptions, args).keywords())
    print(load_line(engine, time.perf_counter() - started, chosen), file=sys.stderr)
    return engine


def load_line(engine, seconds: float, threads_chosen: bool) -> str:
    from ..model.memory import kv_cache_bytes

    name = engine.source.name if engine.source is not None else "model"
    element = engine.model.kv_cache_dtype
    kv = kv_cache_bytes(engine.config, engine.context_length, element.itemsize)
    kv_kind = " fp16" if element.itemsize == 2 else ""
    threads = __import__('torch').get_num_threads()
    why = "--threads" if threads_chosen else "this machine's physical cores; --threads to change"
    return (f"specee: {name} loaded in {seconds:.1f} s: {engine.quantization} weights, {engine.model.weight_bytes / 2**30:.2f} "
            f"GiB read per token; context {engine.context_length} tokens (KV cache{kv_kind} up to {kv / 2**30:.2f} GiB); "
            f"{threads} threads ({why})")


def load_off_main_thread(args):
    """Load on a thread that ends before serving starts. OpenMP gives every thread that runs a
    parallel region a pool of its own, and libgomp slows every pool down once more threads are in
    pools than there are cores: a pool left on the main thread (which then only runs the HTTP loop)
    made the scheduler thread decode about 1.4x slower. A pool ends with its thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specee-load") as pool:
        return pool.submit(load, args).result()
