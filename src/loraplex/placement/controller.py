"""The placement controller: each round it reads every worker's state and the registry's
adapters, asks the policy for moves, and applies them through the workers' admin API (a place:
prewarm, then the worker's placement pin; a release: the pin dropped). One controller is active at
a time: it holds the registry's `placement` lease, renewed each round and before each move; a
second one waits and takes over when the lease runs out. While the registry cannot be reached no
move is made (a move needs the lease renewed); the controller retries, backing off, and keeps or
takes the lease again once the registry answers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.exc import DBAPIError

from loraplex.placement.policy import Move, PlacementPolicy, WorkerView
from loraplex.placement.views import adapter_views, worker_view
from loraplex.registry import Registry
from loraplex.registry.db import utcnow
from loraplex.registry.leases import Leases
from loraplex.settings.pools import PoolSpec

log = logging.getLogger("loraplex.placement")
LEASE = "placement"


class PlacementMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.moves = Counter(
            "loraplex_placement_moves",
            "Placement moves applied, by kind (place, release) and outcome (done, failed)",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.placed = Gauge(
            "loraplex_placement_placed_adapters",
            "Placements (adapter revision on a worker) on the live workers, at the last round",
            registry=self.registry,
        )
        self.leader = Gauge(
            "loraplex_placement_leader",
            "1 while this controller holds the placement lease (until the expiry it last wrote)",
            registry=self.registry,
        )
        self.workers_up = Gauge(
            "loraplex_placement_workers_up",
            "Workers whose state the last round read",
            registry=self.registry,
        )
        self.workers_unplaceable = Gauge(
            "loraplex_placement_workers_unplaceable",
            "Workers the last round read that take no placement (one device slot or none)",
            registry=self.registry,
        )


@dataclass(frozen=True)
class Target:
    """A worker the controller places on, and its pool."""

    url: str
    pool: PoolSpec


class PlacementController:
    def __init__(
        self,
        targets: list[Target],
        registry: Registry,
        policy: PlacementPolicy,
        client: httpx.Client,
        tier: str = "gpu",
        holder: str = "",
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ):
        """`client`: with the workers' admin token; `holder`: what the lease names (HOST:PID)."""
        self.targets, self.registry, self.policy, self.client = targets, registry, policy, client
        self.tier, self.holder, self.lease_s, self.clock = tier, holder, lease_s, clock
        self.leases = Leases(registry)
        self.metrics = PlacementMetrics()
        self.lease_until: datetime | None = None
        """When the lease this controller last took or renewed runs out; None: not its own."""
        self.metrics.leader.set_function(lambda: 1.0 if self.leading_now() else 0.0)
        self.unanswered: set[str] = set()
        """The workers that did not answer their state in the last round."""
        self.unplaceable: set[str] = set()
        """The workers the last round read that take no placement (each said once in the log)."""

    def holds_lease(self) -> bool:
        """Take or renew the lease; whether this controller holds it now."""
        lease = self.leases.take(LEASE, self.holder, self.lease_s)
        self.lease_until = lease.expires_at if lease.holder == self.holder else None
        return self.lease_until is not None

    def leading_now(self) -> bool:
        """Whether the lease this controller last took or renewed still runs (no registry
        read: it holds while the registry is down, until the lease runs out)."""
        return self.lease_until is not None and utcnow() < self.lease_until

    def workers(self) -> list[WorkerView]:
        """The workers that answer their state now (a dead one is left out: its placements are
        gone with it, and the policy places them again elsewhere)."""
        views = []
        for t in self.targets:
            try:
                answer = self.client.get(f"{t.url}/admin/state")
                answer.raise_for_status()
                views.append(worker_view(t.url, t.pool, answer.json()))
            except (httpx.HTTPError, ValueError) as exc:
                if t.url not in self.unanswered:
                    log.warning("worker %s left out until it answers: %s", t.url, exc)
                self.unanswered.add(t.url)
                continue
            if t.url in self.unanswered:
                log.info("worker %s answers again", t.url)
                self.unanswered.discard(t.url)
        self.metrics.workers_up.set(len(views))
        self.note_unplaceable(views)
        return views

    def note_unplaceable(self, views: list[WorkerView]) -> None:
        """Log, once per worker, one that takes no placement, and count them in the metrics."""
        unplaceable = {w.name: w.slots for w in views if not self.policy.placeable_slots(w.slots)}
        for url in sorted(unplaceable.keys() - self.unplaceable):
            log.warning(
                "worker %s takes no placement: it has %d device slot(s) and keeps one free",
                url,
                unplaceable[url],
            )
        self.unplaceable = set(unplaceable)
        self.metrics.workers_unplaceable.set(len(unplaceable))

    def round(self) -> list[tuple[Move, bool]]:
        """One round: read, plan, apply; each move applied with whether it was done. A release
        that stands in for a place that failed is skipped (the adapter stays warm where it is)."""
        workers = self.workers()
        adapters = adapter_views(self.registry.list_adapters())
        moves = self.policy.plan(workers, adapters, self.clock())
        placed = sum(len(w.placed) for w in workers)
        failed_places: set[str] = set()
        applied = []
        for move in moves:
            if not self.holds_lease():
                log.warning("the placement lease was lost: the round stops")
                break
            if move.kind == "release" and move.adapter in failed_places:
                continue
            done = self.apply(move)
            applied.append((move, done))
            self.metrics.moves.labels(move.kind, "done" if done else "failed").inc()
            if move.kind == "place" and not done:
                failed_places.add(move.adapter)
            if done:
                placed += 1 if move.kind == "place" else -1
        self.metrics.placed.set(placed)
        return applied

    def apply(self, move: Move) -> bool:
        """A place: prewarm, then the worker's placement pin (which waits for the load); a
        release: the pin dropped. Whether the worker did it (a failure is logged)."""
        name, _, revision = move.adapter.partition("@")
        url = move.worker
        try:
            if move.kind == "place":
                body = {"revision": revision, "tier": self.tier}
                self.client.post(f"{url}/admin/adapters/{name}/prewarm", json=body)
                answer = self.client.post(f"{url}/admin/placement/{move.adapter}", json=body)
            else:
                answer = self.client.delete(f"{url}/admin/placement/{move.adapter}")
        except httpx.HTTPError as exc:
            log.warning("%s %s on %s failed: %s", move.kind, move.adapter, url, exc)
            return False
        if answer.status_code != 200:
            log.warning(
                "%s %s on %s: %s %s", move.kind, move.adapter, url, answer.status_code, answer.text
            )
            return False
        log.info("%s %s on %s", move.kind, move.adapter, url)
        return True

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Rounds every `interval_s` while this controller holds the lease; otherwise wait for
        it. While the registry cannot be reached, the waits double, up to a quarter of the lease
        (so that a renewal comes before it runs out). Until `stop`; the lease is given back
        then."""
        leading: bool | None = None
        failures = 0
        while not stop.is_set():
            try:
                now_leading = self.holds_lease()
                if failures:
                    log.info("the registry answers again")
                failures = 0
                if now_leading != leading:
                    self.announce(now_leading)
                leading = now_leading
                if leading:
                    self.round()
            except DBAPIError as exc:
                if not failures:
                    reason = str(exc.orig or exc).splitlines()[0]
                    log.warning("the registry cannot be reached, no move until it can: %s", reason)
                failures += 1
            except Exception:  # noqa: BLE001 (a worker's answer or a bug: the next round tries)
                log.exception("placement round failed")
            stop.wait(min(interval_s * 2 ** min(failures, 16), max(interval_s, self.lease_s / 4)))
        if self.lease_until is not None:
            self.give_back()

    def announce(self, leading: bool) -> None:
        """Say on stdout that this controller is now active, or waiting and for whom."""
        held = self.leases.get(LEASE).holder
        print(
            f"placement controller {self.holder}: "
            + ("active" if leading else f"waiting (the lease is {held}'s)"),
            flush=True,
        )

    def give_back(self) -> None:
        """Release the lease, so that another controller takes over at once; while the registry
        cannot be reached, it runs out by itself instead."""
        try:
            self.leases.release(LEASE, self.holder)
        except DBAPIError as exc:
            log.warning("the lease runs out by itself (the registry cannot be reached): %s", exc)
        self.lease_until = None
