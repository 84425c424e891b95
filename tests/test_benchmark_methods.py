"""Every benchmark names the decoding method it times: the default (`auto`) speculates, so a call
that leaves the method out would time speculation under another name."""
import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))
DECODING_CALLS = {"generate", "stream"}


def calls_without_a_method(source: str) -> list[int]:
    """Lines of `x.generate(...)` / `x.stream(...)` calls that pass no `spec_method` keyword."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DECODING_CALLS
            and not any(keyword.arg == "spec_method" for keyword in node.keywords)]


def test_the_check_sees_a_call_without_a_method():
    assert calls_without_a_method("engine.generate(p, max_tokens=8)\nengine.stream(m, **options)") == [1, 2]
    assert calls_without_a_method("engine.generate(p, spec_method='none', **options)") == []


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_every_decoding_call_names_its_method(path):
    assert calls_without_a_method(path.read_text()) == [], f"{path.name}: name spec_method at these lines"
