"""Every command's help: each option and argument has a help text and a placeholder a person can
read (FILE, N, URL; never typer's `<str>` or `<list[Path]>`), arguments listed as arguments."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from loraplex.cli import app

ROOT = typer.main.get_command(app)


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = [path for path, _ in _commands(ROOT)]


def _command(path):
    command = ROOT
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "loraplex")
def test_every_option_and_argument_has_help(path):
    command = _command(path)
    undocumented = [
        p.name
        for p in command.params
        if not getattr(p, "hidden", False) and not (getattr(p, "help", None) or "").strip()
    ]
    assert undocumented == []
    if getattr(command, "commands", None) is None:
        assert (command.help or "").strip(), "the command itself has no help"


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "loraplex")
def test_placeholders_are_readable(path):
    text = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output
    assert not re.findall(r"<[a-z][\w\[\], ]*>", text), text
    assert "{" not in text.split("\n", 1)[0], text  # the usage line: NAME, not {NAME}


def test_arguments_are_listed_as_arguments():
    text = CliRunner().invoke(app, ["rollout", "start", "--help"]).output
    assert text.splitlines()[0].endswith("rollout start [OPTIONS] NAME REVISION")
    arguments = text.split("\nArguments:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in arguments] == ["NAME", "REVISION"]
    assert "The adapter name" in arguments[0]
