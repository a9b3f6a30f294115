"""Tenants, their budgets and limits, grants, and API keys."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry import queries as q
from loraplex.registry.db import (
    ApiKey,
    Grant,
    Tenant,
    as_utc,
    utcnow,
)
from loraplex.registry.errors import (
    RegistryError,
)
from loraplex.registry.records import (
    KeyRecord,
    TenantRecord,
)
from loraplex.registry.store import Store

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KEY_PREFIX = "lpx-"
TENANT_LIMITS = ("max_concurrent_requests", "max_waiting")


def _hash_key(key: str) -> str:
    # Keys are 256-bit random strings, so a plain sha256 is enough (no password-style stretching
    # needed).
    return hashlib.sha256(key.encode()).hexdigest()


class Tenancy:
    """Tenants, grants and keys."""

    def __init__(self, store: Store):
        self.store = store

    def add_tenant(
        self,
        name: str,
        priority: int = 0,
        max_gpu_slots: int | None = None,
        max_cpu_bytes: int | None = None,
    ) -> TenantRecord:
        """Create a tenant, or set the priority of an existing one; budgets given are set too
        (`set_budget`)."""
        if not TENANT_RE.fullmatch(name):
            raise RegistryError(f"tenant name {name!r} must match {TENANT_RE.pattern}")
        given = (("max_gpu_slots", max_gpu_slots), ("max_cpu_bytes", max_cpu_bytes))
        budget = {k: v for k, v in given if v is not None}
        _check_budget(budget)
        with self.store.write() as session:
            tenant = session.get(Tenant, name)
            if tenant is None:
                tenant = Tenant(name=name, priority=priority, created_at=utcnow(), **budget)
                session.add(tenant)
                self.store.audit(session, "tenant_add", name, priority=priority, **budget)
                return _tenant_record(tenant)
            if tenant.priority != priority:
                tenant.priority = priority
                self.store.audit(session, "tenant_priority", name, priority=priority)
            self._set_budget(session, tenant, budget)
            return _tenant_record(tenant)

    def set_budget(self, name: str, **budget: int | None) -> TenantRecord:
        """Set a tenant's residency budgets: `max_gpu_slots` (device slots) and `max_cpu_bytes`
        (host bytes); None clears one (the server's default share applies). Fields not given stay as
        they are."""
        _check_budget(budget)
        with self.store.write() as session:
            tenant = q.tenant_or_error(session, name)
            self._set_budget(session, tenant, budget)
            return _tenant_record(tenant)

    def _set_budget(self, session: Session, tenant: Tenant, budget: dict[str, int | None]) -> None:
        changed = {k: v for k, v in budget.items() if getattr(tenant, k) != v}
        if changed:
            for field_name, value in changed.items():
                setattr(tenant, field_name, value)
            self.store.audit(session, "tenant_budget", tenant.name, **changed)

    def set_tenant_limits(self, name: str, **limits: int | None) -> TenantRecord:
        """Set `max_concurrent_requests` and/or `max_waiting` of a tenant (None: the server's
        default); the limits not named stay as they are."""
        check_tenant_limits(limits)
        with self.store.write() as session:
            tenant = q.tenant_or_error(session, name)
            changed = {f: v for f, v in limits.items() if getattr(tenant, f) != v}
            for field, value in changed.items():
                setattr(tenant, field, value)
            if changed:
                self.store.audit(session, "tenant_limits", name, **changed)
            return _tenant_record(tenant)

    def list_tenants(self) -> list[TenantRecord]:
        with self.store.read() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.name))
            return [_tenant_record(t) for t in rows]

    def grant(self, name: str, tenant: str) -> None:
        with self.store.write() as session:
            q.locked_adapter_or_404(session, name)
            q.tenant_or_error(session, tenant)
            if session.get(Grant, (name, tenant)) is None:
                session.add(Grant(adapter_name=name, tenant=tenant))
                self.store.audit(session, "grant", name, tenant=tenant)

    def revoke_grant(self, name: str, tenant: str) -> None:
        with self.store.write() as session:
            grant = session.get(Grant, (name, tenant))
            if grant is not None:
                session.delete(grant)
                self.store.audit(session, "revoke_grant", name, tenant=tenant)

    def create_key(self, tenant: str) -> str:
        """A new API key for `tenant`, returned in clear this once; only its sha256 is stored."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.add_key(tenant, key)
        return key

    def add_key(self, tenant: str, key: str) -> str:
        """Record an existing key (e.g. from an --api-keys file); returns its id (its first 12
        characters)."""
        if len(key) < 16:
            raise RegistryError("an API key must be at least 16 characters long")
        key_id = key[:12]
        with self.store.write() as session:
            q.tenant_or_error(session, tenant)
            if session.get(ApiKey, key_id) is not None:
                raise RegistryError(f"a key with id {key_id} exists already; use another key")
            session.add(
                ApiKey(key_id=key_id, tenant=tenant, key_hash=_hash_key(key), created_at=utcnow())
            )
            self.store.audit(session, "key_create", tenant, key_id=key_id)
        return key_id

    def revoke_key(self, key_or_id: str) -> str:
        """Revoke by key id (or the whole key); returns the id."""
        with self.store.write() as session:
            row = session.get(ApiKey, key_or_id[:12])
            if row is None or (len(key_or_id) > 12 and row.key_hash != _hash_key(key_or_id)):
                raise RegistryError(f"no API key with id {key_or_id[:12]!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                self.store.audit(session, "key_revoke", row.tenant, key_id=row.key_id)
            return row.key_id

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant of a valid, unrevoked key; None otherwise."""
        with self.store.read() as session:
            row = session.scalar(select(ApiKey).where(ApiKey.key_hash == _hash_key(key)))
            return row.tenant if row is not None and row.revoked_at is None else None

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        query = select(ApiKey).order_by(ApiKey.created_at)
        if tenant is not None:
            query = query.where(ApiKey.tenant == tenant)
        with self.store.read() as session:
            return [
                KeyRecord(k.key_id, k.tenant, as_utc(k.created_at), as_utc(k.revoked_at))
                for k in session.scalars(query)
            ]


BUDGET_FIELDS = ("max_gpu_slots", "max_cpu_bytes")


def _check_budget(budget: dict) -> None:
    """Refuse an unknown field, a value that is not a whole number, or a negative one, naming the
    field."""
    for field_name, value in budget.items():
        if field_name not in BUDGET_FIELDS:
            raise RegistryError(
                f"unknown budget field {field_name!r}: use {' or '.join(BUDGET_FIELDS)}"
            )
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RegistryError(f"{field_name} must be a whole number, not {value!r}")
        if value is not None and value < 0:
            raise RegistryError(f"{field_name} must be >= 0, not {value}")


def check_tenant_limits(limits: dict) -> None:
    """RegistryError for an unknown limit or one below 1 (None stands for the server's default)."""
    unknown = set(limits) - set(TENANT_LIMITS)
    if unknown:
        raise RegistryError(
            f"unknown tenant limit {sorted(unknown)[0]!r}: use {', '.join(TENANT_LIMITS)}"
        )
    for field, value in limits.items():
        if value is not None and value < 1:
            raise RegistryError(
                f"{field} {value}: give at least 1 (or none for the server's default)"
            )


def _tenant_record(t: Tenant) -> TenantRecord:
    return TenantRecord(
        t.name,
        t.priority,
        as_utc(t.created_at),
        max_gpu_slots=t.max_gpu_slots,
        max_cpu_bytes=t.max_cpu_bytes,
        max_concurrent_requests=t.max_concurrent_requests,
        max_waiting=t.max_waiting,
    )
