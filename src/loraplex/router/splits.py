"""The revision of a split name, picked at the router: a request for a name whose traffic is split
(a canary beside its stable) goes out as `name@revision`, picked by the registry's weights and
sticky by `user` as the workers pick, so that the picker's affinity sends the canary's share to
the workers that hold the canary (the rollout's canary pool) while they have room."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from loraplex.registry.traffic import pick

log = logging.getLogger("loraplex.router")

ModelFor = Callable[[str, str | None], str]
"""(model, user) -> the model a request is sent as."""


class Splits:
    """Name -> its serving (revision, weight) pairs, of the names with more than one; read again
    when the registry's change count moved, at most every `refresh_s`."""

    def __init__(self, read_count: Callable[[], int], read_splits, refresh_s: float = 1.0):
        self.read_count, self.read_splits, self.refresh_s = read_count, read_splits, refresh_s
        self._count: int | None = None
        self._looked_at = -float("inf")
        self.splits: dict[str, list[tuple[str, int]]] = {}

    def weights(self, name: str) -> list[tuple[str, int]] | None:
        now = time.monotonic()
        if now - self._looked_at >= self.refresh_s:
            self._looked_at = now
            try:
                count = self.read_count()
                if count != self._count:
                    self.splits, self._count = self.read_splits(), count
            except Exception as exc:  # noqa: BLE001 (the registry down: route as last read)
                log.warning("traffic splits not read: %s", exc)
        return self.splits.get(name)

    def model_for(self, model: str, user: str | None) -> str:
        name, at, _ = model.partition("@")
        weights = None if at else self.weights(name)
        return f"{name}@{pick(name, weights, user)}" if weights else model


def registry_splits(url: str) -> ModelFor:
    """`Splits.model_for` over the registry at `url`."""
    from loraplex.registry import Registry

    registry = Registry(url)

    def read_splits() -> dict[str, list[tuple[str, int]]]:
        return {a.name: list(a.traffic) for a in registry.list_adapters() if len(a.traffic) > 1}

    return Splits(registry.change_count, read_splits).model_for
