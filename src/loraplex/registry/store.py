"""The registry's store: its database (sessions, one transaction per change with its audit event,
the change count) and its artifact store."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError
from sqlalchemy.orm import Session

from loraplex.artifacts import ArtifactStore
from loraplex.registry import changes, db
from loraplex.registry.db import AuditEvent, ChangeCounter, utcnow
from loraplex.registry.errors import LifecycleError, RegistryError

_CHANGE_COUNT = select(ChangeCounter.value).where(ChangeCounter.id == 1)
_AFTER_COMMIT = "after_commit"  # session.info: what runs once the transaction has committed


def sqlite_file(url: str) -> Path | None:
    """The database file of a `sqlite:///FILE` URL; None for any other."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        return Path(url.removeprefix("sqlite:///"))
    return None


def default_store_for(url: str) -> ArtifactStore | None:
    """`<db dir>/artifacts` for a SQLite file; None for a server database (the operator names a
    store)."""
    path = sqlite_file(url)
    return ArtifactStore(path.parent / "artifacts") if path else None


def unreachable_store(
    url: str, storage_base: str | None, store_named: bool, store_root: Path
) -> str | None:
    """Why revisions recorded in `url` would be unreadable by the workers of other machines: a
    server database whose revisions go to this machine's default store, with no storage base they
    are pushed to and no store named on a shared volume. None when they are readable."""
    if url.startswith("sqlite") or storage_base or store_named:
        return None
    return (
        f"the registry is a server database, but revisions would be stored in {store_root} on "
        "this machine only, where workers cannot read them: give --storage-base with the "
        "cluster's store (oci://HOST/REPOSITORY or s3://BUCKET/PREFIX, which revisions are "
        "uploaded to), or --store DIR "
        "on a volume the workers mount at the same path"
    )


def shown_url(url: str) -> str:
    """The registry URL as messages show it: its password, if any, as `***`."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


class Store:
    """What every service of the registry is given: the database, its sessions, the audit event,
    and the artifact store."""

    def __init__(
        self,
        url: str,
        artifacts: ArtifactStore | None = None,
        actor: str = "loraplex",
        create: bool = True,
    ):
        """`artifacts`: where revisions' bytes go (default: `default_store_for(url)`); `actor`: who
        the audit events name; `create`: make a SQLite file that is missing (else RegistryError,
        and nothing is written)."""
        path = sqlite_file(url)
        if path is not None and not create and not path.exists():
            raise RegistryError(
                f"no registry at {path}: create it with `loraplex registry init` (or name one "
                "with --registry or --data-dir)"
            )
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.engine = db.make_engine(url)
        self._writer = db.writer(self.engine)
        self.artifacts = artifacts if artifacts is not None else default_store_for(url)
        self.actor = actor
        self._ready = self._schema_ready()  # a newer schema refuses here, before any work

    def _schema_ready(self) -> bool:
        ready = db.check_schema(self.engine)
        if ready:
            # a database made by an older version: the tables added since
            db.add_missing_tables(self.engine)
            db.add_missing_columns(self.engine)  # and the columns
            changes.install(self.engine)  # the change feed's triggers
        return ready

    def init(self) -> None:
        """Create the tables (idempotent)."""
        db.create_schema(self.engine)
        changes.install(self.engine)
        self._ready = True

    def close(self) -> None:
        self.engine.dispose()

    def check_ready(self) -> None:
        """RegistryError saying how to initialize a database that has no tables yet."""
        if not self._ready:
            self._ready = self._schema_ready()
        if not self._ready:
            raise RegistryError(
                f"the registry at {shown_url(self.url)} is not initialized: run `loraplex registry "
                "init`"
            )

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        self.check_ready()
        with Session(self.engine) as session, session.begin():
            yield session

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction; it first bumps the change count, which also makes writers wait one at a
        time. What `after_commit` was given runs once it has committed."""
        self.check_ready()
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
        for action in session.info.get(_AFTER_COMMIT, ()):
            action()

    @staticmethod
    def after_commit(session: Session, action: Callable[[], None]) -> None:
        """Run `action` once the transaction of `session` (a `write`'s) has committed, outside
        it; never when it rolls back."""
        session.info.setdefault(_AFTER_COMMIT, []).append(action)

    def audit(self, session: Session, action: str, target: str, **detail) -> None:
        """Add the audit event of a change to the change's transaction."""
        session.add(
            AuditEvent(
                at=utcnow(),
                actor=self.actor,
                action=action,
                target=target,
                detail=json.dumps(detail, sort_keys=True, default=str),
            )
        )

    def change_count(self) -> int:
        """A number every registry change moves: a reader may keep what it read until it moves."""
        self.check_ready()
        with db.single_statement_reader(self.engine).connect() as conn:
            return conn.execute(_CHANGE_COUNT).scalar_one()
