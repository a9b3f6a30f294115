"""Retention: a name keeps its newest `keep` revisions servable, and the older ones, with those an
operator deletes, are retired.

A retired revision is never served again and leaves the catalog (`name@rev` is not found, the bare
name never picks it), gets no grace period, and keeps its row: its label is never used again and
the audit events name it. Once its retirement has committed, its artifact leaves the store (the
local one, and the OCI repository it was pushed to) unless another revision, of any name, refers
to the same bytes.
"""

from __future__ import annotations

import json
import logging

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from loraplex.artifacts import ArtifactError, delete_pushed, is_oci_uri
from loraplex.artifacts.s3 import delete_s3, is_s3_uri
from loraplex.registry import queries as q
from loraplex.registry.db import ROLLOUT_ACTIVE, Adapter, AuditEvent, Revision, Rollout
from loraplex.registry.errors import AdapterRejected, LifecycleError, RegistryError
from loraplex.registry.reading import Reading
from loraplex.registry.records import AdapterRecord
from loraplex.registry.store import Store

log = logging.getLogger("loraplex.registry")
_RETIRED = "retired_artifacts"  # session.info: digest -> storage URI of the revisions retired


def check_keep(keep: int | None) -> None:
    if keep is not None and keep < 1:
        raise AdapterRejected(
            "keep", f"a name keeps at least 1 revision (none: every revision), got {keep}"
        )


def retire_beyond_keep(store: Store, session: Session, adapter: Adapter) -> None:
    """Retire the revisions of `adapter` older than its newest `keep` (by creation; quarantined
    ones take no place), except the stable, those in traffic and those of a rollout under way:
    inside the caller's write transaction, one audit event (`retire`) each, oldest first."""
    if adapter.keep is None:
        return
    newest_first = session.scalars(
        select(Revision)
        .where(
            Revision.adapter_name == adapter.name,
            Revision.status.not_in(("quarantined", "retired")),
        )
        .order_by(Revision.id.desc())
    ).all()
    held = held_revisions(session, adapter.name)
    for row in reversed(newest_first[adapter.keep :]):
        if row.revision not in held:
            retire(store, session, row, "retire", f"older than the newest {adapter.keep}")


def held_revisions(session: Session, name: str) -> set[str]:
    """The revisions of `name` that serve traffic or that a rollout under way names."""
    held = {row.revision for row in q.serving(session, name)}
    rollout = session.get(Rollout, name)
    if rollout is not None and rollout.phase in ROLLOUT_ACTIVE:
        held |= {rollout.revision, rollout.stable_revision}
    return held


def retire(store: Store, session: Session, row: Revision, action: str, reason: str) -> None:
    """Retire `row` in the caller's write transaction; its artifact is released after the
    commit (`release_artifacts`)."""
    row.status, row.status_reason = "retired", reason
    store.audit(session, action, f"{row.adapter_name}@{row.revision}", reason=reason)
    retired = session.info.get(_RETIRED)
    if retired is None:
        retired = session.info[_RETIRED] = {}
        store.after_commit(session, lambda: release_artifacts(store, retired))
    retired[row.digest] = row.storage_uri


def release_artifacts(store: Store, retired: dict[str, str]) -> list[str]:
    """Delete the artifacts of retired revisions (digest -> storage URI) that no revision still
    refers to, each with a `delete_artifact` audit event; returns the digests deleted.

    In a write transaction of its own: a registration of the same bytes commits its row before
    this reads the digests in use (and keeps them), or after the deletion, and then finds its
    local copy gone and puts it back, pushing it again (`Registration.put_again`). The local copy
    goes first, so that a pushed copy is never gone while the local one is there."""
    deleted = []
    try:
        with store.write() as session:
            in_use = set(
                session.scalars(
                    select(Revision.digest).where(
                        Revision.digest.in_(list(retired)), Revision.status != "retired"
                    )
                )
            )
            for digest, uri in retired.items():
                if digest not in in_use and delete_artifact(store, session, digest, uri):
                    deleted.append(digest)
    except (RegistryError, SQLAlchemyError) as exc:  # the retirement stands; `gc` deletes them
        log.warning("the artifacts of retired revisions were not deleted: %s", exc)
        return []
    return deleted


def delete_artifact(store: Store, session: Session, digest: str, uri: str) -> bool:
    """Delete one artifact from the local store and the OCI repository or S3 bucket `uri` names
    (if it does); False, with the reason logged and audited, when the store refused."""
    local = store.artifacts
    try:
        removed = local.remove(digest) if local is not None else False
        pushed = (
            delete_pushed(uri) if is_oci_uri(uri) else delete_s3(uri) if is_s3_uri(uri) else None
        )
    except (ArtifactError, OSError) as exc:
        log.warning("%s: not deleted from the store: %s", digest, exc)
        store.audit(session, "delete_artifact", digest, error=str(exc))
        return False
    store.audit(session, "delete_artifact", digest, local=removed, **_pushed(uri, pushed))
    return True


def pushed_left(session: Session, in_use: set[str]) -> dict[str, str]:
    """The pushed copies (OCI or S3) of retired revisions that are still to delete: digest ->
    storage URI, for the digests outside `in_use` whose last deletion the store refused, or that
    no deletion was made for (the process stopped between the retirement and its release)."""
    last_failed: dict[str, bool] = {}
    events = select(AuditEvent.target, AuditEvent.detail).where(
        AuditEvent.action == "delete_artifact"
    )
    for digest, detail in session.execute(events.order_by(AuditEvent.id)):
        last_failed[digest] = "error" in json.loads(detail)
    retired = select(Revision.digest, Revision.storage_uri).where(Revision.status == "retired")
    return {
        digest: uri
        for digest, uri in session.execute(retired)
        if digest not in in_use
        and uri
        and (is_oci_uri(uri) or is_s3_uri(uri))
        and last_failed.get(digest, True)
    }


def _pushed(uri: str, deleted: bool | None) -> dict:
    if deleted is None:
        return {}
    scheme = "s3" if is_s3_uri(uri) else "oci"
    return {scheme: uri, f"{scheme}_deleted": deleted}


class Retention:
    """How many revisions a name keeps, and the operator's deletion of one."""

    def __init__(self, store: Store, reading: Reading):
        self.store = store
        self.reading = reading

    def set_keep(self, name: str, keep: int | None) -> AdapterRecord:
        """Keep the newest `keep` revisions of `name` servable (None: every revision); those
        beyond are retired now, and at each later promotion."""
        check_keep(keep)
        with self.store.write() as session:
            adapter = q.locked_adapter_or_404(session, name)
            adapter.keep = keep
            self.store.audit(session, "keep", name, keep=keep)
            retire_beyond_keep(self.store, session, adapter)
        return self.reading.show(name)

    def delete(self, name: str, revision: str) -> AdapterRecord:
        """Retire one revision now; refused while it is the stable one, in a split, or named by a
        rollout under way, and for a quarantined one (its row refuses its bytes)."""
        with self.store.write() as session:
            q.locked_adapter_or_404(session, name)
            row = q.revision_or_404(session, name, revision)
            refusal = _why_not_deleted(row, held_revisions(session, name))
            if refusal is not None:
                raise LifecycleError(f"{name}@{revision} {refusal}")
            retire(self.store, session, row, "delete", "deleted by operator")
        return self.reading.show(name)


def _why_not_deleted(row: Revision, held: set[str]) -> str | None:
    if row.status == "stable":
        return "is the stable revision; promote another revision first"
    if row.revision in held:
        return "is in a traffic split or a rollout; roll back or promote another revision first"
    if row.status == "quarantined":
        return "is quarantined: its row is kept so that its bytes are never registered again"
    if row.status == "retired":
        return f"is already retired ({row.status_reason})"
    return None
