"""Registering many adapters in one go (`registry import`): each checked as `add_revision` checks
it, all of them before anything is recorded, then recorded in a few transactions."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from sqlalchemy import select

from loraplex.lora_format import CONFIG_FILE
from loraplex.registry import queries as q
from loraplex.registry.db import Tenant
from loraplex.registry.errors import AdapterRejected, RegistryError
from loraplex.registry.records import RevisionRecord
from loraplex.registry.registration import Registration, _check_names

BATCH = 1000
"""Adapters recorded per transaction."""


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


class BulkRegistration(Registration):
    def add_revisions(
        self, items: Iterable[ImportItem], base_model_dir: str | Path | None = None
    ) -> ImportResult:
        """Register every item: each is checked and stored first (ImportRefused naming the first
        bad one, nothing recorded), then recorded `BATCH` to a transaction. An item whose bytes
        that name holds already gives its existing revision, as `add_revision` does."""
        items = list(items)
        self._check_items(items)
        stored = []
        for index, item in enumerate(items):
            try:
                stored.append(
                    self._store_verified(
                        item.path, base_model_dir, None, item.eval_set, item.digest, item.signature
                    )
                )
            except (AdapterRejected, OSError, ValueError) as exc:
                raise ImportRefused(f"item {index + 1} ({item.name}, {item.path}): {exc}") from None
        records: list[RevisionRecord] = []
        num_new = 0
        for start in range(0, len(items), BATCH):
            with self._write() as session:
                for item, done in zip(items[start : start + BATCH], stored[start : start + BATCH]):
                    adapter = self._adapter_for_add(
                        session,
                        item.name,
                        item.tenant,
                        item.shared,
                        done.spec.task_type,
                        item.warm,
                        item.priority,
                    )
                    known = q.find_revision(session, item.name, item.revision, done.digest)
                    num_new += known is None
                    records.append(
                        self._insert_revision(session, adapter, done, item.revision, _status(item))
                    )
        return ImportResult(tuple(records), num_new)

    def _check_items(self, items: list[ImportItem]) -> None:
        """What can be refused before any file is read: names, fields, a name given twice, an
        unknown tenant."""
        seen: set[str] = set()
        for index, item in enumerate(items):
            try:
                _check_names(item.name, item.revision, item.warm, _status(item))
            except AdapterRejected as exc:
                raise ImportRefused(f"item {index + 1} ({item.name}): {exc}") from None
            if item.name in seen:
                raise ImportRefused(f"item {index + 1}: {item.name} is named twice in the import")
            seen.add(item.name)
        with self._read() as session:
            tenants = set(session.scalars(select(Tenant.name)))
        for index, item in enumerate(items):
            if item.tenant is not None and item.tenant not in tenants:
                raise ImportRefused(
                    f"item {index + 1} ({item.name}): unknown tenant {item.tenant!r}; add it with "
                    f"`loraplex registry tenant add {item.tenant}`"
                )


def _status(item: ImportItem) -> str:
    return "stable" if item.stable else "staging"
