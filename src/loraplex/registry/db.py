"""The registry's tables (SQLAlchemy 2), the schema version check, and engine setup for SQLite and
PostgreSQL."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
    select,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from loraplex.registry.errors import RegistryError, SchemaTooNew

# Bump when the tables change, and add the step that upgrades the previous version in
# `create_schema`. A new table that older versions can ignore does not bump it: `create_schema` adds
# the tables it lacks.
SCHEMA_VERSION = 1


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every time the registry stores is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class ChangeCounter(Base):
    """Bumped by every change; a reader that keeps what it read compares it to know it is still
    current."""

    __tablename__ = "generation"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class Tenant(Base):
    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Residency budgets (NULL: the server's default share); added to older tables by
    # `add_missing_columns`.
    max_gpu_slots: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_cpu_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Limits of the tenant's requests on each server; NULL: the server's default. Added to an
    # existing registry on open (add_missing_columns).
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_waiting: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Adapter(Base):
    __tablename__ = "adapters"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_tenant: Mapped[str | None] = mapped_column(ForeignKey("tenants.name"), nullable=True)
    shared: Mapped[bool] = mapped_column(Boolean, default=False)
    task_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    warm_policy: Mapped[str] = mapped_column(String(16), default="on_demand")
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # How many of the newest revisions stay servable (NULL: all); the older ones are retired
    # (`retention`). Added to an existing registry on open (add_missing_columns).
    keep: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Revision(Base):
    """Immutable once written, except for status and the life-cycle timestamps."""

    __tablename__ = "revisions"
    __table_args__ = (UniqueConstraint("adapter_name", "revision"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter_name: Mapped[str] = mapped_column(ForeignKey("adapters.name"), index=True)
    revision: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(71), index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    base_model_digest: Mapped[str | None] = mapped_column(String(71), nullable=True)
    rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    dtype: Mapped[str] = mapped_column(String(16))
    target_modules: Mapped[str] = mapped_column(Text)  # comma-separated, sorted
    estimated_bytes: Mapped[int] = mapped_column(BigInteger)
    actual_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_uri: Mapped[str] = mapped_column(Text)
    signature: Mapped[str | None] = mapped_column(Text, nullable=True)
    # JSONL, checked at registration
    eval_set: Mapped[str | None] = mapped_column(Text, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    stable_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ParityReference(Base):
    """A revision's reference for the parity gate (`registry.parity`): token ids and the trainer's
    per-token log-probabilities under the adapter and the base model, JSON."""

    __tablename__ = "parity_references"
    revision_id: Mapped[int] = mapped_column(ForeignKey("revisions.id"), primary_key=True)
    reference: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ArtifactPieces(Base):
    """The hash of each piece of an artifact's files (`store.Pieces`, JSON), taken at registration:
    loads check the bytes on several cores with it. Revisions registered before this table have none
    and are checked by their digest alone."""

    __tablename__ = "artifact_pieces"
    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    pieces: Mapped[str] = mapped_column(Text)


class ArtifactPiecesBlake3(Base):
    """The BLAKE3 piece list of an artifact (`store.Pieces`, JSON): what this version's loads check.
    Kept apart from `artifact_pieces`, which keeps the sha256 list that earlier versions read (they
    refuse a list of another hash), so that servers of both versions can share one registry."""

    __tablename__ = "artifact_pieces_blake3"
    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    pieces: Mapped[str] = mapped_column(Text)


class PinTier(Base):
    """The tier a pinned adapter is pinned in (`gpu` or `cpu`), so that a restart pins it there
    again. Added after `adapters.pinned`: a pinned adapter without a row (pinned by an older
    version) is pinned in cpu, or in the tier of its warm policy."""

    __tablename__ = "pin_tiers"
    adapter_name: Mapped[str] = mapped_column(ForeignKey("adapters.name"), primary_key=True)
    tier: Mapped[str] = mapped_column(String(8))


class Traffic(Base):
    __tablename__ = "traffic"
    adapter_name: Mapped[str] = mapped_column(ForeignKey("adapters.name"), primary_key=True)
    revision_id: Mapped[int] = mapped_column(ForeignKey("revisions.id"), primary_key=True)
    weight: Mapped[int] = mapped_column(Integer)


class Grant(Base):
    __tablename__ = "grants"
    adapter_name: Mapped[str] = mapped_column(ForeignKey("adapters.name"), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), primary_key=True)


class ApiKey(Base):
    """Only the sha256 of a key is stored; `key_id` (the key's first characters) names it for
    revocation."""

    __tablename__ = "api_keys"
    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AuditEvent(Base):
    __tablename__ = "audit_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(160))
    detail: Mapped[str] = mapped_column(Text, default="{}")  # JSON object


ROLLOUT_ACTIVE = ("running", "rolling_back")
"""Phases of a rollout under way: `rolling_back` is a rollback decided and not yet seen applied."""


class Rollout(Base):
    """The rollout of a name (`loraplex rollout`): where it stands, and the lease of the controller
    driving it (holder and expiry; another controller refuses while it holds). One row a name, the
    latest rollout's; what it decided is in the audit events."""

    __tablename__ = "rollouts"
    name: Mapped[str] = mapped_column(ForeignKey("adapters.name"), primary_key=True)
    revision: Mapped[str] = mapped_column(String(64))
    stable_revision: Mapped[str] = mapped_column(String(64))
    steps: Mapped[str] = mapped_column(Text)  # comma-separated percents, ending in 100
    step: Mapped[int] = mapped_column(Integer)  # index into steps of the step under way
    phase: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    settings: Mapped[str] = mapped_column(Text, default="{}")  # JSON: what it judges by
    last_decision: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    step_started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    holder: Mapped[str | None] = mapped_column(String(160), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )


class Lease(Base):
    """A controller's lease on a job of the whole fleet (the placement controller's, say): one
    holder at a time, until its expiry, which it renews while it lives."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(160), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


DATABASE_SCHEMES = ("sqlite", "postgresql", "postgres", "postgresql+psycopg")
"""The schemes of the registry URLs it opens (`sqlite:///FILE`; PostgreSQL by psycopg 3)."""


def check_database_url(url: str) -> None:
    """RegistryError naming the supported schemes for any other URL (only its scheme is named: a
    server database's URL may hold a password)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in DATABASE_SCHEMES:
        named = f"scheme {scheme!r}" if sep else "no scheme"
        raise RegistryError(
            f"unsupported registry URL ({named}): give sqlite:///FILE, postgresql://... or "
            "postgresql+psycopg://..."
        )


def make_engine(url: str) -> Engine:
    """An engine for `sqlite:///FILE` (WAL) or `postgresql://...` (driver psycopg 3)."""
    check_database_url(url)
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url.removeprefix(prefix)
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # transactions are begun explicitly below
        cursor = dbapi_conn.cursor()
        _set_wal(cursor, deadline=time.monotonic() + 30)
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        # A writer takes the write lock when it begins, so that two writers queue on busy_timeout
        # instead of one failing at its first write after both have read (SQLITE_BUSY on upgrade).
        options = conn.get_execution_options()
        if not options.get("single_statement"):  # alone, a statement is its own transaction
            conn.exec_driver_sql("BEGIN IMMEDIATE" if options.get("write") else "BEGIN")

    return engine


def _set_wal(cursor, deadline: float) -> None:
    # Turning a fresh file to WAL takes its exclusive lock, and SQLite answers "locked" at once,
    # without the busy timeout, while another process holds it (two servers starting on one new
    # registry): wait here instead.
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def writer(engine: Engine) -> Engine:
    """The same engine, marked so that SQLite transactions on it begin IMMEDIATE."""
    return engine.execution_options(write=True)


def single_statement_reader(engine: Engine) -> Engine:
    """For reads whose statements each stand alone: no BEGIN/ROLLBACK (round trips on
    PostgreSQL)."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="AUTOCOMMIT")
    return engine.execution_options(single_statement=True)


def schema_version(engine: Engine) -> int | None:
    """The version stored in the database, or None when it has no registry tables yet."""
    if not inspect(engine).has_table(SchemaVersion.__tablename__):
        return None
    with Session(engine) as session:
        return session.scalar(select(SchemaVersion.version).where(SchemaVersion.id == 1))


def check_schema(engine: Engine) -> bool:
    """True when the tables are current, False when there are none; refuses a newer or older
    schema."""
    version = schema_version(engine)
    if version is None:
        return False
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"the registry database has schema version {version}, newer than this loraplex "
            "understands "
            f"({SCHEMA_VERSION}); upgrade loraplex, or point --registry at another database"
        )
    if version < SCHEMA_VERSION:
        raise RegistryError(
            f"registry schema version {version} is old: run `loraplex registry init` to upgrade it"
        )
    return True


def add_missing_tables(engine: Engine) -> None:
    """Create the tables added since the database was made (older versions ignore them, so the
    schema version stays):
    any process that opens the registry does it, not only `init`, so that reading it never meets a
    missing table."""
    missing = [t for t in Base.metadata.sorted_tables if not inspect(engine).has_table(t.name)]
    if missing:
        with writer(engine).begin() as conn:
            # checkfirst: a process that made them meanwhile is fine
            Base.metadata.create_all(conn, tables=missing)


def add_missing_columns(engine: Engine) -> None:
    """Add the nullable columns added to existing tables since the database was made (older versions
    ignore them, so the schema version stays); run on open, as add_missing_tables."""
    inspector = inspect(engine)
    missing = []
    for table in Base.metadata.sorted_tables:
        if inspector.has_table(table.name):
            present = {c["name"] for c in inspector.get_columns(table.name)}
            missing += [(table, c) for c in table.columns if c.name not in present]
    if not missing:
        return
    with writer(engine).begin() as conn:
        for table, column in missing:
            if not column.nullable:
                raise RegistryError(
                    f"column {table.name}.{column.name} cannot be added to an "
                    "existing registry: it has no NULL to fill the rows with"
                )
            kind = column.type.compile(dialect=engine.dialect)
            # IF NOT EXISTS where the database has it: another process may add it meanwhile.
            guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
            try:
                conn.exec_driver_sql(
                    f"ALTER TABLE {table.name} ADD COLUMN {guard}{column.name} {kind}"
                )
            except OperationalError as exc:  # SQLite: a process that opened it meanwhile added it
                if "duplicate column" not in str(exc):
                    raise


def create_schema(engine: Engine) -> None:
    """Create the tables and record the schema version (idempotent)."""
    if schema_version(engine) is not None:
        check_schema(engine)
        add_missing_tables(engine)
        add_missing_columns(engine)
        return
    # One write transaction (BEGIN IMMEDIATE on SQLite): a second process creating the same fresh
    # registry waits for the first and then finds its tables, instead of failing on the lock or
    # inserting the same rows twice.
    with writer(engine).begin() as conn:
        Base.metadata.create_all(conn)
        with Session(bind=conn) as session:
            if session.get(ChangeCounter, 1) is None:
                session.add(ChangeCounter(id=1, value=0))
            if session.get(SchemaVersion, 1) is None:
                session.add(SchemaVersion(id=1, version=SCHEMA_VERSION))
            session.flush()
