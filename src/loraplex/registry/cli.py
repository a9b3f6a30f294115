"""`loraplex registry ...`: the operator's commands over the registry (a typer sub-app)."""

from __future__ import annotations

import functools
import getpass
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from loraplex.artifacts import ArtifactError, ArtifactStore, canonical_digest
from loraplex.model_config import ModelConfigError
from loraplex.registry.bulk import ImportRefused, read_directory, read_jsonl
from loraplex.registry.db import SCHEMA_VERSION
from loraplex.registry.errors import AdapterRejected, RegistryError
from loraplex.registry.records import AdapterRecord
from loraplex.registry.registry import Registry, check_tenant_limits, default_store_for
from loraplex.registry.signing import (
    generate_keypair,
    load_private_key,
    load_public_key,
    sign_digest,
)
from loraplex.registry.stats import revision_stats
from loraplex.settings.command import PLAIN
from loraplex.units import parse_size

# Help in click's plain layout (PLAIN): rich's tables cut long option names when piped or narrow.
app = typer.Typer(
    name="registry",
    help="Adapters, revisions, rollouts, tenants and keys.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=PLAIN,
)
tenant_app = typer.Typer(help="Tenants.", no_args_is_help=True, rich_markup_mode=PLAIN)
key_app = typer.Typer(
    help="API keys (stored hashed; a new key is printed once).",
    no_args_is_help=True,
    rich_markup_mode=PLAIN,
)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "loraplex"


@dataclass(frozen=True)
class CliOptions:
    url: str
    store: Path
    storage_base: str | None
    trusted_keys: tuple[Path, ...]
    max_lora_rank: int

    def open(self) -> Registry:
        keys = tuple(load_public_key(p) for p in self.trusted_keys)
        return Registry(
            self.url,
            ArtifactStore(self.store),
            max_lora_rank=self.max_lora_rank,
            trusted_keys=keys,
            storage_base=self.storage_base,
            actor=getpass.getuser(),
        )


@app.callback()
def main(
    ctx: typer.Context,
    registry: Annotated[
        str | None, typer.Option(help="Database URL (default: sqlite:///DATA_DIR/registry.db)")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data directory (default: ~/.local/share/loraplex)")
    ] = None,
    store: Annotated[
        Path | None, typer.Option(help="Artifact store (default: artifacts/ beside the database)")
    ] = None,
    storage_base: Annotated[
        str | None, typer.Option(help="URL the store is served under (http store)")
    ] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(
            help="ed25519 public key (PEM); repeat; with any, unsigned revisions are refused"
        ),
    ] = None,
    max_lora_rank: Annotated[int, typer.Option(help="Refuse adapters of a higher rank")] = 64,
):
    data = data_dir or default_data_dir()
    url = registry or f"sqlite:///{data / 'registry.db'}"
    default_store = default_store_for(url)
    store_dir = store or (default_store.root if default_store else data / "artifacts")
    ctx.obj = CliOptions(url, store_dir, storage_base, tuple(trusted_key or ()), max_lora_rank)


def _errors(command):
    """Print registry errors as one line on stderr and exit 1, instead of a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (
            RegistryError,
            ArtifactError,
            AdapterRejected,
            ModelConfigError,
            OSError,
            ValueError,
        ) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except (
            SQLAlchemyError
        ) as exc:  # not a registry file, an unknown URL, or another writer holding it
            reason = getattr(exc, "orig", None) or exc
            hint = "; another process is writing it, retry" if "locked" in str(reason) else ""
            typer.echo(
                f"error: the registry database: {str(reason).splitlines()[0]}{hint}", err=True
            )
            raise typer.Exit(1) from None
        except (
            ImportError,
            TypeError,
        ) as exc:  # a database driver not installed; a key file needing a password
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return run


def _open(ctx: typer.Context) -> Registry:
    registry = ctx.obj.open()
    ctx.call_on_close(registry.close)
    return registry


def _print_json(value) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


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
            r.created_at.strftime("%Y-%m-%d %H:%M"),
        )
    return table


@app.command()
@_errors
def init(ctx: typer.Context):
    """Create the registry database (idempotent)."""
    registry = _open(ctx)
    registry.init()
    typer.echo(
        f"registry ready at {ctx.obj.url} (schema version {SCHEMA_VERSION}); artifacts in "
        f"{ctx.obj.store}"
    )


_Revision = Annotated[str | None, typer.Option(help="Revision label (default: r1, r2, ...)")]
_Shared = Annotated[
    bool, typer.Option("--shared", help="Usable by every tenant (default without --tenant)")
]
_BaseModel = Annotated[Path | None, typer.Option(help="Base model directory to validate against")]
_Stable = Annotated[
    bool, typer.Option("--stable", help="Serve it at once (100% of the name's traffic)")
]
_EvalSet = Annotated[Path | None, typer.Option(help="JSONL of {prompt, expected|contains}")]
_Signature = Annotated[str | None, typer.Option(help="ed25519:<base64> over the digest")]
_SigningKey = Annotated[Path | None, typer.Option(help="Sign with this ed25519 private key (PEM)")]
_Digest = Annotated[str | None, typer.Option(help="Refuse unless the files hash to this digest")]
_StrictBase = Annotated[
    bool,
    typer.Option(
        help="Refuse an adapter whose config names another base model (default: a warning)"
    ),
]


@app.command()
@_errors
def add(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(help="PEFT adapter directory")],
    name: Annotated[str, typer.Option(help="Adapter name")],
    revision: _Revision = None,
    tenant: Annotated[str | None, typer.Option(help="Owner tenant")] = None,
    shared: _Shared = False,
    base_model: _BaseModel = None,
    warm: Annotated[str | None, typer.Option(help="gpu | cpu | on_demand")] = None,
    priority: Annotated[int | None, typer.Option()] = None,
    stable: _Stable = False,
    eval_set: _EvalSet = None,
    signature: _Signature = None,
    signing_key: _SigningKey = None,
    digest: _Digest = None,
    strict_base_model_name: _StrictBase = False,
    json_out: JsonFlag = False,
):
    """Validate an adapter against the base model and register it as a new revision."""
    if signing_key is not None:
        signature = sign_digest(canonical_digest(directory), load_private_key(signing_key))
    registry = _open(ctx)
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
    )
    if json_out:
        _print_json(record.to_dict())
        return
    typer.echo(
        f"added {record.model_id} {record.digest} (rank {record.rank}, {record.estimated_bytes:,} "
        f"bytes, {record.status})"
    )


STATUSES = ("staging", "canary", "stable", "deprecated", "quarantined")


@app.command("list")
@_errors
def list_(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option(help="Only what this tenant may use")] = None,
    status: Annotated[
        str | None,
        typer.Option(help="Only adapters with a revision in this status: " + " | ".join(STATUSES)),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="At most this many (one page), by name")
    ] = None,
    after: Annotated[
        str | None, typer.Option(help="Those named after this (the last name of the page before)")
    ] = None,
    json_out: JsonFlag = False,
):
    """Adapters, their traffic split and owners, by name."""
    if status is not None and status not in STATUSES:
        typer.echo(f"error: --status {status}: give one of {', '.join(STATUSES)}", err=True)
        raise typer.Exit(2)
    adapters = _open(ctx).list_adapters(tenant, status=status, after=after, limit=limit)
    if json_out:
        _print_json([a.to_dict() for a in adapters])
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
    Console().print(table)
    if limit is not None and len(adapters) == limit:
        typer.echo(f"more may follow: --after {adapters[-1].name}")


@app.command("import")
@_errors
def import_(
    ctx: typer.Context,
    source: Annotated[
        Path,
        typer.Argument(
            help="JSONL file (one object a line: path, name, and any of revision, tenant, shared, "
            "warm, priority, stable, digest, signature, eval_set) or a directory of adapter "
            "directories (each named by its directory)"
        ),
    ],
    tenant: Annotated[
        str | None, typer.Option(help="Owner tenant of each (unless its line says)")
    ] = None,
    shared: Annotated[bool, typer.Option("--shared", help="Usable by every tenant")] = False,
    stable: Annotated[
        bool, typer.Option("--stable", help="Serve each at once (100% of its name's traffic)")
    ] = False,
    base_model: Annotated[
        Path | None, typer.Option(help="Base model directory to validate against")
    ] = None,
    json_out: JsonFlag = False,
):
    """Register many adapters in one go, each checked as `add` checks it, all before any is
    recorded (a bad one: nothing is), then recorded in a few transactions."""
    defaults: dict = {"tenant": tenant, "stable": stable}
    if shared:
        defaults["shared"] = True
    registry = _open(ctx)
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
    if json_out:
        _print_json([r.to_dict() for r in result.records])
        return
    rate = len(result.records) / seconds if seconds > 0 else 0.0
    typer.echo(
        f"imported {len(result.records)} adapters ({result.num_new} new revisions) in "
        f"{seconds:.1f} s ({rate:,.0f}/s)"
    )


@app.command()
@_errors
def show(
    ctx: typer.Context,
    name: str,
    audit_log: Annotated[
        Path | None, typer.Option(help="Server audit log (JSONL): per-revision stats")
    ] = None,
    json_out: JsonFlag = False,
):
    """One adapter: its revisions, with --audit-log its requests, errors, TTFT/TPOT per revision."""
    adapter = _open(ctx).show(name)
    stats = revision_stats(audit_log, name) if audit_log else []
    if json_out:
        _print_json({**adapter.to_dict(), "stats": [s.to_dict() for s in stats]})
        return
    console = Console()
    access = (
        "shared with every tenant"
        if adapter.shared
        else f"tenants {', '.join(adapter.allowed_tenants)}"
    )
    pinned = f", pinned in {adapter.pin_tier}" if adapter.pinned else ""
    console.print(
        f"[bold]{adapter.name}[/bold]  owner {adapter.owner_tenant or '-'}, {access}; warm "
        f"{adapter.warm_policy}, priority {adapter.priority}{pinned}"
    )
    console.print(_revisions_table(adapter))
    if audit_log:
        console.print(_stats_table(name, stats))


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


def _traffic_line(adapter: AdapterRecord) -> str:
    return f"{adapter.name}: " + (
        " ".join(f"{rev} {w}%" for rev, w in adapter.traffic) or "no traffic"
    )


@app.command()
@_errors
def promote(
    ctx: typer.Context,
    name: str,
    revision: str,
    weight: Annotated[int, typer.Option(help="Percent of traffic; 100 makes it stable")] = 100,
    force: Annotated[
        bool, typer.Option("--force", help="Promote without running its eval set")
    ] = False,
):
    """Give a revision a share of the traffic (canary) or all of it (stable)."""
    typer.echo(_traffic_line(_open(ctx).promote(name, revision, weight, force=force)))


@app.command()
@_errors
def traffic(
    ctx: typer.Context,
    name: str,
    weights: Annotated[list[str], typer.Argument(help="REV=PERCENT ..., summing to 100")],
):
    """Set the whole traffic split of a name at once."""
    try:
        plan = {rev: int(w) for rev, _, w in (item.partition("=") for item in weights)}
    except ValueError:
        raise RegistryError(f"weights must be REV=PERCENT, got {' '.join(weights)}") from None
    typer.echo(_traffic_line(_open(ctx).set_traffic(name, plan)))


@app.command()
@_errors
def rollback(ctx: typer.Context, name: str):
    """Drop the canary, or go back to the previous stable revision."""
    typer.echo(_traffic_line(_open(ctx).rollback(name)))


@app.command()
@_errors
def deprecate(
    ctx: typer.Context, name: str, revision: Annotated[str | None, typer.Argument()] = None
):
    """Deprecate a revision that serves no traffic, or without REVISION the whole name."""
    typer.echo(_traffic_line(_open(ctx).deprecate(name, revision)))


@app.command()
@_errors
def quarantine(
    ctx: typer.Context,
    name: str,
    revision: str,
    reason: Annotated[
        str, typer.Option(help="Why (kept with the revision)")
    ] = "quarantined by operator",
):
    """Never serve a revision again; its traffic goes back to the stable revision."""
    typer.echo(_traffic_line(_open(ctx).quarantine(name, revision, reason)))


@app.command()
@_errors
def pin(
    ctx: typer.Context,
    name: str,
    tier: Annotated[str, typer.Option(help="gpu (a slot) or cpu (host memory)")] = "cpu",
):
    """Keep an adapter resident in a tier of the caches (servers pin it there at next start)."""
    _open(ctx).pin(name, tier=tier)
    typer.echo(f"{name}: pinned in {tier}")


@app.command()
@_errors
def unpin(ctx: typer.Context, name: str):
    _open(ctx).unpin(name)
    typer.echo(f"{name}: unpinned")


@app.command()
@_errors
def grant(ctx: typer.Context, name: str, tenant: str):
    """Let another tenant use an adapter."""
    _open(ctx).grant(name, tenant)
    typer.echo(f"{name}: granted to {tenant}")


@app.command()
@_errors
def ungrant(ctx: typer.Context, name: str, tenant: str):
    _open(ctx).revoke_grant(name, tenant)
    typer.echo(f"{name}: grant to {tenant} revoked")


@app.command()
@_errors
def audit(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Option(help="Only this adapter")] = None,
    limit: Annotated[int, typer.Option()] = 50,
    json_out: JsonFlag = False,
):
    """Who changed what, when (newest first)."""
    events = _open(ctx).audit_events(limit, target=name)
    if json_out:
        _print_json([e.to_dict() for e in events])
        return
    table = Table(title="audit events")
    for column in ("id", "at", "actor", "action", "target", "detail"):
        table.add_column(column)
    for e in events:
        table.add_row(
            str(e.id),
            e.at.strftime("%Y-%m-%d %H:%M:%S"),
            e.actor,
            e.action,
            e.target,
            json.dumps(e.detail, sort_keys=True),
        )
    Console().print(table)


@app.command()
@_errors
def digest(directory: Path):
    """Print the canonical digest of an adapter directory."""
    typer.echo(canonical_digest(directory))


@app.command()
@_errors
def sign(directory: Path, key: Annotated[Path, typer.Option(help="ed25519 private key (PEM)")]):
    """Print the signature of an adapter directory's digest, for `add --signature`."""
    typer.echo(sign_digest(canonical_digest(directory), load_private_key(key)))


@app.command()
@_errors
def keygen(private_out: Path, public_out: Path):
    """Write a new ed25519 key pair (PEM) for signing revisions."""
    private, public = generate_keypair()
    private_out.touch(mode=0o600)
    private_out.write_bytes(private)
    public_out.write_bytes(public)
    typer.echo(f"wrote {private_out} (keep it secret) and {public_out} (give it to --trusted-key)")


@app.command()
@_errors
def gc(
    ctx: typer.Context,
    min_age_s: Annotated[float, typer.Option(help="Keep entries younger than this")] = 3600,
):
    """Delete artifacts no revision refers to (left by refused or interrupted registrations)."""
    removed = _open(ctx).gc_artifacts(min_age_s)
    typer.echo(f"removed {len(removed)} unreferenced artifact(s)")


GpuSlotsOption = Annotated[
    str | None,
    typer.Option(
        "--max-gpu-slots",
        help="Residency budget in device slots; `none`: the server's default share",
    ),
]
CpuBytesOption = Annotated[
    str | None,
    typer.Option(
        "--max-cpu-bytes",
        help="Residency budget in host memory, e.g. 512MiB; `none`: the server's default share",
    ),
]


def _budget(max_gpu_slots: str | None, max_cpu_bytes: str | None) -> dict[str, int | None]:
    """The budget fields given on the command line (`none` clears one); a bad one names its flag."""
    budget: dict[str, int | None] = {}
    given = (
        ("--max-gpu-slots", max_gpu_slots, int),
        ("--max-cpu-bytes", max_cpu_bytes, parse_size),
    )
    for flag, text, parse in given:
        if text is None:
            continue
        try:
            value = None if text.strip().lower() == "none" else parse(text)
        except ValueError:
            what = "a whole number of slots" if parse is int else "a size such as 512MiB"
            raise RegistryError(f"{flag}: {text!r} is not {what}") from None
        if value is not None and value < 0:
            raise RegistryError(f"{flag}: must be >= 0, not {value}")
        budget[flag[2:].replace("-", "_")] = value
    return budget


def _budget_text(value: int | None, size: bool) -> str:
    return "default" if value is None else _size_text(value) if size else str(value)


def _size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


LimitFlag = Annotated[int | None, typer.Option(help="Per server; 0: the server's default")]


@tenant_app.command("add")
@_errors
def tenant_add(
    ctx: typer.Context,
    name: str,
    priority: Annotated[int, typer.Option()] = 0,
    max_gpu_slots: GpuSlotsOption = None,
    max_cpu_bytes: CpuBytesOption = None,
    max_concurrent_requests: LimitFlag = None,
    max_waiting: LimitFlag = None,
):
    """Create a tenant (or set its priority), with residency budgets and request limits if given."""
    budget = _budget(max_gpu_slots, max_cpu_bytes)
    limits = _limits(max_concurrent_requests, max_waiting)
    registry = _open(ctx)
    _set_tenant(registry, registry.add_tenant(name, priority), budget, limits)


@tenant_app.command("set")
@_errors
def tenant_set(
    ctx: typer.Context,
    name: str,
    priority: Annotated[int | None, typer.Option()] = None,
    max_gpu_slots: GpuSlotsOption = None,
    max_cpu_bytes: CpuBytesOption = None,
    max_concurrent_requests: LimitFlag = None,
    max_waiting: LimitFlag = None,
):
    """Change a tenant's priority, residency budgets or request limits (running servers follow
    within their watch interval)."""
    budget = _budget(max_gpu_slots, max_cpu_bytes)
    limits = _limits(max_concurrent_requests, max_waiting)
    registry = _open(ctx)
    tenant = next((t for t in registry.list_tenants() if t.name == name), None)
    if tenant is None:
        raise RegistryError(
            f"unknown tenant {name!r}; add it with `loraplex registry tenant add {name}`"
        )
    if priority is not None:
        tenant = registry.add_tenant(name, priority)
    _set_tenant(registry, tenant, budget, limits)


def _set_tenant(registry, tenant, budget: dict, limits: dict) -> None:
    """Apply the budgets and request limits given, then print the tenant as it is now."""
    if budget:
        tenant = registry.set_budget(tenant.name, **budget)
    if limits:
        tenant = registry.set_tenant_limits(tenant.name, **limits)
    typer.echo(
        f"tenant {tenant.name} (priority {tenant.priority}{_budget_line(tenant)}"
        f"{_limits_text(tenant)})"
    )


def _limits(max_concurrent_requests: int | None, max_waiting: int | None) -> dict[str, int | None]:
    """The request limits given (0: back to the server's default), checked before any change."""
    limits = {
        field: value or None
        for field, value in (
            ("max_concurrent_requests", max_concurrent_requests),
            ("max_waiting", max_waiting),
        )
        if value is not None
    }
    check_tenant_limits(limits)
    return limits


def _budget_line(t) -> str:
    if t.max_gpu_slots is None and t.max_cpu_bytes is None:
        return ""
    return (
        f", gpu slots {_budget_text(t.max_gpu_slots, False)}, "
        f"cpu bytes {_budget_text(t.max_cpu_bytes, True)}"
    )


def _limits_text(tenant) -> str:
    limits = (
        ("max concurrent requests", tenant.max_concurrent_requests),
        ("max waiting", tenant.max_waiting),
    )
    return "".join(f", {label} {value}" for label, value in limits if value is not None)


@tenant_app.command("list")
@_errors
def tenant_list(ctx: typer.Context, json_out: JsonFlag = False):
    tenants = _open(ctx).list_tenants()
    if json_out:
        _print_json(
            [
                {
                    "name": t.name,
                    "priority": t.priority,
                    "created_at": t.created_at.isoformat(),
                    "max_gpu_slots": t.max_gpu_slots,
                    "max_cpu_bytes": t.max_cpu_bytes,
                    "max_concurrent_requests": t.max_concurrent_requests,
                    "max_waiting": t.max_waiting,
                }
                for t in tenants
            ]
        )
        return
    table = Table(title="tenants")
    # Budgets, then request limits (concurrent, waiting); the creation time is in --json.
    for column in ("name", "priority", "max gpu slots", "max cpu bytes", "requests", "waiting"):
        table.add_column(column)
    for t in tenants:
        table.add_row(
            t.name,
            str(t.priority),
            _budget_text(t.max_gpu_slots, False),
            _budget_text(t.max_cpu_bytes, True),
            _or_default(t.max_concurrent_requests),
            _or_default(t.max_waiting),
        )
    Console().print(table)


def _or_default(value: int | None) -> str:
    return "default" if value is None else str(value)


@key_app.command("create")
@_errors
def key_create(ctx: typer.Context, tenant: str):
    """Create an API key for a tenant; it is printed once and only its hash is kept."""
    typer.echo(_open(ctx).create_key(tenant))


@key_app.command("revoke")
@_errors
def key_revoke(
    ctx: typer.Context,
    key_id: Annotated[str, typer.Argument(help="Key id (its first 12 characters)")],
):
    typer.echo(f"revoked {_open(ctx).revoke_key(key_id)}")


@key_app.command("list")
@_errors
def key_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option()] = None,
    json_out: JsonFlag = False,
):
    keys = _open(ctx).list_keys(tenant)
    rows = [
        {
            "key_id": k.key_id,
            "tenant": k.tenant,
            "created_at": k.created_at.isoformat(),
            "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        }
        for k in keys
    ]
    if json_out:
        _print_json(rows)
        return
    table = Table(title="API keys")
    for column in ("key id", "tenant", "created", "revoked"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["key_id"], row["tenant"], row["created_at"][:16], (row["revoked_at"] or "")[:16]
        )
    Console().print(table)


if __name__ == "__main__":
    app()


export_app = typer.Typer(
    help="The registry as another system's configuration.",
    no_args_is_help=True,
    rich_markup_mode=PLAIN,
)
app.add_typer(export_app, name="export")


@export_app.command("k8s")
@_errors
def export_k8s(
    ctx: typer.Context,
    pool: Annotated[str, typer.Option(help="InferencePool the rewrites apply to")] = "loraplex",
    namespace: Annotated[str | None, typer.Option(help="Namespace of the objects")] = None,
):
    """Print one InferenceModelRewrite per adapter name with traffic (YAML for `kubectl apply`)."""
    import yaml

    from loraplex.registry.k8s import check_names, model_rewrites

    check_names(pool, namespace)
    objects = model_rewrites(_open(ctx).list_adapters(), pool, namespace)
    typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)
