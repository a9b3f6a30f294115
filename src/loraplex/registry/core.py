"""What every part of the registry shares: the database, its sessions, the audit event, and the
records made from its rows."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.artifacts import AllowList, ArtifactStore
from loraplex.registry import changes, db
from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    AuditEvent,
    ChangeCounter,
    Revision,
    Traffic,
    as_utc,
    utcnow,
)
from loraplex.registry.errors import (
    LifecycleError,
    RegistryError,
)
from loraplex.registry.records import (
    AdapterRecord,
    RevisionRecord,
)

if TYPE_CHECKING:
    from loraplex.registry.resolution import _Snapshot

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WARM_POLICIES = ("gpu", "cpu", "on_demand")
PIN_TIERS = ("gpu", "cpu")

log = logging.getLogger("loraplex.registry")


def default_store_for(url: str) -> ArtifactStore | None:
    """`<db dir>/artifacts` for a SQLite file; None for a server database (the operator names a
    store)."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        return ArtifactStore(Path(url.removeprefix("sqlite:///")).parent / "artifacts")
    return None


class RegistryCore:
    """The database and the settings every part reads; one transaction per change, with its audit
    event."""

    def __init__(
        self,
        url: str,
        store: ArtifactStore | None = None,
        *,
        base_model_dir: str | Path | None = None,
        max_lora_rank: int = 64,
        trusted_keys: tuple = (),
        allowed: AllowList | None = None,
        storage_base: str | None = None,
        grace_period_s: float = 600.0,
        actor: str = "loraplex",
        strict_base_model_name: bool = False,
    ):
        """`storage_base`: URL under which the store's `<hex>` directories are served (else file://
        URIs).

        `allowed`: when set, `add_revision` only reads adapter directories under its roots.
        `trusted_keys`: ed25519 public keys; when set, unsigned or badly signed revisions are
        refused. `strict_base_model_name`: refuse an adapter whose config names another base model
        (by default a warning: its shapes are checked against the base model either way).
        """
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.engine = db.make_engine(url)
        self._writer = db.writer(self.engine)
        self._reader = db.single_statement_reader(self.engine)
        self.store = store if store is not None else default_store_for(url)
        self.base_model_dir = Path(base_model_dir) if base_model_dir else None
        self.max_lora_rank = max_lora_rank
        self.strict_base_model_name = strict_base_model_name
        self.trusted_keys = tuple(trusted_keys)
        self.allowed = allowed
        self.storage_base = storage_base.rstrip("/") if storage_base else None
        self.grace_period = timedelta(seconds=grace_period_s)
        self.actor = actor
        self._rng = random.Random()
        self._snapshots: dict[str, _Snapshot] = {}  # name -> what resolve last read about it
        # SQLite: the change count is read on a connection of its own, without SQLAlchemy's
        # checkout and statement layers (5 µs against 140: the server reads it for every request)
        self._counter_lock = threading.Lock()
        self._counter = None  # its DBAPI connection, made at first use
        self._ready = self._schema_ready()  # a newer schema refuses here, before any work

    def _schema_ready(self) -> bool:
        ready = db.check_schema(self.engine)
        if ready:
            # a database made by an older version: the tables added since
            db.add_missing_tables(self.engine)
            db.add_missing_columns(self.engine)  # and the columns
            changes.install(self.engine)  # the change feed's triggers
        return ready

    def close(self) -> None:
        with self._counter_lock:
            counter, self._counter = self._counter, None
        if counter is not None:
            counter.close()
        self.engine.dispose()

    def init(self) -> None:
        """Create the tables (idempotent)."""
        db.create_schema(self.engine)
        changes.install(self.engine)
        self._ready = True

    # ---- sessions --------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if not self._ready:
            self._ready = self._schema_ready()
        if not self._ready:
            raise RegistryError(
                f"the registry at {self.url} is not initialized: run `loraplex registry init`"
            )

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        self._check_ready()
        with Session(self.engine) as session, session.begin():
            yield session

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """One transaction; it first bumps the change count, which also makes writers wait one at a
        time."""
        self._check_ready()
        try:
            with Session(self._writer, expire_on_commit=False) as session, session.begin():
                session.execute(
                    update(ChangeCounter)
                    .where(ChangeCounter.id == 1)
                    .values(value=ChangeCounter.value + 1)
                )
                yield session
        except IntegrityError as exc:
            raise LifecycleError(
                f"a concurrent change conflicted with this one; retry ({exc.orig})"
            ) from None

    def _audit(self, session: Session, action: str, target: str, **detail) -> None:
        session.add(
            AuditEvent(
                at=utcnow(),
                actor=self.actor,
                action=action,
                target=target,
                detail=json.dumps(detail, sort_keys=True, default=str),
            )
        )

    def _apply_traffic(
        self, session: Session, name: str, plan: dict[str, int], stable: str | None
    ) -> None:
        """Replace the name's traffic rows by `plan` and set statuses to match, inside the caller's
        transaction."""
        now = utcnow()
        for row, _ in q.serving_weights(session, name):
            if row.revision not in plan:
                row.retired_at = now  # its grace period starts
                row.status = "deprecated" if row.status == "stable" else "staging"
        session.execute(delete(Traffic).where(Traffic.adapter_name == name))
        for revision, weight in plan.items():
            row = q.find_revision(session, name, revision, None)
            session.add(Traffic(adapter_name=name, revision_id=row.id, weight=weight))
            row.retired_at = None
            if revision == stable and row.status != "stable":
                row.status, row.stable_since, row.status_reason = "stable", now, None
            elif revision != stable:
                row.status, row.status_reason = "canary", None

    @staticmethod
    def _record(session: Session, adapter: Adapter, row: Revision) -> RevisionRecord:
        return revision_record(
            adapter, row, q.grants(session, adapter.name), q.weights(session, adapter.name)
        )


def revision_record(
    adapter, row, grants: tuple[str, ...], weights: dict[int, int]
) -> RevisionRecord:
    """From ORM objects, or from plain rows of the same tables (the per-request path)."""
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
    )
