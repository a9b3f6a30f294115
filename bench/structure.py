"""The tree's structure figures, from its source (AST only, nothing imported):

    python bench/structure.py [--root src/loraplex] [--json OUT]

- the classes with the most methods, counting the ones they inherit from the tree's own classes
  (Protocols are left out, as bases and as classes);
- the files over 600 lines;
- the functions over 60 lines and over 100.

Import circles are `tests/test_layers.py`'s to find.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

FILE_LINES, FUNCTION_LINES, FUNCTION_LINES_MAX = 600, 60, 100


class Klass:
    """A class as its module defines it; its bases by qualified name (`module.Class`)."""

    def __init__(self, node: ast.ClassDef, module: str, names: dict[str, str]):
        self.name = f"{module}.{node.name}"
        bases = [ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases]
        self.is_protocol = any(b.split(".")[-1] == "Protocol" for b in bases)
        self.methods = {
            n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        self.bases = [names.get(b, f"{module}.{b}") for b in bases]


def scan(root: Path) -> tuple[dict[str, Klass], list[tuple[int, str]], list[tuple[int, str]]]:
    classes: dict[str, Klass] = {}
    files, functions = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        rel = str(path.relative_to(root.parent))
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        if (lines := len(text.splitlines())) > FILE_LINES:
            files.append((lines, rel))
        names = {
            a.asname or a.name: f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    functions.append((length, f"{rel}:{node.name}"))
            elif isinstance(node, ast.ClassDef):
                klass = Klass(node, module, names)
                classes[klass.name] = klass
    return classes, files, functions


def methods_of(klass: Klass, classes: dict[str, Klass], seen: frozenset = frozenset()) -> set:
    """Its methods and those of its bases in the tree."""
    out = set(klass.methods)
    for base in klass.bases:
        found = classes.get(base)
        if found is not None and base not in seen and not found.is_protocol:
            out |= methods_of(found, classes, seen | {klass.name})
    return out


def figures(root: Path, top: int = 8) -> dict:
    classes, files, functions = scan(root)
    counted = sorted(
        ((len(methods_of(k, classes)), name) for name, k in classes.items() if not k.is_protocol),
        reverse=True,
    )
    return {
        "largest_classes": [{"class": name, "methods": n} for n, name in counted[:top]],
        "files_over_600": [{"file": f, "lines": n} for n, f in sorted(files, reverse=True)],
        "functions_over_60": [
            {"function": f, "lines": n} for n, f in sorted(functions, reverse=True)
        ],
        "functions_over_100": sum(n > FUNCTION_LINES_MAX for n, _ in functions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).parents[1] / "src" / "loraplex")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = figures(args.root)
    print("class (methods, inherited counted)")
    for row in result["largest_classes"]:
        print(f"  {row['methods']:4d}  {row['class']}")
    print(f"files over {FILE_LINES} lines: {len(result['files_over_600'])}")
    for row in result["files_over_600"]:
        print(f"  {row['lines']:4d}  {row['file']}")
    print(
        f"functions over {FUNCTION_LINES} lines: {len(result['functions_over_60'])} "
        f"(over {FUNCTION_LINES_MAX}: {result['functions_over_100']})"
    )
    for row in result["functions_over_60"]:
        print(f"  {row['lines']:4d}  {row['function']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
