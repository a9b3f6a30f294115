"""Where each rollout stands, in the registry (table `rollouts`), with the lease of the controller
driving it, and its decisions as audit events: written together, one transaction each."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.registry import db
from loraplex.registry.db import Revision, Rollout, as_utc, utcnow
from loraplex.registry.errors import AdapterNotFound, LifecycleError, RegistryError
from loraplex.registry.registry import Registry

ACTIVE = db.ROLLOUT_ACTIVE
"""Phases of a rollout under way: `rolling_back` is a rollback decided and not yet seen applied."""
ENDED = ("promoted", "rolled_back", "aborted", "ended")
"""`ended`: by someone else (a quarantine, a manual rollback or split)."""


class LeaseHeld(RegistryError):
    """Another controller drives this rollout; the message names it."""


class RolloutEnded(LifecycleError):
    """The rollout was ended meanwhile (an abort): a controller's later decision is refused."""


@dataclass(frozen=True)
class RolloutRecord:
    name: str
    revision: str
    stable_revision: str
    steps: tuple[int, ...]
    step: int
    phase: str
    reason: str | None
    settings: dict
    last_decision: dict | None
    started_at: datetime
    step_started_at: datetime
    updated_at: datetime
    holder: str | None
    lease_expires_at: datetime | None

    @property
    def weight(self) -> int:
        """The canary's percent at the step under way."""
        return self.steps[min(self.step, len(self.steps) - 1)]

    @property
    def is_active(self) -> bool:
        return self.phase in ACTIVE

    def lease_alive(self, now: datetime | None = None) -> bool:
        """A controller holds it: its lease runs, and its process, when on this host, lives."""
        if self.holder is None or self.lease_expires_at is None:
            return False
        return self.lease_expires_at > (now or utcnow()) and not holder_is_gone(self.holder)

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("started_at", "step_started_at", "updated_at", "lease_expires_at"):
            out[key] = out[key].isoformat() if out[key] else None
        out["steps"], out["weight"] = list(self.steps), self.weight
        out["controller_alive"] = self.lease_alive()
        return out


def this_holder() -> str:
    """`HOST:PID` of this process: what a lease names."""
    return f"{socket.gethostname()}:{os.getpid()}"


def holder_is_gone(holder: str) -> bool:
    """True for a holder on this host whose process has exited: its lease need not run out."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def parse_steps(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


class RolloutStore:
    """The rollouts of one registry (its database, its actor for the audit events)."""

    def __init__(self, registry: Registry):
        self.store = registry.db

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        self.store.check_ready()
        writer = db.writer(self.store.engine)
        with Session(writer, expire_on_commit=False) as session, session.begin():
            yield session

    def _audit(self, session: Session, action: str, row: Rollout, **detail) -> None:
        self.store.audit(session, action, f"{row.name}@{row.revision}", **detail)

    def get(self, name: str) -> RolloutRecord | None:
        self.store.check_ready()
        with Session(self.store.engine) as session:
            row = session.get(Rollout, name)
            return _record(row) if row is not None else None

    def begin(
        self,
        name: str,
        revision: str,
        stable: str,
        steps: tuple[int, ...],
        settings: dict,
        lease_s: float,
        holder: str | None = None,
    ) -> tuple[RolloutRecord, bool]:
        """Take the lease of `name`'s rollout of `revision`: a new one, or the one under way
        (resumed: True). Refuses while another controller holds it, naming that controller, and
        while a rollout of another revision is under way."""
        holder = holder or this_holder()
        now = utcnow()
        with self._write() as session:
            row = session.get(Rollout, name, with_for_update=True)
            if row is not None and row.phase in ACTIVE:
                _refuse_other(_record(row), revision, holder, now)
                row.holder, row.lease_expires_at = holder, now + timedelta(seconds=lease_s)
                row.updated_at = now
                self._audit(session, "rollout_resume", row, step=row.step, holder=holder)
                return _record(row), True
            if row is None:
                row = Rollout(name=name)
                session.add(row)
            row.revision, row.stable_revision = revision, stable
            row.steps, row.step = ",".join(map(str, steps)), 0
            row.phase, row.reason, row.last_decision = "running", None, None
            row.settings = json.dumps(settings, sort_keys=True, default=str)
            row.started_at = row.step_started_at = row.updated_at = now
            row.holder, row.lease_expires_at = holder, now + timedelta(seconds=lease_s)
            self._audit(
                session, "rollout_start", row, stable=stable, steps=list(steps), settings=settings
            )
            return _record(row), False

    def renew(self, name: str, holder: str, lease_s: float) -> RolloutRecord:
        """Extend the lease; the record as it is now (its phase may have been ended elsewhere)."""
        with self._write() as session:
            row = _held(session, name, holder)
            row.lease_expires_at = utcnow() + timedelta(seconds=lease_s)
            return _record(row)

    def record(
        self,
        name: str,
        holder: str,
        action: str,
        decision: dict,
        *,
        step: int | None = None,
        phase: str | None = None,
        reason: str | None = None,
    ) -> RolloutRecord:
        """A decision: its audit event (`action`, with the figures it was based on) and the
        rollout's new step or phase, in one transaction."""
        now = utcnow()
        with self._write() as session:
            row = _held(session, name, holder)
            if row.phase not in ACTIVE:
                raise RolloutEnded(f"{name}'s rollout has ended ({row.phase}: {row.reason})")
            if step is not None and step != row.step:
                row.step, row.step_started_at = step, now
            if phase is not None:
                row.phase = phase
            if reason is not None:
                row.reason = reason
            row.last_decision = json.dumps({"action": action, **decision}, default=str)
            row.updated_at = now
            self._audit(session, action, row, **decision)
            return _record(row)

    def release(self, name: str, holder: str) -> None:
        with self._write() as session:
            row = session.get(Rollout, name, with_for_update=True)
            if row is not None and row.holder == holder:
                row.holder, row.lease_expires_at = None, None

    def end(self, name: str, phase: str, reason: str, action: str, **detail) -> RolloutRecord:
        """End the rollout under way whoever holds it (an abort, an ending found by a status)."""
        if phase not in ENDED:
            raise ValueError(f"{phase!r} is not an ending phase")
        with self._write() as session:
            row = session.get(Rollout, name, with_for_update=True)
            if row is None or row.phase not in ACTIVE:
                raise LifecycleError(f"{name} has no rollout under way")
            row.phase, row.reason, row.updated_at = phase, reason, utcnow()
            row.last_decision = json.dumps({"action": action, "reason": reason, **detail})
            self._audit(session, action, row, reason=reason, **detail)
            return _record(row)

    def active(self) -> list[RolloutRecord]:
        """The rollouts under way."""
        self.store.check_ready()
        with Session(self.store.engine) as session:
            rows = session.scalars(select(Rollout).where(Rollout.phase.in_(ACTIVE)))
            return [_record(row) for row in rows]

    def eval_set(self, name: str, revision: str) -> str | None:
        """The eval set (JSONL) registered with a revision, None when it has none."""
        self.store.check_ready()
        with Session(self.store.engine) as session:
            row = session.execute(
                select(Revision.id, Revision.eval_set).where(
                    Revision.adapter_name == name, Revision.revision == revision
                )
            ).first()
        if row is None:
            raise AdapterNotFound(f"{name}@{revision}")
        return row.eval_set


def _refuse_other(record: RolloutRecord, revision: str, holder: str, now: datetime) -> None:
    if record.holder != holder and record.lease_alive(now):
        assert record.lease_expires_at is not None  # a live lease has its expiry
        raise LeaseHeld(
            f"{record.name}@{record.revision} is being rolled out by the controller "
            f"{record.holder} (its lease runs until {record.lease_expires_at:%H:%M:%S} UTC); "
            "stop it, or let its lease run out"
        )
    if record.revision != revision:
        raise LifecycleError(
            f"a rollout of {record.name}@{record.revision} is under way (step {record.step + 1} "
            f"of {len(record.steps)}); resume it, or `loraplex rollout abort {record.name}` first"
        )


def _held(session: Session, name: str, holder: str) -> Rollout:
    row = session.get(Rollout, name, with_for_update=True)
    if row is None:
        raise LifecycleError(f"{name} has no rollout")
    if row.holder != holder:
        raise LeaseHeld(
            f"the lease of {name}'s rollout is held by {row.holder or 'no controller'}, not "
            f"{holder}: this controller stops"
        )
    return row


def _utc(value: datetime) -> datetime:
    utc = as_utc(value)
    assert utc is not None  # a column without NULLs
    return utc


def _record(row: Rollout) -> RolloutRecord:
    return RolloutRecord(
        name=row.name,
        revision=row.revision,
        stable_revision=row.stable_revision,
        steps=parse_steps(row.steps),
        step=row.step,
        phase=row.phase,
        reason=row.reason,
        settings=json.loads(row.settings or "{}"),
        last_decision=json.loads(row.last_decision) if row.last_decision else None,
        started_at=_utc(row.started_at),
        step_started_at=_utc(row.step_started_at),
        updated_at=_utc(row.updated_at),
        holder=row.holder,
        lease_expires_at=as_utc(row.lease_expires_at),
    )
