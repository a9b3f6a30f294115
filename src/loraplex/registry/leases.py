"""Leases in the registry (table `leases`) for jobs of the whole fleet that one process does at a
time, such as placement: a process takes the lease when no one holds it (never held, released,
run out, or its holder's process gone from this host), and renews it while it works."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry import db
from loraplex.registry.db import Lease, as_utc, utcnow
from loraplex.registry.registry import Registry
from loraplex.registry.rollouts import holder_is_gone


@dataclass(frozen=True)
class LeaseState:
    name: str
    holder: str | None
    expires_at: datetime | None

    def alive(self, now: datetime | None = None) -> bool:
        """Someone holds it: it runs, and its holder, when on this host, lives."""
        if self.holder is None or self.expires_at is None:
            return False
        return self.expires_at > (now or utcnow()) and not holder_is_gone(self.holder)


class Leases:
    """The leases of one registry."""

    def __init__(self, registry: Registry):
        self.store = registry.db

    def get(self, name: str) -> LeaseState:
        self.store.check_ready()
        with Session(self.store.engine) as session:
            row = session.get(Lease, name)
            if row is None:
                return LeaseState(name, None, None)
            return LeaseState(name, row.holder, as_utc(row.expires_at) if row.expires_at else None)

    def take(self, name: str, holder: str, lease_s: float) -> LeaseState:
        """Take or renew the lease for `holder` when no one else holds it; the lease as it is now
        (another holder's, when that one holds it)."""
        try:
            return self._take(name, holder, lease_s)
        except IntegrityError:  # another process made the lease's row meanwhile: it holds it
            return self.get(name)

    def _take(self, name: str, holder: str, lease_s: float) -> LeaseState:
        self.store.check_ready()
        with Session(db.writer(self.store.engine), expire_on_commit=False) as session:
            with session.begin():
                now = utcnow()
                # FOR UPDATE: two takers of a lease that is free wait on each other (PostgreSQL);
                # SQLite's write transaction (BEGIN IMMEDIATE) does it there
                row = session.get(Lease, name, with_for_update=True)
                if row is None:
                    row = Lease(name=name)
                    session.add(row)
                current = LeaseState(
                    name, row.holder, as_utc(row.expires_at) if row.expires_at else None
                )
                if current.holder not in (None, holder) and current.alive(now):
                    return current
                row.holder, row.expires_at = holder, now + timedelta(seconds=lease_s)
                return LeaseState(name, holder, row.expires_at)

    def release(self, name: str, holder: str) -> None:
        """Give the lease up, if `holder` holds it."""
        self.store.check_ready()
        with Session(db.writer(self.store.engine)) as session, session.begin():
            row = session.get(Lease, name, with_for_update=True)
            if row is not None and row.holder == holder:
                row.holder, row.expires_at = None, None
