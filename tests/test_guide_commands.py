"""Each `loraplex ...` command line in the guides' code blocks still parses: its subcommands exist,
its `--help` answers, and every option it names is an option of that command or of a group above
it. A synopsis (`[...]`, `a|b` alternatives, `...`) and a command named in the text (`loraplex
registry pin|unpin`) are checked as far as they go: each command and option they name exists."""

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


# Spans in the text that name loraplex but are no command line: a log line, benchmark labels.
NOT_COMMANDS = {
    "loraplex serving NAME on http://HOST:PORT",
    "loraplex --engine vllm",
    "loraplex --engine vllm (plugin active)",
    "loraplex native engine",
}


SHELL = {"kubectl", "grep", "jq", "head", "tail", "sort", "tee", "xargs", "less", "wc"}


def _named(path: Path) -> list[str]:
    """The `loraplex ...` spans of the text and the code blocks' lines `_words` leaves out."""
    spans = [
        " ".join(m.replace("\\|", "|").split())
        for m in re.findall(r"`(loraplex [^`]+)`", path.read_text())
    ]
    blocks = [line for line in _command_lines(path) if _words(line) is None]
    return [text for text in spans + blocks if text not in NOT_COMMANDS]


NAMED = [
    pytest.param(text, id=f"{path.name}: {text[:60]}") for path in GUIDES for text in _named(path)
]


@pytest.mark.parametrize("text", NAMED)
def test_each_command_and_option_a_guide_names_exists(text):
    first, *rest = re.split(r"\s#\s", text)[0].split(" | ")
    words, alternatives = first.split()[1:], []
    for part in rest:
        if part.split()[0] in SHELL:  # a pipe: the rest is another program's
            break
        if part.startswith("-"):  # `[--trace FILE | --workload NAME]`: the same command's
            words += part.split()
        else:  # `init | add DIR | list`: another command of the same group
            alternatives.append(part.split())
    group = _check(words)[:-1]
    for part in alternatives:
        assert part[0] in _command(group).commands, f"{part[0]!r} is no command of {group}"
        _check([*group, *part])


def _check(words: list[str]) -> list[str]:
    """Walk the command path `words` name, asserting each command and option they name exists and
    each command's --help answers; the path (the first of `a|b` alternatives)."""
    words = [w.strip("[]") for w in words if w.strip("[].")]
    named = {w.split("=")[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*(=\S*)?", w)}
    paths, options = [[]], {"--help"}
    while words:
        groups = [_command(path) for path in paths]
        if not all(hasattr(g, "commands") for g in groups):
            break
        params = {o: p for g in groups for p in g.params for o in (*p.opts, *p.secondary_opts)}
        options |= set(params)
        word = words.pop(0)
        if word.startswith("-"):  # a group's option, and its value
            param = params.get(word.split("=")[0])
            if param is not None and not param.is_flag and "=" not in word and words:
                words.pop(0)
            continue
        names = [n for n in word.split("|") if n]
        if any(n not in g.commands for g in groups for n in names):
            assert all(n.isupper() for n in names) or paths == [["rollout"]], (
                f"{word!r} is no command of loraplex {' '.join(paths[0])}"
            )
            if paths == [["rollout"]]:  # `rollout NAME REV` is `rollout start NAME REV`
                paths = [["rollout", "start"]]
            break
        paths = [[*path, n] for path in paths for n in names]
    for path in paths:
        command = _command(path)
        options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        assert CliRunner().invoke(app, [*path, "--help"]).exit_code == 0
    assert sorted(named - options) == []
    return paths[0]


def _command(path: list[str]):
    command = TOP
    for name in path:
        command = command.commands[name]
    return command


def test_every_guide_that_names_a_command_has_it_checked():
    top = "|".join(TOP.commands)
    for path in GUIDES:
        if re.search(rf"\bloraplex ({top})\b", path.read_text()):
            assert _named(path) or any(_words(line) for line in _command_lines(path)), path.name
