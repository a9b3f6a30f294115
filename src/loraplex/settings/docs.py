"""The settings tables of the docs, made from the settings models: `python -m
loraplex.settings.docs`, run in the repository's root, rewrites each table between its markers and
the Helm chart's schema of `worker.serve` (`loraplex.settings.schema`); `--check` fails when one
differs (as the drift tests do).

A table's place in a guide is two lines, the first naming the command and the panel:

    <!-- settings: serve / Engine -->
    <!-- end settings -->
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from loraplex.settings import loadgen, placement, rollout, router, serve, sim
from loraplex.settings.command import default_text, metavar_of
from loraplex.settings.fields import settings_of
from loraplex.settings.schema import stale_chart_schema


@dataclass(frozen=True)
class Documented:
    command: str
    model: type
    env_prefix: str
    guide: str
    """The guide holding its tables, relative to the repository root."""


COMMANDS = (
    Documented("serve", serve.ServeSettings, serve.ENV_PREFIX, "docs/operator-guide.md"),
    Documented("router", router.RouterSettings, router.ENV_PREFIX, "docs/router.md"),
    Documented("placement", placement.PlacementSettings, placement.ENV_PREFIX, "docs/scale-out.md"),
    Documented("simulate", sim.SimulateSettings, sim.SIMULATE_ENV, "docs/capacity-planning.md"),
    Documented("plan", sim.PlanSettings, sim.PLAN_ENV, "docs/capacity-planning.md"),
    Documented("bench serve", loadgen.BenchServeSettings, loadgen.ENV_PREFIX, "docs/loadgen.md"),
    Documented("rollout start", rollout.RolloutSettings, rollout.ENV_PREFIX, "docs/registry.md"),
    Documented(
        "rollout replay", rollout.ReplaySettings, rollout.REPLAY_ENV_PREFIX, "docs/registry.md"
    ),
)
BLOCK = re.compile(r"(<!-- settings: (.+?) / (.+?) -->\n)(.*?)(<!-- end settings -->)", re.S)


def table(doc: Documented, panel: str) -> str:
    rows = [
        "| flag | environment | default | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for s in settings_of(doc.model):
        if s.spec.panel != panel:
            continue
        if s.is_flag:
            flag = f"{s.flag}`, `--no-{s.flag[2:]}"
        else:
            flag = f"{s.flag} {s.spec.metavar or metavar_of(s)}"
        cells = (
            f"`{flag}`",
            f"`{s.env(doc.env_prefix)}`",
            default_text(s),
            s.spec.doc or s.spec.help,
        )
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def render(text: str, by_command: dict[str, Documented]) -> str:
    """The guide's text with every settings table made anew."""

    def fill(m: re.Match) -> str:
        doc = by_command.get(m[2])
        if doc is None:
            raise ValueError(f"a settings table names no known command: {m[2]!r}")
        panels = {s.spec.panel for s in settings_of(doc.model)}
        if m[3] not in panels:
            raise ValueError(f"{m[2]} has no settings panel {m[3]!r}: {', '.join(sorted(panels))}")
        return m[1] + table(doc, m[3]) + m[5]

    return BLOCK.sub(fill, text)


def stale_guides(root: Path, write: bool) -> list[str]:
    """The guides whose tables differ from the models (rewritten when `write`)."""
    by_command = {d.command: d for d in COMMANDS}
    stale = []
    for guide in sorted({d.guide for d in COMMANDS}):
        path = root / guide
        text = path.read_text()
        made = render(text, by_command)
        if made != text:
            stale.append(guide)
            if write:
                path.write_text(made)
    return stale


def main(argv: list[str]) -> int:
    root = Path.cwd()
    missing = sorted({d.guide for d in COMMANDS if not (root / d.guide).is_file()})
    if missing:
        print(f"{root}: no {missing[0]}: run this in the repository's root", file=sys.stderr)
        return 2
    check = "--check" in argv
    stale = stale_guides(root, write=not check) + stale_chart_schema(root, write=not check)
    for guide in stale:
        verb = "differs from the settings models" if check else "rewritten"
        print(f"{guide}: {verb}", file=sys.stderr)
    if check and stale:
        print("run: python -m loraplex.settings.docs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
