"""`--fair-share`, `--kv-prefix-blocks`, `--system-prompt-tokens` and `--router` (of `simulate` and
`plan`): the simulation's options they set, and the tables they add to `simulate` (each tenant's
TTFT; the fleet's prefix-cache hit rate)."""

from __future__ import annotations

import typer
from rich.table import Table

from loraplex.settings.sim import PlanSettings, SimulateSettings


def routing_check(s: SimulateSettings) -> None:
    """One line on stderr and exit 2 for a `--routing` the simulation does not run with the other
    flags."""
    if s.routing != "router" and (s.engine != "native" or s.pool):
        typer.echo(
            f"error: --routing {s.routing}: one pool of native-engine workers only", err=True
        )
        raise typer.Exit(2)
    if s.fair_share and s.routing != "router":
        typer.echo(f"error: --fair-share: --routing router only, not {s.routing}", err=True)
        raise typer.Exit(2)


def sharing_options(s: SimulateSettings | PlanSettings) -> dict:
    """The `SimConfig` fields these flags set (none of them given: none); one line on stderr and
    exit 2 for an engine the simulation does not run them on."""
    if (s.fair_share or s.kv_prefix_blocks) and s.engine != "native":
        typer.echo("error: --fair-share and --kv-prefix-blocks: --engine native only", err=True)
        raise typer.Exit(2)
    options: dict = {}
    if s.router != "affinity":
        options["router"] = s.router
    if s.fair_share:
        options.update(fair_share=True, tenant_weights=s.tenant_weights)
        options["holdback_window_s"] = s.holdback_window_s
    if s.kv_prefix_blocks:
        options["kv_prefix_blocks"] = s.kv_prefix_blocks
    return options


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def sharing_tables(runs: list[dict]) -> list[Table]:
    """Per tenant, its TTFT and admission wait (with fair share or prefixes); per run and policy,
    the fleet's prefix-cache hit rate (with prefixes)."""
    entries = [(run, name, e) for run in runs for name, e in run["policies"].items()]
    shared = [x for x in entries if "fair_share" in x[2] or "prefix_cache" in x[2]]
    if not shared:
        return []
    tenants = Table(
        title="per tenant",
        caption="TTFT and wait from arrival at the router (its wait in the router's fair queue "
        "counted); waited: its requests granted a worker after waiting their turn at the router; "
        "held back: its requests that waited while a free place was kept for another tenant",
    )
    columns = ("workload", "policy", "tenant", "requests", "TTFT p50", "TTFT p99", "wait p99")
    for col in (*columns, "waited", "held back"):
        tenants.add_column(
            col, justify="left" if col in ("workload", "policy", "tenant") else "right"
        )
    for run, name, e in shared:
        fair = e.get("fair_share", {})
        granted, held = fair.get("granted"), fair.get("held_back")
        for tenant, t in e["tenants"].items():
            tenants.add_row(
                run["workload"].rsplit("/", 1)[-1],
                name,
                tenant,
                f"{t['requests']:,}",
                _ms(t["ttft_s"]["p50"]),
                _ms(t["ttft_s"]["p99"]),
                _ms(t["queue_wait_s"]["p99"]),
                "-" if granted is None else f"{granted.get(tenant, 0):,}",
                "-" if held is None else f"{held.get(tenant, 0):,}",
            )
    tables = [tenants]
    prefixed = [x for x in shared if "prefix_cache" in x[2]]
    if prefixed:
        tables.append(_prefix_table(prefixed))
    return tables


def _prefix_table(entries: list[tuple[dict, str, dict]]) -> Table:
    table = Table(
        title="prefix cache",
        caption="hit: prompt tokens found in the worker's KV cache over those prefilled "
        "(vLLM's prefix_cache_hits / prefix_cache_queries), fleet-wide",
    )
    for col in ("workload", "policy", "prefix hit", "tokens", "TTFT p50", "TTFT p99"):
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for run, name, e in entries:
        p, lat = e["prefix_cache"], e["latency"]["all"]["ttft_s"]
        table.add_row(
            run["workload"].rsplit("/", 1)[-1],
            name,
            f"{100 * p['hit_rate']:.1f}%",
            f"{p['queries']:,}",
            _ms(lat["p50"]),
            _ms(lat["p99"]),
        )
    return table
