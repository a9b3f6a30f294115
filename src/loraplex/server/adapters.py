"""What a request's `model` means for this worker: the base model, or one adapter revision with its
cache ref.

Also the bookkeeping that lets an unload drain: requests in flight per adapter name, and names whose
new requests are refused while their last requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.artifacts import Pieces
from loraplex.registry import Registry, RevisionRecord
from loraplex.registry.catalog import Catalog
from loraplex.registry.errors import AdapterRejected
from loraplex.registry.signing import verify_digest
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.server.errors import APIError, not_found


@dataclass(frozen=True)
class Target:
    ref: AdapterRef | None  # None: the base model
    label: str  # name@revision, or the served name of the base model
    digest: str
    record: RevisionRecord | None = None


class AdapterResolver:
    def __init__(
        self,
        registry: Registry,
        catalog: Catalog,
        base_model_digest: str,
        served_name: str,
        tenant_priority: Callable[[str], int] = lambda tenant: 0,
        trusted_keys: tuple = (),
    ):
        """`tenant_priority`: a tenant's priority, given to the cache with the adapters it asks for.
        `trusted_keys`: with any, a revision is loaded only if one of them signed its digest."""
        self.registry = registry
        self.catalog = catalog
        self.tenant_priority = tenant_priority
        self.trusted_keys = trusted_keys
        self._verified: dict[tuple[str, str | None], AdapterRejected | None] = {}
        self.base_model_digest = base_model_digest
        self.served_name = served_name
        self.base = Target(None, served_name, base_model_digest)
        # requests per adapter name, on the event loop thread
        self.in_flight: Counter[str] = Counter()
        self.draining: set[str] = set()
        self._idle: dict[str, asyncio.Event] = {}
        """Per name being drained: set when its last request in flight ends."""
        # names vLLM's unload retired here: their deprecated revisions are gone too
        self.unloaded: set[str] = set()
        # digest -> its directory in the registry's store (None: not there when first looked for)
        self._paths: dict[str, Path | None] = {}
        # digest -> its piece list (immutable: read once)
        self._pieces: dict[str, Pieces | None] = {}

    def resolve(self, tenant: str, model: str, user: str | None = None) -> Target:
        """The target, or 404 (unknown, another tenant's, being unloaded, made for another base
        model), from the catalog in memory. The first request for a digest reads its piece list and
        looks for its bytes in the store: on the event loop, await `prepare` first."""
        record = self.record_for(tenant, model, user)
        return self.base if record is None else self.target(record, tenant)

    def target(self, record: RevisionRecord, tenant: str) -> Target:
        return Target(self.ref_for(record, tenant), record.model_id, record.digest, record)

    def record_for(self, tenant: str, model: str, user: str | None = None) -> RevisionRecord | None:
        """The revision `model` means for `tenant` (None: the base model), or the errors of
        `resolve`; no I/O."""
        if model == self.served_name:
            return None
        if model.partition("@")[0] in self.draining:
            raise not_found(model)
        record = self.catalog.resolve(tenant, model, user)
        if record.status == "deprecated" and record.name in self.unloaded:
            # the registry still answers name@revision for a retired name; after vLLM's unload, this
            # server does not
            raise not_found(model)
        if record.base_model_digest and record.base_model_digest != self.base_model_digest:
            raise APIError(
                404,
                f"{record.model_id} was registered for base model {record.base_model}, "
                f"not the one this server runs ({self.served_name})",
                "model_not_available",
                "model",
            )
        problem = self.signature_problem(record)
        if problem is not None:
            raise APIError(
                503,
                f"{record.model_id} cannot be loaded: {problem}",
                "adapter_unavailable",
                "model",
            )
        return record

    async def prepare(self, record: RevisionRecord) -> None:
        """Read what `ref_for` needs of a digest not seen yet (its piece list, a stat in the
        store) on a worker thread: once per digest, never on the event loop."""
        if record.digest not in self._pieces:
            await asyncio.to_thread(self._read_files, record.digest)

    def _read_files(self, digest: str) -> None:
        self._local_path(digest)
        if digest not in self._pieces:
            self._pieces[digest] = self.registry.pieces(digest)

    def signature_problem(self, record: RevisionRecord) -> str | None:
        """Why the revision's signature does not pass the trusted keys (None: it does, or none are
        configured). Checked at each load's resolve, not only at registration: a revision registered
        before the keys were configured, or by another server, is checked here too."""
        if not self.trusted_keys:
            return None
        seen = (record.digest, record.signature)
        if seen not in self._verified:  # records are immutable: one check per digest and signature
            try:
                verify_digest(record.digest, record.signature, self.trusted_keys)
                self._verified[seen] = None
            except AdapterRejected as exc:
                self._verified[seen] = exc
        problem = self._verified[seen]
        return None if problem is None else str(problem)

    def ref_for(self, record: RevisionRecord, tenant: str = "default") -> AdapterRef:
        """A local path when the registry's own store holds the bytes (the cache checks the digest
        when it reads them); otherwise the storage URI, which the cache fetches through its disk
        tier."""
        key = AdapterKey(self.base_model_digest, record.name, record.revision, record.digest)
        if record.digest not in self._pieces:
            self._pieces[record.digest] = self.registry.pieces(record.digest)
        return AdapterRef(
            key,
            self._local_path(record.digest),
            record.storage_uri,
            tenant,
            self.tenant_priority(tenant),
            self._pieces[record.digest],
        )

    def _local_path(self, digest: str) -> Path | None:
        if digest not in self._paths:  # a stat: once per digest, not per request
            store = self.registry.store
            has = store is not None and store.has(digest)
            self._paths[digest] = store.path(digest) if has and store is not None else None
        return self._paths[digest]

    def may_see(self, record_base_digest: str | None) -> bool:
        return not record_base_digest or record_base_digest == self.base_model_digest

    def started(self, target: Target) -> None:
        if target.record is not None:
            self.in_flight[target.record.name] += 1

    def finished(self, target: Target) -> None:
        if target.record is not None:
            name = target.record.name
            self.in_flight[name] -= 1
            if self.in_flight[name] <= 0:
                del self.in_flight[name]
                if name in self._idle:
                    self._idle.pop(name).set()

    async def drain(self, name: str, timeout_s: float) -> bool:
        """Refuse new requests for `name` and wait for those in flight; False when the timeout came
        first. The caller removes the name from `draining` once the adapter is gone from the
        registry."""
        self.draining.add(name)
        if self.in_flight.get(name):
            idle = self._idle.setdefault(name, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), timeout_s)
        return not self.in_flight.get(name)
