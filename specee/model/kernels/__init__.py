"""specee's CPU kernels, in tiers: one source (`kernels.h` on a 16-lane vector) built once per
instruction set into its own library (`tier.cpp`: AMX, AVX-512 VNNI, AVX-VNNI, AVX2 + FMA, NEON
with dot products, portable C++), and the torch bindings that open a tier's library (`bindings.cpp`).
Every tier gives the same bits (kernels.h says how).

`cpu_kernels()` takes the best tier this CPU runs, or the one `SPECEE_CPU_TIER` (the CLI's
`--cpu-tier`) names, builds what is missing once per machine under the cache folder
(`$SPECEE_CACHE/kernels/`, default `~/.cache/specee`), says which tier runs once on stderr and
returns its `Kernels`. Without a compiler it says why and returns None: the model then runs the
eager path (PyTorch's kernels).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
TIER_SOURCES = ("tier.cpp", "kernels.h", "api.h")
BINDING_SOURCES = ("bindings.cpp", "api.h")
# Rounding must not depend on how the compiler fuses a multiply and an add; each tier exports one
# symbol, so two tiers in one process never mix.
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off")
TIER_VARIABLE = "SPECEE_CPU_TIER"


@dataclass(frozen=True)
class Tier:
    name: str
    machine: str  # "x86_64", "aarch64", or "any"
    cpu_flags: tuple[str, ...]  # as Linux's /proc/cpuinfo names them
    cflags: tuple[str, ...]
    header: str
    description: str


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma")
AVX512_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma")
# Best first: a CPU runs the first tier whose flags it has.
TIERS = (
    Tier("amx", "x86_64", ("amx_tile", "amx_int8", *AVX512_FLAGS), ("-mamx-tile", "-mamx-int8", *AVX512_CFLAGS),
         "vec_amx.h", "AMX int8 tiles for several rows, else AVX-512 VNNI"),
    Tier("avx512", "x86_64", AVX512_FLAGS, AVX512_CFLAGS, "vec_avx512.h", "AVX-512 VNNI"),
    Tier("avxvnni", "x86_64", ("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
         "vec_avx2.h", "AVX2 with AVX-VNNI"),
    Tier("avx2", "x86_64", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "vec_avx2.h", "AVX2 + FMA"),
    Tier("neon", "aarch64", ("asimddp",), ("-march=armv8.2-a+dotprod",), "vec_neon.h", "ARM NEON with dot products"),
    Tier("portable", "any", (), (), "vec_portable.h", "portable C++"),
)
TIER_NAMES = tuple(tier.name for tier in TIERS)


class KernelsUnavailable(RuntimeError):
    """The CPU kernels cannot run here; the message says why."""


def tier_named(name: str) -> Tier:
    for tier in TIERS:
        if tier.name == name:
            return tier
    raise ValueError(f"unknown CPU tier {name!r} (choose from {', '.join(TIER_NAMES)})")


def machine() -> str:
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 `flags`, ARM `Features`)."""
    if platform.system() == "Darwin" and machine() == "aarch64":  # every Apple M chip has dot products
        done = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_DotProd"], capture_output=True, text=True)
        return frozenset({"asimddp"} if done.stdout.strip() == "1" else ())
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("flags", "Features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing_cpu_flags(tier: Tier) -> list[str]:
    """What `tier` needs that this CPU lacks (its whole architecture, on another one)."""
    if tier.machine not in ("any", machine()):
        return [tier.machine]
    return [flag for flag in tier.cpu_flags if flag not in cpu_features()]


def supported_tiers() -> list[str]:
    """The tiers this CPU runs, best first (the portable one always)."""
    return [tier.name for tier in TIERS if not missing_cpu_flags(tier)]


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise KernelsUnavailable("no C++ compiler found (install g++, e.g. `apt-get install g++`)")
    return found


def tier_command(tier: Tier, output: Path, cxx: str = "c++") -> list[str]:
    """The compiler command that builds `tier`'s library."""
    return [cxx, *COMMON_FLAGS, *tier.cflags, f"-DSPECEE_TIER={tier.name}", f'-DSPECEE_VEC_HEADER="{tier.header}"',
            f"-I{HERE}", str(HERE / "tier.cpp"), "-o", str(output)]


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _sources(names) -> list[str]:
    return [(HERE / name).read_text() for name in names]


def tier_headers(tier: Tier) -> tuple[str, ...]:
    """`tier`'s vector header and the headers of this folder it includes (AMX's, AVX-512's)."""
    included = re.findall(r'^#include "([^"]+)"', (HERE / tier.header).read_text(), re.MULTILINE)
    return (tier.header, *(name for name in included if (HERE / name).exists()))


def tier_library(tier: Tier) -> Path:
    """`tier`'s library, built once per source, flags and compiler (a few seconds)."""
    from ..loading import cache_root

    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    # Keyed by the sources' text, not their place: another clone or install of them reuses the build.
    command = [part.replace(str(HERE), "<kernels>") for part in tier_command(tier, Path("out"), cxx)]
    directory = cache_root() / "kernels" / f"{tier.name}-{_key(*_sources(TIER_SOURCES + tier_headers(tier)), *command, version)}"
    library = directory / f"libspecee_{tier.name}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with building(directory):
        if library.exists():  # another process built it while this one waited
            return library
        _build_tier(tier, cxx, library)
    return library


@contextlib.contextmanager
def building(directory: Path):
    """Held while a library is built into `directory`: processes that need it at once (test
    workers, a server and a command) build it once, and none replaces the library another loaded."""
    import fcntl

    with open(directory / ".building", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_tier(tier: Tier, cxx: str, library: Path) -> None:
    # Built beside and renamed into place: a process that finds the library finds it whole.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        done = subprocess.run(tier_command(tier, built, cxx), capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelsUnavailable(f"building the {tier.name} CPU kernels failed: {last}")
        os.replace(built, library)


def bindings_directory() -> Path:
    """One folder per bindings source, torch and Python version: a change rebuilds."""
    import torch

    from ..loading import cache_root

    return cache_root() / "kernels" / f"bindings-{_key(*_sources(BINDING_SOURCES), torch.__version__, sys.version)}"


def _binding_sources(directory: Path) -> Path:
    """A copy of the bindings' sources in `directory`, which the build compiles: its commands name
    no path of this checkout, so another clone or install of the same sources reuses the build."""
    sources = directory / "src"
    sources.mkdir(parents=True, exist_ok=True)
    for source in BINDING_SOURCES:
        text = (HERE / source).read_bytes()
        if not (sources / source).exists() or (sources / source).read_bytes() != text:
            with tempfile.NamedTemporaryFile(dir=sources, delete=False) as copy:  # renamed whole into place
                copy.write(text)
            os.replace(copy.name, sources / source)
    return sources


def _compile_bindings(directory: Path):
    from torch.utils import cpp_extension

    # Through its real path: a cache folder reached by a symbolic link (a test's own cache sharing
    # the machine's kernels) gives ninja the same commands, so nothing is built again.
    directory = directory.resolve()
    sources = _binding_sources(directory)
    name = f"specee_kernels_{directory.name.replace('-', '_')}"
    # torch skips the build step for a name it already built in this process: forget it, so a
    # removed or damaged library is built again.
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    # -fopenmp: at::parallel_for is inline, and runs on one thread when built without it.
    return cpp_extension.load(name, [str(sources / "bindings.cpp")], extra_cflags=["-O2", "-fopenmp", f"-I{sources}"],
                              extra_ldflags=["-ldl", "-fopenmp"], build_directory=str(directory), verbose=False)


@functools.cache
def bindings():
    """The torch bindings module (its `Kernels` opens a tier's library), built once per machine."""
    compiler()
    directory = bindings_directory()
    fresh = not any(directory.glob("*.so"))
    started = time.perf_counter()
    if fresh:
        print("specee: compiling the CPU kernels (once per machine, about 40 s)...", file=sys.stderr, flush=True)
    try:
        try:
            module = _compile_bindings(directory)
        except ImportError as error:  # a damaged shared object: build it again
            warnings.warn(f"specee: the cached CPU kernels in {directory} could not be loaded ({error}); rebuilding",
                          stacklevel=2)
            shutil.rmtree(directory, ignore_errors=True)
            module = _compile_bindings(directory)
    except KernelsUnavailable:
        raise
    except Exception as error:  # a compiler or linker failure
        raise KernelsUnavailable(f"building the CPU kernels failed: {str(error).strip().splitlines()[-1]}") from error
    if fresh:
        print(f"specee: CPU kernels ready in {time.perf_counter() - started:.0f} s ({directory})", file=sys.stderr,
              flush=True)
    return module


@functools.cache
def load_tier(name: str):
    """`name`'s kernels (a `Kernels` with the methods the model calls); raises KernelsUnavailable,
    or ValueError for a tier this CPU cannot run."""
    tier = tier_named(name)
    missing = missing_cpu_flags(tier)
    if missing:
        raise ValueError(f"CPU tier {name} needs {', '.join(missing)}, which this CPU lacks "
                         f"(it runs {', '.join(supported_tiers())})")
    module = bindings()
    library = tier_library(tier)
    try:
        return module.Kernels(str(library), f"specee_kernel_table_{name}")
    except module.TierUnavailable as error:  # built and whole, but not for this process (AMX: no tile state)
        raise KernelsUnavailable(f"the {name} CPU kernels cannot run here: {error}") from None
    except RuntimeError as error:  # a damaged library: build it again
        warnings.warn(f"specee: the cached {name} kernels could not be loaded ({error}); rebuilding", stacklevel=2)
        shutil.rmtree(library.parent, ignore_errors=True)
        return module.Kernels(str(tier_library(tier)), f"specee_kernel_table_{name}")


def requested_tier(tier: str | None = None) -> str:
    """The tier to run: `tier` if given (other than "auto"), else $SPECEE_CPU_TIER, else the best."""
    from_variable = tier in (None, "auto") and bool(os.environ.get(TIER_VARIABLE))
    name = os.environ[TIER_VARIABLE] if from_variable else tier or "auto"
    if name == "auto":
        return supported_tiers()[0]
    try:
        tier_named(name)
    except ValueError as error:
        raise ValueError(f"{TIER_VARIABLE}: {error}" if from_variable else str(error)) from None
    return name


@functools.cache
def cpu_kernels(tier: str | None = None):
    """The kernels of `tier` (see `requested_tier`), or None where no tier can be built (said once
    on stderr). A tier asked for by name that this CPU cannot run is a ValueError; the best tier
    failing to build or to start falls back to the next, with a warning on stderr that names the tier,
    why, and the tier that runs instead."""
    name = requested_tier(tier)
    candidates = supported_tiers() if name == supported_tiers()[0] else [name]
    try:
        bindings()
    except KernelsUnavailable as error:
        print(f"specee: {error}; running the eager path (PyTorch's kernels, slower)", file=sys.stderr, flush=True)
        return None
    for index, candidate in enumerate(candidates):
        try:
            kernels = load_tier(candidate)
        except KernelsUnavailable as error:
            # Never silent: a lower tier runs slower, and whoever runs it should know why.
            after = (f"falling back to the {candidates[index + 1]} tier" if index + 1 < len(candidates)
                     else "no other tier to fall back to")
            print(f"specee: warning: the {candidate} CPU tier is unavailable ({error}); {after}", file=sys.stderr,
                  flush=True)
            continue
        print(f"specee: CPU kernels: {candidate} ({tier_named(candidate).description}; this CPU runs "
              f"{', '.join(supported_tiers())})", file=sys.stderr, flush=True)
        return kernels
    print("specee: no CPU tier could be built; running the eager path (PyTorch's kernels, slower)", file=sys.stderr,
          flush=True)
    return None
