"""Run a HumanEval completion against its tests in a separate, limited Python process.

The limits (own process group, wall-clock kill, address-space cap, empty environment, sockets
disabled, throwaway working directory) guard against a model's accidents such as infinite loops,
runaway memory or stray network calls. They are not a security boundary against hostile code.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FAILED_EXIT = 3  # the tests ran and an assertion failed; any other non-zero exit is an error
DETAIL_CHARS = 2000

# Runs in the child before the solution: it limits its own resources (set here rather than in a
# preexec_fn, which can deadlock a threaded parent), sockets cannot be created, then the program
# runs and its outcome becomes the exit status.
HARNESS = f"""\
import _socket, resource, socket, sys, traceback

memory_mb, cpu_s = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))  # backstop if the wall-clock kill fails
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the HumanEval sandbox")

class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()

socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = _NoSocket
socket.socketpair = _socket.socketpair = socket.create_connection = socket.fromfd = _no_network

source = open("solution.py", encoding="utf-8").read()
try:
    exec(compile(source, "solution.py", "exec"), {{"__name__": "__main__"}})
except AssertionError:
    traceback.print_exc()
    sys.exit({FAILED_EXIT})
except BaseException:
    traceback.print_exc()
    sys.exit(1)
"""


@dataclass
class ExecResult:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "error"
    detail: str  # the tail of the program's output, or why it was stopped


def program_source(problem: dict, completion: str) -> str:
    """HumanEval's convention: the completion continues the prompt, then the tests check it."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def check_humaneval(problem: dict, completion: str, timeout_s: float = 5.0, memory_mb: int = 1024) -> ExecResult:
    """Whether prompt + completion passes the problem's tests (HumanEval dict fields)."""
    with tempfile.TemporaryDirectory(prefix="specee-humaneval-") as workdir:
        Path(workdir, "solution.py").write_text(program_source(problem, completion), encoding="utf-8")
        Path(workdir, "harness.py").write_text(HARNESS, encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-I", "harness.py", str(memory_mb), str(int(timeout_s) + 2)],
            cwd=workdir,
            env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session and process group, so a kill takes its children
        )
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return ExecResult(False, "timeout", f"killed after {timeout_s:g} s")
    detail = output.decode("utf-8", errors="replace")[-DETAIL_CHARS:]
    if process.returncode == 0:
        return ExecResult(True, "passed", detail)
    if process.returncode == FAILED_EXIT:
        return ExecResult(False, "failed", detail)
    if process.returncode < 0:
        detail += f"\nkilled by {signal.Signals(-process.returncode).name}"
    return ExecResult(False, "error", detail)


FENCED_BLOCK = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def entry_point_of(prompt: str) -> str | None:
    """The function a HumanEval prompt asks for: the last one it defines."""
    names = re.findall(r"^def\s+(\w+)\s*\(", prompt, flags=re.MULTILINE)
    return names[-1] if names else None


def extract_code(completion_text: str, prompt: str) -> str:
    """The completion to append to `prompt`, taken from a chat answer.

    Prefers a fenced block that defines the function, then a ```python block, then any block, and
    falls back to the raw text. A block that re-defines the whole function is a complete program:
    appended after the prompt it replaces the prompt's stub (a def with only a docstring is valid)
    while keeping the prompt's imports and helper functions.
    """
    blocks = [(lang.lower(), code) for lang, code in FENCED_BLOCK.findall(completion_text)]
    entry = entry_point_of(prompt)
    defines_entry = re.compile(rf"^\s*def\s+{re.escape(entry)}\s*\(", re.MULTILINE) if entry else None
    full_programs = [code for _, code in blocks if defines_entry and defines_entry.search(code)]
    python_blocks = [code for lang, code in blocks if lang in ("python", "py", "python3")]
    if full_programs:
        return "\n" + full_programs[0]
    if python_blocks or blocks:
        return (python_blocks or [code for _, code in blocks])[0]
    if defines_entry and defines_entry.search(completion_text):
        return "\n" + completion_text
    return completion_text
