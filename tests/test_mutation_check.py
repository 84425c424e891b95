"""scripts/mutation_check.py stays applicable: each mutation's text is in the code it breaks,
exactly once, and a mutated copy of the checkout holds the change and nothing else differs. (The
check itself runs the fast tier once per mutation: its results are in docs/testing.md.)"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mutation_check = sys.modules["mutation_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_finds_its_text_once(mutation):
    assert (ROOT / mutation.path).read_text().count(mutation.old) == 1
    assert mutation.old != mutation.new


def test_a_mutated_copy_differs_from_the_checkout_in_the_mutated_file_alone(tmp_path):
    mutation = mutation_check.MUTATIONS[1]
    mutation_check.mutated_copy(mutation, tmp_path)
    changed = (tmp_path / mutation.path).read_text()
    assert mutation.new in changed and mutation.old not in changed
    for name in ("specee/engine.py", "tests/conftest.py", "pyproject.toml"):
        assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes()


def test_text_that_moved_stops_the_check_with_a_message(tmp_path):
    moved = mutation_check.Mutation("moved", "specee/engine.py", "no such line in the engine", "", "")
    with pytest.raises(SystemExit, match="not in specee/engine.py exactly once"):
        mutation_check.mutated_copy(moved, tmp_path)
