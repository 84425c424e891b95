"""The import graph of specee, read from the source (function-level imports included): it has no
cycle, and no module below the engine imports the engine or anything above it."""
import ast
import graphlib
from pathlib import Path

import pytest

import specee

PACKAGE = Path(specee.__file__).parent
# Above the engine: the user-facing layers and the tools built on the engine.
ABOVE_ENGINE = ("specee.engine", "specee.cli", "specee.server", "specee.eval", "specee.train")
BELOW_ENGINE = ("specee.decoding", "specee.drafters", "specee.exits", "specee.verification", "specee.model",
                "specee.sampling", "specee.stats", "specee.tokenizer", "specee.text_stream", "specee.loader")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The specee modules `path` imports anywhere in its body."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, root, set(paths)) for name, path in paths.items()}


def within(module: str, layers: tuple[str, ...]) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


def test_the_import_graph_has_no_cycle():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError naming the cycle


def test_no_module_below_the_engine_imports_it_or_what_is_above_it():
    wrong = {(module, dep) for module, deps in import_graph().items() if within(module, BELOW_ENGINE)
             for dep in deps if within(dep, ABOVE_ENGINE)}
    assert not wrong


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The graph reader finds relative, absolute and function-level imports, so the tests above can fail."""
    root = tmp_path / "specee"
    (root / "decoding").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "decoding" / "__init__.py").write_text("")
    (root / "decoding" / "a.py").write_text("from . import b\n")
    (root / "decoding" / "b.py").write_text("def f():\n    from specee.decoding.a import x\n    from ..engine import E\n")
    (root / "engine.py").write_text("")
    graph = import_graph(root)
    assert graph["specee.decoding.b"] == {"specee.decoding.a", "specee.engine"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
