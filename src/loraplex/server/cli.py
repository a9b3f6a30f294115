"""The `serve` command, made from its settings (`loraplex.settings.serve`); `python -m
loraplex.server.cli --model DIR ...` runs it alone."""

from __future__ import annotations

import sys

import typer

from loraplex.server.serve import StartupError, preflight, run
from loraplex.settings.command import add_settings_command
from loraplex.settings.serve import ENV_PREFIX, ServeSettings


def serve(settings: ServeSettings) -> None:
    """Serve the OpenAI-compatible API over one base model and its adapters."""
    try:
        run(settings)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


def check(settings: ServeSettings) -> None:
    """What serve checks before it writes, binds or loads: a problem is one line and exit 2."""
    try:
        preflight(settings)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


def add_serve(app: typer.Typer) -> None:
    add_settings_command(app, ServeSettings, serve, "serve", ENV_PREFIX, check=check)


if __name__ == "__main__":
    alone = typer.Typer(add_completion=False)
    add_serve(alone)
    alone(prog_name="loraplex serve")
