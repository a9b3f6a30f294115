"""Retired revisions leave the worker: once the registry retires a revision (retention, `registry
delete`), the catalog no longer lists it, and this worker drops it from its slots and host memory
as soon as no request holds it, with every pin of its (a grace pin included)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import GaugeMetricFamily

from loraplex.engines.contract import AdapterResidency
from loraplex.registry.catalog import Catalog
from loraplex.registry.changes import Changed
from loraplex.residency.errors import AdapterInFlight
from loraplex.residency.key import AdapterKey
from loraplex.server.pins import PinReconciler

log = logging.getLogger("loraplex.server")


class RetiredRevisions:
    """Unloads the resident revisions the catalog no longer lists under their name."""

    def __init__(
        self,
        catalog: Catalog,
        cache: AdapterResidency,
        pins: PinReconciler,
        on_unloaded: Callable[[AdapterKey], None],
    ):
        self.catalog = catalog
        self.cache = cache
        self.pins = pins
        self.on_unloaded = on_unloaded
        # a drop that waited for a request to end runs here, off the thread that released it
        self._later = ThreadPoolExecutor(1, thread_name_prefix="retired-revisions")
        self._waiting: set[AdapterKey] = set()
        self._lock = threading.Lock()

    def follow(self, names: Iterable[str] | None) -> None:
        """Drop the retired revisions of `names` (None: of every name) that are resident."""
        for key in self.retired(None if names is None else set(names)):
            with self._lock:
                if key in self._waiting:  # its drop runs when its requests end
                    continue
            self.drop(key)

    def retired(self, names: set[str] | None) -> list[AdapterKey]:
        """The resident keys of `names` whose revision their name's catalog entry no longer
        lists."""
        keys = []
        for a in self.cache.state()["adapters"]:
            if names is not None and a["name"] not in names:
                continue
            adapter = self.catalog.adapter(a["name"])
            if adapter is None or any(r.revision == a["revision"] for r in adapter.revisions):
                continue
            keys.append(AdapterKey(a["base_model_digest"], a["name"], a["revision"], a["digest"]))
        return keys

    def drop(self, key: AdapterKey) -> None:
        """Unpin and unload `key` now, or once its last request ends."""
        self.pins.released([key])
        try:
            self.cache.forget(key)
        except AdapterInFlight:
            with self._lock:
                self._waiting.add(key)
            released = self.cache.when_released(key)
            released.add_done_callback(lambda _: self._later.submit(self._drop_waiting, key))
            return
        log.info("unloaded %s: retired in the registry", key)
        self.on_unloaded(key)

    def _drop_waiting(self, key: AdapterKey) -> None:
        with self._lock:
            self._waiting.discard(key)
        self.drop(key)

    def stop(self) -> None:
        self._later.shutdown(wait=False, cancel_futures=True)


class RetiredTally:
    """Counts the revisions that leave the catalog's listing of their name: those the registry
    retired (beyond their name's `keep`, or deleted), each once, as the change feed brings them.
    A catalog listener; its first call (the whole catalog) only reads what is listed."""

    def __init__(self, catalog: Catalog, on_retired: Callable[[int], None]):
        self.catalog = catalog
        self.on_retired = on_retired
        self._listed: dict[str, frozenset[str]] | None = None  # name -> its listed revisions

    def __call__(self, changed: Changed) -> None:
        if self._listed is None:
            self._listed = {a.name: _revisions(a) for a in self.catalog.adapters()}
            return
        names = set(self.catalog.names) | set(self._listed)
        if changed.adapters is not None:
            names = set(changed.adapters)
        gone = 0
        for name in names:
            adapter = self.catalog.adapter(name)
            now = frozenset() if adapter is None else _revisions(adapter)
            gone += len(self._listed.get(name, frozenset()) - now)
            if adapter is None:
                self._listed.pop(name, None)
            else:
                self._listed[name] = now
        if gone:
            self.on_retired(gone)


def _revisions(adapter) -> frozenset[str]:
    return frozenset(r.revision for r in adapter.revisions)


def held_revisions(catalog: Catalog, rows: list[dict]) -> dict[str, int]:
    """Per name with a `keep` set, how many of its revisions this worker holds in a slot or in
    host memory (`rows`: the residency's adapters, as `/admin/state` lists them)."""
    held = {}
    for name in sorted({row["name"] for row in rows}):
        adapter = catalog.adapter(name)
        if adapter is not None and adapter.keep is not None:
            held[name] = 0
    for row in rows:
        if row["name"] in held and row["tier"] in ("gpu", "cpu") and not row["loading"]:
            held[row["name"]] += 1
    return held


class HeldCollector:
    """`loraplex_adapter_revisions_held{adapter}`: `held_revisions` at scrape time. A series per
    name with a `keep` set (the names trainers publish to), not per adapter."""

    def __init__(self, catalog: Catalog, cache: AdapterResidency):
        self.catalog = catalog
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        gauge = GaugeMetricFamily(
            "loraplex_adapter_revisions_held",
            "Revisions of a name with a keep set held in a slot or in host memory here",
            labels=["adapter"],
        )
        for name, count in held_revisions(self.catalog, self.cache.state()["adapters"]).items():
            gauge.add_metric([name], count)
        yield gauge
