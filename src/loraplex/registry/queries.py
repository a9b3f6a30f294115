"""Small reads, checks and writes over one registry session, shared by the registry's services."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from loraplex.registry.db import Adapter, Grant, Revision, Tenant, Traffic, utcnow
from loraplex.registry.errors import AdapterNotFound, AdapterRejected, LifecycleError, RegistryError


def locked_adapter(session: Session, name: str) -> Adapter | None:
    """The adapter row, locked for the rest of the transaction (PostgreSQL; SQLite writers hold the
    db lock)."""
    return session.scalar(select(Adapter).where(Adapter.name == name).with_for_update())


def locked_adapter_or_404(session: Session, name: str) -> Adapter:
    adapter = locked_adapter(session, name)
    if adapter is None:
        raise AdapterNotFound(name)
    return adapter


def tenant_or_error(session: Session, tenant: str) -> Tenant:
    row = session.get(Tenant, tenant)
    if row is None:
        raise RegistryError(
            f"unknown tenant {tenant!r}; add it with `loraplex registry tenant add {tenant}`"
        )
    return row


NOT_RETIRED = Revision.status != "retired"
"""A retired revision is served no more (`retention`); its row stays."""


def find_revision(
    session: Session, name: str, revision: str | None, digest: str | None
) -> Revision | None:
    """By revision when given (refusing a different digest under it), else the one holding
    `digest`. A retired revision keeps its label but not its bytes: they may come back as a new
    revision."""
    if revision is not None:
        row = session.scalar(
            select(Revision).where(Revision.adapter_name == name, Revision.revision == revision)
        )
        if row is not None and digest is not None and row.digest != digest:
            raise AdapterRejected(
                "revision",
                f"{name}@{revision} exists with digest {row.digest}; revisions are immutable, pick "
                "a new one",
            )
        if (
            row is None and digest is not None
        ):  # the same bytes under a new label: one revision per content
            same = session.scalar(
                select(Revision)
                .where(Revision.adapter_name == name, Revision.digest == digest, NOT_RETIRED)
                .limit(1)
            )
            if same is not None:
                raise AdapterRejected(
                    "revision",
                    f"these are the bytes of {name}@{same.revision} ({same.status}); use that "
                    "revision",
                )
        return row
    if digest is None:
        return None
    return session.scalar(
        select(Revision)
        .where(Revision.adapter_name == name, Revision.digest == digest, NOT_RETIRED)
        .order_by(Revision.id)
        .limit(1)
    )


def revision_or_404(session: Session, name: str, revision: str) -> Revision:
    row = find_revision(session, name, revision, None)
    if row is None:
        raise AdapterNotFound(f"{name}@{revision}")
    return row


def refuse_unservable(row: Revision) -> None:
    """LifecycleError for a quarantined or retired revision: neither is served again."""
    if row.status == "quarantined":
        raise LifecycleError(
            f"{row.adapter_name}@{row.revision} is quarantined ({row.status_reason}); it is never "
            "served"
        )
    if row.status == "retired":
        raise LifecycleError(
            f"{row.adapter_name}@{row.revision} is retired ({row.status_reason}); register its "
            "bytes again for a new revision"
        )


def next_revision(session: Session, name: str) -> str:
    existing = set(session.scalars(select(Revision.revision).where(Revision.adapter_name == name)))
    number = len(existing) + 1
    while f"r{number}" in existing:
        number += 1
    return f"r{number}"


def weights(session: Session, name: str) -> dict[int, int]:
    rows = session.execute(
        select(Traffic.revision_id, Traffic.weight).where(Traffic.adapter_name == name)
    )
    return {rid: w for rid, w in rows}


def serving_weights(session: Session, name: str) -> list[tuple[Revision, int]]:
    rows = session.execute(
        select(Revision, Traffic.weight)
        .join(Traffic, Traffic.revision_id == Revision.id)
        .where(Traffic.adapter_name == name)
        .order_by(Revision.id)
    )
    return [(r, w) for r, w in rows]


def serving(session: Session, name: str) -> list[Revision]:
    return [r for r, _ in serving_weights(session, name)]


def current_stable(session: Session, name: str) -> Revision | None:
    return next((r for r in serving(session, name) if r.status == "stable"), None)


def previous_stable(
    session: Session, name: str, current: Revision | None, required: bool = True
) -> Revision | None:
    """The most recently promoted stable revision other than `current` that may still be served."""
    query = (
        select(Revision)
        .where(
            Revision.adapter_name == name,
            Revision.stable_since.is_not(None),
            Revision.status.not_in(("quarantined", "retired")),
        )
        .order_by(Revision.stable_since.desc())
    )
    row = next((r for r in session.scalars(query) if current is None or r.id != current.id), None)
    if row is None and required:
        raise LifecycleError(f"{name} has no earlier stable revision to roll back to")
    return row


def apply_traffic(session: Session, name: str, plan: dict[str, int], stable: str | None) -> None:
    """Replace the name's traffic rows by `plan` and set statuses to match, inside the caller's
    transaction."""
    now = utcnow()
    for row, _ in serving_weights(session, name):
        if row.revision not in plan:
            row.retired_at = now  # its grace period starts
            row.status = "deprecated" if row.status == "stable" else "staging"
    session.execute(delete(Traffic).where(Traffic.adapter_name == name))
    for revision, weight in plan.items():
        row = find_revision(session, name, revision, None)
        session.add(Traffic(adapter_name=name, revision_id=row.id, weight=weight))
        row.retired_at = None
        if revision == stable and row.status != "stable":
            row.status, row.stable_since, row.status_reason = "stable", now, None
        elif revision != stable:
            row.status, row.status_reason = "canary", None


def grants(session: Session, name: str) -> tuple[str, ...]:
    return tuple(
        session.scalars(
            select(Grant.tenant).where(Grant.adapter_name == name).order_by(Grant.tenant)
        )
    )


def all_grants(session: Session) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for name, tenant in session.execute(
        select(Grant.adapter_name, Grant.tenant).order_by(Grant.tenant)
    ):
        out.setdefault(name, []).append(tenant)
    return {k: tuple(v) for k, v in out.items()}


def allowed(adapter: Adapter, grants) -> tuple[str, ...]:
    owner = (adapter.owner_tenant,) if adapter.owner_tenant else ()
    return owner + tuple(t for t in grants if t != adapter.owner_tenant)


def may_use(adapter: Adapter, grants, tenant: str) -> bool:
    return adapter.shared or tenant == adapter.owner_tenant or tenant in grants
