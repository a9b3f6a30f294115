"""What the registry says of the names a request may give, for routing: each serving revision's
base model and rank, and who may use it; read again when the registry's change count moves, at
most every `refresh_s`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.router.pools import Need

if TYPE_CHECKING:
    from loraplex.registry import Registry

log = logging.getLogger("loraplex.router")


@dataclass(frozen=True)
class RevisionFacts:
    name: str
    revision: str
    base_model: str
    base_model_digest: str | None
    rank: int
    shared: bool
    allowed_tenants: tuple[str, ...]
    serving: bool
    """Whether it has traffic: the revisions a bare name resolves to."""
    digest: str = ""
    """The revision's artifact digest: what a KV prefix is reusable under."""
    warm: bool = False
    """Its adapter is pinned or has a warm policy of gpu (tier A)."""

    def may_use(self, tenant: str | None) -> bool:
        return self.shared or (tenant is not None and tenant in self.allowed_tenants)


class AdapterCatalog:
    def __init__(
        self,
        read_count: Callable[[], int],
        read_revisions: Callable[[], Iterable[RevisionFacts]],
        refresh_s: float = 1.0,
    ):
        self.read_count, self.read_revisions, self.refresh_s = read_count, read_revisions, refresh_s
        self._count: int | None = None
        self._looked_at = -float("inf")
        self._by_name: dict[str, list[RevisionFacts]] = {}

    def revisions(self, model: str) -> list[RevisionFacts]:
        """The revisions `model` may mean: `name@revision` that one, a bare name its serving
        ones ([]: not a registered adapter)."""
        self._refresh()
        name, at, revision = model.partition("@")
        facts = self._by_name.get(name, [])
        if at:
            return [f for f in facts if f.revision == revision]
        return [f for f in facts if f.serving]

    def warm(self, model: str) -> bool:
        """Whether the adapter `model` names is pinned or in tier A."""
        return any(f.warm for f in self.revisions(model))

    def need(self, model: str, tenant: str | None) -> Need:
        """What the adapter `model` needs of a worker, for a caller of `tenant`; nothing for a name
        the caller may not use (the worker's own answer says so, wherever it goes)."""
        facts = [f for f in self.revisions(model) if f.may_use(tenant)]
        digests = frozenset(f.base_model_digest for f in facts if f.base_model_digest)
        if not facts or not digests:
            return Need()
        bases = ", ".join(sorted({f.base_model for f in facts}))
        label = f"{bases} (the base of {', '.join(f'{f.name}@{f.revision}' for f in facts)})"
        return Need(base_digests=digests, rank=max(f.rank for f in facts), label=label)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._looked_at < self.refresh_s:
            return
        self._looked_at = now
        try:
            count = self.read_count()
            if count != self._count:
                by_name: dict[str, list[RevisionFacts]] = {}
                for facts in self.read_revisions():
                    by_name.setdefault(facts.name, []).append(facts)
                self._by_name, self._count = by_name, count
        except Exception as exc:  # noqa: BLE001 (the registry down: route as last read)
            log.warning("adapter catalog not read: %s", exc)


def registry_catalog(registry: Registry) -> AdapterCatalog:
    """The adapters of `registry`."""

    def read_revisions() -> list[RevisionFacts]:
        return [
            RevisionFacts(
                r.name,
                r.revision,
                r.base_model,
                r.base_model_digest,
                r.rank,
                r.shared,
                r.allowed_tenants,
                bool(r.traffic_weight),
                r.digest,
                a.pinned or a.warm_policy == "gpu",
            )
            for a in registry.list_adapters()
            for r in a.revisions
        ]

    return AdapterCatalog(registry.change_count, read_revisions)
