"""A real `specee serve` process from this checkout, for the server tests."""
from __future__ import annotations

import os
from pathlib import Path

from specee.eval.server_process import ServerProcess
from tiers import require_slow

ROOT = Path(__file__).resolve().parent.parent  # the checkout under test


def running_server(*flags: str) -> ServerProcess:
    require_slow("a server process")
    return ServerProcess(*flags, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
