"""How many physical cores this process may run on: the default thread count of the CLI. A
hyper-thread's sibling shares its core's vector units and caches, and decoding, bound by the
weights' reads and the integer products, gains nothing from it (llama.cpp defaults the same way)."""
from __future__ import annotations

import os
from pathlib import Path

TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores(topology: Path = TOPOLOGY) -> int:
    """Logical CPUs in this process's affinity, counting hyper-thread siblings once (Linux's
    topology files); elsewhere, the logical CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            cores.add((topology / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))
