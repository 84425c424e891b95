"""The two test tiers. `pytest -m "not slow"` is the fast tier: tiny random models only, no default
model, no server process, no browser. A test that needs one of those is marked `slow`;
`require_slow` makes an unmarked one fail, saying so (conftest.py sets which tier is running)."""
import pytest

running = {"slow": True}  # outside a test (collection, session fixtures of a slow test): allowed


def require_slow(what: str) -> None:
    if not running["slow"]:
        pytest.fail(f"{what} in a test not marked slow: mark it @pytest.mark.slow "
                    "(the fast tier, pytest -m 'not slow', runs tiny random models only)", pytrace=False)
