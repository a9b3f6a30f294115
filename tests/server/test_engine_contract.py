"""The server programs against the engine contract: no module of `server/` but the factory
(`server/engines.py`) imports an engine's package."""

from __future__ import annotations

import ast
from pathlib import Path

import loraplex.server

SERVER = Path(loraplex.server.__file__).parent
ENGINE_PACKAGES = ("loraplex.engines.native", "loraplex.engines.vllm")


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_factory_imports_the_engines():
    importers = {
        path.name
        for path in SERVER.glob("*.py")
        if any(name.startswith(ENGINE_PACKAGES) for name in _imported(path))
    }
    assert importers == {"engines.py"}
