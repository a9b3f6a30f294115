"""Retired revisions leave the worker: once the registry retires a revision (retention, `registry
delete`), the catalog no longer lists it, and this worker drops it from its slots and host memory
as soon as no request holds it, with every pin of its (a grace pin included)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from loraplex.engines.contract import AdapterResidency
from loraplex.registry.catalog import Catalog
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
