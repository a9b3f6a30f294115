"""`loraplex registry tenant ...` and `loraplex registry key ...`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from loraplex.registry.cli.common import (
    JsonFlag,
    TenantArg,
    app,
    errors,
    open_registry,
    print_json,
)
from loraplex.registry.errors import RegistryError
from loraplex.registry.registry import check_tenant_limits
from loraplex.settings.command import PlainTyper
from loraplex.tables import is_piped, print_table
from loraplex.units import parse_size

tenant_app = PlainTyper(help="Tenants.", no_args_is_help=True)
key_app = PlainTyper(
    help="API keys (stored hashed; a new key is printed once).",
    no_args_is_help=True,
)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")


GpuSlotsOption = Annotated[
    str | None,
    typer.Option(
        "--max-gpu-slots",
        metavar="N|none",
        help="Residency budget in device slots; `none`: the server's default share",
    ),
]
CpuBytesOption = Annotated[
    str | None,
    typer.Option(
        "--max-cpu-bytes",
        metavar="SIZE|none",
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


LimitFlag = Annotated[
    int | None, typer.Option(metavar="N", help="Per server; 0: the server's default")
]
_PRIORITY = (
    "Higher: its adapters stay longer in the caches, and the router favours and sheds it last"
)


@tenant_app.command("add")
@errors
def tenant_add(
    ctx: typer.Context,
    name: TenantArg,
    priority: Annotated[int, typer.Option(metavar="N", help=_PRIORITY)] = 0,
    max_gpu_slots: GpuSlotsOption = None,
    max_cpu_bytes: CpuBytesOption = None,
    max_concurrent_requests: LimitFlag = None,
    max_waiting: LimitFlag = None,
):
    """Create a tenant (or set its priority), with residency budgets and request limits if given."""
    budget = _budget(max_gpu_slots, max_cpu_bytes)
    limits = _limits(max_concurrent_requests, max_waiting)
    registry = open_registry(ctx)
    _set_tenant(registry, registry.add_tenant(name, priority), budget, limits)


@tenant_app.command("set")
@errors
def tenant_set(
    ctx: typer.Context,
    name: TenantArg,
    priority: Annotated[int | None, typer.Option(metavar="N", help=_PRIORITY)] = None,
    max_gpu_slots: GpuSlotsOption = None,
    max_cpu_bytes: CpuBytesOption = None,
    max_concurrent_requests: LimitFlag = None,
    max_waiting: LimitFlag = None,
):
    """Change a tenant's priority, residency budgets or request limits (running servers follow
    within their watch interval)."""
    budget = _budget(max_gpu_slots, max_cpu_bytes)
    limits = _limits(max_concurrent_requests, max_waiting)
    registry = open_registry(ctx)
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
@errors
def tenant_list(ctx: typer.Context, json_out: JsonFlag = False):
    """Tenants, their priorities, residency budgets and request limits."""
    tenants = open_registry(ctx).list_tenants()
    if json_out:
        print_json(
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
    print_table(table)


def _or_default(value: int | None) -> str:
    return "default" if value is None else str(value)


@key_app.command("create")
@errors
def key_create(ctx: typer.Context, tenant: TenantArg):
    """Create an API key for a tenant; it is printed once and only its hash is kept."""
    typer.echo(open_registry(ctx).create_key(tenant))


@key_app.command("revoke")
@errors
def key_revoke(
    ctx: typer.Context,
    key_id: Annotated[
        str, typer.Argument(metavar="KEY_ID", help="Key id (its first 12 characters)")
    ],
):
    """Revoke an API key: servers refuse it within their watch interval."""
    typer.echo(f"revoked {open_registry(ctx).revoke_key(key_id)}")


@key_app.command("list")
@errors
def key_list(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Option(metavar="TENANT", help="Only this tenant's keys")
    ] = None,
    json_out: JsonFlag = False,
):
    """API keys by id (never the key itself), their tenants, when created and revoked."""
    keys = open_registry(ctx).list_keys(tenant)
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
        print_json(rows)
        return
    table = Table(title="API keys")
    for column in ("key id", "tenant", "created", "revoked"):
        table.add_column(column)
    for row in rows:
        cut = None if is_piped() else 16
        table.add_row(
            row["key_id"], row["tenant"], row["created_at"][:cut], (row["revoked_at"] or "")[:cut]
        )
    print_table(table)
