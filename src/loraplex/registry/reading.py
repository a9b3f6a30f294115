"""Reading the registry: adapters, revisions, the grace set, audit events, piece lists."""

from __future__ import annotations

import json
from datetime import timedelta

from sqlalchemy import select

from loraplex.artifacts import Pieces
from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    ArtifactPieces,
    ArtifactPiecesBlake3,
    AuditEvent,
    Grant,
    PinTier,
    Revision,
    Traffic,
    as_utc,
    utcnow,
)
from loraplex.registry.errors import (
    AdapterNotFound,
)
from loraplex.registry.records import (
    AdapterRecord,
    AuditRecord,
    RevisionRecord,
    adapter_record,
    read_revision_record,
)
from loraplex.registry.store import Store


class Reading:
    """Reads for operators and the server's listings."""

    def __init__(self, store: Store, grace_period: timedelta = timedelta(seconds=600)):
        """`grace_period`: how long a revision that left traffic stays in `grace_revisions`."""
        self.store = store
        self.grace_period = grace_period

    def list_adapters(
        self,
        tenant: str | None = None,
        status: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        retired: bool = False,
    ) -> list[AdapterRecord]:
        """Adapters by name: every one, or only those `tenant` may use, those with a revision in
        `status`; one page with `limit` (and `after`, the last name of the page before). Their
        retired revisions only with `retired` (or `status` retired)."""
        query = select(Adapter).order_by(Adapter.name)
        if tenant is not None:
            granted = select(Grant.adapter_name).where(Grant.tenant == tenant)
            query = query.where(
                Adapter.shared | (Adapter.owner_tenant == tenant) | Adapter.name.in_(granted)
            )
        if status is not None:
            query = query.where(
                Adapter.name.in_(select(Revision.adapter_name).where(Revision.status == status))
            )
        if after is not None:
            query = query.where(Adapter.name > after)
        if limit is not None:
            query = query.limit(limit)
        with self.store.read() as session:
            adapters = session.scalars(query).all()
            names = [a.name for a in adapters]
            # the whole tables for a whole listing; the page's rows for a page
            few = limit is not None and len(names) <= 1000

            def rows_of(statement, column):
                return session.execute(statement.where(column.in_(names)) if few else statement)

            grants = q.all_grants(session) if not few else _grants_of(session, names)
            revisions: dict[str, list[Revision]] = {}
            of_names = select(Revision).order_by(Revision.id)
            if not (retired or status == "retired"):
                of_names = of_names.where(q.NOT_RETIRED)
            for (row,) in rows_of(of_names, Revision.adapter_name):
                revisions.setdefault(row.adapter_name, []).append(row)
            weights = {
                rid: w
                for rid, w in rows_of(
                    select(Traffic.revision_id, Traffic.weight), Traffic.adapter_name
                )
            }
            tiers = {
                n: t
                for n, t in rows_of(
                    select(PinTier.adapter_name, PinTier.tier), PinTier.adapter_name
                )
            }
            return [
                adapter_record(
                    a, grants.get(a.name, ()), revisions.get(a.name, []), weights, tiers.get(a.name)
                )
                for a in adapters
            ]

    def show(self, name: str, retired: bool = False) -> AdapterRecord:
        """The adapter with its revisions; the retired ones (which only grow) with `retired`."""
        with self.store.read() as session:
            adapter = session.get(Adapter, name)
            if adapter is None:
                raise AdapterNotFound(name)
            query = select(Revision).where(Revision.adapter_name == name).order_by(Revision.id)
            rows = session.scalars(query if retired else query.where(q.NOT_RETIRED))
            tier = session.get(PinTier, name)
            return adapter_record(
                adapter,
                q.grants(session, name),
                list(rows),
                q.weights(session, name),
                tier.tier if tier is not None else None,
            )

    def get_revision(self, name: str, revision: str) -> RevisionRecord:
        with self.store.read() as session:
            adapter = session.get(Adapter, name)
            row = q.find_revision(session, name, revision, None) if adapter else None
            if row is None:
                raise AdapterNotFound(f"{name}@{revision}")
            return read_revision_record(session, adapter, row)

    def grace_revisions(self) -> list[RevisionRecord]:
        """Revisions that left traffic less than the grace period ago: keep them warm, do not evict
        yet. Never a quarantined or retired one."""
        cutoff = utcnow() - self.grace_period
        with self.store.read() as session:
            rows = session.scalars(
                select(Revision).where(
                    Revision.retired_at >= cutoff,
                    Revision.status.not_in(("quarantined", "retired")),
                )
            ).all()
            return [
                read_revision_record(session, session.get(Adapter, r.adapter_name), r) for r in rows
            ]

    def audit_events(self, limit: int = 100, target: str | None = None) -> list[AuditRecord]:
        """Newest first; `target` filters to one adapter (its name and every `name@revision`)."""
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
        if target is not None:
            revisions = AuditEvent.target.startswith(f"{target}@", autoescape=True)
            query = query.where((AuditEvent.target == target) | revisions)
        with self.store.read() as session:
            return [
                AuditRecord(e.id, as_utc(e.at), e.actor, e.action, e.target, json.loads(e.detail))
                for e in session.scalars(query)
            ]

    def pieces(self, digest: str) -> Pieces | None:
        """The piece list recorded for an artifact at registration (None for one registered before
        there were piece lists): what lets a load check its bytes on several cores."""
        with self.store.read() as session:
            row = session.get(ArtifactPiecesBlake3, digest) or session.get(ArtifactPieces, digest)
            return Pieces.from_json(row.pieces) if row is not None else None


def _grants_of(session, names: list[str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    rows = session.execute(
        select(Grant.adapter_name, Grant.tenant)
        .where(Grant.adapter_name.in_(names))
        .order_by(Grant.tenant)
    )
    for name, tenant in rows:
        out.setdefault(name, []).append(tenant)
    return {k: tuple(v) for k, v in out.items()}
