"""The revision of a split name, picked at the router: a request for a name whose traffic is split
(a canary beside its stable) goes out as `name@revision`, picked by the registry's weights and
sticky by `user` as the workers pick; the canary's share goes to the workers that hold the canary
(the rollout's canary pool) while any of them has room, and by the usual pick beyond."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplex.registry.traffic import pick
from loraplex.router.picker import Pick, Picker, WorkerView

if TYPE_CHECKING:
    from loraplex.registry import Registry

log = logging.getLogger("loraplex.router")


class Splits:
    """Name -> its serving (revision, weight) pairs, of the names with more than one; read again
    when the registry's change count moved, at most every `refresh_s`."""

    def __init__(self, read_count: Callable[[], int], read_splits, refresh_s: float = 1.0):
        """`read_splits() -> (splits, pools)`: name -> its serving (revision, weight) pairs of the
        names with more than one, and name -> the worker URLs of its rollout's canary pool."""
        self.read_count, self.read_splits, self.refresh_s = read_count, read_splits, refresh_s
        self._count: int | None = None
        self._looked_at = -float("inf")
        self.splits: dict[str, list[tuple[str, int]]] = {}
        self.pools: dict[str, tuple[str, ...]] = {}

    def weights(self, name: str) -> list[tuple[str, int]] | None:
        now = time.monotonic()
        if now - self._looked_at >= self.refresh_s:
            self._looked_at = now
            try:
                count = self.read_count()
                if count != self._count:
                    (self.splits, self.pools), self._count = self.read_splits(), count
            except Exception as exc:  # noqa: BLE001 (the registry down: route as last read)
                log.warning("traffic splits not read: %s", exc)
        return self.splits.get(name)

    def route(self, model: str, user: str | None) -> tuple[str, bool]:
        """(the model sent, whether it is a canary): `name@revision` for a split name."""
        name, at, _ = model.partition("@")
        weights = None if at else self.weights(name)
        if not weights:
            return model, False
        revision = pick(name, weights, user)
        return f"{name}@{revision}", revision != weights[-1][0]  # the stable comes last

    def model_for(self, model: str, user: str | None) -> str:
        return self.route(model, user)[0]


def pool_first(
    picker: Picker, views: list[WorkerView], model: str, priority: int, pool: tuple[str, ...]
) -> Pick | None:
    """A canary's pick among its pool (the rollout's canary workers; without one, the workers that
    hold it in a slot) while one of them has room (None: no such worker, or all saturated)."""
    if pool:
        holders = [w for w in views if w.healthy and w.url in pool]
    else:
        holders = [w for w in views if w.healthy and w.affinity(model) == "gpu"]
    if not holders:
        return None
    chosen = picker.pick(holders, model, priority)
    if chosen.url is None or chosen.reason.startswith("saturated"):
        return None
    others = [w.url for w in views if w.healthy and w.url not in chosen.ranking]
    return Pick((*chosen.ranking, *others), "canary-pool")


def split_revision(splits: Splits, payload: dict, model: str, body: bytes):
    """(model, is a canary, body) as sent: a split name's revision picked here."""
    user = payload.get("user")
    routed, canary = splits.route(model, user if isinstance(user, str) else None)
    if routed == model:
        return model, False, body
    return routed, canary, json.dumps({**payload, "model": routed}).encode()


def registry_splits(registry: Registry) -> Splits:
    """The splits of `registry`."""
    from loraplex.registry.rollouts import RolloutStore

    rollouts = RolloutStore(registry)

    def read_splits():
        splits = {a.name: list(a.traffic) for a in registry.list_adapters() if len(a.traffic) > 1}
        pools = {
            r.name: tuple(url.rstrip("/") for url in r.settings.get("canary_workers", ()))
            for r in rollouts.active()
        }
        return splits, pools

    return Splits(registry.change_count, read_splits)
