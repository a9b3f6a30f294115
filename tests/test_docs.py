"""The docs (README.md, docs/*.md) and the docstrings and comments of src/ point only inside the
repository, and every package path and module they name exists in the tree."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "loraplex"

OUTSIDE = re.compile(r"(?<![\w./])\.\./[\w.-]+(?:/|\.[A-Za-z]+\b)|\]\(\.\./")
"""A path or a Markdown link that climbs out of the repository (`../x/y`, `../x.md`); `../name`
alone is a name, such as the hostile model name `../upper` that reliability.md lists."""
NAMED_OUTSIDE = re.compile(r"(?<![\w/.-])shared/|ARCHITECTURE\.md")
"""Files that sit beside the repository on a development machine, never in a package."""
SRC_PATH = re.compile(r"src/loraplex/[\w./{},-]*")
MODULE = re.compile(r"(?<![\w./-])loraplex(?:\.\w+)+")
DIRS = r"[a-z_][a-z0-9_]*(?:/[a-z_][a-z0-9_]*)*"
CODE_PATH = re.compile(rf"`({DIRS}/(?:[a-z_][\w-]*\.[a-z]+)?)`")
"""A tree name in a code span: `engines/native/`, `registry/catalog.py`, `bench/`, `docs/x.md`."""
PY_PATH = re.compile(r"(?<![\w./<>$~-])((?:[a-z_][a-z0-9_]*/)+[a-z_]\w*\.py)\b")
"""A Python file named with its folder anywhere in the text: `engines/native/client.py`."""
NOT_TREE_PATHS = {
    "vllm/": "vLLM's own source files, which vllm-notes.md cites",
    "trl/": "TRL's own source files, which rl-publishing.md cites",
    "sha256/": "the artifact store's directory on a server's disk (registry.md)",
}


def documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(PACKAGE.rglob("*.py")),
    ]


def prose(path: Path) -> str:
    """A guide's text; a module's docstrings (standalone strings) and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    parts = [
        node.value.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    parts += [t.string for t in tokens if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def bases(path: Path) -> tuple[Path, ...]:
    """Where a relative tree name resolves: the document's own folder (a guide's `img/`, a
    module's neighbours), the package, and the repository's root (bench/, tests/, deploy/, ...)."""
    return (path.parent, PACKAGE, ROOT)


def problems(text: str, roots: tuple[Path, ...]) -> list[str]:
    """What in `text` points outside the repository or names a path or module the tree lacks."""
    found = [f"points outside the repository: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    found += [
        f"names a file outside the repository: {m.group(0)}" for m in NAMED_OUTSIDE.finditer(text)
    ]
    for m in SRC_PATH.finditer(text):
        for path in expand(m.group(0).rstrip(".,")):
            if not (ROOT / path).exists():
                found.append(f"no such path: {path}")
    found += [
        f"no such module: {m.group(0)}"
        for m in MODULE.finditer(text)
        if not module_exists(m.group(0))
    ]
    names = [m.group(1) for m in (*CODE_PATH.finditer(text), *PY_PATH.finditer(text))]
    for name in names:
        if not name.startswith(tuple(NOT_TREE_PATHS)) and not any(
            (r / name).exists() for r in roots
        ):
            found.append(f"no such path: {name}")
    return found


def expand(path: str) -> list[str]:
    """`src/loraplex/{a,b/c}/` → `src/loraplex/a/`, `src/loraplex/b/c/`."""
    m = re.fullmatch(r"(.*?)\{([^{}]*)\}(.*)", path)
    if m is None:
        return [path]
    head, choices, tail = m.groups()
    return [p for choice in choices.split(",") for p in expand(head + choice + tail)]


def module_exists(dotted: str) -> bool:
    """`loraplex.a.b.Name`: each part a package, then a module (the rest its attributes) or a name
    the package's `__init__.py` defines."""
    here = PACKAGE
    for part in dotted.split(".")[1:]:
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            return True
        init = here / "__init__.py"
        return init.is_file() and re.search(rf"\b{part}\b", init.read_text()) is not None
    return True


def test_docs_and_source_comments_point_inside_the_repository_at_names_that_exist():
    found = [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in documents()
        for problem in problems(prose(path), bases(path))
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "The design: `../shared/ARCHITECTURE.md`.",
        "see [the map](../shared/map.md)",
        "the interfaces are in ARCHITECTURE.md",
        "src/loraplex/{engine,cache}/",
        "`src/loraplex/bench/`",
        "`loraplex.engine.llm_engine`",
        "`loraplex.residency.NativeResidency`",
        "the step loop (`engine/`)",
        "# the client (engine/client.py) starts it",
        "`registry/no_such_module.py`",
    ],
)
def test_the_check_finds(text):
    assert problems(text, (PACKAGE, ROOT))


@pytest.mark.parametrize(
    "text",
    [
        "hostile names: `../upper`, `upper/../../etc/passwd`, `s3://`",
        "src/loraplex/{engines/native,residency,sim}/ and src/loraplex/cli.py.",
        "`loraplex.sim.workload.Request`, `loraplex.engines.native`",
        "`registry/catalog.py`, `engines/native/`, `server/listing.py`, `bench/`, `docs/cache.md`",
        "`meta-llama/Llama-3.1-8B-Instruct`, `bench/results/*.cuda*.json`, `<data-dir>/cache/`",
        "vLLM's `vllm/lora/model_manager.py`, the store's `sha256/` directory",
    ],
)
def test_the_check_passes(text):
    assert problems(text, (PACKAGE, ROOT)) == []


def layout_entries() -> list[tuple[Path, str]]:
    """The README's layout block as (folder it is relative to, name): the indented lines under
    `src/loraplex/` name the package's parts, the others the repository's."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout\n\n```\n", 1)[1].split("```", 1)[0]
    entries = []
    for line in block.splitlines():
        names, base = line.strip().split("  ")[0], PACKAGE if line.startswith(" ") else ROOT
        entries += [(base, name) for name in names.split(", ")]
    return entries


def test_the_readme_layout_names_every_package_and_only_what_exists():
    entries = layout_entries()
    assert (ROOT, "src/loraplex/") in entries
    missing = [f"{name} ({base.name})" for base, name in entries if not (base / name).exists()]
    assert not missing, missing
    named = [name for base, name in entries if base == PACKAGE]
    packages = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    unnamed = [p for p in packages if not any(n.startswith(f"{p}/") for n in named)]
    assert not unnamed, f"README.md's layout does not name {unnamed}"
