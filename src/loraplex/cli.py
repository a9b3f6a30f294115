"""The `loraplex` command: it only wires the parts together."""

from __future__ import annotations

from pathlib import Path

import typer

from loraplex.loadgen.cli import app as bench_app
from loraplex.registry.cli import app as registry_app
from loraplex.server.auth import read_admin_token
from loraplex.server.cli import serve
from loraplex.server.serve import StartupError, make_dir, read_option_file
from loraplex.sim.cli import plan, simulate

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Serve one base LLM with many LoRA adapters."
)
app.add_typer(registry_app, name="registry")
app.add_typer(bench_app, name="bench")
app.command()(serve)
app.command()(simulate)
app.command()(plan)


@app.command()
def demo(
    dir: Path | None = typer.Option(
        None, "--dir", help="Where the demo world is built (default: a cache dir)."
    ),
    serve: bool = typer.Option(False, "--serve", help="Keep serving the demo until Ctrl-C."),
    max_loras: int = typer.Option(
        3, "--max-loras", help="Adapter slots (fewer than adapters, so the cache works)."
    ),
) -> None:
    """Build the demo world if needed, serve it to three tenants and check every answer."""
    if dir is not None:
        _or_exit_2(make_dir, dir, "--dir")
    from loraplex.demo.run import run_demo  # torch: after the check, so a bad --dir fails at once

    raise typer.Exit(run_demo(dir, serve=serve, max_loras=max_loras))


ROUTING, TIMING = "Routing", "Polling and timeouts"
ROUTER_WEIGHTS = {
    "affinity": "w_affinity",
    "queue": "w_queue",
    "tokens": "w_tokens",
    "evictions": "w_evictions",
}


@app.command()
def router(
    worker: list[str] = typer.Option(
        ..., "--worker", help="A worker's base URL; repeat for each worker."
    ),
    policy: str = typer.Option(
        "affinity", "--policy", help="affinity | round-robin | least-loaded | pure-affinity"
    ),
    admin_token_file: Path | None = typer.Option(
        None, "--admin-token-file", help="Admin token: reads workers' /admin/state, guards /admin."
    ),
    registry: str | None = typer.Option(
        None, "--registry", help="Registry URL for tenant priorities."
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port", help="0 picks a free port and prints it."),
    metrics_token_file: Path | None = typer.Option(
        None, "--metrics-token-file", help="Token /metrics requires (no file: /metrics is open)."
    ),
    saturation_waiting: int = typer.Option(
        5,
        help="A worker with more requests waiting than this is saturated (affinity gives way)",
        rich_help_panel=ROUTING,
    ),
    saturation_kv_usage: float = typer.Option(
        0.8, help="...or with more of its KV cache in use than this share", rich_help_panel=ROUTING
    ),
    score_weights: str | None = typer.Option(
        None,
        help="NAME=W,...: affinity (1), queue (0.5), tokens (0.2), evictions (0.2)",
        rich_help_panel=ROUTING,
    ),
    load_factor: float = typer.Option(
        1.25,
        help="Bounded-load hashing: a cold adapter's worker carries up to this x mean load",
        rich_help_panel=ROUTING,
    ),
    shed_priority_below: int = typer.Option(
        0,
        help="When every worker is saturated, tenants below this priority get 429",
        rich_help_panel=ROUTING,
    ),
    poll_interval_s: float = typer.Option(
        0.5, help="Seconds between polls of each worker's state", rich_help_panel=TIMING
    ),
    stale_after_s: float = typer.Option(
        2.0,
        help="A worker's state older than this is not used for affinity",
        rich_help_panel=TIMING,
    ),
    poll_timeout_s: float = typer.Option(
        2.0, help="A poll slower than this marks the worker out", rich_help_panel=TIMING
    ),
    request_timeout_s: float = typer.Option(
        300.0, help="Longest wait for a worker's answer (504 beyond)", rich_help_panel=TIMING
    ),
) -> None:
    """Route requests to the worker that has their adapter, until it is saturated."""
    from loraplex.router.picker import PickerConfig
    from loraplex.router.serve import serve_router

    token = _or_exit_2(read_option_file, read_admin_token, admin_token_file, "--admin-token-file")
    metrics_token = _or_exit_2(
        read_option_file, read_admin_token, metrics_token_file, "--metrics-token-file"
    )
    weights = _or_exit_2(_router_weights, score_weights or "")
    timings = {
        "--poll-interval-s": poll_interval_s,
        "--stale-after-s": stale_after_s,
        "--poll-timeout-s": poll_timeout_s,
        "--request-timeout-s": request_timeout_s,
    }
    for flag, value in timings.items():
        if not value > 0:
            _or_exit_2(_refuse, f"{flag} {value}: must be positive")
    try:
        picker = PickerConfig(
            max_waiting=saturation_waiting,
            max_kv_usage=saturation_kv_usage,
            load_factor=load_factor,
            shed_priority_below=shed_priority_below,
            **weights,
        )
    except ValueError as exc:
        _or_exit_2(_refuse, _router_flags(str(exc)))
    timing = {
        "poll_s": poll_interval_s,
        "stale_s": stale_after_s,
        "poll_timeout_s": poll_timeout_s,
        "request_timeout_s": request_timeout_s,
    }
    raise typer.Exit(
        serve_router(
            worker, policy, token, registry, host, port, metrics_token, picker=picker, **timing
        )
    )


def _router_flags(message: str) -> str:
    """PickerConfig's message with its field names written as the router's flags."""
    flags = (
        ("max_waiting", "--saturation-waiting"),
        ("max_kv_usage", "--saturation-kv-usage"),
        ("load_factor", "--load-factor"),
        ("the score weights", "--score-weights"),
    )
    for field, flag in flags:
        message = message.replace(field, flag)
    return message


def _router_weights(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name.strip() not in ROUTER_WEIGHTS:
            raise StartupError(
                f"--score-weights {part!r}: expected NAME=WEIGHT, NAME one of "
                f"{', '.join(ROUTER_WEIGHTS)}"
            )
        try:
            out[ROUTER_WEIGHTS[name.strip()]] = float(value)
        except ValueError:
            raise StartupError(f"--score-weights {part!r}: {value!r} is not a number") from None
    return out


def _refuse(message: str):
    raise StartupError(message)


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
