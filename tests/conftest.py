import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def _worker_core() -> int | None:
    """Under pytest-xdist (`-n N`), worker gwK keeps to one core of its own, K modulo the cores
    this run may use, and so do the servers and builds it starts: two workers' OpenMP threads
    never wait on each other, and a worker's threads never outnumber its core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


# Two test runs side by side each take one core: SPECEE_TEST_THREADS=1 (two threads a core run 10x
# slower); an xdist worker runs on its own core with one thread.
torch.set_num_threads(int(os.environ.get("SPECEE_TEST_THREADS", 1 if _worker_core() is not None else 2)))

import specee.model.loading as loading  # noqa: E402
from tiers import require_slow, running  # noqa: E402

_default_model_path = loading.default_model_path


def _default_model_path_of_a_slow_test():
    require_slow("the default model")
    return _default_model_path()


# Every way to the default model goes through default_model_path (specee.load, the tokenizer of
# the GGUF, the benchmarks): modules that import it later get this one.
loading.default_model_path = _default_model_path_of_a_slow_test
for _module in list(sys.modules.values()):
    if getattr(_module, "default_model_path", None) is _default_model_path:
        _module.default_model_path = _default_model_path_of_a_slow_test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    running["slow"] = item.get_closest_marker("slow") is not None


def _holds_the_default_model(value) -> bool:
    from specee.eval.server_process import ServerProcess

    if isinstance(value, dict):
        return any(_holds_the_default_model(v) for v in value.values())
    return isinstance(value, ServerProcess) or getattr(value, "source", None) == _default_model_path()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A fixture made by an earlier slow test (a session's engine, a module's server) reaches an
    unmarked test without loading anything: caught here, from the values the test receives."""
    if not running["slow"]:
        for name, value in getattr(item, "funcargs", {}).items():
            if _holds_the_default_model(value):
                require_slow(f"the default model (fixture {name!r})")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from helpers import tiny_tokenizer

    return tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (SmolLM2-135M-Instruct) with fp32 weights on the CPU, loaded once per
    session: the dense reference the tests compare against (the CLI's default format is `gguf`, the
    file's own blocks)."""
    import specee

    return specee.load(quantization="none")


@pytest.fixture(scope="module")
def default_server():
    """A real `specee serve` process with the default model, one per test module that asks for it;
    stopped with SIGTERM at the module's end, which must exit cleanly."""
    from serve_helpers import running_server

    running = running_server()
    yield running
    assert running.stop() == 0, running.output()


def _fresh_cache(tmp_path, monkeypatch, shared: list[str]):
    """$SPECEE_CACHE in a new folder, in which the named entries of the machine's cache are links."""
    from specee.model.loading import cache_root

    machine = cache_root()
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in shared:
        (machine / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(machine / name)
    monkeypatch.setenv("SPECEE_CACHE", str(cache))
    return cache


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    """A fresh $SPECEE_CACHE for a test's GGUF metadata and packed weights, sharing the machine's
    built kernels (a build per test would take a minute each)."""
    return _fresh_cache(tmp_path, monkeypatch, ["kernels"])


@pytest.fixture
def training_cache(tmp_path, monkeypatch):
    """A fresh $SPECEE_CACHE for what a training run collects (so the run collects it, and leaves
    nothing in the machine's cache), sharing the machine's kernels and converted models (converting
    the default model's file again takes seconds)."""
    from specee.model.loading import cache_root

    return _fresh_cache(tmp_path, monkeypatch, [p.name for p in cache_root().iterdir() if p.is_dir()])
