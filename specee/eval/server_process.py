"""Server child processes on 127.0.0.1: started, waited for until healthy, stopped with SIGTERM,
and their peak memory. `ServerProcess` is `specee serve`; the load generator also starts
llama.cpp's servers through `ChildServer`. Both only speak HTTP to the child."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 300  # the first load of the default model converts it (about a minute); a busy CPU is slower


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """`command` serving HTTP on 127.0.0.1:`port`, healthy once `health_path` answers 200."""

    def __init__(self, command: list[str], port: int, health_path: str = "/health", cwd: Path | None = None,
                 env: dict | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_path = health_path
        self.log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would block the server
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.output()}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: a hang must not hang the caller)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ChildServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(ChildServer):
    """`specee serve` run by this Python with `flags`."""

    def __init__(self, *flags: str, cwd: Path | None = None, env: dict | None = None) -> None:
        port = free_port()
        command = [sys.executable, "-m", "specee.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
        super().__init__(command, port, cwd=cwd, env=env)


def peak_rss_mb(status: str) -> float | None:
    """The peak resident memory (VmHWM) in a /proc/<pid>/status text, in MiB; None without one."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # the kernel writes every Vm* line in kB
    return None


def process_peak_rss_mb(pid: int) -> float | None:
    try:
        return peak_rss_mb(Path(f"/proc/{pid}/status").read_text())
    except OSError:  # not Linux, or the process is gone
        return None


def reset_peak_rss(pid: int) -> bool:
    """Lower a process's VmHWM to its current resident memory (Linux's clear_refs 5), so the next
    reading is the peak since now; False where that is not allowed or not Linux."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False
