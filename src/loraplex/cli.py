"""The `loraplex` command: it only wires the parts together."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from loraplex.bench.cli import app as bench_app
from loraplex.registry.cli import app as registry_app
from loraplex.server.auth import read_admin_token
from loraplex.server.cli import serve
from loraplex.server.serve import StartupError, make_dir, read_option_file
from loraplex.sim.cli import plan, simulate

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Serve one base LLM with many LoRA adapters.")
app.add_typer(registry_app, name="registry")
app.add_typer(bench_app, name="bench")
app.command()(serve)
app.command()(simulate)
app.command()(plan)


@app.command()
def demo(
    dir: Optional[Path] = typer.Option(None, "--dir", help="Where the demo world is built (default: a cache dir)."),
    serve: bool = typer.Option(False, "--serve", help="Keep serving the demo until Ctrl-C."),
    max_loras: int = typer.Option(3, "--max-loras", help="Adapter slots (fewer than adapters, so the cache works)."),
) -> None:
    """Build the demo world if needed, serve it to three tenants and check every answer."""
    from loraplex.demo.run import run_demo

    if dir is not None:
        _or_exit_2(make_dir, dir, "--dir")
    raise typer.Exit(run_demo(dir, serve=serve, max_loras=max_loras))


@app.command()
def router(
    worker: list[str] = typer.Option(..., "--worker", help="A worker's base URL; repeat for each worker."),
    policy: str = typer.Option("affinity", "--policy", help="affinity | round-robin | least-loaded | pure-affinity"),
    admin_token_file: Optional[Path] = typer.Option(None, "--admin-token-file",
                                                   help="Admin token: reads workers' /admin/state, guards /admin."),
    registry: Optional[str] = typer.Option(None, "--registry", help="Registry URL for tenant priorities."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port", help="0 picks a free port and prints it."),
    metrics_token_file: Optional[Path] = typer.Option(None, "--metrics-token-file",
                                                      help="Token /metrics requires (no file: /metrics is open)."),
) -> None:
    """Route requests to the worker that has their adapter, until it is saturated."""
    from loraplex.router.serve import serve_router

    token = _or_exit_2(read_option_file, read_admin_token, admin_token_file, "--admin-token-file")
    metrics_token = _or_exit_2(read_option_file, read_admin_token, metrics_token_file, "--metrics-token-file")
    raise typer.Exit(serve_router(worker, policy, token, registry, host, port, metrics_token))


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
