"""The `loraplex` command: it only wires the parts together."""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import typer

from loraplex.loadgen.cli import app as bench_app
from loraplex.registry import RegistryError
from loraplex.registry.cli import app as registry_app
from loraplex.rollout.cli import app as rollout_app
from loraplex.server.auth import read_admin_token
from loraplex.server.cli import add_serve
from loraplex.server.serve import StartupError, make_dir, read_option_file
from loraplex.settings.command import PlainTyper, add_settings_command
from loraplex.settings.placement import ENV_PREFIX as PLACEMENT_ENV
from loraplex.settings.placement import PlacementSettings
from loraplex.settings.router import ENV_PREFIX as ROUTER_ENV
from loraplex.settings.router import RouterSettings
from loraplex.sim.cli import add_sim_commands

app = PlainTyper(
    no_args_is_help=True,
    add_completion=False,
    help="Serve one base LLM with many LoRA adapters.",
)
app.add_typer(registry_app, name="registry")
app.add_typer(bench_app, name="bench")
app.add_typer(rollout_app, name="rollout")
add_sim_commands(app)


def _print_version(given: bool) -> None:
    if given:
        typer.echo(f"loraplex {version('loraplex')}")
        raise typer.Exit()


@app.callback()
def main_options(
    _: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print loraplex's version and exit.",
    ),
) -> None:
    """The options of `loraplex` itself, before a command."""


@app.command()
def demo(
    dir: Path | None = typer.Option(
        None, "--dir", metavar="DIR", help="Where the demo world is built (default: a cache dir)."
    ),
    serve: bool = typer.Option(False, "--serve", help="Keep serving the demo until Ctrl-C."),
    max_loras: int = typer.Option(
        3,
        "--max-loras",
        metavar="N",
        help="Adapter slots (fewer than adapters, so the cache works).",
    ),
) -> None:
    """Build the demo world if needed, serve it to three tenants and check every answer."""
    if dir is not None:
        _or_exit_2(make_dir, dir, "--dir")
    from loraplex.demo.run import run_demo  # torch: after the check, so a bad --dir fails at once

    raise typer.Exit(run_demo(dir, serve=serve, max_loras=max_loras))


def router(settings: RouterSettings) -> None:
    """Route requests to the worker that has their adapter, until it is saturated."""
    from loraplex.router.serve import serve_router

    token = _or_exit_2(
        read_option_file, read_admin_token, settings.admin_token_file, "--admin-token-file"
    )
    metrics_token = _or_exit_2(
        read_option_file, read_admin_token, settings.metrics_token_file, "--metrics-token-file"
    )
    try:
        code = serve_router(settings, token, metrics_token)
    except RegistryError as exc:  # the registry is read, never made: a missing one is named
        typer.echo(f"error: --registry: {exc}", err=True)
        raise typer.Exit(2) from None
    sys.exit(code)


def placement(settings: PlacementSettings) -> None:
    """Keep each hot adapter warm on a bounded set of workers, from the fleet's demand; drain a
    worker before it leaves. One active controller at a time (a lease in the registry)."""
    from loraplex.placement.cli import run_placement

    token = _or_exit_2(
        read_option_file, read_admin_token, settings.admin_token_file, "--admin-token-file"
    )
    if token is None:
        typer.echo("error: --admin-token-file is required (the workers' admin API)", err=True)
        raise typer.Exit(2)
    try:
        code = run_placement(settings, token)
    except RegistryError as exc:  # the registry is read, never made: a missing one is named
        typer.echo(f"error: --registry: {exc}", err=True)
        raise typer.Exit(2) from None
    sys.exit(code)


@app.command()
def drain(
    url: str = typer.Option(
        ..., "--url", metavar="URL", help="The worker's URL (where its admin API answers)."
    ),
    admin_token_file: Path = typer.Option(
        ..., "--admin-token-file", metavar="FILE", help="The admin token, on the file's first line."
    ),
    timeout: float = typer.Option(
        30.0, "--timeout", metavar="S", min=0.0, help="How long to wait for the drain."
    ),
) -> None:
    """Drain a worker before it stops (the chart's preStop hook): the router sends it no new
    request and the placement controller moves what it placed there; returns once the worker says
    it is drained (exit status 3 when it is not within --timeout)."""
    from loraplex.placement.drain import DrainError, drain_worker

    token = _or_exit_2(read_option_file, read_admin_token, admin_token_file, "--admin-token-file")
    try:
        drained = drain_worker(url.rstrip("/"), token or "", timeout)
    except DrainError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{url} {'drained' if drained else 'still draining'}")
    if not drained:
        raise typer.Exit(3)


@app.command()
def publish(
    directory: Path = typer.Argument(..., metavar="DIR", help="The adapter directory."),
    name: str = typer.Option(
        ..., "--name", metavar="NAME", help="The adapter name it becomes a revision of."
    ),
    url: str = typer.Option(..., "--url", metavar="URL", help="The server's URL (its admin API)."),
    admin_token_file: Path = typer.Option(
        ...,
        "--admin-token-file",
        metavar="FILE",
        help="The admin token, on the file's first line.",
    ),
    stable: bool = typer.Option(False, "--stable", help="All of the name's traffic at once."),
    keep: int | None = typer.Option(
        None, "--keep", metavar="K", help="The name keeps its newest K revisions servable."
    ),
    revision: str | None = typer.Option(
        None, "--revision", metavar="REVISION", help="Its label (default: next rN)."
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Return once every worker of the name's pool holds it."
    ),
    wait_timeout: float = typer.Option(
        60.0, "--wait-timeout", metavar="S", min=0.001, help="How long --wait waits."
    ),
) -> None:
    """Upload an adapter directory to a server (no shared file system) and register it as a
    revision; prints NAME@REVISION and its digest, and with --wait a line per worker (exit status
    3 when one is not ready)."""
    from loraplex.client import Publisher, PublishError

    token = _or_exit_2(read_option_file, read_admin_token, admin_token_file, "--admin-token-file")
    if not directory.is_dir():
        typer.echo(f"error: {directory}: not a directory", err=True)
        raise typer.Exit(2)
    try:
        with Publisher(url, token) as publisher:
            done = publisher.publish_dir(
                name,
                directory,
                stable=stable,
                keep=keep,
                revision=revision,
                wait=wait,
                wait_timeout_s=wait_timeout,
            )
    except PublishError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
        typer.echo(f"error: {url}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{done.model} {done.digest}")
    if done.cutover is not None:
        for w in done.cutover.workers:
            state = f"ready {w.tier}" if w.ready else f"not-ready {w.error}"
            typer.echo(f"{w.worker} {state} {w.seconds:.3f}s")
        if not done.cutover.ready:
            raise typer.Exit(3)


add_serve(app)
add_settings_command(app, RouterSettings, router, "router", ROUTER_ENV)
add_settings_command(app, PlacementSettings, placement, "placement", PLACEMENT_ENV)


def _or_exit_2(check, *args):
    """`check(*args)`; a StartupError is one line on stderr and exit code 2, as `serve` does."""
    try:
        return check(*args)
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
