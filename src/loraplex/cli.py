"""The `loraplex` command: it only wires the parts together."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from loraplex.registry.cli import app as registry_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Serve one base LLM with many LoRA adapters.")
app.add_typer(registry_app, name="registry")


@app.command()
def demo(
    dir: Optional[Path] = typer.Option(None, "--dir", help="Where the demo world is built (default: a cache dir)."),
    max_loras: int = typer.Option(4, "--max-loras", help="Adapter slots (fewer than adapters, so the cache works)."),
) -> None:
    """Build the demo world if needed and show many adapters answering in one continuous batch."""
    from loraplex.demo.run import run_demo

    raise typer.Exit(run_demo(dir, max_loras=max_loras))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
