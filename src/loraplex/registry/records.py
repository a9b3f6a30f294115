"""What the registry hands out: frozen records, detached from the database session that read
them, and how they are made from its rows."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from loraplex.registry import queries as q
from loraplex.registry.db import Adapter, Revision, as_utc

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WARM_POLICIES = ("gpu", "cpu", "on_demand")
PIN_TIERS = ("gpu", "cpu")


@dataclass(frozen=True, slots=True)  # slots: a server holds one per revision of its catalog
class RevisionRecord:
    """One immutable revision of an adapter, with the manifest fields of the architecture doc."""

    name: str
    revision: str
    digest: str
    base_model: str
    base_model_digest: str | None
    owner_tenant: str | None
    shared: bool
    allowed_tenants: tuple[str, ...]  # owner and grants; with `shared`, every tenant may use it
    task_type: str | None
    rank: int
    lora_alpha: float
    dtype: str
    target_modules: tuple[str, ...]
    estimated_bytes: int
    actual_bytes: int
    priority: int
    warm_policy: str  # gpu | cpu | on_demand
    status: str  # staging | canary | stable | deprecated | quarantined | retired
    storage_uri: str
    signature: str | None
    created_at: datetime
    pinned: bool = False
    traffic_weight: int = 0  # percent of the name's traffic this revision gets now
    status_reason: str | None = None
    stable_since: datetime | None = None
    retired_at: datetime | None = None  # when it last left traffic (start of its grace period)
    has_eval_set: bool = False

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.revision}"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("created_at", "stable_since", "retired_at"):
            out[key] = out[key].isoformat() if out[key] else None
        out["allowed_tenants"] = list(self.allowed_tenants)
        out["target_modules"] = list(self.target_modules)
        return out


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    name: str
    owner_tenant: str | None
    shared: bool
    allowed_tenants: tuple[str, ...]
    task_type: str | None
    priority: int
    warm_policy: str
    pinned: bool
    created_at: datetime
    traffic: tuple[tuple[str, int], ...]  # (revision, weight), in the order resolution walks them
    revisions: tuple[RevisionRecord, ...]  # oldest first
    pin_tier: str | None = None
    """`gpu` or `cpu` when pinned: the tier a start pins it in."""
    keep: int | None = None
    """How many of the newest revisions stay servable (None: all); older ones are retired."""

    @property
    def stable(self) -> RevisionRecord | None:
        return next((r for r in self.revisions if r.status == "stable" and r.traffic_weight), None)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "owner_tenant": self.owner_tenant,
            "shared": self.shared,
            "allowed_tenants": list(self.allowed_tenants),
            "task_type": self.task_type,
            "priority": self.priority,
            "warm_policy": self.warm_policy,
            "pinned": self.pinned,
            "pin_tier": self.pin_tier,
            "keep": self.keep,
            "created_at": self.created_at.isoformat(),
            "traffic": dict(self.traffic),
            "revisions": [r.to_dict() for r in self.revisions],
        }


@dataclass(frozen=True)
class TenantRecord:
    name: str
    priority: int
    created_at: datetime
    max_gpu_slots: int | None = None
    """Residency budget in device slots (None: the server's default share)."""
    max_cpu_bytes: int | None = None
    """Residency budget in host-memory bytes (None: the server's default share)."""
    max_concurrent_requests: int | None = None
    """Requests in flight on one server at a time (None: the server's --max-requests-per-tenant)."""
    max_waiting: int | None = None
    """Requests waiting for a first token on one server (None: only the server's --max-waiting)."""


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class AuditRecord:
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    detail: dict

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "at": self.at.isoformat()}


# ---- records from rows -------------------------------------------------------------------------


def revision_record(
    adapter, row, grants: tuple[str, ...], weights: dict[int, int]
) -> RevisionRecord:
    """From ORM objects, or from plain rows of the same tables (the catalog's)."""
    return RevisionRecord(
        name=adapter.name,
        revision=row.revision,
        digest=row.digest,
        base_model=row.base_model,
        base_model_digest=row.base_model_digest,
        owner_tenant=adapter.owner_tenant,
        shared=adapter.shared,
        allowed_tenants=q.allowed(adapter, grants),
        task_type=adapter.task_type,
        rank=row.rank,
        lora_alpha=row.lora_alpha,
        dtype=row.dtype,
        target_modules=tuple(row.target_modules.split(",")),
        estimated_bytes=row.estimated_bytes,
        actual_bytes=row.actual_bytes,
        priority=adapter.priority,
        warm_policy=adapter.warm_policy,
        status=row.status,
        storage_uri=row.storage_uri,
        signature=row.signature,
        created_at=as_utc(row.created_at),
        pinned=adapter.pinned,
        traffic_weight=weights.get(row.id, 0),
        status_reason=row.status_reason,
        stable_since=as_utc(row.stable_since),
        retired_at=as_utc(row.retired_at),
        has_eval_set=row.eval_set is not None,
    )


def read_revision_record(session: Session, adapter: Adapter, row: Revision) -> RevisionRecord:
    """`revision_record` with the grants and weights read in `session`."""
    return revision_record(
        adapter, row, q.grants(session, adapter.name), q.weights(session, adapter.name)
    )


def serving_order(records) -> tuple[tuple[str, int], ...]:
    """(revision, weight) of the revisions with traffic, canaries newest first, then the stable.

    Canaries first: raising a canary's weight then keeps every user it already had.
    """
    serving = [r for r in reversed(list(records)) if r.traffic_weight and r.status != "quarantined"]
    serving.sort(key=lambda r: r.status == "stable")
    return tuple((r.revision, r.traffic_weight) for r in serving)


def adapter_record(
    adapter: Adapter, grants: tuple[str, ...], rows: list[Revision], weights, pin_tier: str | None
) -> AdapterRecord:
    revisions = tuple(revision_record(adapter, r, grants, weights) for r in rows)
    if adapter.pinned and pin_tier not in PIN_TIERS:  # pinned by a version that kept no tier
        pin_tier = adapter.warm_policy if adapter.warm_policy in PIN_TIERS else "cpu"
    return AdapterRecord(
        name=adapter.name,
        owner_tenant=adapter.owner_tenant,
        shared=adapter.shared,
        allowed_tenants=q.allowed(adapter, grants),
        task_type=adapter.task_type,
        priority=adapter.priority,
        warm_policy=adapter.warm_policy,
        pinned=adapter.pinned,
        created_at=as_utc(adapter.created_at),
        traffic=serving_order(revisions),
        revisions=revisions,
        pin_tier=pin_tier if adapter.pinned else None,
        keep=adapter.keep,
    )
