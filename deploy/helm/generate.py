"""Write what is derived from the chart: the plain manifests in deploy/kubernetes/ (the chart
rendered with the InferencePool on) and the values table in docs/deploy.md (from
values.schema.json and values.yaml).

    python deploy/helm/generate.py          # rewrite them
    python deploy/helm/generate.py --check  # exit 1 naming each file that is out of date

Needs `helm-python-sdk` (the `test` extra): Helm's own template engine, offline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "loraplex"
MANIFESTS = ROOT / "deploy" / "kubernetes"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
RELEASE = "loraplex"
MANIFEST_VALUES = {"inferencePool": {"enabled": True}}
WHOLE = {"worker.serve", "worker.hostCache", "workerGroups[].serve"}
"""Objects of many keys that the table gives one row (`serve`'s: docs/operator-guide.md)."""
TABLE_START, TABLE_END = "<!-- values-table:start -->", "<!-- values-table:end -->"


def render(values: dict | None = None, release: str = RELEASE) -> dict[str, str]:
    """The chart's templates rendered by Helm: file name -> text (empty ones left out)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=release, namespace="default", is_install=True)
    return {
        Path(path).name: text
        for path, text in sorted(out.items())
        if path.endswith(".yaml") and text.strip()
    }


def manifest_files() -> dict[Path, str]:
    """deploy/kubernetes/'s files as the chart renders them."""
    header = (
        "# Rendered from deploy/helm/loraplex (release loraplex, inferencePool.enabled=true) by\n"
        "# `python deploy/helm/generate.py`: edit the chart, then run it.\n"
    )
    return {
        MANIFESTS / name: header + text.lstrip("-\n")
        for name, text in render(MANIFEST_VALUES).items()
    }


def _leaves(schema: dict, values, prefix: str = ""):
    """(dotted key, schema, default) for each documented value, depth first in schema order;
    the objects of WHOLE are one row each, a list of objects a row per key of its items."""
    props, dotted = schema.get("properties"), prefix.rstrip(".")
    closed = schema.get("additionalProperties") is False
    if props and isinstance(values, dict) and closed and dotted not in WHOLE:
        for key, sub in props.items():
            yield from _leaves(sub, values.get(key), f"{prefix}{key}.")
    elif "description" in schema:
        yield dotted, schema, values
    items = schema.get("items", {})
    if items.get("additionalProperties") is False:  # no defaults: an item's keys are its own
        yield from _leaves(items, ITEM, f"{dotted}[].")


class _Item(dict):
    """The values of a list's item: every key without a default."""

    def get(self, key, default=None):
        return self


ITEM = _Item()


def _type(schema: dict) -> str:
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "anyOf" in schema:
        return "quantity"
    kind = schema.get("type", "object")
    return kind if isinstance(kind, str) else " \\| ".join(kind)


def _default(value) -> str:
    if value is ITEM:
        return "-"
    if value in ("", None):
        return '`""`' if value == "" else "-"
    text = json.dumps(value, separators=(", ", ": ")) if not isinstance(value, str) else value
    return f"`{text}`"


def values_table() -> str:
    """The Markdown table of every value: key, type, default, description."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, sub, default in _leaves(schema, values):
        if key == "global":
            continue
        description = sub["description"].replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(sub)} | {_default(default)} | {description} |")
    return "\n".join(rows)


def deploy_doc() -> str:
    """docs/deploy.md with the values table between its markers replaced by values_table()."""
    text = DEPLOY_DOC.read_text()
    head, _, rest = text.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{values_table()}\n{TABLE_END}{tail}"


def derived_files() -> dict[Path, str]:
    return {**manifest_files(), DEPLOY_DOC: deploy_doc()}


def stale_files() -> list[Path]:
    """Derived files that differ from what the chart gives, and manifests it no longer has."""
    want = derived_files()
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    return stale + [p for p in sorted(MANIFESTS.glob("*.yaml")) if p not in want]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        stale = stale_files()
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run python deploy/helm/generate.py)")
        return 1 if stale else 0
    for path in sorted(MANIFESTS.glob("*.yaml")):
        path.unlink()
    for path, text in derived_files().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
