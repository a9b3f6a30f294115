"""The names the placement controller keeps warm on this worker, and its drain: what the admin
API's placement endpoints change (`server/placement_admin.py`) and the worker's state reports."""

from __future__ import annotations

import threading

from loraplex.residency.key import AdapterKey


class WorkerPlacement:
    """The adapter revisions placed on this worker (each with the tier of its pin), and whether
    it is draining."""

    def __init__(self):
        self.placed: dict[AdapterKey, str] = {}
        self.draining = False
        self._lock = threading.Lock()

    def add(self, key: AdapterKey, tier: str) -> None:
        with self._lock:
            self.placed[key] = tier

    def pop(self, model: str) -> list[tuple[AdapterKey, str]]:
        """Forget the placements of `name@revision`, or of every revision of a bare name."""
        name, _, revision = model.partition("@")
        with self._lock:
            keys = [k for k in self.placed if k.name == name and revision in ("", k.revision)]
            return [(k, self.placed.pop(k)) for k in keys]

    def state(self, in_flight: int) -> dict:
        """`placed` (`name@revision`) and `drain`: None, `draining` (asked to), or `drained`
        (nothing placed here and no request in flight)."""
        with self._lock:
            placed = sorted({f"{k.name}@{k.revision}" for k in self.placed})
        drain = None
        if self.draining:
            drain = "drained" if not placed and in_flight == 0 else "draining"
        return {"placed": placed, "drain": drain}
