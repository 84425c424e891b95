"""Data flows one way: cli/eval/train -> server -> engine -> decoding -> drafters -> verification -> model.
A module may import its own layer and the layers below it, never one above."""
import ast
from pathlib import Path

import pytest

import specee

PACKAGE = Path(specee.__file__).parent
# Each layer, from the top; a module's layer is the first whose prefix its name starts with.
LAYERS = [
    ("cli", "eval", "train"),
    ("server",),  # the HTTP face of the engine; the CLI starts it, it never calls back up
    ("engine",),
    ("exits.builder", "exits.autoregressive", "exits.speculative"),  # exit strategies: the loops with exits
    ("decoding", "loader", "artifact_store"),
    ("drafters", "exits"),
    ("verification",),
    ("model", "sampling", "tokenizer", "text_stream", "stats", "artifact_header"),
]


def layer_of(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if any(module == n or module.startswith(n + ".") for n in names))


def imports_of(path: Path) -> set[str]:
    """specee modules imported by a file (relative imports resolved), as dotted names below specee."""
    here = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level])
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("specee."):
                target = node.module.removeprefix("specee.")
            else:
                continue
            found.add(target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("specee.") for a in node.names if a.name.startswith("specee.")}
    return {name for name in found if name}


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path):
    own = layer_of(".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    above = [name for name in imports_of(path) if layer_of(name) < own]
    assert not above, f"{path.name} imports {above}, which sit above it"


def test_the_layer_map_sees_the_imports():
    """Guards the test itself: it finds the engine's imports of the layers below."""
    found = imports_of(PACKAGE / "engine.py")
    assert {"decoding.builder", "loader", "model.cache"} <= found


def test_the_server_sits_under_the_cli_and_over_the_engine():
    assert layer_of("cli") < layer_of("server.app") < layer_of("engine")
    assert "engine" in imports_of(PACKAGE / "server" / "scheduler.py")
