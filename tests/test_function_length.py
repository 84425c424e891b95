"""No function in specee/ is longer than a screen: 80 lines from its `def` to its last line,
nested functions counted inside the function that holds them (and on their own)."""
import ast
from pathlib import Path

import specee

PACKAGE = Path(specee.__file__).parent
MOST_LINES = 80


def long_functions(root: Path = PACKAGE, most: int = MOST_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method over `most` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > most:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    assert long_functions() == []


def test_the_walk_finds_a_long_function_and_a_long_method(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n\n\nclass C:\n    async def g(self):\n        pass\n")
    (tmp_path / "short.py").write_text(f"def h():\n{body[:-len('    x79 = 79')].rstrip()}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/long.py:1 f (81 lines)"]
