"""Resolution: the revision a request gets, read once per registry change."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Row, bindparam, select

from loraplex.artifacts import Pieces
from loraplex.registry import queries as q
from loraplex.registry.core import (
    NAME_RE,
    RegistryCore,
    revision_record,
    serving_order,
)
from loraplex.registry.db import (
    Adapter,
    ArtifactPieces,
    ArtifactPiecesBlake3,
    ChangeCounter,
    Grant,
    Revision,
    Traffic,
)
from loraplex.registry.errors import (
    AdapterNotFound,
    RevisionUnavailable,
)
from loraplex.registry.records import (
    RevisionRecord,
)
from loraplex.registry.traffic import pick

MAX_CACHED_NAMES = 100_000


class Resolution(RegistryCore):
    """What the per-request path asks: the revision a name means, the change count, piece lists."""

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
        records = {r.revision: revision_record(adapter, r, grants, weights) for r in rows}
        snapshot = _Snapshot(
            change_count, adapter, grants, records, serving_order(records.values())
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
