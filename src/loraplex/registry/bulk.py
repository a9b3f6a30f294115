"""Registering many adapters in one go (`registry import`): each checked as `add_revision` checks
it, all of them before anything is recorded, then recorded in a few transactions."""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from loraplex.lora_format import CONFIG_FILE
from loraplex.registry import queries as q
from loraplex.registry.db import (
    Adapter,
    ArtifactPieces,
    ArtifactPiecesBlake3,
    AuditEvent,
    Revision,
    Tenant,
    Traffic,
    utcnow,
)
from loraplex.registry.errors import AdapterRejected, RegistryError
from loraplex.registry.records import RevisionRecord, revision_record
from loraplex.registry.registration import Registration, Stored, check_names
from loraplex.registry.retention import check_keep, retire_beyond_keep

BATCH = 1000
"""Adapters recorded per transaction."""
STORE_THREADS = 4
"""Adapters checked and copied into the store at once."""


@dataclass(frozen=True)
class ImportItem:
    """One adapter to register: what `add_revision` takes."""

    path: Path
    name: str
    revision: str | None = None
    tenant: str | None = None
    shared: bool | None = None
    warm: str | None = None
    priority: int | None = None
    stable: bool = False
    digest: str | None = None
    signature: str | None = None
    eval_set: Path | None = None
    keep: int | None = None


class ImportRefused(RegistryError):
    """An import's input is wrong: nothing was recorded."""


@dataclass(frozen=True)
class ImportResult:
    records: tuple[RevisionRecord, ...]
    num_new: int  # revisions recorded now; the others were registered already


def read_jsonl(path: Path, defaults: dict | None = None) -> list[ImportItem]:
    """Items from a JSONL file of objects with ImportItem's fields (`path` relative to the file's
    directory); `defaults` fill the fields a line leaves out. ImportRefused names the line."""
    known = {f.name for f in fields(ImportItem)}
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ImportRefused(f"{where}: not JSON ({exc})") from None
        if not isinstance(entry, dict) or "path" not in entry or "name" not in entry:
            raise ImportRefused(f'{where}: give an object with "path" and "name"')
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ImportRefused(f"{where}: unknown field {unknown[0]!r}")
        entry = {**(defaults or {}), **entry}
        entry["path"] = path.parent / entry["path"]
        if entry.get("eval_set") is not None:
            entry["eval_set"] = path.parent / entry["eval_set"]
        items.append(ImportItem(**entry))
    return items


def read_directory(root: Path, defaults: dict | None = None) -> list[ImportItem]:
    """One item per adapter directory directly under `root`, named by it."""
    if (root / CONFIG_FILE).is_file():
        raise ImportRefused(f"{root} is one adapter: register it with `loraplex registry add`")
    found = sorted(d for d in root.iterdir() if (d / CONFIG_FILE).is_file())
    if not found:
        raise ImportRefused(f"{root} holds no adapter directory (none has {CONFIG_FILE})")
    return [ImportItem(path=d, name=d.name, **(defaults or {})) for d in found]


class BulkImport:
    """Registering many adapters at once, with the checks and rows of `registration`."""

    def __init__(self, registration: Registration):
        self.registration = registration
        self.store = registration.store

    def add_revisions(
        self, items: Iterable[ImportItem], base_model_dir: str | Path | None = None
    ) -> ImportResult:
        """Register every item: each is checked and stored first (ImportRefused naming the first
        bad one, nothing recorded), then recorded `BATCH` to a transaction. An item whose bytes
        that name holds already gives its existing revision, as `add_revision` does."""
        items = list(items)
        self._check_items(items)
        stored = self._store_all(items, base_model_dir)
        records: list[RevisionRecord] = []
        num_new = 0
        for start in range(0, len(items), BATCH):
            batch = list(zip(items[start : start + BATCH], stored[start : start + BATCH]))
            with self.store.write() as session:
                names = [item.name for item, _ in batch]
                known = set(session.scalars(select(Adapter.name).where(Adapter.name.in_(names))))
                fresh = [(i, d) for i, d in batch if i.name not in known]
                records += self._insert_new(session, fresh)
                num_new += len(fresh)
                for item, done in batch:
                    if item.name in known:
                        adapter = self.registration.adapter_for_add(
                            session,
                            item.name,
                            item.tenant,
                            item.shared,
                            done.spec.task_type,
                            item.warm,
                            item.priority,
                            item.keep,
                        )
                        num_new += (
                            q.find_revision(session, item.name, item.revision, done.digest) is None
                        )
                        records.append(
                            self.registration.insert_revision(
                                session, adapter, done, item.revision, _status(item)
                            )
                        )
                        if item.keep is not None:
                            retire_beyond_keep(self.store, session, adapter)
        by_name = {r.name: r for r in records}
        return ImportResult(tuple(by_name[i.name] for i in items), num_new)

    def _store_all(self, items: list[ImportItem], base_model_dir) -> list[Stored]:
        """`check_and_store` of each, on a few threads (their hashing, copies and fsyncs overlap);
        ImportRefused naming the first bad item."""

        def one(item: ImportItem) -> Stored:
            return self.registration.check_and_store(
                item.path, base_model_dir, None, item.eval_set, item.digest, item.signature
            )

        with ThreadPoolExecutor(STORE_THREADS) as pool:
            futures = [pool.submit(one, item) for item in items]
            for index, (item, future) in enumerate(zip(items, futures)):
                try:
                    future.result()
                except (AdapterRejected, OSError, ValueError) as exc:
                    for rest in futures:
                        rest.cancel()
                    raise ImportRefused(
                        f"item {index + 1} ({item.name}, {item.path}): {exc}"
                    ) from None
        return [f.result() for f in futures]

    def _insert_new(self, session: Session, batch: list[tuple[ImportItem, Stored]]) -> list:
        """Record items whose names are new, a few statements for the lot: what `adapter_for_add`
        and `insert_revision` write for a new name, the same rows and audit events."""
        if not batch:
            return []
        now = utcnow()
        for _, done in batch:
            self.registration.put_again(done)
        self._insert_pieces(session, [done for _, done in batch])
        adapters = [_adapter_row(item, done, now) for item, done in batch]
        session.execute(insert(Adapter), adapters)
        revisions = [self._revision_row(item, done, now) for item, done in batch]
        session.execute(insert(Revision), revisions)
        names = [a["name"] for a in adapters]
        query = select(Revision.adapter_name, Revision.id).where(Revision.adapter_name.in_(names))
        ids = {name: rid for name, rid in session.execute(query)}
        stable = [r for r in revisions if r["status"] == "stable"]
        if stable:
            session.execute(
                insert(Traffic),
                [
                    {
                        "adapter_name": r["adapter_name"],
                        "revision_id": ids[r["adapter_name"]],
                        "weight": 100,
                    }
                    for r in stable
                ],
            )
        session.execute(
            insert(AuditEvent),
            [self._add_event(item, done, a, now) for (item, done), a in zip(batch, adapters)],
        )
        return [
            revision_record(
                SimpleNamespace(**a),
                SimpleNamespace(id=ids[a["name"]], **r),
                (),
                {ids[a["name"]]: 100} if r["status"] == "stable" else {},
            )
            for a, r in zip(adapters, revisions)
        ]

    def _insert_pieces(self, session: Session, stored: list[Stored]) -> None:
        digests = sorted({d.digest for d in stored})
        for table in (ArtifactPiecesBlake3, ArtifactPieces):
            have = set(session.scalars(select(table.digest).where(table.digest.in_(digests))))
            rows, seen = [], set(have)
            for d in stored:
                if d.digest not in seen:
                    seen.add(d.digest)
                    pieces = d.pieces if table is ArtifactPiecesBlake3 else d.sha256_pieces
                    rows.append({"digest": d.digest, "pieces": pieces})
            if rows:
                session.execute(insert(table), rows)

    def _revision_row(self, item: ImportItem, done: Stored, now) -> dict:
        spec, stable = done.spec, item.stable
        return {
            "adapter_name": item.name,
            "revision": item.revision or "r1",
            "digest": done.digest,
            "base_model": done.base_model,
            "base_model_digest": done.base_model_digest,
            "rank": spec.rank,
            "lora_alpha": spec.lora_alpha,
            "dtype": spec.dtype,
            "target_modules": ",".join(spec.target_modules),
            "estimated_bytes": spec.estimated_bytes,
            "actual_bytes": spec.actual_bytes,
            "storage_uri": done.storage_uri,
            "signature": done.signature,
            "eval_set": done.eval_set,
            "status": "stable" if stable else "staging",
            "status_reason": None,
            "created_at": now,
            "stable_since": now if stable else None,
            "retired_at": None,
        }

    def _add_event(self, item: ImportItem, done: Stored, adapter: dict, now) -> dict:
        detail = {
            "digest": done.digest,
            "status": _status(item),
            "owner": adapter["owner_tenant"],
            "shared": adapter["shared"],
            "estimated_bytes": done.spec.estimated_bytes,
            **({"keep": item.keep} if item.keep is not None else {}),
        }
        return {
            "at": now,
            "actor": self.store.actor,
            "action": "add",
            "target": f"{item.name}@{item.revision or 'r1'}",
            "detail": json.dumps(detail, sort_keys=True, default=str),
        }

    def _check_items(self, items: list[ImportItem]) -> None:
        """What can be refused before any file is read: names, fields, a name given twice, an
        unknown tenant."""
        seen: set[str] = set()
        for index, item in enumerate(items):
            try:
                check_names(item.name, item.revision, item.warm, _status(item))
                check_keep(item.keep)
            except AdapterRejected as exc:
                raise ImportRefused(f"item {index + 1} ({item.name}): {exc}") from None
            if item.name in seen:
                raise ImportRefused(f"item {index + 1}: {item.name} is named twice in the import")
            seen.add(item.name)
        with self.store.read() as session:
            tenants = set(session.scalars(select(Tenant.name)))
        for index, item in enumerate(items):
            if item.tenant is not None and item.tenant not in tenants:
                raise ImportRefused(
                    f"item {index + 1} ({item.name}): unknown tenant {item.tenant!r}; add it with "
                    f"`loraplex registry tenant add {item.tenant}`"
                )


def _status(item: ImportItem) -> str:
    return "stable" if item.stable else "staging"


def _adapter_row(item: ImportItem, done: Stored, now) -> dict:
    return {
        "name": item.name,
        "owner_tenant": item.tenant,
        "shared": item.tenant is None if item.shared is None else item.shared,
        "task_type": done.spec.task_type,
        "priority": item.priority or 0,
        "warm_policy": item.warm or "on_demand",
        "pinned": False,
        "created_at": now,
        "keep": item.keep,
    }
