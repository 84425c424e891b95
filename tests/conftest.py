import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_engine():
    """The real default model (SmolLM2-135M-Instruct, fp32, CPU), loaded once per session."""
    import specee

    return specee.load()
