"""The registry's Python API: register, resolve, roll out and roll back adapter revisions, tenants
and keys.

Every change is one database transaction that also writes its audit event; reads see one committed
state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import Row, bindparam, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.artifacts import AllowList, ArtifactStore, Pieces, artifact_files, canonical_digest
from loraplex.lora_format import CONFIG_FILE, base_model_mismatch, read_adapter
from loraplex.model_config import ModelConfig, ModelConfigError, base_model_digest
from loraplex.registry import db
from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    ApiKey,
    ArtifactPieces,
    ArtifactPiecesBlake3,
    AuditEvent,
    ChangeCounter,
    Grant,
    PinTier,
    Revision,
    Tenant,
    Traffic,
    as_utc,
    utcnow,
)
from loraplex.registry.errors import (
    AdapterNotFound,
    AdapterRejected,
    LifecycleError,
    RegistryError,
    RevisionUnavailable,
)
from loraplex.registry.records import (
    AdapterRecord,
    AuditRecord,
    KeyRecord,
    RevisionRecord,
    TenantRecord,
)
from loraplex.registry.release import ReleaseChecks, parse_eval_set
from loraplex.registry.signing import read_signature_file, verify_digest
from loraplex.registry.traffic import pick

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
WARM_POLICIES = ("gpu", "cpu", "on_demand")
PIN_TIERS = ("gpu", "cpu")
KEY_PREFIX = "lpx-"
TENANT_LIMITS = ("max_concurrent_requests", "max_waiting")
MAX_CACHED_NAMES = 100_000

log = logging.getLogger("loraplex.registry")


def _hash_key(key: str) -> str:
    # Keys are 256-bit random strings, so a plain sha256 is enough (no password-style stretching
    # needed).
    return hashlib.sha256(key.encode()).hexdigest()


def default_store_for(url: str) -> ArtifactStore | None:
    """`<db dir>/artifacts` for a SQLite file; None for a server database (the operator names a
    store)."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        return ArtifactStore(Path(url.removeprefix("sqlite:///")).parent / "artifacts")
    return None


class Registry:
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

    # ---- registration ----------------------------------------------------------------------------

    def add_revision(
        self,
        src_dir: str | Path,
        name: str,
        revision: str | None = None,
        tenant: str | None = None,
        shared: bool | None = None,
        base_model_dir: str | Path | None = None,
        warm_policy: str | None = None,
        priority: int | None = None,
        status: str = "staging",
        eval_set: str | Path | None = None,
        signature: str | None = None,
        digest: str | None = None,
        base_model: str | None = None,
    ) -> RevisionRecord:
        """Validate an adapter directory, put it into the store and record it, in one transaction.

        `tenant` owns the adapter (None: shared by all); `shared=True` with a tenant makes an owned
        adapter usable by all. `digest`: refuse unless the files hash to it. `status`: "staging" (no
        traffic yet) or "stable" (100% of the name's traffic at once, as `serve --lora-modules`
        does). Registering the same bytes again under the same name returns the existing revision.
        """
        _check_names(name, revision, warm_policy, status)
        src = Path(src_dir)
        if self.allowed is not None:
            self._check_source_allowed(src)
        spec, base_name, base_digest = self._validate(src, base_model_dir, base_model)
        cases_text = Path(eval_set).read_text() if eval_set is not None else None
        if cases_text is not None:
            parse_eval_set(cases_text)
        actual = canonical_digest(src)
        if digest is not None and digest != actual:
            raise AdapterRejected(
                "digest", f"the files hash to {actual}, not to the expected {digest}"
            )
        if signature is None:
            signature = read_signature_file(src)
        if self.trusted_keys:
            verify_digest(actual, signature, self.trusted_keys)
        if self.store is None:
            raise RegistryError(
                "no artifact store configured for this registry (pass store=ArtifactStore(DIR))"
            )
        # from the read hashing the copy
        stored, (pieces, sha256_pieces) = self.store.put_with_piece_lists(src)
        if stored != actual:
            raise AdapterRejected(
                "digest", f"the files in {src} changed while they were being registered"
            )
        with self._write() as session:
            if not self.store.has(actual) and self.store.put(src) != actual:
                # removed by a gc since the put
                raise AdapterRejected(
                    "digest", f"the files in {src} changed while they were being registered"
                )
            # Both lists, also for bytes registered before the tables: the BLAKE3 one this version
            # checks, and the sha256 one earlier versions read (they refuse another hash), for
            # servers of both sharing a registry.
            if session.get(ArtifactPiecesBlake3, actual) is None:
                session.add(ArtifactPiecesBlake3(digest=actual, pieces=pieces.to_json()))
            if session.get(ArtifactPieces, actual) is None:
                session.add(ArtifactPieces(digest=actual, pieces=sha256_pieces.to_json()))
            adapter = self._adapter_for_add(
                session, name, tenant, shared, spec.task_type, warm_policy, priority
            )
            existing = q.find_revision(session, name, revision, actual)
            if existing is not None:
                return self._record(session, adapter, existing)
            row = Revision(
                adapter_name=name,
                revision=revision or q.next_revision(session, name),
                digest=actual,
                base_model=base_name,
                base_model_digest=base_digest,
                rank=spec.rank,
                lora_alpha=spec.lora_alpha,
                dtype=spec.dtype,
                target_modules=",".join(spec.target_modules),
                estimated_bytes=spec.estimated_bytes,
                actual_bytes=spec.actual_bytes,
                storage_uri=self._storage_uri(actual),
                signature=signature,
                eval_set=cases_text,
                status="staging",
                created_at=utcnow(),
            )
            session.add(row)
            session.flush()
            self._audit(
                session,
                "add",
                f"{name}@{row.revision}",
                digest=actual,
                status=status,
                owner=adapter.owner_tenant,
                shared=adapter.shared,
                estimated_bytes=spec.estimated_bytes,
            )
            if status == "stable":
                self._apply_traffic(session, name, {row.revision: 100}, stable=row.revision)
            return self._record(session, adapter, row)

    def _check_source_allowed(self, src: Path) -> None:
        root = self.allowed.root_for(src.resolve().as_uri())
        for name in artifact_files(src):
            if not (src / name).resolve().is_relative_to(root):
                raise AdapterRejected(
                    "path", f"{src / name} is a symlink out of the allowed root {root}"
                )

    def _validate(self, src: Path, base_model_dir, base_model: str | None):
        """(AdapterSpec, base model name, base model digest), or AdapterRejected naming field and
        reason."""
        base_dir = (
            Path(base_model_dir)
            if base_model_dir
            else self.base_model_dir or _base_dir_named_by(src)
        )
        if base_dir is None:
            raise AdapterRejected(
                "base_model", "no base model to validate against: pass --base-model DIR"
            )
        try:
            model = ModelConfig.from_dir(base_dir)
        except (ModelConfigError, OSError, ValueError) as exc:
            raise AdapterRejected("base_model", f"{base_dir}: {exc}") from None
        spec = read_adapter(src, model, self.max_lora_rank)
        base_name = base_model or base_dir.resolve().name
        mismatch = base_model_mismatch(spec, base_name)
        if mismatch and self.strict_base_model_name:
            raise AdapterRejected("base_model_name_or_path", mismatch)
        if mismatch:
            log.warning(
                "%s: %s; accepted, as its shapes fit (--strict-base-model-name refuses it)",
                src,
                mismatch,
            )
        return spec, base_name, base_model_digest(base_dir)

    def _adapter_for_add(
        self, session, name, tenant, shared, task_type, warm_policy, priority
    ) -> Adapter:
        if tenant is not None and session.get(Tenant, tenant) is None:
            raise AdapterRejected(
                "tenant",
                f"unknown tenant {tenant!r}; add it with `loraplex registry tenant add {tenant}`",
            )
        adapter = q.locked_adapter(session, name)
        if adapter is None:
            adapter = Adapter(
                name=name,
                owner_tenant=tenant,
                shared=tenant is None if shared is None else shared,
                task_type=task_type,
                priority=priority or 0,
                warm_policy=warm_policy or "on_demand",
                pinned=False,
                created_at=utcnow(),
            )
            session.add(adapter)
            session.flush()
            return adapter
        if tenant is not None and tenant != adapter.owner_tenant:
            raise AdapterRejected(
                "tenant", f"{name} is not owned by tenant {tenant!r}; pick another name"
            )
        if shared is not None:
            adapter.shared = shared
        if warm_policy is not None:
            adapter.warm_policy = warm_policy
        if priority is not None:
            adapter.priority = priority
        return adapter

    def _storage_uri(self, digest: str) -> str:
        if self.storage_base:
            return f"{self.storage_base}/{digest.removeprefix('sha256:')}"
        return self.store.uri(digest)

    # ---- resolution ------------------------------------------------------------------------------

    def resolve(
        self, tenant: str, model: str, user: str | None = None, change_count: int | None = None
    ) -> RevisionRecord:
        """The revision a request for `model` (`name` or `name@revision`) by `tenant` gets.

        Weighted by the traffic split, sticky per `user` when given. A name the tenant may not use
        raises exactly the same AdapterNotFound as a name that does not exist. `change_count`: a
        `change_count()` the caller read after its request arrived; what was read at that count is
        used without a query.
        """
        name, _, revision = model.partition("@")
        snapshot = self._snapshot(name, change_count) if NAME_RE.fullmatch(name) else None
        if snapshot is None or not q.may_use(snapshot.adapter, snapshot.grants, tenant):
            raise AdapterNotFound(model)
        if revision:
            record = snapshot.records.get(revision)
            if record is None:
                raise AdapterNotFound(model)
            if record.status == "quarantined":
                raise RevisionUnavailable(
                    f"{model} is quarantined ({record.status_reason}); it is never served"
                )
            return record
        if not snapshot.serving:
            raise RevisionUnavailable(_nothing_in_service(name, snapshot.records.values()))
        return snapshot.records[pick(name, snapshot.serving, user, self._rng)]

    def change_count(self) -> int:
        """A number every registry change moves (one query): a reader may keep what it read until it
        moves."""
        self._check_ready()
        if self.engine.dialect.name != "sqlite":
            with self._reader.connect() as conn:
                return conn.execute(_CHANGE_COUNT).scalar_one()
        with self._counter_lock:
            if self._counter is None:
                self._counter = self.engine.raw_connection()
            try:
                cursor = self._counter.cursor()
                try:
                    cursor.execute(_CHANGE_COUNT_SQL)
                    return cursor.fetchone()[0]
                finally:
                    cursor.close()
            except Exception:  # the next read opens a fresh connection
                self._counter.invalidate()
                self._counter = None
                raise

    def _snapshot(self, name: str, change_count: int | None = None) -> _Snapshot | None:
        """What resolution needs about `name`, read again only when the registry changed since (one
        query, none when `change_count` is that of the snapshot kept)."""
        cached = self._snapshots.get(name)
        if cached is not None and cached.change_count == change_count:
            return cached
        self._check_ready()
        with self._reader.connect() as conn:
            change_count = conn.execute(_CHANGE_COUNT).scalar_one()
            cached = self._snapshots.get(name)
            if cached is not None and cached.change_count == change_count:
                return cached
            adapter = conn.execute(_ADAPTER_BY_NAME, {"name": name}).first()
            if adapter is None:
                return None
            grants = tuple(conn.execute(_GRANTS_OF, {"name": name}).scalars())
            # One statement for revisions and weights, so that statuses and the split come from one
            # commit.
            rows = conn.execute(_REVISIONS_WITH_WEIGHT, {"name": name}).all()
        weights = {r.id: r.weight for r in rows if r.weight}
        records = {r.revision: _revision_record(adapter, r, grants, weights) for r in rows}
        snapshot = _Snapshot(
            change_count, adapter, grants, records, _serving_order(records.values())
        )
        if len(self._snapshots) >= MAX_CACHED_NAMES:
            self._snapshots.clear()
        self._snapshots[name] = snapshot
        return snapshot

    def pieces(self, digest: str) -> Pieces | None:
        """The piece list recorded for an artifact at registration (None for one registered before
        there were piece lists): what lets a load check its bytes on several cores."""
        with self._read() as session:
            row = session.get(ArtifactPiecesBlake3, digest) or session.get(ArtifactPieces, digest)
            return Pieces.from_json(row.pieces) if row is not None else None

    def tenant_may_use(self, tenant: str, name: str) -> bool:
        with self._read() as session:
            adapter = session.get(Adapter, name)
            return adapter is not None and q.may_use(adapter, q.grants(session, name), tenant)

    # ---- reading ---------------------------------------------------------------------------------

    def list_adapters(self, tenant: str | None = None) -> list[AdapterRecord]:
        """Every adapter, or only those `tenant` may use."""
        with self._read() as session:
            grants = q.all_grants(session)
            adapters = session.scalars(select(Adapter).order_by(Adapter.name)).all()
            visible = [
                a
                for a in adapters
                if tenant is None or q.may_use(a, grants.get(a.name, ()), tenant)
            ]
            revisions: dict[str, list[Revision]] = {}
            for row in session.scalars(select(Revision).order_by(Revision.id)):
                revisions.setdefault(row.adapter_name, []).append(row)
            weights = {
                rid: w for rid, w in session.execute(select(Traffic.revision_id, Traffic.weight))
            }
            tiers = {n: t for n, t in session.execute(select(PinTier.adapter_name, PinTier.tier))}
            return [
                _adapter_record(
                    a, grants.get(a.name, ()), revisions.get(a.name, []), weights, tiers.get(a.name)
                )
                for a in visible
            ]

    def show(self, name: str) -> AdapterRecord:
        with self._read() as session:
            adapter = session.get(Adapter, name)
            if adapter is None:
                raise AdapterNotFound(name)
            rows = session.scalars(
                select(Revision).where(Revision.adapter_name == name).order_by(Revision.id)
            )
            tier = session.get(PinTier, name)
            return _adapter_record(
                adapter,
                q.grants(session, name),
                list(rows),
                q.weights(session, name),
                tier.tier if tier is not None else None,
            )

    def get_revision(self, name: str, revision: str) -> RevisionRecord:
        with self._read() as session:
            adapter = session.get(Adapter, name)
            row = q.find_revision(session, name, revision, None) if adapter else None
            if row is None:
                raise AdapterNotFound(f"{name}@{revision}")
            return self._record(session, adapter, row)

    def grace_revisions(self) -> list[RevisionRecord]:
        """Revisions that left traffic less than the grace period ago: keep them warm, do not evict
        yet."""
        cutoff = utcnow() - self.grace_period
        with self._read() as session:
            rows = session.scalars(
                select(Revision).where(
                    Revision.retired_at >= cutoff, Revision.status != "quarantined"
                )
            ).all()
            return [self._record(session, session.get(Adapter, r.adapter_name), r) for r in rows]

    def audit_events(self, limit: int = 100, target: str | None = None) -> list[AuditRecord]:
        """Newest first; `target` filters to one adapter (its name and every `name@revision`)."""
        query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
        if target is not None:
            revisions = AuditEvent.target.startswith(f"{target}@", autoescape=True)
            query = query.where((AuditEvent.target == target) | revisions)
        with self._read() as session:
            return [
                AuditRecord(e.id, as_utc(e.at), e.actor, e.action, e.target, json.loads(e.detail))
                for e in session.scalars(query)
            ]

    @staticmethod
    def _record(session: Session, adapter: Adapter, row: Revision) -> RevisionRecord:
        return _revision_record(
            adapter, row, q.grants(session, adapter.name), q.weights(session, adapter.name)
        )

    # ---- life cycle ------------------------------------------------------------------------------

    def promote(
        self,
        name: str,
        revision: str,
        weight: int = 100,
        checks: ReleaseChecks | None = None,
        force: bool = False,
    ) -> AdapterRecord:
        """Give `revision` `weight`% of the traffic (100: it becomes stable; less: a canary beside
        the stable).

        A revision that has no traffic yet first passes the release checks; with no checks given,
        one that has an eval set is refused unless `force`.
        """
        if not 1 <= weight <= 100:
            raise LifecycleError(f"weight must be between 1 and 100, got {weight}")
        summary = self._release_checks(name, revision, checks, force)
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            row = q.revision_or_404(session, name, revision)
            q.refuse_quarantined(row)
            stable = q.current_stable(session, name)
            if weight == 100:
                plan, new_stable = {revision: 100}, revision
            else:
                plan, new_stable = self._canary_plan(session, name, revision, weight, stable)
            self._apply_traffic(session, name, plan, stable=new_stable)
            self._audit(
                session,
                "promote",
                f"{name}@{revision}",
                weight=weight,
                traffic=plan,
                checks=summary,
            )
        return self.show(name)

    def _canary_plan(self, session, name, revision, weight, stable) -> tuple[dict[str, int], str]:
        if stable is None or stable.revision == revision:
            raise LifecycleError(
                f"{name}@{revision} cannot be a {weight}% canary: "
                + (
                    "it is the stable revision"
                    if stable
                    else f"{name} has no stable revision; promote with weight 100"
                )
            )
        others = [
            r.revision
            for r in q.serving(session, name)
            if r.revision not in (revision, stable.revision)
        ]
        if others:
            raise LifecycleError(
                f"{name}@{others[0]} is already in canary; promote it to 100 or roll back first"
            )
        return {revision: weight, stable.revision: 100 - weight}, stable.revision

    def _release_checks(
        self, name: str, revision: str, checks: ReleaseChecks | None, force: bool
    ) -> dict | str:
        with self._read() as session:
            adapter = session.get(Adapter, name)
            row = q.find_revision(session, name, revision, None) if adapter else None
            if row is None:
                raise AdapterNotFound(f"{name}@{revision}")
            q.refuse_quarantined(row)
            if q.weights(session, name).get(row.id):
                return "already in traffic"
            record, eval_text = self._record(session, adapter, row), row.eval_set
        cases = parse_eval_set(eval_text) if eval_text else ()
        if checks is None:
            if cases and not force:
                raise LifecycleError(
                    f"{record.model_id} has an eval set but no release checks were given to run it "
                    "(promote through a running server's admin API, or force it)"
                )
            return "skipped (forced)" if cases else "none configured"
        return checks.run(record, cases)

    def set_traffic(
        self,
        name: str,
        weights: dict[str, int],
        checks: ReleaseChecks | None = None,
        force: bool = False,
    ) -> AdapterRecord:
        """Set the whole split at once (weights in percent, summing to 100; 0 removes a
        revision)."""
        plan = {rev: int(w) for rev, w in weights.items() if int(w) != 0}
        if any(w < 0 for w in plan.values()) or sum(plan.values()) != 100:
            raise LifecycleError(
                f"traffic weights must be non-negative and sum to 100, got {weights}"
            )
        if len(plan) > 2:
            raise LifecycleError(
                f"one canary at a time: a split names the stable and at most one canary, got {plan}"
            )
        summaries = {rev: self._release_checks(name, rev, checks, force) for rev in plan}
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            rows = {rev: q.revision_or_404(session, name, rev) for rev in plan}
            for row in rows.values():
                q.refuse_quarantined(row)
            stable = q.current_stable(session, name)
            new_stable = (
                stable.revision
                if stable and stable.revision in plan
                else max(plan, key=lambda rev: (plan[rev], rows[rev].id))
            )
            self._apply_traffic(session, name, plan, stable=new_stable)
            self._audit(session, "set_traffic", name, traffic=plan, checks=summaries)
        return self.show(name)

    def rollback(self, name: str) -> AdapterRecord:
        """One call back: drop the canary if there is one, else return to the previous stable
        revision."""
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            stable = q.current_stable(session, name)
            canaries = [r for r in q.serving(session, name) if stable is None or r.id != stable.id]
            if stable is not None and canaries:
                target, dropped = stable, canaries
            else:
                target, dropped = (
                    q.previous_stable(session, name, stable),
                    [stable] if stable else [],
                )
            self._apply_traffic(session, name, {target.revision: 100}, stable=target.revision)
            for row in dropped:
                row.status, row.status_reason = "deprecated", f"rolled back to {target.revision}"
            self._audit(
                session, "rollback", name, to=target.revision, dropped=[r.revision for r in dropped]
            )
        return self.show(name)

    def deprecate(self, name: str, revision: str | None = None) -> AdapterRecord:
        """Deprecate one revision (it must not serve traffic), or with no revision the whole
        name."""
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            if revision is None:
                self._apply_traffic(session, name, {}, stable=None)
                rows = session.scalars(
                    select(Revision).where(
                        Revision.adapter_name == name, Revision.status != "quarantined"
                    )
                ).all()
            else:
                rows = [q.revision_or_404(session, name, revision)]
                if q.weights(session, name).get(rows[0].id):
                    raise LifecycleError(
                        f"{name}@{revision} serves traffic; promote another revision or roll back "
                        "first"
                    )
                q.refuse_quarantined(rows[0])
            for row in rows:
                row.status, row.status_reason = "deprecated", "deprecated by operator"
            self._audit(session, "deprecate", f"{name}@{revision}" if revision else name)
        return self.show(name)

    def quarantine(self, name: str, revision: str, reason: str) -> AdapterRecord:
        """Never serve this revision again; its traffic goes back to the stable (or the previous
        stable)."""
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            row = q.revision_or_404(session, name, revision)
            serving = {r.revision: w for r, w in q.serving_weights(session, name)}
            weight = serving.pop(revision, 0)
            stable = q.current_stable(session, name)
            if stable is not None and stable.id != row.id:
                heir = stable
            else:
                heir = q.previous_stable(session, name, row, required=False)
            if weight and heir is not None:
                serving[heir.revision] = serving.get(heir.revision, 0) + weight
            elif weight:
                serving = {}  # no earlier stable: never let a canary silently take all the traffic
            self._apply_traffic(
                session, name, serving, stable=heir.revision if heir and serving else None
            )
            row.status, row.status_reason = "quarantined", reason
            self._audit(session, "quarantine", f"{name}@{revision}", reason=reason, traffic=serving)
        return self.show(name)

    def pin(self, name: str, pinned: bool = True, tier: str = "cpu") -> AdapterRecord:
        """A pinned adapter is kept resident by the cache in `tier` (never chosen for eviction from
        it); a server pins it there again at its next start. Unpinning also ends a warm policy of
        gpu or cpu (it becomes `on_demand`): that policy is a pin too, and the operator's call
        overrides the manifest's."""
        if pinned and tier not in PIN_TIERS:
            raise RegistryError(f"a pin's tier is gpu or cpu, not {tier!r}")
        with self._write() as session:
            adapter = q.locked_adapter_or_404(session, name)
            adapter.pinned = pinned
            row = session.get(PinTier, name)
            if not pinned:
                if adapter.warm_policy in PIN_TIERS:
                    adapter.warm_policy = "on_demand"
                if row is not None:
                    session.delete(row)
            elif row is None:
                session.add(PinTier(adapter_name=name, tier=tier))
            else:
                row.tier = tier
            self._audit(
                session, "pin" if pinned else "unpin", name, **({"tier": tier} if pinned else {})
            )
        return self.show(name)

    def unpin(self, name: str) -> AdapterRecord:
        return self.pin(name, pinned=False)

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

    def gc_artifacts(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove store entries no revision refers to and older than `min_age_s` (left by refused or
        interrupted registrations; the age keeps a registration in flight from losing its bytes)."""
        # Under the write lock: a registration commits its row before this reads the digests in use,
        # or after the removals, and then finds its artifact gone and puts it back (add_revision).
        with self._write() as session:
            used = set(session.scalars(select(Revision.digest)))
            cutoff = time.time() - min_age_s
            removed = [
                d
                for d in self.store.digests()
                if d not in used and self.store.path(d).stat().st_mtime < cutoff
            ]
            for digest in removed:
                self.store.remove(digest)
            if removed:
                self._audit(session, "gc", "artifacts", removed=removed)
        return removed

    # ---- tenants, grants, keys -------------------------------------------------------------------

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
        with self._write() as session:
            tenant = session.get(Tenant, name)
            if tenant is None:
                tenant = Tenant(name=name, priority=priority, created_at=utcnow(), **budget)
                session.add(tenant)
                self._audit(session, "tenant_add", name, priority=priority, **budget)
                return _tenant_record(tenant)
            if tenant.priority != priority:
                tenant.priority = priority
                self._audit(session, "tenant_priority", name, priority=priority)
            self._set_budget(session, tenant, budget)
            return _tenant_record(tenant)

    def set_budget(self, name: str, **budget: int | None) -> TenantRecord:
        """Set a tenant's residency budgets: `max_gpu_slots` (device slots) and `max_cpu_bytes`
        (host bytes); None clears one (the server's default share applies). Fields not given stay as
        they are."""
        _check_budget(budget)
        with self._write() as session:
            tenant = q.tenant_or_error(session, name)
            self._set_budget(session, tenant, budget)
            return _tenant_record(tenant)

    def _set_budget(self, session: Session, tenant: Tenant, budget: dict[str, int | None]) -> None:
        changed = {k: v for k, v in budget.items() if getattr(tenant, k) != v}
        if changed:
            for field_name, value in changed.items():
                setattr(tenant, field_name, value)
            self._audit(session, "tenant_budget", tenant.name, **changed)

    def set_tenant_limits(self, name: str, **limits: int | None) -> TenantRecord:
        """Set `max_concurrent_requests` and/or `max_waiting` of a tenant (None: the server's
        default); the limits not named stay as they are."""
        check_tenant_limits(limits)
        with self._write() as session:
            tenant = q.tenant_or_error(session, name)
            changed = {f: v for f, v in limits.items() if getattr(tenant, f) != v}
            for field, value in changed.items():
                setattr(tenant, field, value)
            if changed:
                self._audit(session, "tenant_limits", name, **changed)
            return _tenant_record(tenant)

    def list_tenants(self) -> list[TenantRecord]:
        with self._read() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.name))
            return [_tenant_record(t) for t in rows]

    def grant(self, name: str, tenant: str) -> None:
        with self._write() as session:
            q.locked_adapter_or_404(session, name)
            q.tenant_or_error(session, tenant)
            if session.get(Grant, (name, tenant)) is None:
                session.add(Grant(adapter_name=name, tenant=tenant))
                self._audit(session, "grant", name, tenant=tenant)

    def revoke_grant(self, name: str, tenant: str) -> None:
        with self._write() as session:
            grant = session.get(Grant, (name, tenant))
            if grant is not None:
                session.delete(grant)
                self._audit(session, "revoke_grant", name, tenant=tenant)

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
        with self._write() as session:
            q.tenant_or_error(session, tenant)
            if session.get(ApiKey, key_id) is not None:
                raise RegistryError(f"a key with id {key_id} exists already; use another key")
            session.add(
                ApiKey(key_id=key_id, tenant=tenant, key_hash=_hash_key(key), created_at=utcnow())
            )
            self._audit(session, "key_create", tenant, key_id=key_id)
        return key_id

    def revoke_key(self, key_or_id: str) -> str:
        """Revoke by key id (or the whole key); returns the id."""
        with self._write() as session:
            row = session.get(ApiKey, key_or_id[:12])
            if row is None or (len(key_or_id) > 12 and row.key_hash != _hash_key(key_or_id)):
                raise RegistryError(f"no API key with id {key_or_id[:12]!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                self._audit(session, "key_revoke", row.tenant, key_id=row.key_id)
            return row.key_id

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant of a valid, unrevoked key; None otherwise."""
        with self._read() as session:
            row = session.scalar(select(ApiKey).where(ApiKey.key_hash == _hash_key(key)))
            return row.tenant if row is not None and row.revoked_at is None else None

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        query = select(ApiKey).order_by(ApiKey.created_at)
        if tenant is not None:
            query = query.where(ApiKey.tenant == tenant)
        with self._read() as session:
            return [
                KeyRecord(k.key_id, k.tenant, as_utc(k.created_at), as_utc(k.revoked_at))
                for k in session.scalars(query)
            ]


def _revision_record(
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


def _serving_order(records) -> tuple[tuple[str, int], ...]:
    """(revision, weight) of the revisions with traffic, canaries newest first, then the stable.

    Canaries first: raising a canary's weight then keeps every user it already had.
    """
    serving = [r for r in reversed(list(records)) if r.traffic_weight and r.status != "quarantined"]
    serving.sort(key=lambda r: r.status == "stable")
    return tuple((r.revision, r.traffic_weight) for r in serving)


def _adapter_record(
    adapter: Adapter, grants: tuple[str, ...], rows: list[Revision], weights, pin_tier: str | None
) -> AdapterRecord:
    revisions = tuple(_revision_record(adapter, r, grants, weights) for r in rows)
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
        traffic=_serving_order(revisions),
        revisions=revisions,
        pin_tier=pin_tier if adapter.pinned else None,
    )


# ---- statements of the per-request path (plain SQL, compiled once) -------------------------------

_ADAPTERS, _REVISIONS, _TRAFFIC, _GRANTS = (
    m.__table__ for m in (Adapter, Revision, Traffic, Grant)
)
_CHANGE_COUNT = select(ChangeCounter.__table__.c.value).where(ChangeCounter.__table__.c.id == 1)
_CHANGE_COUNT_SQL = str(_CHANGE_COUNT.compile(compile_kwargs={"literal_binds": True}))
_ADAPTER_BY_NAME = select(_ADAPTERS).where(_ADAPTERS.c.name == bindparam("name"))
_GRANTS_OF = (
    select(_GRANTS.c.tenant)
    .where(_GRANTS.c.adapter_name == bindparam("name"))
    .order_by(_GRANTS.c.tenant)
)
_REVISIONS_WITH_WEIGHT = (
    select(_REVISIONS, _TRAFFIC.c.weight)
    .outerjoin(_TRAFFIC, _TRAFFIC.c.revision_id == _REVISIONS.c.id)
    .where(_REVISIONS.c.adapter_name == bindparam("name"))
    .order_by(_REVISIONS.c.id)
)


@dataclass(frozen=True)
class _Snapshot:
    change_count: int
    adapter: Row
    grants: tuple[str, ...]
    records: dict[str, RevisionRecord]  # every revision of the name, by label
    serving: tuple[tuple[str, int], ...]  # (revision, weight) in the order resolution walks them


# ---- helpers over one session --------------------------------------------------------------------


def _check_names(name: str, revision: str | None, warm_policy: str | None, status: str) -> None:
    if not NAME_RE.fullmatch(name):
        raise AdapterRejected("name", f"{name!r} must match {NAME_RE.pattern}")
    if revision is not None and not REVISION_RE.fullmatch(revision):
        raise AdapterRejected("revision", f"{revision!r} must match {REVISION_RE.pattern}")
    if warm_policy is not None and warm_policy not in WARM_POLICIES:
        raise AdapterRejected(
            "warm_policy", f"{warm_policy!r} is not one of {', '.join(WARM_POLICIES)}"
        )
    if status not in ("staging", "stable"):
        raise AdapterRejected(
            "status", f"a new revision starts as staging or stable, not {status!r}"
        )


def _nothing_in_service(name: str, records) -> str:
    """Why a name serves nothing: its revisions are staged (how to promote one), or retired."""
    staged = [r.revision for r in records if r.status == "staging"]
    if not staged:
        return f"{name} has no revision in service (all deprecated or quarantined)"
    which = f"{staged[-1]} is" if len(staged) == 1 else f"{', '.join(staged)} are"
    return (
        f"{name} has no revision in service: {which} staged, not promoted; promote one with "
        f"`loraplex registry promote {name} {staged[-1]}` (or POST /admin/adapters/{name}/promote)"
    )


def _base_dir_named_by(src: Path) -> Path | None:
    """The base model directory the adapter's config names, when it is a local directory."""
    try:
        named = json.loads((src / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(named) if named else None
    return path if path is not None and (path / "config.json").is_file() else None


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
