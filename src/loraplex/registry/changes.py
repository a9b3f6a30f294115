"""The registry's change feed: which names each commit touched, and how a reader learns of a commit
without asking per request.

Triggers in the database append `(kind, name)` to `registry_changes` for every row written to the
tables a server keeps in memory (adapters and what hangs off them, tenants, keys), so that every
writer, of any version, feeds it. A reader keeps the last id it applied and reads only the rows
after it. On PostgreSQL the change counter's trigger also sends `NOTIFY`, delivered at commit; on
SQLite one thread polls `PRAGMA data_version`, which moves when another connection commits.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, String, event, func, select, text
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.registry import db

log = logging.getLogger("loraplex.registry")

KEEP_ROWS = 200_000
"""The feed's length: a writer drops older rows; a reader that far behind reads everything again."""
SQLITE_POLL_S = 0.01
"""How often the SQLite watcher looks at `data_version` (a read of shared memory, no disk I/O) just
after a change; each look that finds none doubles the wait, up to SQLITE_POLL_MAX_S."""
SQLITE_POLL_MAX_S = 0.08
"""The longest wait between looks: a change made elsewhere after a quiet spell arrives within it.
Idle, the watcher wakes about 12 times a second rather than 100."""
PG_CHANNEL = "loraplex_registry"

# table -> (kind, the column naming what changed)
FED_TABLES = {
    "adapters": ("adapter", "name"),
    "revisions": ("adapter", "adapter_name"),
    "traffic": ("adapter", "adapter_name"),
    "grants": ("adapter", "adapter_name"),
    "pin_tiers": ("adapter", "adapter_name"),
    "tenants": ("tenant", "name"),
    "api_keys": ("key", "tenant"),
}


class RegistryChange(db.Base):
    """One row a write touched: `kind` adapter (`name` is the adapter's), tenant or key (`name` is
    the tenant's). Written by triggers only."""

    __tablename__ = "registry_changes"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused, even after a prune
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(8))
    name: Mapped[str] = mapped_column(String(64))


_CHANGES = RegistryChange.__table__


@dataclass(frozen=True)
class Changed:
    """What a refresh found: adapter names (None: all of them, read again whole), and whether
    tenants or keys changed."""

    adapters: frozenset[str] | None = frozenset()
    tenants: bool = False
    keys: bool = False

    @property
    def is_empty(self) -> bool:
        return self.adapters == frozenset() and not self.tenants and not self.keys


EVERYTHING = Changed(None, True, True)


# ---- the triggers --------------------------------------------------------------------------------


def install(engine: Engine) -> None:
    """Create the feed's triggers where they are missing (idempotent; safe with several processes
    opening the registry at once)."""
    if engine.dialect.name == "postgresql":
        _install_postgresql(engine)
    else:
        _install_sqlite(engine)


def _sqlite_triggers() -> dict[str, str]:
    out = {}
    for table, (kind, column) in FED_TABLES.items():
        for op, row in (("insert", "NEW"), ("update", "NEW"), ("delete", "OLD")):
            out[f"lpx_feed_{table}_{op}"] = (
                f"AFTER {op.upper()} ON {table} BEGIN INSERT INTO registry_changes(kind, name) "
                f"VALUES ('{kind}', {row}.{column}); END"
            )
    out["lpx_feed_prune"] = (
        "AFTER UPDATE ON generation BEGIN DELETE FROM registry_changes WHERE id < "
        f"(SELECT max(id) FROM registry_changes) - {KEEP_ROWS}; END"
    )
    return out


def _install_sqlite(engine: Engine) -> None:
    wanted = _sqlite_triggers()
    with engine.connect() as conn:
        have = set(
            conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'trigger'").scalars()
        )
    if set(wanted) <= have:
        return
    with db.writer(engine).begin() as conn:
        for name, body in wanted.items():
            conn.exec_driver_sql(f"CREATE TRIGGER IF NOT EXISTS {name} {body}")


_PG_FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION loraplex_feed() RETURNS trigger AS $$
DECLARE r record;
BEGIN
  IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
  INSERT INTO registry_changes(kind, name) VALUES (TG_ARGV[0], to_jsonb(r) ->> TG_ARGV[1]);
  RETURN NULL;
END $$ LANGUAGE plpgsql;
CREATE OR REPLACE FUNCTION loraplex_feed_notify() RETURNS trigger AS $$
BEGIN
  DELETE FROM registry_changes
    WHERE id < (SELECT max(id) FROM registry_changes) - {KEEP_ROWS};
  PERFORM pg_notify('{PG_CHANNEL}_' || current_schema(), NEW.value::text);
  RETURN NULL;
END $$ LANGUAGE plpgsql;
"""


def _pg_triggers() -> dict[str, str]:
    out = {
        f"lpx_feed_{table}": (
            f"AFTER INSERT OR UPDATE OR DELETE ON {table} FOR EACH ROW "
            f"EXECUTE FUNCTION loraplex_feed('{kind}', '{column}')"
        )
        for table, (kind, column) in FED_TABLES.items()
    }
    out["lpx_feed_notify"] = (
        "AFTER UPDATE ON generation FOR EACH ROW EXECUTE FUNCTION loraplex_feed_notify()"
    )
    return out


_PG_HAVE = """
SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON t.tgrelid = c.oid
JOIN pg_namespace n ON c.relnamespace = n.oid
WHERE n.nspname = current_schema() AND t.tgname LIKE 'lpx_feed%'
"""


def _install_postgresql(engine: Engine) -> None:
    wanted = _pg_triggers()
    with engine.connect() as conn:
        if set(wanted) <= set(conn.execute(text(_PG_HAVE)).scalars()):
            return
    with engine.begin() as conn:
        # one process at a time creates them: replacing a function concurrently fails
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.feed'))"))
        have = set(conn.execute(text(_PG_HAVE)).scalars())
        conn.exec_driver_sql(_PG_FUNCTIONS)
        for name, body in wanted.items():
            if name not in have:
                conn.exec_driver_sql(f"CREATE TRIGGER {name} {body}")


# ---- reading it ----------------------------------------------------------------------------------


def bounds(conn: Connection) -> tuple[int | None, int | None]:
    """(lowest, highest) id in the feed; (None, None) when it is empty."""
    # two scalar subqueries: each is one index lookup, where min and max in one SELECT scan it
    low = select(func.min(_CHANGES.c.id)).scalar_subquery()
    high = select(func.max(_CHANGES.c.id)).scalar_subquery()
    first, last = conn.execute(select(low, high)).one()
    return first, last


def since(conn: Connection, after: int, upto: int) -> Changed:
    """What the rows after `after` up to `upto` touched."""
    rows = conn.execute(
        select(_CHANGES.c.kind, _CHANGES.c.name)
        .where(_CHANGES.c.id > after, _CHANGES.c.id <= upto)
        .distinct()
    ).all()
    kinds = {kind for kind, _ in rows}
    names = frozenset(name for kind, name in rows if kind == "adapter")
    return Changed(names, "tenant" in kinds, "key" in kinds)


def on_local_commit(engine: Engine, callback: Callable[[], None]) -> None:
    """Call `callback` once each write transaction of this process (one that bumped the change
    counter) has committed on `engine` and its connection is back in the pool: what lets this
    process's own reader see its writes at once."""
    bump = "UPDATE generation"

    @event.listens_for(engine, "after_cursor_execute")
    def _seen(conn, _cursor, statement, *_):
        if statement.startswith(bump):
            conn.info["lpx_bumped"] = True

    @event.listens_for(engine, "commit")
    def _committing(conn):  # before the database's commit: told once it is back in the pool
        if conn.info.pop("lpx_bumped", False):
            conn.info["lpx_committed"] = True

    @event.listens_for(engine, "rollback")
    def _rolled_back(conn):
        conn.info.pop("lpx_bumped", None)
        conn.info.pop("lpx_committed", None)

    @event.listens_for(engine.pool, "checkin")
    def _returned(_dbapi_conn, record):
        if record is not None and record.info.pop("lpx_committed", False):
            callback()


# ---- watching it ---------------------------------------------------------------------------------


class ChangeWatcher:
    """One thread that calls `on_change` soon after any commit to the registry: LISTEN on
    PostgreSQL, `PRAGMA data_version` on SQLite. `on_change` reads the feed itself; a call with
    nothing new is cheap. `idle_s`: how long the PostgreSQL listener waits between looks at its
    stop flag, and the pause before reconnecting after a lost connection."""

    def __init__(self, engine: Engine, on_change: Callable[[], object], idle_s: float = 1.0):
        self.engine = engine
        self.on_change = on_change
        self.idle_s = idle_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.engine.dialect.name == "postgresql":
            target = self._listen
        elif self.engine.url.database not in (None, "", ":memory:"):
            target = self._poll
        else:
            return  # a private in-memory database: only this process writes it
        self._thread = threading.Thread(target=target, name="registry-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _changed(self) -> None:
        try:
            self.on_change()
        except Exception:  # a registry briefly unreachable: the next commit or look tries again
            if not self._stop.is_set():
                log.exception("could not read the registry's changes")

    def _poll(self) -> None:
        conn = sqlite3.connect(self.engine.url.database, check_same_thread=False)
        try:
            seen, wait = None, SQLITE_POLL_S
            while not self._stop.wait(wait):
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                if version != seen:
                    seen, wait = version, SQLITE_POLL_S
                    self._changed()
                else:
                    wait = min(2 * wait, SQLITE_POLL_MAX_S)
        finally:
            conn.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen_once()
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("the registry's change notifications stopped; reconnecting")
                self._stop.wait(self.idle_s)

    def _listen_once(self) -> None:
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        conn = self.engine.dialect.dbapi.connect(*cargs, **cparams, autocommit=True)
        try:
            schema = conn.execute("SELECT current_schema()").fetchone()[0]
            conn.execute(f'LISTEN "{PG_CHANNEL}_{schema}"')
            self._changed()  # what was committed before the LISTEN
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=self.idle_s, stop_after=1):
                    self._changed()
        finally:
            conn.close()
