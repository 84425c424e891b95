"""The import graph of specee, read from the source with `ast`: data flows one way, from the CLI
and the server down to the model; nothing below the engine imports it; only the CLI and the
server import the CLI or the server; and no import cycle.

Function-level imports are edges like module-level ones, in the cycle check too: deferring an
import into a function hides a cycle from the interpreter, not from the design (the two modules
still need each other), and the package has none to hide."""
import ast
import graphlib
from pathlib import Path

import specee

PACKAGE = Path(specee.__file__).parent
# Each layer, from the top; a module sits in the first layer naming it or a package holding it.
LAYERS = [
    ("specee", "specee.cli", "specee.__main__", "specee.eval", "specee.train", "specee.deploy"),  # the tools
    ("specee.cluster",),  # the server on Ray Serve replicas; the CLI and a Ray Serve config start it
    ("specee.server",),  # the HTTP face of the engine; the CLI starts it, it never calls back up
    ("specee.batch",),  # generations of the engine sharing passes
    ("specee.engine",),
    ("specee.strategies.builder",),  # one strategy from a decoding configuration
    ("specee.strategies",),  # every decoding loop, and the configuration they are built from
    ("specee.drafters", "specee.exits"),  # what drafts, and the exit policy's parts
    # What the engine loads and keeps: trained artifacts (their modules above register the loaders),
    # models, earlier prompts' K/V.
    ("specee.artifact_store", "specee.loader", "specee.prefix_cache"),
    ("specee.verification", "specee.grammar"),  # the grammar masks verification rows and prunes drafts
    ("specee.model", "specee.sampling", "specee.tokenizer", "specee.text_stream", "specee.stats",
     "specee.artifact_header", "specee.bundled", "specee.registry", "specee.options"),
]
USER_FACING = ("specee.cli", "specee.__main__", "specee.server", "specee.cluster", "specee.deploy")
ON_THE_ENGINE = ("specee", "specee.engine", "specee.batch", "specee.eval", "specee.train", *USER_FACING)


def within(module: str, names: tuple[str, ...]) -> bool:
    """`module` is one of `names` or inside one of those packages (the package root only as itself)."""
    return any(module == name or (name != "specee" and module.startswith(name + ".")) for name in names)


def layer_of(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if within(module, names))


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The specee modules `path` imports anywhere in its body (relative imports resolved)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from . import sibling` imports the sibling module; other names come from the module `base`.
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, root, set(paths)) for name, path in paths.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def imports_of_the_user_facing(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, dep) for module, deps in graph.items() if not within(module, USER_FACING)
                  for dep in deps if within(dep, USER_FACING))


def imports_of_the_engine_from_below(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, dep) for module, deps in graph.items() if not within(module, ON_THE_ENGINE)
                  for dep in deps if within(dep, ON_THE_ENGINE))


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, dep) for module, deps in graph.items() for dep in deps if layer_of(dep) < layer_of(module))


def test_the_import_graph_has_no_cycle():
    cycle = cycle_in(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_only_the_cli_and_the_server_import_the_cli_or_the_server():
    assert not imports_of_the_user_facing(import_graph())


def test_no_module_below_the_engine_imports_it_or_what_is_above_it():
    assert not imports_of_the_engine_from_below(import_graph())


def test_no_module_imports_a_layer_above_its_own():
    assert not upward_imports(import_graph())


def test_the_graph_sees_what_the_engine_imports():
    assert {"specee.strategies.builder", "specee.loader", "specee.model.cache"} <= import_graph()["specee.engine"]


def test_the_checks_find_a_cycle_and_imports_that_go_up(tmp_path):
    """The graph reader finds relative, absolute and function-level imports, so the tests above can fail."""
    root = tmp_path / "specee"
    for package in ("strategies", "server"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "strategies" / "a.py").write_text("from . import b\n")
    (root / "strategies" / "b.py").write_text("def f():\n    from specee.strategies.a import x\n    from ..engine import E\n")
    (root / "server" / "app.py").write_text("")
    (root / "engine.py").write_text("from .server.app import app\n")
    graph = import_graph(root)
    assert graph["specee.strategies.b"] == {"specee.strategies.a", "specee.engine"}
    assert set(cycle_in(graph)) == {"specee.strategies.a", "specee.strategies.b"}
    assert imports_of_the_user_facing(graph) == [("specee.engine", "specee.server.app")]
    assert imports_of_the_engine_from_below(graph) == [("specee.strategies.b", "specee.engine")]
    assert upward_imports(graph) == [("specee.engine", "specee.server.app"), ("specee.strategies.b", "specee.engine")]
