"""The catalog in memory: every adapter with its revisions, traffic, grants and pin, kept current
from the registry's change feed (`changes`), so that a request resolves, and `/v1/models` lists,
without a query.

Consistency: a commit made through this process's registry is applied before the next request
resolves (`current`); one made elsewhere within the feed's delay (the watcher's, a few
milliseconds, plus one refresh: `docs/registry.md` has the measured bound).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import random
import sys
import threading
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Connection, select

from loraplex.registry import changes
from loraplex.registry.changes import EVERYTHING, Changed
from loraplex.registry.db import Adapter, Grant, PinTier, Revision, Traffic
from loraplex.registry.errors import AdapterNotFound, RevisionUnavailable
from loraplex.registry.records import NAME_RE, AdapterRecord, RevisionRecord, adapter_record
from loraplex.registry.traffic import pick

if TYPE_CHECKING:
    from loraplex.registry.registry import Registry

_ADAPTERS, _REVISIONS, _TRAFFIC, _GRANTS, _PINS = (
    m.__table__ for m in (Adapter, Revision, Traffic, Grant, PinTier)
)
CHUNK = 500  # names per IN list
Listener = Callable[[Changed], None]


@dataclass(frozen=True)
class Entry:
    """One adapter as resolution reads it."""

    adapter: AdapterRecord
    by_revision: dict[str, RevisionRecord]

    def may_use(self, tenant: str) -> bool:
        return self.adapter.shared or tenant in self.adapter.allowed_tenants


class Catalog:
    """The registry's adapters in memory. `refresh()` applies what the feed says changed (on any
    thread; one at a time); reads are lock-free (each entry is immutable and replaced whole).

    The only resolver: which revision a request gets is its `resolve`."""

    def __init__(self, registry: Registry, rng: random.Random | None = None):
        self.store = registry.db
        self.entries: dict[str, Entry] = {}
        self.names: list[str] = []  # sorted
        self.version = 0
        """Moves with every applied change (what a listing cached against it checks)."""
        self.last_id: int | None = None  # the feed's last row applied; None: nothing read yet
        self.num_refreshes = 0
        self._rng = rng or random.Random()
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self._local = itertools.count(1)  # this process's commits, counted as they happen
        self._num_local = 0
        self._applied_local = 0
        self._pending: asyncio.Future | None = None
        changes.on_local_commit(self.store.engine, self._local_commit)

    def _local_commit(self) -> None:
        self._num_local = next(self._local)

    def subscribe(self, listener: Listener) -> None:
        """`listener(changed)` after each refresh that found something, in order, on the
        refreshing thread; from the next refresh on (one under way finishes first)."""
        with self._lock:
            self._listeners.append(listener)

    # ---- keeping it current --------------------------------------------------------------------

    def refresh(self) -> Changed:
        """Apply what changed since the last refresh (everything, the first time)."""
        with self._lock:
            local = self._num_local
            engine = self.store.engine
            if engine.dialect.name == "postgresql":  # the feed and the rows from one snapshot
                engine = engine.execution_options(isolation_level="REPEATABLE READ")
            self.store.check_ready()
            with engine.connect() as conn, conn.begin():
                changed = self._read_changes(conn)
            self._applied_local = max(self._applied_local, local)
            self.num_refreshes += 1
            if not changed.is_empty:
                self.version += 1
                for listener in self._listeners:
                    listener(changed)
            return changed

    def _read_changes(self, conn: Connection) -> Changed:
        low, high = changes.bounds(conn)
        last = self.last_id
        if last is None or (low is not None and low > last + 1):  # first, or pruned past us
            self._load(conn, None)
            self.last_id = high or 0
            return EVERYTHING
        if high is None or high <= last:
            return Changed()
        changed = changes.since(conn, last, high)
        if changed.adapters:
            self._load(conn, sorted(changed.adapters))
        self.last_id = high
        return changed

    def _load(self, conn: Connection, names: list[str] | None) -> None:
        """Read `names` (None: every adapter) and replace their entries."""
        if names is None:
            fresh = _read_entries(conn, None)
            self.entries = fresh
            self.names = sorted(fresh)
            return
        for start in range(0, len(names), CHUNK):
            chunk = names[start : start + CHUNK]
            fresh = _read_entries(conn, chunk)
            for name in chunk:
                entry = fresh.get(name)
                if entry is None:
                    self._remove(name)
                else:
                    self._put(name, entry)

    def _put(self, name: str, entry: Entry) -> None:
        if name not in self.entries:
            bisect.insort(self.names, name)
        self.entries[name] = entry

    def _remove(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            del self.names[bisect.bisect_left(self.names, name)]

    async def current(self) -> None:
        """Return once every commit this process made before the call is applied (at once when
        there is none pending: no query)."""
        while self._applied_local < self._num_local:
            if self._pending is None or self._pending.done():  # one refresh for all who wait
                self._pending = asyncio.ensure_future(asyncio.to_thread(self.refresh))
            await asyncio.shield(self._pending)

    # ---- reading it ----------------------------------------------------------------------------

    def adapter(self, name: str) -> AdapterRecord | None:
        entry = self.entries.get(name)
        return entry.adapter if entry is not None else None

    def adapters(self, names: Iterable[str] | None = None) -> Iterator[AdapterRecord]:
        """Those of `names` that exist (None: every adapter, by name)."""
        entries = self.entries
        for name in list(self.names) if names is None else names:
            entry = entries.get(name)
            if entry is not None:
                yield entry.adapter

    def visible(self, tenant: str) -> list[AdapterRecord]:
        """The adapters `tenant` may use, by name."""
        return [entry.adapter for entry in self.visible_entries(tenant)]

    def visible_entries(self, tenant: str, names: Iterable[str] | None = None) -> list[Entry]:
        """The entries of the adapters `tenant` may use, of `names` (None: every adapter), by
        name."""
        entries = self.entries
        out = []
        for name in list(self.names) if names is None else names:
            entry = entries.get(name)
            if entry is not None and entry.may_use(tenant):
                out.append(entry)
        return out

    def resolve(self, tenant: str, model: str, user: str | None = None) -> RevisionRecord:
        """The revision a request for `model` (`name` or `name@revision`) by `tenant` gets.

        Weighted by the traffic split, sticky per `user` when given. A name the tenant may not use
        raises exactly the same AdapterNotFound as a name that does not exist.
        """
        name, _, revision = model.partition("@")
        entry = self.entries.get(name) if NAME_RE.fullmatch(name) else None
        if entry is None or not entry.may_use(tenant):
            raise AdapterNotFound(model)
        if revision:
            record = entry.by_revision.get(revision)
            if record is None:
                raise AdapterNotFound(model)
            if record.status == "quarantined":
                raise RevisionUnavailable(
                    f"{model} is quarantined ({record.status_reason}); it is never served"
                )
            return record
        serving = entry.adapter.traffic
        if not serving:
            raise RevisionUnavailable(_nothing_in_service(name, entry.adapter.revisions))
        return entry.by_revision[pick(name, list(serving), user, self._rng)]


def _nothing_in_service(name: str, records: Iterable[RevisionRecord]) -> str:
    """Why a name serves nothing: its revisions are staged (how to promote one), or retired."""
    staged = [r.revision for r in records if r.status == "staging"]
    if not staged:
        return f"{name} has no revision in service (all deprecated or quarantined)"
    which = f"{staged[-1]} is" if len(staged) == 1 else f"{', '.join(staged)} are"
    return (
        f"{name} has no revision in service: {which} staged, not promoted; promote one with "
        f"`loraplex registry promote {name} {staged[-1]}` (or POST /admin/adapters/{name}/promote)"
    )


# Columns whose values repeat across a catalog: each value kept once (sys.intern)
_SHARED = {
    "base_model", "base_model_digest", "dtype", "status", "warm_policy", "target_modules",
    "task_type", "owner_tenant", "revision", "status_reason",
}  # fmt: skip


def _plain(result) -> list:
    """The rows as named tuples: their fields read several times faster than a Row's (every
    field of every revision is read at a start), with the values of `_SHARED` columns kept once."""
    keys = list(result.keys())
    kind = namedtuple("Row", keys)  # type: ignore[misc]
    shared = [i for i, key in enumerate(keys) if key in _SHARED]
    rows = []
    for row in result:
        values = list(row)
        for i in shared:
            if values[i] is not None:
                values[i] = sys.intern(values[i])
        rows.append(kind._make(values))
    return rows


def _read_entries(conn: Connection, names: list[str] | None) -> dict[str, Entry]:
    """The entries of `names` (None: all), from four statements."""

    def where(query, column):
        return query if names is None else query.where(column.in_(names))

    adapters = _plain(conn.execute(where(select(_ADAPTERS), _ADAPTERS.c.name)))
    revisions: dict[str, list] = {}
    query = select(_REVISIONS, _TRAFFIC.c.weight).outerjoin(
        _TRAFFIC, _TRAFFIC.c.revision_id == _REVISIONS.c.id
    )
    # a retired revision is served no more: neither resolved nor listed
    query = where(query, _REVISIONS.c.adapter_name).where(_REVISIONS.c.status != "retired")
    query = query.order_by(_REVISIONS.c.id)
    for row in _plain(conn.execute(query)):
        revisions.setdefault(row.adapter_name, []).append(row)
    grants: dict[str, list[str]] = {}
    query = select(_GRANTS.c.adapter_name, _GRANTS.c.tenant).order_by(_GRANTS.c.tenant)
    for name, tenant in conn.execute(where(query, _GRANTS.c.adapter_name)):
        grants.setdefault(name, []).append(tenant)
    tiers = dict(
        conn.execute(where(select(_PINS.c.adapter_name, _PINS.c.tier), _PINS.c.adapter_name)).all()
    )
    out = {}
    for a in adapters:
        rows = revisions.get(a.name, [])
        weights = {r.id: r.weight for r in rows if r.weight}
        record = adapter_record(a, tuple(grants.get(a.name, ())), rows, weights, tiers.get(a.name))
        out[a.name] = Entry(record, {r.revision: r for r in record.revisions})
    return out
