"""The registry's load in a simulated fleet, under the push model the workers run.

A worker learns of registry changes by notification (PostgreSQL `LISTEN/NOTIFY`): each change is
one notification to every worker, and no request asks the registry whether anything changed. A
worker queries the registry only to resolve a name it holds no resolution for: its first request
for the adapter (a cold miss), or its first after a change to it was notified.
"""

from __future__ import annotations

import numpy as np

from loraplex.sim.workload import Request


def registry_changes(trace: list[Request], per_s: float, seed: int = 0) -> list[tuple[float, str]]:
    """(time, name@revision) of changes arriving as a Poisson process over the trace's span, each
    to the adapter of a request drawn at random (so adapters change in proportion to their
    traffic)."""
    adapter_requests = [r for r in trace if r.adapter is not None]
    if per_s <= 0 or not adapter_requests:
        return []
    span = trace[-1].time
    rng = np.random.default_rng(seed + 7)
    count = int(rng.poisson(per_s * span))
    times = np.sort(rng.uniform(0.0, span, count))
    picks = rng.integers(0, len(adapter_requests), count)
    return [(float(t), adapter_requests[i].model) for t, i in zip(times, picks)]


class RegistryLoad:
    """Counts the registry queries and notifications of a fleet of `workers` as requests arrive
    and `changes` (sorted by time) happen."""

    def __init__(self, workers: int, changes: list[tuple[float, str]], half_at: float):
        self.workers = workers
        self.changes = changes
        self.half_at = half_at
        """Resolves from this time on also count as the second half's (the steady state)."""
        self._next = 0
        self.resolved: dict[str, set[int]] = {}  # name@revision -> workers holding a resolution
        self.stale: dict[str, set[int]] = {}  # name@revision -> workers that a change reached
        self.notifications = 0
        self.cold_resolves = 0
        self.change_resolves = 0
        self.second_half_resolves = 0
        self.second_half_requests = 0

    def request(self, worker: int, model: str | None, now: float) -> None:
        """A request for `model` reached `worker` at `now`."""
        self._take_changes(now)
        second_half = now >= self.half_at
        self.second_half_requests += second_half
        if model is None:
            return
        holders = self.resolved.setdefault(model, set())
        if worker in holders:
            return
        holders.add(worker)
        self.second_half_resolves += second_half
        stale = self.stale.get(model)
        if stale is not None and worker in stale:
            stale.discard(worker)
            self.change_resolves += 1
        else:
            self.cold_resolves += 1

    def _take_changes(self, now: float) -> None:
        changes = self.changes
        while self._next < len(changes) and changes[self._next][0] <= now:
            model = changes[self._next][1]
            self._next += 1
            self.notifications += self.workers
            reached = self.resolved.pop(model, None)
            if reached:
                self.stale.setdefault(model, set()).update(reached)

    def figures(self, requests: int, span_s: float) -> dict:
        """Queries and notifications, in all and per second of the trace, and queries per request
        (overall and over the trace's second half)."""
        self._take_changes(span_s)
        resolves = self.cold_resolves + self.change_resolves
        per_s = 1.0 / span_s if span_s > 0 else 0.0
        return {
            "changes": self._next,
            "notifications": self.notifications,
            "queries": resolves,
            "cold_queries": self.cold_resolves,
            "change_queries": self.change_resolves,
            "queries_per_s": resolves * per_s,
            "notifications_per_s": self.notifications * per_s,
            "queries_per_request": resolves / requests if requests else 0.0,
            "queries_per_request_second_half": self.second_half_resolves / self.second_half_requests
            if self.second_half_requests
            else 0.0,
        }
