"""What the registry hands out: frozen records, detached from the database session that read
them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime


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
    status: str  # staging | canary | stable | deprecated | quarantined
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
