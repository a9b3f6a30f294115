"""`loraplex registry` commands over adapters: init, add, list, import, show."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from loraplex.artifacts import canonical_digest
from loraplex.registry.bulk import ImportRefused, read_directory, read_jsonl
from loraplex.registry.cli.common import (
    JsonFlag,
    NameArg,
    app,
    errors,
    open_registry,
    print_json,
)
from loraplex.registry.db import SCHEMA_VERSION
from loraplex.registry.records import AdapterRecord
from loraplex.registry.signing import load_private_key, sign_digest
from loraplex.registry.stats import revision_stats
from loraplex.tables import is_piped, print_line, print_table


def _short(digest: str) -> str:
    """The digest's first 12 hex digits on a terminal; whole when piped."""
    return digest if is_piped() else digest.removeprefix("sha256:")[:12]


def _when(at) -> str:
    return at.isoformat() if is_piped() else at.strftime("%Y-%m-%d %H:%M")


def _revisions_table(adapter: AdapterRecord) -> Table:
    table = Table(title=f"{adapter.name}: revisions")
    for column in (
        "revision",
        "status",
        "traffic %",
        "digest",
        "rank",
        "modules",
        "est. bytes",
        "created",
    ):
        table.add_column(column)
    for r in adapter.revisions:
        status = f"{r.status} ({r.status_reason})" if r.status_reason else r.status
        table.add_row(
            r.revision,
            status,
            str(r.traffic_weight or ""),
            _short(r.digest),
            str(r.rank),
            ",".join(r.target_modules),
            f"{r.estimated_bytes:,}",
            _when(r.created_at),
        )
    return table


@app.command()
@errors
def init(ctx: typer.Context):
    """Create the registry database (idempotent)."""
    registry = open_registry(ctx, create=True)
    registry.init()
    typer.echo(
        f"registry ready at {ctx.obj.url} (schema version {SCHEMA_VERSION}); artifacts in "
        f"{ctx.obj.store}"
    )


_Revision = Annotated[
    str | None, typer.Option(metavar="REVISION", help="Revision label (default: r1, r2, ...)")
]
_Shared = Annotated[
    bool, typer.Option("--shared", help="Usable by every tenant (default without --tenant)")
]
_BaseModel = Annotated[
    Path | None, typer.Option(metavar="DIR", help="Base model directory to validate against")
]
_Stable = Annotated[
    bool, typer.Option("--stable", help="Serve it at once (100% of the name's traffic)")
]
_EvalSet = Annotated[
    Path | None,
    typer.Option(
        metavar="FILE",
        help="JSONL of {prompt, expected|contains} cases a promotion runs (docs/registry.md)",
    ),
]
_Signature = Annotated[
    str | None, typer.Option(metavar="ed25519:BASE64", help="Signature over the digest")
]
_SigningKey = Annotated[
    Path | None, typer.Option(metavar="FILE", help="Sign with this ed25519 private key (PEM)")
]
_Digest = Annotated[
    str | None,
    typer.Option(metavar="sha256:HEX", help="Refuse unless the files hash to this digest"),
]
_Keep = Annotated[
    int | None,
    typer.Option(
        metavar="K",
        help="The name keeps its newest K revisions servable; older ones are retired at each "
        "promotion (default: as it was, at first every revision)",
    ),
]
_StrictBase = Annotated[
    bool,
    typer.Option(
        help="Refuse an adapter whose config names another base model (default: a warning)"
    ),
]


@app.command()
@errors
def add(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="PEFT adapter directory")],
    name: Annotated[str, typer.Option(metavar="NAME", help="Adapter name")],
    revision: _Revision = None,
    tenant: Annotated[str | None, typer.Option(metavar="TENANT", help="Owner tenant")] = None,
    shared: _Shared = False,
    base_model: _BaseModel = None,
    warm: Annotated[
        str | None,
        typer.Option(
            metavar="gpu|cpu|on_demand",
            help="Keep it resident in a tier of the caches, or load it on demand (default)",
        ),
    ] = None,
    priority: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="A number kept with the adapter and shown by list and show (default 0); the "
            "caches rank by the tenant's priority (tenant add --priority)",
        ),
    ] = None,
    stable: _Stable = False,
    eval_set: _EvalSet = None,
    signature: _Signature = None,
    signing_key: _SigningKey = None,
    digest: _Digest = None,
    strict_base_model_name: _StrictBase = False,
    keep: _Keep = None,
    json_out: JsonFlag = False,
):
    """Validate an adapter against the base model and register it as a new revision."""
    ctx.obj.check_reachable_store()
    if signing_key is not None:
        signature = sign_digest(canonical_digest(directory), load_private_key(signing_key))
    registry = open_registry(ctx)
    registry.registration.strict_base_model_name = strict_base_model_name
    record = registry.add_revision(
        directory,
        name,
        revision=revision,
        tenant=tenant,
        shared=True if shared else None,
        base_model_dir=base_model,
        warm_policy=warm,
        priority=priority,
        status="stable" if stable else "staging",
        eval_set=eval_set,
        signature=signature,
        digest=digest,
        keep=keep,
    )
    _note_copy(ctx)
    if json_out:
        print_json(record.to_dict())
        return
    typer.echo(
        f"added {record.model_id} {record.digest} (rank {record.rank}, {record.estimated_bytes:,} "
        f"bytes, {record.status})"
    )


def _note_copy(ctx: typer.Context) -> None:
    note = ctx.obj.remote_copy_note()
    if note:
        typer.echo(note, err=True)


_Retired = Annotated[bool, typer.Option("--retired", help="Count and show retired revisions too")]
STATUSES = ("staging", "canary", "stable", "deprecated", "quarantined", "retired")


@app.command("list")
@errors
def list_(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Option(metavar="TENANT", help="Only what this tenant may use")
    ] = None,
    status: Annotated[
        str | None,
        typer.Option(
            metavar="STATUS",
            help="Only adapters with a revision in this status: " + " | ".join(STATUSES),
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="At most this many (one page), by name"),
    ] = None,
    after: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help="Those named after this (the last name of the page before)"
        ),
    ] = None,
    retired: _Retired = False,
    json_out: JsonFlag = False,
):
    """Adapters, their traffic split and owners, by name."""
    if status is not None and status not in STATUSES:
        typer.echo(f"error: --status {status}: give one of {', '.join(STATUSES)}", err=True)
        raise typer.Exit(2)
    adapters = open_registry(ctx).list_adapters(
        tenant, status=status, after=after, limit=limit, retired=retired
    )
    if json_out:
        print_json([a.to_dict() for a in adapters])
        return
    table = Table(title="adapters")
    for column in ("name", "traffic", "revisions", "owner", "access", "warm", "priority", "pinned"):
        table.add_column(column)
    for a in adapters:
        traffic = " ".join(f"{rev}:{w}%" for rev, w in a.traffic) or "-"
        access = "shared" if a.shared else ",".join(a.allowed_tenants)
        table.add_row(
            a.name,
            traffic,
            str(len(a.revisions)),
            a.owner_tenant or "-",
            access,
            a.warm_policy,
            str(a.priority),
            a.pin_tier or "",
        )
    print_table(table)
    if limit is not None and len(adapters) == limit:
        typer.echo(f"more may follow: --after {adapters[-1].name}")


@app.command("import")
@errors
def import_(
    ctx: typer.Context,
    source: Annotated[
        Path,
        typer.Argument(
            metavar="FILE|DIR",
            help="JSONL file (one object a line: path, name, and any of revision, tenant, shared, "
            "warm, priority, stable, digest, signature, eval_set, keep) or a directory of adapter "
            "directories (each named by its directory)",
        ),
    ],
    tenant: Annotated[
        str | None,
        typer.Option(metavar="TENANT", help="Owner tenant of each (unless its line says)"),
    ] = None,
    shared: Annotated[bool, typer.Option("--shared", help="Usable by every tenant")] = False,
    stable: Annotated[
        bool, typer.Option("--stable", help="Serve each at once (100% of its name's traffic)")
    ] = False,
    base_model: _BaseModel = None,
    json_out: JsonFlag = False,
):
    """Register many adapters in one go, each checked as `add` checks it, all before any is
    recorded (a bad one: nothing is), then recorded in a few transactions."""
    ctx.obj.check_reachable_store()
    defaults: dict = {"tenant": tenant, "stable": stable}
    if shared:
        defaults["shared"] = True
    registry = open_registry(ctx)
    started = time.perf_counter()
    try:
        if source.is_dir():
            items = read_directory(source, defaults)
        else:
            items = read_jsonl(source, defaults)
        result = registry.add_revisions(items, base_model_dir=base_model)
    except ImportRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    seconds = time.perf_counter() - started
    _note_copy(ctx)
    if json_out:
        print_json([r.to_dict() for r in result.records])
        return
    rate = len(result.records) / seconds if seconds > 0 else 0.0
    typer.echo(
        f"imported {len(result.records)} adapters ({result.num_new} new revisions) in "
        f"{seconds:.1f} s ({rate:,.0f}/s)"
    )


@app.command()
@errors
def show(
    ctx: typer.Context,
    name: NameArg,
    audit_log: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Server audit log (JSONL): per-revision stats"),
    ] = None,
    retired: _Retired = False,
    json_out: JsonFlag = False,
):
    """One adapter: its revisions (the retired ones with --retired), with --audit-log its
    requests, errors, TTFT/TPOT per revision."""
    adapter = open_registry(ctx).show(name, retired)
    stats = revision_stats(audit_log, name) if audit_log else []
    if json_out:
        print_json({**adapter.to_dict(), "stats": [s.to_dict() for s in stats]})
        return
    access = (
        "shared with every tenant"
        if adapter.shared
        else f"tenants {', '.join(adapter.allowed_tenants)}"
    )
    pinned = f", pinned in {adapter.pin_tier}" if adapter.pinned else ""
    keep = f", keeps the newest {adapter.keep}" if adapter.keep is not None else ""
    print_line(
        f"[bold]{adapter.name}[/bold]  owner {adapter.owner_tenant or '-'}, {access}; warm "
        f"{adapter.warm_policy}, priority {adapter.priority}{pinned}{keep}"
    )
    print_table(_revisions_table(adapter))
    if audit_log:
        print_table(_stats_table(name, stats))


def _stats_table(name: str, stats) -> Table:
    table = Table(title=f"{name}: requests by revision (audit log)")
    for column in (
        "revision",
        "requests",
        "error rate",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
    ):
        table.add_column(column)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for s in stats:
        table.add_row(
            s.revision,
            str(s.requests),
            f"{s.error_rate:.1%}",
            fmt(s.ttft_p50_ms),
            fmt(s.ttft_p99_ms),
            fmt(s.tpot_p50_ms),
            fmt(s.tpot_p99_ms),
        )
    return table
