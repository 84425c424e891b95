import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (SmolLM2-135M-Instruct) with fp32 weights on the CPU, loaded once per
    session: the dense reference the tests compare against (the CLI's default format is int4)."""
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
