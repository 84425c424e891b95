"""The fast tier's guard: an unmarked test cannot reach the default model or a server process."""
import pytest

import specee.model.loading as loading


def test_an_unmarked_test_is_stopped_at_the_default_model():
    with pytest.raises(pytest.fail.Exception, match="not marked slow"):
        loading.default_model_path()


def test_an_unmarked_test_is_stopped_at_a_server_process():
    from serve_helpers import running_server

    with pytest.raises(pytest.fail.Exception, match="a server process in a test not marked slow"):
        running_server()


def test_fixtures_holding_the_default_model_are_recognised():
    from types import SimpleNamespace

    from conftest import _default_model_path, _holds_the_default_model
    from helpers import tiny_model

    default = SimpleNamespace(source=_default_model_path())  # what an Engine of the default model says
    assert _holds_the_default_model(default) and _holds_the_default_model({"int4": default})
    assert not _holds_the_default_model(SimpleNamespace(source=None, model=tiny_model()))
    assert not _holds_the_default_model({"x": 1})


@pytest.mark.slow
def test_a_slow_test_reaches_it():
    assert loading.default_model_path().suffix == ".gguf"
