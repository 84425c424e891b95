"""The CPU kernels of `cpu_kernels.cpp`: built once per machine with the C++ compiler, kept under
the cache folder (`$SPECEE_CACHE/kernels/`, default `~/.cache/specee`) and reused by later
processes. Where they cannot be had (no compiler, a CPU without AVX-512 VNNI, a failed build),
`cpu_kernels()` says why once on stderr and returns None: the model then runs the eager path.
"""
from __future__ import annotations

import functools
import hashlib
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mavx2",
          # Rounding must not depend on how the compiler fuses a multiply and an add.
          "-ffp-contract=off", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-fopenmp"]


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot run here; the message says why."""


def missing_cpu_flags() -> list[str]:
    """The instruction sets the kernels need that this CPU lacks (all of them off Linux x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return list(REQUIRED_CPU_FLAGS)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(REQUIRED_CPU_FLAGS)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]


def build_directory() -> Path:
    """One folder per source, compiler flags, torch and Python version: a change rebuilds."""
    from ..loading import cache_root

    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, sys.version]).encode())
    return cache_root() / "kernels" / key.hexdigest()[:16]


def _compile(directory: Path):
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    name = f"specee_cpu_kernels_{directory.name}"
    # torch skips the build step for a name it already built in this process: forget it, so a
    # removed or damaged library is built again.
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    return cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=str(directory), verbose=False)


def build(directory: Path | None = None):
    """Compile (or reuse) the kernels and import them; raises KernelsUnavailable."""
    missing = missing_cpu_flags()
    if missing:
        raise KernelsUnavailable(f"this CPU lacks {', '.join(missing)}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise KernelsUnavailable("no C++ compiler found (install g++, e.g. `apt-get install g++`)")
    directory = directory or build_directory()
    fresh = not any(directory.glob("*.so"))
    started = time.perf_counter()
    if fresh:
        print("specee: compiling the CPU kernels (once per machine, about 30 s)...", file=sys.stderr, flush=True)
    try:
        try:
            module = _compile(directory)
        except ImportError as error:  # a damaged shared object: build it again
            warnings.warn(f"specee: the cached CPU kernels in {directory} could not be loaded ({error}); rebuilding",
                          stacklevel=2)
            shutil.rmtree(directory, ignore_errors=True)
            module = _compile(directory)
    except Exception as error:  # a compiler or linker failure
        raise KernelsUnavailable(f"building the CPU kernels failed: {str(error).strip().splitlines()[-1]}") from error
    if fresh:
        print(f"specee: CPU kernels ready in {time.perf_counter() - started:.0f} s ({directory})", file=sys.stderr,
              flush=True)
    return module


@functools.cache
def cpu_kernels():
    """The kernels module, or None (said once on stderr) where they cannot be had."""
    try:
        return build()
    except KernelsUnavailable as error:
        print(f"specee: {error}; running the eager path (slower)", file=sys.stderr, flush=True)
        return None
