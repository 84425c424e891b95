"""Every CPU tier gives the portable tier's bits: tests/native/tier_check.cpp links one tier's
kernels and the portable ones (tier.cpp built as the product builds it, each with its own flags)
into one program, runs both tables on the same random inputs (a fixed seed) and compares every
output with memcmp. The NEON tier is cross-compiled for AArch64 and runs under qemu. Every x86 tier
is built on every x86-64 machine, so a tier this CPU cannot run still fails the build here, and runs
natively where the CPU has its flags. No torch: the harness needs a C++ compiler alone."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from specee.model.kernels import HERE, TIERS, compiler, machine, missing_cpu_flags, tier_command, tier_named

HARNESS = Path(__file__).resolve().parent / "native" / "tier_check.cpp"
CROSS_COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
CROSS_PACKAGES = "g++-aarch64-linux-gnu qemu-user"
# The libraries build with -O3; -O0 builds the tier objects far sooner (BENCHMARKS.md, "The suite in
# 11 min 51 s on a Zen 4"), and its slower code costs the harness's run less than that. Rounding does
# not depend on it: -ffp-contract=off and the flags below stay. Nor does a build error hide behind it:
# at -O0 GCC's headers take immediate operands as macros, stricter than the inlined forms.
OPTIMIZATION = "-O0"


def tier_object(name: str, output: Path, cxx: str) -> list[str]:
    """tier.cpp built with the product's command for `name` (tier_command), as an object for one
    static link. Its namespace is renamed: kernels.h's inline functions are weak symbols named after
    their namespace, and two tiers linked into one program would otherwise share one copy of each
    (the harness's "tables" case fails when they do). The table function is extern "C": its name,
    specee_kernel_table_<name>, stays."""
    command = tier_command(tier_named(name), output, cxx)
    command[command.index("-shared")] = "-c"
    command = [OPTIMIZATION if flag == "-O3" else flag for flag in command]
    assert "-ffp-contract=off" in command and OPTIMIZATION in command, command
    return [command[0], f"-Dspecee=specee_{name}", *command[1:]]


def run_all(commands: list[list[str]]) -> None:
    """The commands side by side; each must succeed."""
    started = [(command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
               for command in commands]
    for command, process in started:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{' '.join(command)} failed:\n{output}"


def build_harness(name: str, cxx: str, directory: Path, link_flags: tuple[str, ...] = (),
                  portable: Path | None = None) -> Path:
    """tier_check built for tier `name` against the portable tier, in `directory`; `portable`: that
    tier's object built already by the same compiler (the slowest of the three to build)."""
    objects = {name: directory / f"{name}.o", "portable": portable or directory / "portable.o"}
    harness = directory / "tier_check.o"
    run_all([*(tier_object(tier, path, cxx) for tier, path in objects.items() if not path.exists()),
             [cxx, "-c", "-O2", "-std=c++17", f"-DTIER_UNDER_TEST={name}", f"-I{HERE}", str(HARNESS), "-o", str(harness)]])
    binary = directory / f"tier_check_{name}"
    run_all([[cxx, *link_flags, str(harness), *map(str, objects.values()), "-o", str(binary)]])
    return binary


@pytest.fixture(scope="module")
def x86_portable_object(tmp_path_factory) -> Path:
    """The portable tier's object for the x86 harnesses, built once for all of them."""
    path = tmp_path_factory.mktemp("portable") / "portable.o"
    run_all([tier_object("portable", path, compiler())])
    return path


def assert_all_passed(done: subprocess.CompletedProcess, name: str) -> int:
    """The harness's verdict: exit status 0 and a last line `N passed, 0 failed` with N > 0."""
    report = f"{name} against portable (exit status {done.returncode}):\n{done.stdout}{done.stderr}"
    lines = done.stdout.strip().splitlines()
    counts = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1]) if lines else None
    assert counts is not None, f"no `N passed, M failed` line: {report}"
    passed, failed = int(counts[1]), int(counts[2])
    assert failed == 0 and done.returncode == 0, report
    assert passed > 0, report
    return passed


@pytest.mark.slow
def test_the_neon_tier_gives_the_portable_bits_under_qemu(tmp_path):
    """Cross-compiled for AArch64 (NEON with dot products, and the portable tier on the same CPU),
    linked statically and run under qemu's `max` CPU, which has the dot-product instructions. CI
    installs the cross compiler and qemu: missing, the test fails rather than skips."""
    missing = [tool for tool in (CROSS_COMPILER, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: install the Debian packages {CROSS_PACKAGES} "
                    f"(apt-get install {CROSS_PACKAGES})", pytrace=False)
    started = time.perf_counter()
    binary = build_harness("neon", CROSS_COMPILER, tmp_path, ("-static",))
    done = subprocess.run([QEMU, "-cpu", "max", str(binary)], capture_output=True, text=True, timeout=300)
    passed = assert_all_passed(done, "neon")
    print(f"neon: {passed} cases passed in {time.perf_counter() - started:.1f} s (build and run)")


X86_TIERS = [tier.name for tier in TIERS if tier.machine == "x86_64"]


@pytest.mark.slow  # the fast tier compares the x86 tiers through the bindings (test_kernels.py)
@pytest.mark.parametrize("name", X86_TIERS)
def test_an_x86_tier_builds_everywhere_and_gives_the_portable_bits(name, tmp_path, x86_portable_object):
    """Each x86 tier, built with its own flags beside the portable tier built with none, on any
    x86-64 machine: a build or link failure fails the test whatever this CPU has. The run against
    the portable tier needs the tier's flags; on a CPU without them it is skipped, saying so, after
    the build has passed."""
    if machine() != "x86_64":
        pytest.skip(f"the x86 tiers build with an x86-64 compiler; this machine is {machine()}")
    started = time.perf_counter()
    binary = build_harness(name, compiler(), tmp_path, portable=x86_portable_object)
    assert binary.is_file() and os.access(binary, os.X_OK), f"linking the {name} harness made no program"
    built = time.perf_counter() - started
    missing = missing_cpu_flags(tier_named(name))
    if missing:
        pytest.skip(f"the {name} tier built and linked ({built:.1f} s); not run: this CPU lacks {', '.join(missing)}")
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    passed = assert_all_passed(done, name)
    print(f"{name}: {passed} cases passed in {time.perf_counter() - started:.1f} s (build {built:.1f} s and run)")
