"""Pins that follow the registry: a name's pin or warm policy moves to the revisions its traffic
puts in service, a revision that leaves traffic stays warm for the grace period, and changes made
elsewhere (the registry CLI, another worker's admin API) reach this server with the catalog's
change feed (`follow`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from loraplex.engines.contract import AdapterResidency
from loraplex.registry import AdapterRecord, Registry
from loraplex.registry.catalog import Catalog
from loraplex.residency.errors import CapacityExceeded
from loraplex.residency.key import AdapterKey
from loraplex.server.adapters import AdapterResolver

log = logging.getLogger("loraplex.server")


class PinReconciler:
    """Keeps the engine's pins in line with the registry's pins, warm policies and traffic."""

    def __init__(
        self,
        registry: Registry,
        catalog: Catalog,
        resolver: AdapterResolver,
        cache: AdapterResidency,
        watch_s: float,
    ):
        """`watch_s`: how often the grace pins whose period ended are dropped."""
        self.registry = registry
        self.catalog = catalog
        self.resolver = resolver
        self.cache = cache
        self.watch_s = watch_s
        # Pins that follow traffic: those a name's pin or warm policy made, the revisions that left
        # traffic kept in host memory for the grace period, and each name's serving revisions at the
        # last look.
        self._rule_pins: dict[AdapterKey, str] = {}
        # key -> time.monotonic() its grace period ends
        self._grace_pins: dict[AdapterKey, float] = {}
        self._operator_pins: set[AdapterKey] = set()  # pinned by revision through the admin API
        self._serving: dict[str, frozenset[str]] = {}
        # each name's pin tier (its pin, else warm policy), last look
        self._rule_tiers: dict[str, str | None] = {}
        self._pins_lock = threading.RLock()
        self._stop = threading.Event()

    @property
    def serving(self) -> dict[str, frozenset[str]]:
        """Each name's serving revisions at the last look."""
        return self._serving

    def start(self) -> None:
        threading.Thread(target=self._watch_grace, name="grace-pins", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def warm_start(self) -> None:
        """Pins and warm policies from the registry: load those adapters before traffic asks for
        them."""
        for adapter in self.catalog.adapters():
            self.warm(adapter)

    def warm(self, adapter: AdapterRecord) -> None:
        """Bring the adapter's pins in line with its traffic. The revisions that left traffic since
        the last look lose the pins its rule made, and a resident one is kept in host memory for the
        registry's grace period (a rollback finds it warm; ARCHITECTURE: "the old revision stays
        resident for a grace period"). The serving revisions are pinned when the adapter is pinned,
        in the tier of its pin, or else has a warm policy of gpu or cpu, in that tier (the
        operator's pin overrides the manifest's policy). A pin one revision got from an operator
        (`operator_pinned`) is theirs: neither made nor dropped here, until the name is unpinned.
        When the name is unpinned, the serving revisions lose the pins its rule made, and a revision
        serving again gives up its grace pin. A pin that cannot be made (beyond capacity, a failed
        load) is logged and serving goes on; the revision loses the pin of the name's previous
        tier."""
        tier = _rule_tier(adapter)
        cache, serving = self.cache, _serving_revisions(adapter)
        owner = adapter.owner_tenant or "default"
        with self._pins_lock:
            before = self._serving.get(adapter.name)
            self._serving[adapter.name] = serving
            if tier is None and self._rule_tiers.get(adapter.name) is not None:
                # unpinned (elsewhere too)
                mine = [k for k in self._operator_pins if k.name == adapter.name]
                for key in mine:
                    cache.unpin(key)
                self.released(mine)
            self._rule_tiers[adapter.name] = tier
            present = {r.revision for r in adapter.revisions}
            for key in [*self._rule_pins, *self._grace_pins]:
                if key.name == adapter.name and key.revision not in present:
                    self._unpin_retired(key)
            for record in adapter.revisions:
                if not self.resolver.may_see(record.base_model_digest):
                    continue
                if (
                    before is not None
                    and record.revision in before
                    and record.revision not in serving
                ):
                    self._retire(
                        self.resolver.ref_for(record, owner), record.status != "quarantined"
                    )
            if tier is None and not any(
                k.name == adapter.name for k in (*self._rule_pins, *self._grace_pins)
            ):
                return  # no rule and no pin of its to drop
            for record in adapter.revisions:
                if record.traffic_weight and self.resolver.may_see(record.base_model_digest):
                    problem = self.resolver.signature_problem(record)
                    if problem is not None:  # never loaded, so never pinned
                        log.warning("not pinning %s: %s", record.model_id, problem)
                        continue
                    ref = self.resolver.ref_for(record, owner)
                    if ref.key in self._operator_pins:
                        continue
                    if tier is None:  # no rule (any more): traffic keeps it resident, not a pin
                        made = self._rule_pins.pop(ref.key, None)
                        if self._grace_pins.pop(ref.key, None) is not None:
                            made = made or "cpu"
                        if made is not None and cache.pinned(ref.key) == made:
                            cache.unpin(ref.key)
                        continue
                    # serving again: the rule's pin replaces the grace one
                    self._grace_pins.pop(ref.key, None)
                    try:
                        cache.pin(ref, tier)
                    except Exception as exc:
                        # a warm start that cannot happen must not stop serving
                        log.warning("could not pin %s in %s: %s", record.model_id, tier, exc)
                        # nor keep the pin of the name's previous tier
                        old = self._rule_pins.pop(ref.key, None)
                        if old is not None and cache.pinned(ref.key) == old:
                            cache.unpin(ref.key)
                        continue
                    self._rule_pins[ref.key] = tier

    def _unpin_retired(self, key: AdapterKey) -> None:
        """A revision gone from the catalog (retired) keeps neither the rule's pin nor a grace
        one."""
        made = self._rule_pins.pop(key, None)
        if self._grace_pins.pop(key, None) is not None:
            made = made or "cpu"
        if made is not None and self.cache.pinned(key) == made:
            self.cache.unpin(key)

    def _retire(self, ref, keep_warm: bool) -> None:
        """A revision left traffic: drop its rule's pin; keep it in host memory for the grace period
        if resident."""
        cache, key = self.cache, ref.key
        if key in self._operator_pins:
            return
        tier = self._rule_pins.pop(key, None)
        if tier is not None and cache.pinned(key) == tier:
            cache.unpin(key)
        grace_s = self.registry.reading.grace_period.total_seconds()
        if (
            keep_warm
            and key.name not in self.resolver.unloaded  # vLLM's unload: gone from memory too
            and grace_s > 0
            and cache.tier_of(key) in ("gpu", "cpu")
            and cache.pinned(key) is None
        ):
            try:
                cache.pin(ref, "cpu")
            except CapacityExceeded:
                return  # no room to keep it: it is evicted as any other copy
            self._grace_pins[key] = time.monotonic() + grace_s

    def follow(self, names: Iterable[str] | None = None) -> None:
        """Move pins along with traffic (`warm`) for those of `names` (None: every name) whose
        serving revisions or pin changed since the last look (an admin call here, the registry CLI
        elsewhere, a quarantine), as the catalog holds them; drop the grace pins whose period
        ended."""
        with self._pins_lock:
            self._end_grace()
            for adapter in self.catalog.adapters(names):
                if self._serving.get(adapter.name) != _serving_revisions(
                    adapter
                ) or self._rule_tiers.get(adapter.name) != _rule_tier(adapter):
                    self.warm(adapter)

    def _end_grace(self) -> None:
        cache, now = self.cache, time.monotonic()
        with self._pins_lock:
            for key, until in list(self._grace_pins.items()):
                if until <= now:
                    del self._grace_pins[key]
                    if cache.pinned(key) == "cpu":
                        cache.unpin(key)

    def warm_name(self, name: str) -> None:
        """`warm` with the adapter read under the pins' lock, so that a call made for an admin
        request cannot apply an older reading after the watcher applied a newer one."""
        with self._pins_lock:
            self.warm(self.registry.show(name))

    def released(self, keys) -> None:
        """An operator unpinned or evicted these keys: no pin of theirs is kept or moved by traffic
        any more."""
        with self._pins_lock:
            for key in keys:
                self._rule_pins.pop(key, None)
                self._grace_pins.pop(key, None)
                self._operator_pins.discard(key)

    def holds(self, key: AdapterKey) -> bool:
        """Whether a pin rule, a grace period or an operator holds the key's pin."""
        with self._pins_lock:
            return key in self._rule_pins or key in self._grace_pins or key in self._operator_pins

    def operator_pinned(self, keys, name: str, tier: str) -> None:
        """An operator pinned these revisions of `name` themselves, in `tier`: traffic neither moves
        nor drops those pins. The registry records a pin of the name (what a start pins again),
        under the pins' lock: the watcher is not to take that record for a pin of the name's other
        serving revisions."""
        keys = list(keys)
        with self._pins_lock:
            self.registry.pin(name, True, tier)
            self.released(keys)
            self._operator_pins.update(keys)
            if self._rule_tiers.get(name) is None:
                self._rule_tiers[name] = tier

    def _watch_grace(self) -> None:
        while not self._stop.wait(self.watch_s):
            self._end_grace()


def _rule_tier(adapter: AdapterRecord) -> str | None:
    """The tier a name's serving revisions are pinned in: its pin's, else its warm policy's (gpu or
    cpu)."""
    return (
        adapter.pin_tier
        if adapter.pinned
        else (adapter.warm_policy if adapter.warm_policy in ("gpu", "cpu") else None)
    )


def _serving_revisions(adapter: AdapterRecord) -> frozenset[str]:
    return frozenset(r.revision for r in adapter.revisions if r.traffic_weight)
