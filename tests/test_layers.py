"""Imports go one way: no module of src/loraplex imports, even for its type hints alone, a module
that imports it back through any chain."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "loraplex"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The loraplex modules `path` imports (a name imported from a package counts as its module
    when it is one, else as the package)."""
    name, out = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{head}.{base}" if base else head
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return (out & modules) - {name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def graph_of(paths: list[Path]) -> dict[str, set[str]]:
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) for p in paths}


def test_no_module_imports_one_that_imports_it_back():
    assert circles(graph_of(sorted(PACKAGE.rglob("*.py")))) == []


def test_the_check_finds_a_circle_through_type_hints_alone(tmp_path):
    global PACKAGE
    package, PACKAGE = PACKAGE, tmp_path / "loraplex"
    try:
        (PACKAGE / "a").mkdir(parents=True)
        (PACKAGE / "__init__.py").write_text("")
        (PACKAGE / "a" / "__init__.py").write_text("")
        (PACKAGE / "a" / "one.py").write_text("from loraplex.a.two import Two\n")
        (PACKAGE / "a" / "two.py").write_text(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .one import One\n"
        )
        (PACKAGE / "b.py").write_text("from loraplex.a import one\n")
        found = circles(graph_of(sorted(PACKAGE.rglob("*.py"))))
    finally:
        PACKAGE = package
    assert found == [["loraplex.a.one", "loraplex.a.two"]]
