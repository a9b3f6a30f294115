"""`loraplex bench serve`: the load generator from the command line (mounted by loraplex.cli as
`bench`).

    loraplex bench serve --url http://127.0.0.1:8000 --workload zipf --adapters sql,support \\
        --clients 8 --json out.json
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from loraplex.loadgen import traffic
from loraplex.outputs import unwritable
from loraplex.settings.command import PlainTyper, add_settings_command
from loraplex.settings.loadgen import ENV_PREFIX, BenchServeSettings
from loraplex.sim import workload as workloads
from loraplex.tables import print_table


def load_trace(trace: Path | None, workload: str | None, seed: int) -> list[workloads.Request]:
    """The requests of `--trace FILE` or `--workload NAME`; a BadParameter that says what is
    wrong."""
    if (trace is None) == (workload is None):
        raise typer.BadParameter("give one of --trace FILE or --workload NAME")
    if trace is not None:
        try:
            return workloads.read_trace(trace)
        except workloads.TraceError as exc:  # names the file and the line
            raise typer.BadParameter(str(exc), param_hint="--trace") from None
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"{trace}: {exc}", param_hint="--trace") from None
    try:
        return workloads.named(workload, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload") from None


def tenant_keys(path: Path | None) -> dict[str, str]:
    """tenant -> key from a `TENANT KEY` file (the first key of a tenant wins)."""
    if path is None:
        return {}
    from loraplex.server.auth import read_key_pairs

    try:
        pairs = read_key_pairs(path)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--api-keys") from None
    keys: dict[str, str] = {}
    for tenant, key in pairs:
        keys.setdefault(tenant, key)
    return keys


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def results_table(summary: dict, title: str) -> Table:
    """A row overall and one per tier seen: n, then TTFT, TPOT and e2e p50/p95/p99 in ms."""
    table = Table(title=title)
    table.add_column("tier")
    table.add_column("n", justify="right")
    for metric in ("TTFT", "TPOT", "e2e"):
        for q in traffic.PERCENTILES:
            table.add_column(f"{metric} p{q}" if q == 50 else f"p{q}", justify="right")
    for tier, lat in summary["latency"].items():
        cells = [
            _ms(lat[key][f"p{q}"])
            for key in ("ttft_ms", "tpot_ms", "e2e_ms")
            for q in traffic.PERCENTILES
        ]
        table.add_row(tier, str(lat["n"]), *cells)
        if tier == "all":
            table.add_section()
    return table


def summary_lines(summary: dict) -> list[str]:
    t = summary["throughput"]
    rate, storage_rate = summary["cold_start_rate"], summary["storage_load_rate"]
    cold = "-" if rate is None else f"{100 * rate:.1f}%"
    storage = "-" if storage_rate is None else f"{100 * storage_rate:.1f}%"
    errors = ", ".join(f"{code} ×{n}" for code, n in summary["errors"].items()) or "none"
    lines = [
        (
            f"{summary['ok']}/{summary['requests']} ok in {summary['duration_s']:.1f} s: "
            f"{t['requests_per_s'] or 0:.2f} req/s, {t['output_tokens_per_s'] or 0:.1f} output "
            "tok/s"
        ),
        (
            f"cold starts (adapter not in a gpu slot on arrival): {summary['cold_starts']} "
            f"({cold}), of which "
            "from disk or remote (as loraplex plan and loraplex_cold_starts_total count): "
            f"{summary['storage_loads']} "
            f"({storage}); tier unknown: {summary['tiers']['unknown']}"
        ),
        f"errors: {errors}",
    ]
    if "404" in summary["errors"]:
        lines.append(
            "hint: 404 is an unknown model name; map the trace onto the served adapters with "
            "--adapters"
        )
    lag = summary["send_lag_ms"]["p99"]
    if summary["config"]["mode"] == "open" and lag is not None and lag > 100:
        lines.append(
            f"note: requests left late (p99 {lag:.0f} ms after their trace time): the load "
            "generator itself is a bottleneck"
        )
    return lines


def _progress(console: Console, total: int) -> tuple[Progress, Callable[[traffic.Record], None]]:
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "ok {task.fields[ok]} · errors {task.fields[errors]} · cold {task.fields[cold]}"
        ),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task("requests", total=total, ok=0, errors=0, cold=0)
    counts = {"ok": 0, "errors": 0, "cold": 0}

    def on_record(record: traffic.Record) -> None:
        counts["ok" if record.ok else "errors"] += 1
        counts["cold"] += record.ok and record.tier in traffic.COLD_TIERS
        progress.update(task, advance=1, **counts)

    return progress, on_record


def serve(s: BenchServeSettings) -> None:
    """Replay a trace against a server or router over the OpenAI API and report latency by cache
    tier."""
    console, err = Console(), Console(stderr=True, soft_wrap=True)  # an error line kept whole
    problem = s.json is not None and unwritable(s.json)
    if problem:
        err.print(f"error: --json {s.json}: {problem}", markup=False, highlight=False)
        raise typer.Exit(2)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=120)  # piped to a file: keep the table's rows on one line each
    requests = traffic.prepare_trace(
        load_trace(s.trace, s.workload, s.seed),
        duration_s=s.duration,
        limit=s.limit,
        adapters=list(s.adapters),
        max_prompt_tokens=s.max_prompt_tokens,
        max_output_tokens=s.max_output_tokens,
    )
    if not requests:
        raise typer.BadParameter("the trace has no requests to send")
    try:
        config = traffic.LoadConfig(
            url=s.url,
            clients=s.clients,
            time_scale=s.time_scale,
            base_model=s.base_model,
            api_key=s.api_key,
            tenant_keys=tenant_keys(s.api_keys),
            prompt_unit=s.prompt_unit,
            timeout_s=s.timeout,
        )
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    progress, on_record = _progress(err, len(requests))
    try:
        with progress:
            summary = traffic.run(config, requests, on_record, s.per_request)
    except traffic.LoadError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    summary["trace"] = {
        "source": str(s.trace) if s.trace else s.workload,
        "seed": None if s.trace else s.seed,
        "requests": len(requests),
    }
    loop = (
        f"open loop, time ×{s.time_scale:g}"
        if s.clients is None
        else f"closed loop, {s.clients} clients"
    )
    print_table(results_table(summary, f"bench serve: {config.url}, {loop} (ms)"))
    for line in summary_lines(summary):
        console.print(line, markup=False, highlight=False)
    if s.json is not None:
        s.json.parent.mkdir(parents=True, exist_ok=True)
        s.json.write_text(json.dumps(summary, indent=1) + "\n")
        console.print(f"json: {s.json}", markup=False, highlight=False)


app = PlainTyper(
    add_completion=False,
    no_args_is_help=True,
    help="Load generation against running servers.",
)
app.callback()(lambda: None)  # a group even with one command: `bench serve`, not `bench`
add_settings_command(app, BenchServeSettings, serve, "serve", ENV_PREFIX)

if __name__ == "__main__":
    app()
