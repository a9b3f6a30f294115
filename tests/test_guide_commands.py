"""Each `loraplex ...` command line in the guides' code blocks still parses: its subcommands exist,
its `--help` answers, and every option it names is an option of that command or of a group above
it (a synopsis with `[...]` or `a|b` alternatives is left out)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from loraplex.cli import app

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP = typer.main.get_command(app)


def _command_lines(path: Path) -> list[str]:
    """The `loraplex ...` lines of the file's fenced code blocks, continuations joined."""
    lines, block, pending = [], False, ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("```"):
            block, pending = not block, ""
            continue
        if not block:
            continue
        text = pending + raw.strip().removeprefix("$ ")
        pending = text[:-1] + " " if text.endswith("\\") else ""
        if not pending and text.startswith("loraplex "):
            lines.append(text)
    return lines


def _words(line: str) -> list[str] | None:
    line = re.split(r"\s#\s|\s\|\s", line)[0]
    if re.search(r"\[|\.\.\.|\w\|\w|<", line):  # a synopsis, not a command
        return None
    return shlex.split(line)[1:]


COMMANDS = [
    pytest.param(words, id=f"{path.name}: {' '.join(words)[:60]}")
    for path in GUIDES
    for line in _command_lines(path)
    if (words := _words(line))
]


@pytest.mark.parametrize("words", COMMANDS)
def test_a_guides_command_parses(words):
    command, path, options = TOP, [], set()
    rest = list(words)
    while hasattr(command, "commands"):
        options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        while rest and rest[0].startswith("-"):  # a group's own options and their values
            flag = rest.pop(0)
            if "=" not in flag and rest and not rest[0].startswith("-"):
                rest.pop(0)
        if not rest:  # the top's own option (`loraplex --version`)
            break
        name = rest.pop(0)
        if name not in command.commands:  # `rollout NAME REV` is `rollout start NAME REV`
            name, rest = "start", [name, *rest]
        command = command.commands[name]
        path.append(name)
    options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    unknown = [w.split("=")[0] for w in words if w.startswith("--")]
    assert [o for o in unknown if o not in options] == []
    assert CliRunner().invoke(app, [*path, "--help"]).exit_code == 0


def test_the_guides_have_commands_to_check():
    assert len(COMMANDS) > 30
