"""`loraplex registry` commands over a name's traffic, revisions and access: promote, traffic,
rollback, deprecate, quarantine, keep, delete, pin, unpin, grant, ungrant, audit."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from loraplex.registry.cli.common import (
    JsonFlag,
    NameArg,
    RevisionArg,
    TenantArg,
    app,
    errors,
    open_registry,
    print_json,
)
from loraplex.registry.errors import RegistryError
from loraplex.registry.records import AdapterRecord
from loraplex.tables import is_piped, print_table


def _traffic_line(adapter: AdapterRecord) -> str:
    return f"{adapter.name}: " + (
        " ".join(f"{rev} {w}%" for rev, w in adapter.traffic) or "no traffic"
    )


@app.command()
@errors
def promote(
    ctx: typer.Context,
    name: NameArg,
    revision: RevisionArg,
    weight: Annotated[
        int,
        typer.Option(metavar="PERCENT", help="Percent of traffic; 100 makes it stable"),
    ] = 100,
    force: Annotated[
        bool, typer.Option("--force", help="Promote without running its eval set")
    ] = False,
):
    """Give a revision a share of the traffic (canary) or all of it (stable)."""
    typer.echo(_traffic_line(open_registry(ctx).promote(name, revision, weight, force=force)))


@app.command()
@errors
def traffic(
    ctx: typer.Context,
    name: NameArg,
    weights: Annotated[
        list[str], typer.Argument(metavar="REV=PERCENT...", help="The split, summing to 100")
    ],
):
    """Set the whole traffic split of a name at once."""
    try:
        plan = {rev: int(w) for rev, _, w in (item.partition("=") for item in weights)}
    except ValueError:
        raise RegistryError(f"weights must be REV=PERCENT, got {' '.join(weights)}") from None
    typer.echo(_traffic_line(open_registry(ctx).set_traffic(name, plan)))


@app.command()
@errors
def rollback(ctx: typer.Context, name: NameArg):
    """Drop the canary, or go back to the previous stable revision."""
    typer.echo(_traffic_line(open_registry(ctx).rollback(name)))


@app.command()
@errors
def deprecate(
    ctx: typer.Context,
    name: NameArg,
    revision: Annotated[
        str | None,
        typer.Argument(metavar="REVISION", help="The revision (none: the whole name)"),
    ] = None,
):
    """Deprecate a revision that serves no traffic, or without REVISION the whole name."""
    typer.echo(_traffic_line(open_registry(ctx).deprecate(name, revision)))


@app.command()
@errors
def quarantine(
    ctx: typer.Context,
    name: NameArg,
    revision: RevisionArg,
    reason: Annotated[
        str, typer.Option(metavar="TEXT", help="Why (kept with the revision)")
    ] = "quarantined by operator",
):
    """Never serve a revision again; its traffic goes back to the stable revision."""
    typer.echo(_traffic_line(open_registry(ctx).quarantine(name, revision, reason)))


@app.command()
@errors
def keep(
    ctx: typer.Context,
    name: NameArg,
    count: Annotated[str, typer.Argument(metavar="K", help="A number, or none (every revision)")],
):
    """Keep the newest K revisions of a name servable; older ones are retired now and at each
    promotion."""
    value = None if count == "none" else _count(count)
    registry = open_registry(ctx)
    before = [r.revision for r in registry.show(name).revisions]
    after = {r.revision for r in registry.set_keep(name, value).revisions}
    retired = [r for r in before if r not in after]
    kept = "every revision" if value is None else f"the newest {value} revisions"
    typer.echo(f"{name}: keeps {kept}" + (f"; retired {', '.join(retired)}" if retired else ""))


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise RegistryError(f"K must be a number or none, got {text!r}") from None


@app.command()
@errors
def delete(ctx: typer.Context, name: NameArg, revision: RevisionArg):
    """Retire a revision now: never served again, its artifact left to `gc`. Refused for the
    stable revision, one in a split or a rollout under way, and a quarantined one."""
    open_registry(ctx).delete_revision(name, revision)
    typer.echo(f"{name}@{revision}: retired")


@app.command()
@errors
def pin(
    ctx: typer.Context,
    name: NameArg,
    tier: Annotated[
        str, typer.Option(metavar="gpu|cpu", help="gpu (a slot) or cpu (host memory)")
    ] = "cpu",
):
    """Keep an adapter resident in a tier of the caches (servers pin it there at next start)."""
    open_registry(ctx).pin(name, tier=tier)
    typer.echo(f"{name}: pinned in {tier}")


@app.command()
@errors
def unpin(ctx: typer.Context, name: NameArg):
    """Let an adapter be evicted again (servers follow at next start)."""
    open_registry(ctx).unpin(name)
    typer.echo(f"{name}: unpinned")


@app.command()
@errors
def grant(ctx: typer.Context, name: NameArg, tenant: TenantArg):
    """Let another tenant use an adapter."""
    open_registry(ctx).grant(name, tenant)
    typer.echo(f"{name}: granted to {tenant}")


@app.command()
@errors
def ungrant(ctx: typer.Context, name: NameArg, tenant: TenantArg):
    """Take back another tenant's use of an adapter."""
    open_registry(ctx).revoke_grant(name, tenant)
    typer.echo(f"{name}: grant to {tenant} revoked")


@app.command()
@errors
def audit(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Option(metavar="NAME", help="Only this adapter")] = None,
    limit: Annotated[int, typer.Option(min=1, metavar="N", help="The newest N events")] = 50,
    json_out: JsonFlag = False,
):
    """Who changed what, when (newest first)."""
    events = open_registry(ctx).audit_events(limit, target=name)
    if json_out:
        print_json([e.to_dict() for e in events])
        return
    table = Table(title="audit events")
    for column in ("id", "at", "actor", "action", "target", "detail"):
        table.add_column(column)
    for e in events:
        table.add_row(
            str(e.id),
            e.at.isoformat() if is_piped() else e.at.strftime("%Y-%m-%d %H:%M:%S"),
            e.actor,
            e.action,
            e.target,
            json.dumps(e.detail, sort_keys=True),
        )
    print_table(table)
